//! Real PostgreSQL servers for integration tests.

use std::fs::{self, File};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::{Gid, Uid, User};
use tempfile::TempDir;

use crate::free_port;
use crate::proc::as_pid;

/// Overrides the directory holding `initdb`, `postgres` and `psql`.
const BINDIR_ENV: &str = "FENCELOCK_PG_BINDIR";
/// Debian installs each major version side by side; 15 is the one the project targets.
const PREFERRED_BINDIR: &str = "/usr/lib/postgresql/15/bin";
const DEBIAN_ROOT: &str = "/usr/lib/postgresql";
/// PostgreSQL refuses to run as root; Debian's package creates this account.
const SERVICE_USER: &str = "postgres";

const DATA_DIR: &str = "data";
const LOG_FILE: &str = "postgres.log";
const INITDB_LOG: &str = "initdb.log";

/// Cold initdb takes ~0.6 s here; the margin is for a loaded CI machine.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const POLL_INTERVAL: Duration = Duration::from_millis(10);
const START_ATTEMPTS: usize = 5;
/// How long [`PgServer::restart`] keeps retrying the same port.
const RESTART_BIND_TIMEOUT: Duration = Duration::from_secs(5);
const LOG_TAIL_LINES: usize = 20;
/// How long a SIGSTOP or SIGKILL may take to land.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// A PostgreSQL server (the postmaster as a direct child process) listening on 127.0.0.1,
/// with a fresh cluster in its own temporary directory.
///
/// The cluster has one superuser, `postgres`, with `trust` authentication, so
/// [`PgServer::url`] needs no password. Durability is off (`fsync=off`): data survives
/// [`PgServer::kill`] and [`PgServer::restart`] (the OS still holds it), not a machine crash.
/// Its dynamic shared memory lives in files of the data directory
/// (`dynamic_shared_memory_type=mmap`), not in `/dev/shm`, where a killed server's segments
/// would outlive the test.
///
/// As root the server runs as the `postgres` account (the server refuses root), in a
/// directory owned by it; otherwise as the current user. Kill and drop SIGKILL the
/// postmaster and every backend, so none outlives the test.
///
/// Dropping shuts the server down at once and removes its directory.
#[derive(Debug)]
pub struct PgServer {
    bindir: PathBuf,
    port: u16,
    pid: u32,
    /// `None` once killed; kept unreaped until signalled so its pid (and process group id)
    /// cannot be recycled for an unrelated process.
    child: Option<Child>,
    dir: TempDir,
}

impl PgServer {
    /// Creates a cluster with `initdb`, starts `postgres` on a free loopback port and waits
    /// until it accepts connections.
    ///
    /// The binaries come from `$FENCELOCK_PG_BINDIR`, else `/usr/lib/postgresql/15/bin`,
    /// else the newest `/usr/lib/postgresql/*/bin`.
    pub fn start() -> io::Result<PgServer> {
        start_in(&bindir()?, None)
    }

    /// Like [`PgServer::start`], with `ssl = on` (the server certificate of `tls`, and its CA
    /// for client certificates) and a `pg_hba.conf` whose only lines are `hostssl`: a session
    /// without TLS is refused by the server.
    pub fn start_tls(tls: &crate::TestTls) -> io::Result<PgServer> {
        start_in(&bindir()?, Some(tls))
    }

    /// The TCP port the server listens on (stable across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `"postgres://postgres@127.0.0.1:PORT/postgres"`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's pid, or the last one after
    /// [`PgServer::kill`].
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The server's directory: the cluster in `data/`, the Unix socket and `postgres.log`.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server log so far, or an empty string if it cannot be read; meant for assertion
    /// messages.
    pub fn log(&self) -> String {
        read_lossy(&self.dir.path().join(LOG_FILE))
    }

