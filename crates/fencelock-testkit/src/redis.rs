//! Real `redis-server` processes for integration tests.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use tempfile::TempDir;

use crate::free_port;
use crate::proc::{as_pid, env_or, stop};

/// Overrides the `redis-server` found on `PATH`.
const SERVER_ENV: &str = "FENCELOCK_REDIS_SERVER";
/// Overrides the `redis-cli` found on `PATH`.
const CLI_ENV: &str = "FENCELOCK_REDIS_CLI";

const LOG_FILE: &str = "redis.log";
/// Redis reports command-line and config errors on stderr before it has
/// opened its log file, so stderr goes to a file next to the log; without it
/// such failures would be undiagnosable.
const STDERR_FILE: &str = "redis.stderr";

/// How long a freshly spawned server may take to answer PING.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// Fresh ports to try when another process takes ours between
/// [`free_port`] and redis binding it.
const START_ATTEMPTS: usize = 5;
/// How long [`RedisServer::restart`] keeps retrying the same port; the old
/// connections may linger in TIME_WAIT for a moment.
const RESTART_BIND_TIMEOUT: Duration = Duration::from_secs(5);
const LOG_TAIL_LINES: usize = 20;

/// A `redis-server` child process listening on 127.0.0.1, with its own
/// temporary directory.
///
/// Persistence is off (`--save ''`, `--appendonly no`), so the server holds
/// its data in memory only. The process is killed and reaped when the value
/// is dropped, even if it is paused.
#[derive(Debug)]
pub struct RedisServer {
    bin: PathBuf,
    extra_args: Vec<String>,
    /// Serves TLS only, on `port`, requiring client certificates signed by this CA.
    tls: Option<crate::TestTls>,
    port: u16,
    pid: u32,
    /// `None` once killed. Kept unreaped until we signal it, so its pid
    /// cannot be recycled for an unrelated process under our feet.
    child: Option<Child>,
    dir: TempDir,
}

impl RedisServer {
    /// Starts a server with the default options and waits until it answers
    /// PING.
    ///
    /// The binary is `$FENCELOCK_REDIS_SERVER` if set, else `redis-server`
    /// from `PATH`.
    pub fn start() -> io::Result<RedisServer> {
        Self::start_with(&[])
    }

    /// Like [`RedisServer::start`], appending `extra_args` to the command
    /// line (e.g. `&["--maxmemory", "10mb"]`). Later options override earlier
    /// ones, so these can also replace the defaults. They are reused by
    /// [`RedisServer::restart`].
    pub fn start_with(extra_args: &[&str]) -> io::Result<RedisServer> {
        start_bin(&server_bin(), extra_args, None)
    }

    /// A server that speaks TLS only (`--port 0 --tls-port P`), with `tls`'s server
    /// certificate, and requires a client certificate signed by `tls.ca`
    /// (`--tls-auth-clients yes`). [`RedisServer::cli`] connects with the client certificate.
    pub fn start_tls(tls: &crate::TestTls, extra_args: &[&str]) -> io::Result<RedisServer> {
        start_bin(&server_bin(), extra_args, Some(tls.clone()))
    }

    /// The TCP port the server listens on (stable across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `"127.0.0.1:PORT"`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `"redis://127.0.0.1:PORT"`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// For a server from [`RedisServer::start_tls`]:
    /// `"rediss://127.0.0.1:PORT?ca=CA&cert=CLIENT_CERT&key=CLIENT_KEY"` (the test kit's
    /// temporary paths need no percent-encoding); else [`RedisServer::url`].
    pub fn tls_url(&self) -> String {
        match &self.tls {
            Some(tls) => format!(
                "rediss://127.0.0.1:{}?ca={}&cert={}&key={}",
                self.port,
                tls.ca.display(),
                tls.client_cert.display(),
                tls.client_key.display()
            ),
            None => self.url(),
        }
    }

    /// The pid of the current process, or of the last one after
    /// [`RedisServer::kill`].
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The server's working directory, which holds `redis.log`. A restart
    /// moves the server to a fresh directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The contents of `redis.log` so far, or an empty string if it cannot be
    /// read; meant for assertion messages, where a missing log must not mask
    /// the real failure.
    pub fn log(&self) -> String {
        read_lossy(&self.dir.path().join(LOG_FILE))
    }

