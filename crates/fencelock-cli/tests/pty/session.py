"""Drives an interactive bash on a pseudo-terminal, as a user at a keyboard would, and checks
what `fencelock run` does with job control. Usage: session.py FENCELOCK SQLITE_URL WORKDIR.
Exits non-zero with a message naming the step that failed."""
import os
import pty
import re
import select
import subprocess
import sys
import time

fencelock, url, work = sys.argv[1], sys.argv[2], sys.argv[3]
os.chdir(work)
env = dict(os.environ, PS1="PROMPT> ", FENCELOCK_URL=url, TERM="dumb")
pid, fd = pty.fork()
if pid == 0:
    os.execvpe("bash", ["bash", "--norc", "--noprofile", "-i"], env)

buf = b""
log = b""


def expect(pattern, timeout=15):
    global buf, log
    end = time.time() + timeout
    rx = re.compile(pattern.encode())
    while True:
        m = rx.search(buf)
        if m:
            buf = buf[m.end():]
            return
        left = end - time.time()
        r = select.select([fd], [], [], max(0, left))[0] if left > 0 else []
        if not r:
            ps = subprocess.run(["ps", "-o", "pid,ppid,pgid,tpgid,stat,args", "--forest", "-s", str(os.getsid(pid))],
                                capture_output=True, text=True).stdout
            sys.exit("timed out waiting for %r; the terminal showed:\n%s\nprocesses:\n%s"
                     % (pattern, log.decode(errors="replace"), ps))
        data = os.read(fd, 4096)
        buf += data
        log += data


def send(s):
    os.write(fd, s.encode())


def fl(*args):
    return subprocess.run([fencelock, *args], env=dict(os.environ, FENCELOCK_URL=url),
                          capture_output=True, text=True, timeout=30)


def wait_held():
    end = time.time() + 15
    while not fl("inspect", "x").stdout.startswith("x: held by"):
        check(time.time() < end, "the lock was never taken")
        time.sleep(0.02)


def check(cond, what):
    if not cond:
        sys.exit("%s; the terminal showed:\n%s" % (what, log.decode(errors="replace")))


expect("PROMPT> ")

# 1. cat reads the terminal, Ctrl-C reaches it, fencelock exits 130 and the lock is free.
send(fencelock + " run x -- cat\n")
wait_held()
send("hello\n")
expect("hello\r\nhello\r\n")
send("\x03")
expect("PROMPT> ")
send("echo rc=$?\n")
expect("rc=130")
expect("PROMPT> ")
out = fl("inspect", "x").stdout.strip()
check(out == "x: free", "after Ctrl-C the lock is not free: %r" % out)

# 2. Ctrl-Z gives the shell its prompt back with the lock still held; fg resumes cat.
send(fencelock + " run --ttl 3s x -- cat\n")
wait_held()
send("one\n")
expect("one\r\none\r\n")
send("\x1a")
expect("Stopped")
expect("PROMPT> ")
out = fl("inspect", "x").stdout.strip()
check(out.startswith("x: held by"), "while stopped within the TTL the lock is not held: %r" % out)
send("fg\n")
expect("cat\r\n")
send("two\n")
expect("two\r\ntwo\r\n")
send("\x03")
expect("PROMPT> ")
send("echo rc=$?\n")
expect("rc=130")
expect("PROMPT> ")

# 3. Stopped past the TTL: the command is gone before another holder gets the lock, and fg
#    resumes nothing but fencelock's exit 79. With `tostop` set, the supervisor (in a process
#    group of its own, in the background) still writes its message to the terminal.
send("stty tostop\n")
expect("PROMPT> ")
# bash, not dash: dash vforks, and a vforked child stopped before it execs leaves dash in an
# unstoppable wait, so the job would never stop as a whole (as it would not without fencelock).
send(fencelock + " run --ttl 1s --kill-after 200ms x -- bash -c "
     "'while :; do date +%s%N >> A; sleep 0.02; done'\n")
deadline = time.time() + 10
while not (os.path.exists("A") and os.path.getsize("A") > 0):
    check(time.time() < deadline, "the writer never wrote")
    time.sleep(0.02)
send("\x1a")
expect("Stopped")
expect("PROMPT> ")
second = subprocess.run([fencelock, "run", "--wait", "10s", "x", "--", "sh", "-c", "date +%s%N > B"],
                        env=dict(os.environ, FENCELOCK_URL=url), capture_output=True, text=True,
                        timeout=30)
check(second.returncode == 0, "the second holder failed: %r" % (second,))
a = [int(l) for l in open("A") if l.strip()]
b = int(open("B").read())
check(max(a) < b, "the first command wrote at %d, after the second holder's %d" % (max(a), b))
expect("was fencelock stopped\\?")
send("fg\n")
expect("PROMPT> ")
send("echo rc=$?\n")
expect("rc=79")
expect("PROMPT> ")
after = [int(l) for l in open("A") if l.strip()]
check(len(after) == len(a), "the first command wrote again after fg")
out = fl("inspect", "x").stdout.strip()
check(out == "x: free", "after the lost run the lock is not free: %r" % out)

send("exit\n")
os.waitpid(pid, 0)
print("ok")