    /// Whether the server has been started and not killed since.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILLs the postmaster and all its backends, simulating a crash, and reaps the
    /// postmaster. Once this returns the port refuses connections. Does nothing if the server
    /// is already dead.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            stop(&mut child);
        }
    }

    /// Kills the server and starts it again on the same port over the same cluster: a crash
    /// and a recovery, so committed data is kept. Waits until it accepts connections.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let deadline = Instant::now() + RESTART_BIND_TIMEOUT;
        loop {
            match spawn_ready(&self.bindir, self.dir.path(), self.port) {
                Ok(child) => {
                    self.pid = child.id();
                    self.child = Some(child);
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs `psql` against the server with `sql` as one command (`-X -A -t -v
    /// ON_ERROR_STOP=1`: no psqlrc, unaligned, tuples only) and returns its output; a failing
    /// statement is a non-zero exit status in the `Output`, not an error.
    pub fn psql(&self, sql: &str) -> io::Result<Output> {
        let bin = self.bindir.join("psql");
        Command::new(&bin)
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(self.url())
            .arg("-c")
            .arg(sql)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| explain_spawn_error(e, &bin))
    }
}

impl PgServer {
    /// Creates a login role `user` with `password` that must authenticate with it over TCP
    /// (`scram-sha-256`; every other role keeps trust authentication), with no privilege
    /// beyond connecting, and reloads the server's configuration. Returns its URL.
    pub fn add_password_role(&self, user: &str, password: &str) -> io::Result<String> {
        let out = self.psql(&format!(
            "CREATE ROLE \"{user}\" LOGIN PASSWORD '{}'",
            password.replace('\'', "''")
        ))?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "CREATE ROLE {user} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let hba = self.dir.path().join("data").join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba)?;
        // The first matching line wins, so the role's line goes before the trust lines.
        std::fs::write(
            &hba,
            format!("host all \"{user}\" 127.0.0.1/32 scram-sha-256\n{old}"),
        )?;
        let out = self.psql("SELECT pg_reload_conf()")?;
        if !out.status.success() {
            return Err(io::Error::other("pg_reload_conf failed"));
        }
        Ok(format!(
            "postgres://{user}@127.0.0.1:{}/postgres",
            self.port
        ))
    }

    /// Starts `psql` in the background running `sql` as one session (`-X -q -v
    /// ON_ERROR_STOP=1`, output discarded): a second client, as an operator at a terminal
    /// would be. The caller waits for its effect and kills it when done.
    pub fn psql_session(&self, sql: &str) -> io::Result<Child> {
        let bin = self.bindir.join("psql");
        Command::new(&bin)
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(self.url())
            .arg("-c")
            .arg(sql)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| explain_spawn_error(e, &bin))
    }
}

impl Drop for PgServer {
    /// An immediate shutdown (SIGQUIT: no checkpoint, the cluster is thrown away anyway), so
    /// that the postmaster reaps its own backends: SIGKILLed ones are orphaned, and where the
    /// init process does not reap orphans (some containers), each test would leave zombies.
    /// Falls back to [`PgServer::kill`] if the server does not go in time.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Ok(None) = child.try_wait() {
                let _ = signal::kill(as_pid(child.id()), Signal::SIGQUIT);
                let exited =
                    crate::wait_until(KILL_TIMEOUT, || !matches!(child.try_wait(), Ok(None)));
                if !exited {
                    stop(&mut child);
                }
            }
        }
    }
}