    /// Whether the process has been started and not yet killed. A paused
    /// server counts as running.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server with SIGKILL, simulating a crash (no shutdown hooks
    /// run), and reaps it. Once this returns the port refuses connections.
    /// Does nothing if the server is already dead.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop(&mut child);
        }
    }

    /// Freezes the server with SIGSTOP, simulating a hung node or a long GC
    /// pause: connections are still accepted by the kernel but nothing is
    /// answered until [`RedisServer::resume`].
    pub fn pause(&self) -> io::Result<()> {
        self.signal(Signal::SIGSTOP)
    }

    /// Lets a server frozen by [`RedisServer::pause`] run again; it then
    /// answers the requests that queued up meanwhile.
    pub fn resume(&self) -> io::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    /// Kills the server and starts a fresh process on the same port with the
    /// same extra arguments but no data: a node that crashed and lost its
    /// memory. Waits until the new process answers PING.
    ///
    /// The new process gets a fresh directory, so even with persistence
    /// turned on through the extra arguments nothing is reloaded.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let deadline = Instant::now() + RESTART_BIND_TIMEOUT;
        loop {
            match launch(&self.bin, self.port, &self.extra_args, self.tls.as_ref()) {
                Ok((child, dir)) => {
                    self.pid = child.id();
                    self.child = Some(child);
                    self.dir = dir;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs `redis-cli -h 127.0.0.1 -p PORT <args>` and returns its output.
    ///
    /// The binary is `$FENCELOCK_REDIS_CLI` if set, else `redis-cli` from
    /// `PATH`. A non-zero exit status is returned in the `Output`, not as an
    /// error; note that redis-cli reports server errors on stdout with exit
    /// status 0.
    pub fn cli(&self, args: &[&str]) -> io::Result<Output> {
        let bin = env_or(CLI_ENV, "redis-cli");
        let mut cmd = Command::new(&bin);
        cmd.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(tls) = &self.tls {
            cmd.arg("--tls")
                .arg("--cacert")
                .arg(&tls.ca)
                .arg("--cert")
                .arg(&tls.client_cert)
                .arg("--key")
                .arg(&tls.client_key);
        }
        cmd.args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| explain_spawn_error(e, &bin, "redis-cli", CLI_ENV, "redis-tools"))
    }

    fn signal(&self, sig: Signal) -> io::Result<()> {
        if self.child.is_none() {
            return Err(io::Error::other(format!(
                "redis-server on port {} is not running",
                self.port
            )));
        }
        signal::kill(as_pid(self.pid), sig).map_err(io::Error::from)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `n` independent servers, e.g. the nodes of a Redlock quorum.
///
/// If one fails to start, those already started are stopped and the error is
/// returned.
pub fn start_redis_nodes(n: usize) -> io::Result<Vec<RedisServer>> {
    (0..n).map(|_| RedisServer::start()).collect()
}

/// `"redlock://127.0.0.1:P1,127.0.0.1:P2,..."` for the given nodes, in order.
pub fn redlock_url(nodes: &[RedisServer]) -> String {
    let addrs: Vec<String> = nodes.iter().map(RedisServer::addr).collect();
    format!("redlock://{}", addrs.join(","))
}

/// The backend URL for `nodes`: `redis://` for a single node, `redlock://` for several, so a
/// test can run one scenario on both engines.
pub fn backend_url(nodes: &[RedisServer]) -> String {
    match nodes {
        [one] => one.url(),
        _ => redlock_url(nodes),
    }
}

/// Starts `bin` on a free port. Taking the binary as a parameter lets tests
/// exercise a missing binary without mutating the process-global
/// environment, which concurrently running tests would observe.
fn start_bin(
    bin: &Path,
    extra_args: &[&str],
    tls: Option<crate::TestTls>,
) -> io::Result<RedisServer> {
    let extra_args: Vec<String> = extra_args.iter().map(|s| (*s).to_owned()).collect();
    let mut last_err = None;
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        match launch(bin, port, &extra_args, tls.as_ref()) {
            Ok((child, dir)) => {
                return Ok(RedisServer {
                    bin: bin.to_owned(),
                    extra_args,
                    tls,
                    port,
                    pid: child.id(),
                    child: Some(child),
                    dir,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last_err.unwrap_or_else(|| io::Error::other("redis-server was never started")))
}

/// Spawns one process on `port` and waits until it is ready. On failure the
/// process is gone and the error says why; a port conflict is reported as
/// `ErrorKind::AddrInUse` so callers can retry.
fn launch(
    bin: &Path,
    port: u16,
    extra_args: &[String],
    tls: Option<&crate::TestTls>,
) -> io::Result<(Child, TempDir)> {
    let dir = tempfile::Builder::new()
        .prefix("fencelock-redis-")
        .tempdir()?;
    let stderr = File::create(dir.path().join(STDERR_FILE))?;
    let mut cmd = Command::new(bin);
    match tls {
        None => cmd.arg("--port").arg(port.to_string()),
        Some(tls) => cmd
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(&tls.server_cert)
            .arg("--tls-key-file")
            .arg(&tls.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&tls.ca)
            .args(["--tls-auth-clients", "yes"]),
    };
    let mut child = cmd
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir.path())
        .arg("--logfile")
        .arg(dir.path().join(LOG_FILE))
        .args(extra_args)
        // Never inherit the test's stdio: the harness captures output
        // through pipes and waits for every writer to close them, so a
        // server holding them would hang the test run.
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .map_err(|e| explain_spawn_error(e, bin, "redis-server", SERVER_ENV, "redis-server"))?;

    match wait_ready(&mut child, port, dir.path(), tls.is_some()) {
        Ok(()) => Ok((child, dir)),
        Err(e) => {
            stop(&mut child);
            Err(e)
        }
    }
}

fn wait_ready(child: &mut Child, port: u16, dir: &Path, tls: bool) -> io::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            let log = read_lossy(&dir.join(LOG_FILE));
            let stderr = read_lossy(&dir.join(STDERR_FILE));
            let kind = if log.contains("Address already in use")
                || stderr.contains("Address already in use")
            {
                io::ErrorKind::AddrInUse
            } else {
                io::ErrorKind::Other
            };
            return Err(io::Error::new(
                kind,
                format!(
                    "redis-server on port {port} exited during startup ({status}){}",
                    diagnostics(&log, &stderr)
                ),
            ));
        }
        // A TLS-only server cannot be asked in plain text: its log says when it listens,
        // and the log is in the server's own directory, so it is this server's word.
        let ready = if tls {
            read_lossy(&dir.join(LOG_FILE)).contains("Ready to accept connections")
        } else {
            answers_ping(port, child.id())
        };
        if ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let log = read_lossy(&dir.join(LOG_FILE));
            let stderr = read_lossy(&dir.join(STDERR_FILE));
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "redis-server on port {port} did not answer PING within {READY_TIMEOUT:?}{}",
                    diagnostics(&log, &stderr)
                ),
            ));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether the server on `port` is up and is *our* process. A bare `+PONG`
/// is not enough: if another redis grabbed the port first, it would answer
/// while our child is about to die with "Address already in use".
fn answers_ping(port: u16, pid: u32) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let timeout = Some(Duration::from_millis(500));
    if stream.set_read_timeout(timeout).is_err()
        || stream.set_write_timeout(timeout).is_err()
        || stream.write_all(b"PING\r\nINFO server\r\n").is_err()
    {
        return false;
    }

    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    // INFO is a single bulk reply of a few KiB; the cap only guards against
    // something that is not redis streaming at us forever.
    while reply.len() < 64 * 1024 && reported_pid(&reply).is_none() {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return false,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
        }
        // An error reply such as "-LOADING" means not ready yet.
        if reply.first() == Some(&b'-') {
            return false;
        }
    }
    reply.starts_with(b"+PONG\r\n") && reported_pid(&reply) == Some(pid)
}