fn start_in(bindir: &Path, tls: Option<&crate::TestTls>) -> io::Result<PgServer> {
    let dir = tempfile::Builder::new().prefix("fencelock-pg-").tempdir()?;
    let account = service_account()?;
    if let Some((uid, gid)) = account {
        nix::unistd::chown(dir.path(), Some(uid), Some(gid)).map_err(io::Error::from)?;
    }
    initdb(bindir, dir.path())?;
    if let Some(tls) = tls {
        serve_tls_only(&dir.path().join(DATA_DIR), tls, account)?;
    }
    let mut last_err = None;
    for _ in 0..START_ATTEMPTS {
        let port = free_port();
        match spawn_ready(bindir, dir.path(), port) {
            Ok(child) => {
                return Ok(PgServer {
                    bindir: bindir.to_owned(),
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
    Err(last_err.unwrap_or_else(|| io::Error::other("postgres was never started")))
}

/// Copies the server's certificate, key and CA into the data directory (the server refuses a
/// key others can read), turns `ssl` on and leaves only `hostssl` lines in `pg_hba.conf`.
fn serve_tls_only(
    data: &Path,
    tls: &crate::TestTls,
    account: Option<(Uid, Gid)>,
) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for (from, to) in [
        (&tls.server_cert, "server.crt"),
        (&tls.server_key, "server.key"),
        (&tls.ca, "root.crt"),
    ] {
        let path = data.join(to);
        fs::copy(from, &path)?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
        if let Some((uid, gid)) = account {
            nix::unistd::chown(&path, Some(uid), Some(gid)).map_err(io::Error::from)?;
        }
    }
    let mut conf = fs::OpenOptions::new()
        .append(true)
        .open(data.join("postgresql.conf"))?;
    io::Write::write_all(
        &mut conf,
        b"ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
          ssl_ca_file = 'root.crt'\n",
    )?;
    fs::write(
        data.join("pg_hba.conf"),
        "hostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
    )
}

fn initdb(bindir: &Path, dir: &Path) -> io::Result<()> {
    let bin = bindir.join("initdb");
    let log = File::create(dir.join(INITDB_LOG))?;
    let status = as_service_user(Command::new(&bin))?
        .arg("-D")
        .arg(dir.join(DATA_DIR))
        .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
        .args(["--locale=C.UTF-8", "--no-sync"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .map_err(|e| explain_spawn_error(e, &bin))?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "initdb failed ({status})\n--- tail of {INITDB_LOG} ---\n{}",
            tail(&read_lossy(&dir.join(INITDB_LOG)))
        )))
    }
}

/// Spawns the postmaster on `port` and waits until it is ready. On failure it is gone and
/// the error says why; a port conflict is `ErrorKind::AddrInUse` so callers can retry.
fn spawn_ready(bindir: &Path, dir: &Path, port: u16) -> io::Result<Child> {
    let bin = bindir.join("postgres");
    let log = File::options()
        .create(true)
        .append(true)
        .open(dir.join(LOG_FILE))?;
    let mut child = as_service_user(Command::new(&bin))?
        .arg("-D")
        .arg(dir.join(DATA_DIR))
        .arg("-p")
        .arg(port.to_string())
        .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
        .args(["-c", "dynamic_shared_memory_type=mmap"])
        .arg("-k")
        .arg(dir)
        .current_dir(dir)
        // Never inherit the test's stdio: the harness waits for every writer of its pipes.
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| explain_spawn_error(e, &bin))?;
    match wait_ready(&mut child, dir, port) {
        Ok(()) => Ok(child),
        Err(e) => {
            stop(&mut child);
            Err(e)
        }
    }
}

/// Ready when `postmaster.pid` names our child and says `ready`, as `pg_ctl -w` decides: the
/// postmaster writes that once its sockets listen. Reading the file rather than probing the
/// port keeps another server that holds the port from passing for ours.
fn wait_ready(child: &mut Child, dir: &Path, port: u16) -> io::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let pid_file = dir.join(DATA_DIR).join("postmaster.pid");
    loop {
        if let Some(status) = child.try_wait()? {
            let log = read_lossy(&dir.join(LOG_FILE));
            let kind = if log.contains("Address already in use") {
                io::ErrorKind::AddrInUse
            } else {
                io::ErrorKind::Other
            };
            return Err(io::Error::new(
                kind,
                format!(
                    "postgres on port {port} exited during startup ({status})\n\
                     --- tail of {LOG_FILE} ---\n{}",
                    tail(&log)
                ),
            ));
        }
        let pid_lines = read_lossy(&pid_file);
        let lines: Vec<&str> = pid_lines.lines().collect();
        let ours = lines.first().map(|l| l.trim()) == Some(child.id().to_string().as_str());
        let ready = lines.get(7).map(|l| l.trim()) == Some("ready");
        if ours && ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "postgres on port {port} was not ready within {READY_TIMEOUT:?}\n\
                     --- tail of {LOG_FILE} ---\n{}",
                    tail(&read_lossy(&dir.join(LOG_FILE)))
                ),
            ));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// SIGKILLs the postmaster and its children and reaps the postmaster, ignoring errors: this
/// runs from `Drop` and on error paths, where there is nothing better to do.
///
/// Backends call `setsid`, so they are in no process group of ours; they are found as the
/// postmaster's children while it is stopped, so that it cannot fork one more in between.
fn stop(child: &mut Child) {
    // Only while the postmaster is unreaped is its pid certainly still ours.
    if let Ok(None) = child.try_wait() {
        let pid = child.id();
        let _ = signal::kill(as_pid(pid), Signal::SIGSTOP);
        crate::wait_until(KILL_TIMEOUT, || {
            proc_stat(pid).is_none_or(|s| s.state == 'T' || s.state == 'Z')
        });
        let children = children_of(pid);
        for c in &children {
            let _ = signal::kill(as_pid(c.pid), Signal::SIGKILL);
        }
        let _ = signal::kill(as_pid(pid), Signal::SIGKILL);
        let _ = child.wait();
        // SIGKILL is delivered asynchronously; once this returns, no backend may still serve.
        crate::wait_until(KILL_TIMEOUT, || children.iter().all(|c| !c.is_alive()));
    }
}

/// The fields of `/proc/PID/stat` that tell a process apart from a later one with its pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcStat {
    pid: u32,
    state: char,
    ppid: u32,
    start_time: u64,
}

impl ProcStat {
    /// Whether this very process (not a later one that reuses the pid) still runs.
    fn is_alive(&self) -> bool {
        proc_stat(self.pid).is_some_and(|now| now.start_time == self.start_time && now.state != 'Z')
    }
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may itself hold spaces and parentheses.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(ProcStat {
        pid,
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

fn children_of(parent: u32) -> Vec<ProcStat> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(proc_stat)
        .filter(|s| s.ppid == parent)
        .collect()
}

/// The uid and gid to run the server as: the `postgres` account when we are root, `None`
/// (ourselves) otherwise.
fn service_account() -> io::Result<Option<(Uid, Gid)>> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    match User::from_name(SERVICE_USER).map_err(io::Error::from)? {
        Some(user) => Ok(Some((user.uid, user.gid))),
        None => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "PostgreSQL refuses to run as root and there is no `{SERVICE_USER}` account to \
                 run it as: install the Debian package `postgresql`, or run the tests as \
                 another user"
            ),
        )),
    }
}

/// Switches the child to the service account in the child itself, rather than through
/// `runuser`, which stays behind as the parent and would leave us holding its pid instead
/// of the server's.
fn as_service_user(mut cmd: Command) -> io::Result<Command> {
    if let Some((uid, gid)) = service_account()? {
        cmd.uid(uid.as_raw()).gid(gid.as_raw());
    }
    Ok(cmd)
}