/// The `process_id` field of an `INFO server` reply, once it has fully
/// arrived.
fn reported_pid(reply: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(reply).ok()?;
    let rest = &text[text.find("\r\nprocess_id:")? + "\r\nprocess_id:".len()..];
    rest[..rest.find("\r\n")?].parse().ok()
}

fn server_bin() -> PathBuf {
    env_or(SERVER_ENV, "redis-server")
}

fn explain_spawn_error(
    e: io::Error,
    bin: &Path,
    program: &str,
    env_var: &str,
    package: &str,
) -> io::Error {
    io::Error::new(
        e.kind(),
        format!(
            "cannot run `{}`: {e}. fencelock-testkit needs a real {program} binary: \
             install the Debian package `{package}` (apt-get install {package}) \
             or set {env_var} to its path",
            bin.display(),
        ),
    )
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

fn diagnostics(log: &str, stderr: &str) -> String {
    let mut out = String::new();
    for (name, text) in [(LOG_FILE, log), (STDERR_FILE, stderr)] {
        if !text.trim().is_empty() {
            out.push_str(&format!("\n--- tail of {name} ---\n{}", tail(text)));
        }
    }
    if out.is_empty() {
        out.push_str("; its log is empty");
    }
    out
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn stdout(output: &Output) -> String {
        assert!(output.status.success(), "redis-cli failed: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    fn run_id(server: &RedisServer) -> String {
        let info = stdout(&server.cli(&["INFO", "server"]).unwrap());
        info.lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .unwrap()
            .trim()
            .to_owned()
    }

    fn connect(server: &RedisServer) -> io::Result<TcpStream> {
        TcpStream::connect(("127.0.0.1", server.port()))
    }

    /// Sends PING on a fresh connection and waits at most `timeout` for the
    /// reply.
    fn raw_ping(server: &RedisServer, timeout: Duration) -> io::Result<String> {
        let mut stream = connect(server)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.write_all(b"PING\r\n")?;
        let mut buf = [0u8; 64];
        let n = stream.read(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    }

    #[test]
    fn starts_and_answers_ping() {
        let server = RedisServer::start().unwrap();
        assert_eq!(stdout(&server.cli(&["PING"]).unwrap()), "PONG");
        assert_eq!(server.addr(), format!("127.0.0.1:{}", server.port()));
        assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
        assert!(server.dir().is_dir());
        assert!(server.log().contains("Ready to accept connections"));
        // Persistence really is off, so a "restart" can never reload data.
        let save = stdout(&server.cli(&["CONFIG", "GET", "save"]).unwrap());
        assert_eq!(save.lines().collect::<Vec<_>>(), ["save"]);
    }

    #[test]
    fn kill_closes_the_port() {
        let mut server = RedisServer::start().unwrap();
        connect(&server).unwrap();
        server.kill();
        assert!(!server.is_running());
        assert!(connect(&server).is_err());
        server.kill(); // idempotent
        assert!(server.pause().is_err());
    }

    #[test]
    fn restart_forgets_data_but_keeps_port_and_args() {
        let mut server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]).unwrap();
        let port = server.port();
        let old_pid = server.pid();
        let old_run_id = run_id(&server);
        assert_eq!(stdout(&server.cli(&["SET", "k", "v"]).unwrap()), "OK");
        assert_eq!(stdout(&server.cli(&["GET", "k"]).unwrap()), "v");

        server.restart().unwrap();

        assert_eq!(server.port(), port);
        assert_ne!(server.pid(), old_pid);
        assert_ne!(run_id(&server), old_run_id);
        assert_eq!(stdout(&server.cli(&["GET", "k"]).unwrap()), "");
        assert_eq!(stdout(&server.cli(&["DBSIZE"]).unwrap()), "0");
        let policy = stdout(&server.cli(&["CONFIG", "GET", "maxmemory-policy"]).unwrap());
        assert!(policy.ends_with("allkeys-lru"), "{policy}");
    }

    #[test]
    fn restart_after_kill_works() {
        let mut server = RedisServer::start().unwrap();
        server.kill();
        server.restart().unwrap();
        assert_eq!(stdout(&server.cli(&["PING"]).unwrap()), "PONG");
    }

    #[test]
    fn pause_and_resume() {
        let server = RedisServer::start().unwrap();
        server.pause().unwrap();
        let err = raw_ping(&server, Duration::from_millis(200)).unwrap_err();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{err:?}"
        );
        server.resume().unwrap();
        assert_eq!(
            raw_ping(&server, Duration::from_secs(5)).unwrap(),
            "+PONG\r\n"
        );
    }

    #[test]
    fn drop_kills_and_reaps_even_when_paused() {
        for paused in [false, true] {
            let server = RedisServer::start().unwrap();
            let pid = as_pid(server.pid());
            if paused {
                server.pause().unwrap();
            }
            assert!(signal::kill(pid, None).is_ok());
            drop(server);
            // ESRCH rather than success: success would mean the process, or
            // at least its unreaped zombie, is still there.
            assert_eq!(signal::kill(pid, None), Err(nix::errno::Errno::ESRCH));
        }
    }

    #[test]
    fn missing_binary_names_the_package() {
        let err = start_bin(Path::new("/nonexistent/redis-server"), &[], None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/redis-server"), "{msg}");
        assert!(msg.contains("needs a real redis-server binary"), "{msg}");
        assert!(msg.contains("apt-get install redis-server"), "{msg}");
        assert!(msg.contains(SERVER_ENV), "{msg}");
    }

    #[test]
    fn taken_port_is_reported_as_addr_in_use() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let err = launch(&server_bin(), port, &[], None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        assert!(err.to_string().contains("Address already in use"), "{err}");
    }

    #[test]
    fn startup_failure_includes_the_logs() {
        let err = RedisServer::start_with(&["--no-such-directive", "1"]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("exited during startup"), "{msg}");
        assert!(msg.contains("no-such-directive"), "{msg}");
    }

    #[test]
    fn nodes_and_redlock_url() {
        let nodes = start_redis_nodes(3).unwrap();
        assert_eq!(nodes.len(), 3);
        for node in &nodes {
            assert_eq!(stdout(&node.cli(&["PING"]).unwrap()), "PONG");
        }
        let expected = format!(
            "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
            nodes[0].port(),
            nodes[1].port(),
            nodes[2].port()
        );
        assert_eq!(redlock_url(&nodes), expected);
        assert_eq!(redlock_url(&[]), "redlock://");
    }
}