fn bindir() -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BINDIR_ENV).filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    if Path::new(PREFERRED_BINDIR).join("initdb").is_file() {
        return Ok(PathBuf::from(PREFERRED_BINDIR));
    }
    let newest = fs::read_dir(DEBIAN_ROOT)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((major, bin))
        })
        .max_by_key(|(major, _)| *major);
    newest.map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no PostgreSQL binaries in {PREFERRED_BINDIR} or {DEBIAN_ROOT}/*/bin: \
                 install the Debian package `postgresql` (apt-get install postgresql) or set \
                 {BINDIR_ENV} to the directory holding initdb and postgres"
            ),
        )
    })
}

fn explain_spawn_error(e: io::Error, bin: &Path) -> io::Error {
    io::Error::new(
        e.kind(),
        format!(
            "cannot run `{}`: {e}. fencelock-testkit needs PostgreSQL's binaries: install the \
             Debian package `postgresql` (apt-get install postgresql) or set {BINDIR_ENV}",
            bin.display(),
        ),
    )
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

/// Overrides the `pgbouncer` binary.
const PGBOUNCER_ENV: &str = "FENCELOCK_PGBOUNCER";
const PGBOUNCER_DEFAULT: &str = "/usr/sbin/pgbouncer";

/// A PgBouncer in transaction pooling mode in front of a [`PgServer`], on its own loopback
/// port: every transaction may run on another server connection, so session state (advisory
/// locks, prepared statements, `LISTEN`) does not carry from one statement to the next. Two
/// server connections serve every client.
///
/// Like the server, it runs as the `postgres` account when we are root (PgBouncer refuses
/// root) and is killed on drop.
#[derive(Debug)]
pub struct PgBouncer {
    port: u16,
    child: Option<Child>,
    dir: TempDir,
}

impl PgBouncer {
    /// Starts PgBouncer (`$FENCELOCK_PGBOUNCER`, else `/usr/sbin/pgbouncer`, else `pgbouncer`
    /// on the PATH) for `server`'s `postgres` database and waits until it accepts connections.
    pub fn start(server: &PgServer) -> io::Result<PgBouncer> {
        let bin = std::env::var_os(PGBOUNCER_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                let p = PathBuf::from(PGBOUNCER_DEFAULT);
                p.is_file().then_some(p)
            })
            .unwrap_or_else(|| PathBuf::from("pgbouncer"));
        let dir = tempfile::Builder::new()
            .prefix("fencelock-pgbouncer-")
            .tempdir()?;
        if let Some((uid, gid)) = service_account()? {
            nix::unistd::chown(dir.path(), Some(uid), Some(gid)).map_err(io::Error::from)?;
        }
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port();
            let ini = dir.path().join("pgbouncer.ini");
            fs::write(dir.path().join("userlist.txt"), "\"postgres\" \"\"\n")?;
            fs::write(
                &ini,
                format!(
                    "[databases]\n\
                     postgres = host=127.0.0.1 port={} dbname=postgres user=postgres\n\
                     [pgbouncer]\n\
                     listen_addr = 127.0.0.1\n\
                     listen_port = {port}\n\
                     unix_socket_dir =\n\
                     auth_type = trust\n\
                     auth_file = {}\n\
                     pool_mode = transaction\n\
                     default_pool_size = 2\n\
                     max_client_conn = 500\n\
                     logfile = {}\n\
                     ignore_startup_parameters = extra_float_digits\n",
                    server.port(),
                    dir.path().join("userlist.txt").display(),
                    dir.path().join("pgbouncer.log").display(),
                ),
            )?;
            let mut child = as_service_user(Command::new(&bin))?
                .arg(&ini)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "cannot run `{}`: {e}; install the Debian package `pgbouncer` or \
                             set {PGBOUNCER_ENV}",
                            bin.display()
                        ),
                    )
                })?;
            let ready = crate::wait_until(READY_TIMEOUT, || {
                matches!(child.try_wait(), Ok(Some(_)))
                    || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            });
            if ready && matches!(child.try_wait(), Ok(None)) {
                return Ok(PgBouncer {
                    port,
                    child: Some(child),
                    dir,
                });
            }
            let _ = child.kill();
            let _ = child.wait();
            last_err = Some(io::Error::other(format!(
                "pgbouncer on port {port} did not start\n--- tail of pgbouncer.log ---\n{}",
                tail(&read_lossy(&dir.path().join("pgbouncer.log")))
            )));
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("pgbouncer was never started")))
    }

    /// `"postgres://postgres@127.0.0.1:PORT/postgres"`, through the pooler.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The pooler's log so far, for assertion messages.
    pub fn log(&self) -> String {
        read_lossy(&self.dir.path().join("pgbouncer.log"))
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    fn query(server: &PgServer, sql: &str) -> String {
        let out = server.psql(sql).unwrap();
        assert!(out.status.success(), "psql failed: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The postmaster and its children (checkpointer, walwriter, backends, ...).
    fn server_processes(server: &PgServer) -> Vec<ProcStat> {
        let mut all = children_of(server.pid());
        all.push(proc_stat(server.pid()).unwrap());
        all
    }

    #[test]
    fn starts_accepts_queries_and_kill_leaves_nothing_running() {
        let mut server = PgServer::start().unwrap();
        assert_eq!(
            server.url(),
            format!("postgres://postgres@127.0.0.1:{}/postgres", server.port())
        );
        assert_eq!(query(&server, "SELECT 1 + 1"), "2");
        assert!(query(&server, "SHOW server_version").starts_with(char::is_numeric));
        // A backend busy in a session, so that kill has more than the postmaster to end.
        let mut session = Command::new(server.bindir.join("psql"))
            .args(["-X", "-d", &server.url(), "-c", "SELECT pg_sleep(60)"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'";
        assert!(crate::wait_until(Duration::from_secs(10), || {
            query(&server, sleeping) == "1"
        }));
        let processes = server_processes(&server);
        assert!(processes.len() > 2, "{processes:?}");

        server.kill();
        assert!(!server.is_running());
        let alive: Vec<_> = processes.iter().filter(|p| p.is_alive()).collect();
        assert!(alive.is_empty(), "{alive:?}");
        assert!(TcpStream::connect(("127.0.0.1", server.port())).is_err());
        // The session saw its server vanish and gave up.
        assert!(!session.wait().unwrap().success());
        server.kill(); // idempotent
    }

    #[test]
    fn restart_keeps_port_and_committed_data() {
        let mut server = PgServer::start().unwrap();
        let (port, old_pid) = (server.port(), server.pid());
        query(&server, "CREATE TABLE t (v int); INSERT INTO t VALUES (42)");
        server.restart().unwrap();
        assert_eq!(server.port(), port);
        assert_ne!(server.pid(), old_pid);
        assert_eq!(query(&server, "SELECT v FROM t"), "42");
    }

    #[test]
    fn drop_kills_postmaster_and_backends() {
        let server = PgServer::start().unwrap();
        let processes = server_processes(&server);
        assert!(processes.len() > 1, "{processes:?}");
        drop(server);
        let alive: Vec<_> = processes.iter().filter(|p| p.is_alive()).collect();
        assert!(alive.is_empty(), "{alive:?}");
    }

    #[test]
    fn shared_memory_stays_in_the_servers_directory() {
        let server = PgServer::start().unwrap();
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", server.pid())).unwrap();
        let shared: Vec<&str> = maps
            .lines()
            .filter(|l| l.contains("/dev/shm/") || l.contains("pg_dynshmem"))
            .collect();
        assert!(
            !shared.is_empty(),
            "no dynamic shared memory mapped:\n{maps}"
        );
        let dir = server.dir().to_string_lossy().into_owned();
        assert!(
            shared.iter().all(|l| l.contains(&dir)),
            "mapped outside {dir}: {shared:?}"
        );
    }

    #[test]
    fn missing_binaries_name_the_package() {
        let err = start_in(Path::new("/nonexistent/bin"), None).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        let msg = err.to_string();
        assert!(msg.contains("/nonexistent/bin/initdb"), "{msg}");
        assert!(msg.contains("apt-get install postgresql"), "{msg}");
        assert!(msg.contains(BINDIR_ENV), "{msg}");
    }
}
