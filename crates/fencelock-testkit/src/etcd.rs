//! A real etcd cluster (N `etcd` processes) on loopback for integration tests.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use tempfile::TempDir;

use crate::free_port;
use crate::proc::{as_pid, env_or, stop};

/// Overrides the `etcd` found on `PATH`.
const SERVER_ENV: &str = "FENCELOCK_ETCD";
/// Overrides the `etcdctl` found on `PATH`.
const CTL_ENV: &str = "FENCELOCK_ETCDCTL";

const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    pid: u32,
}

/// N `etcd` members on free loopback ports, each with its own data directory in one temporary
/// directory. Short raft timings (`--heartbeat-interval 50 --election-timeout 500`) keep
/// failover quick; the smallest lease TTL the cluster grants is then 1 s. Every member is
/// killed (SIGKILL, paused or not) and reaped on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: TempDir,
    tls: Option<EtcdTls>,
    /// Member `i` runs on host `i` of this network, when the cluster was started on one.
    lan: Option<std::sync::Arc<crate::Lan>>,
}

/// The certificates an etcd cluster serves clients with: the test kit's [`TestTls`].
pub type EtcdTls = crate::tls::TestTls;

impl EtcdCluster {
    /// Starts `n` members and waits until every one reports healthy.
    pub fn start(n: usize) -> io::Result<EtcdCluster> {
        Self::start_with(n, None, None)
    }

    /// Like [`EtcdCluster::start`], serving clients over TLS that requires a client
    /// certificate signed by `tls.ca` (`--client-cert-auth`); members talk plain HTTP to each
    /// other.
    pub fn start_tls(n: usize, tls: &EtcdTls) -> io::Result<EtcdCluster> {
        Self::start_with(n, Some(tls.clone()), None)
    }

    /// Starts one member on each host of `lan`, so that [`crate::Lan::isolate`] partitions a
    /// member from the others and from every client. Its [`EtcdCluster::endpoints`] are the
    /// hosts' addresses, which clients reach through a [`crate::FaultProxy::start_from`] the
    /// hub; `etcdctl` runs in the hub.
    pub fn start_on(lan: std::sync::Arc<crate::Lan>) -> io::Result<EtcdCluster> {
        let n = lan.len();
        Self::start_with(n, None, Some(lan))
    }

    fn start_with(
        n: usize,
        tls: Option<EtcdTls>,
        lan: Option<std::sync::Arc<crate::Lan>>,
    ) -> io::Result<EtcdCluster> {
        let dir = tempfile::Builder::new()
            .prefix("fencelock-etcd")
            .tempdir()?;
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                child: None,
                pid: 0,
            })
            .collect();
        let mut cluster = EtcdCluster {
            members,
            dir,
            tls,
            lan,
        };
        for i in 0..n {
            cluster.launch(i)?;
        }
        for i in 0..n {
            cluster.wait_healthy(i)?;
        }
        Ok(cluster)
    }

    /// The client endpoints, `127.0.0.1:PORT` each, in member order.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    fn host(&self, i: usize) -> String {
        self.lan
            .as_ref()
            .map_or_else(|| "127.0.0.1".to_owned(), |l| l.ip(i).to_string())
    }

    fn endpoint(&self, i: usize) -> String {
        let port = self.members.get(i).map_or(0, |m| m.client_port);
        format!("{}:{port}", self.host(i))
    }

    /// `etcd://h1:p1,h2:p2,...` for every member (`etcds://` with the CA and the client
    /// certificate when the cluster serves TLS).
    pub fn url(&self) -> String {
        match &self.tls {
            None => format!("etcd://{}", self.endpoints().join(",")),
            Some(t) => format!(
                "etcds://{}?ca={}&cert={}&key={}",
                self.endpoints().join(","),
                t.ca.display(),
                t.client_cert.display(),
                t.client_key.display()
            ),
        }
    }

    /// The number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The pid of member `i`'s current (or last) process.
    pub fn pid(&self, i: usize) -> u32 {
        self.members.get(i).map_or(0, |m| m.pid)
    }

    /// Kills member `i` with SIGKILL (a crash) and reaps it. Its data stays for a restart.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members.get_mut(i).and_then(|m| m.child.take()) {
            stop(&mut child);
        }
    }

    /// Starts member `i` again on the same ports with its data, and waits until it is healthy.
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.kill(i);
        self.launch(i)?;
        self.wait_healthy(i)
    }

    /// Freezes member `i` with SIGSTOP: its connections stay open and unanswered.
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.signal(i, Signal::SIGSTOP)
    }

    /// Lets a member frozen by [`EtcdCluster::pause`] run again.
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.signal(i, Signal::SIGCONT)
    }

    /// The index of the member that is raft leader now, as `etcdctl endpoint status` reports
    /// it on the members that answer.
    pub fn leader(&self) -> io::Result<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            let out = self.ctl_at(&self.endpoint(i), &["endpoint", "status", "-w", "simple"])?;
            // `127.0.0.1:P, <id>, <version>, <db size>, <is leader>, ...`
            let text = String::from_utf8_lossy(&out.stdout);
            let is_leader = text.split(',').nth(4).map(str::trim) == Some("true");
            if out.status.success() && is_leader {
                return Ok(i);
            }
        }
        Err(io::Error::other("no member reports itself leader"))
    }

    /// Runs `etcdctl` (API v3) against every member with `args`, stdin closed.
    pub fn ctl(&self, args: &[&str]) -> io::Result<Output> {
        self.ctl_at(&self.endpoints().join(","), args)
    }

    /// An `etcdctl` command (API v3, every endpoint) for callers that need a child process
    /// (`etcdctl lock`, `etcdctl elect`), stdin closed, stdout and stderr piped.
    pub fn ctl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(ctl_bin());
        cmd.env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoints().join(",")))
            .args(self.ctl_tls_args())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// The temporary directory holding every member's data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Member `i`'s log so far, for assertion messages.
    pub fn log(&self, i: usize) -> String {
        self.members
            .get(i)
            .and_then(|m| fs::read(self.dir.path().join(format!("{}.log", m.name))).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn ctl_at(&self, endpoints: &str, args: &[&str]) -> io::Result<Output> {
        match &self.lan {
            None => Command::new(ctl_bin()),
            Some(lan) => lan.hub_command(ctl_bin()),
        }
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .args(self.ctl_tls_args())
        .arg("--command-timeout=2s")
        .args(args)
        .stdin(Stdio::null())
        .output()
    }

    fn ctl_tls_args(&self) -> Vec<String> {
        match &self.tls {
            None => Vec::new(),
            Some(t) => vec![
                format!("--cacert={}", t.ca.display()),
                format!("--cert={}", t.server_cert.display()),
                format!("--key={}", t.server_key.display()),
            ],
        }
    }

    fn launch(&mut self, i: usize) -> io::Result<()> {
        let initial = self
            .members
            .iter()
            .enumerate()
            .map(|(j, m)| format!("{}=http://{}:{}", m.name, self.host(j), m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let host = self.host(i);
        let lan = self.lan.clone();
        let dir = self.dir.path().to_path_buf();
        let tls_args: Vec<String> = match &self.tls {
            None => Vec::new(),
            Some(t) => vec![
                format!("--cert-file={}", t.server_cert.display()),
                format!("--key-file={}", t.server_key.display()),
                format!("--trusted-ca-file={}", t.ca.display()),
                "--client-cert-auth".to_owned(),
            ],
        };
        let Some(m) = self.members.get_mut(i) else {
            return Err(io::Error::other(format!("no member {i}")));
        };
        let scheme = if tls_args.is_empty() { "http" } else { "https" };
        let client = format!("{scheme}://{host}:{}", m.client_port);
        let peer = format!("http://{host}:{}", m.peer_port);
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{}.stderr", m.name)))?;
        let child = match &lan {
            None => Command::new(server_bin()),
            Some(lan) => lan.command(i, server_bin()),
        }
        .args(["--name", &m.name])
        .arg("--data-dir")
        .arg(dir.join(format!("{}.data", m.name)))
        .args(["--logger", "zap"])
        .arg(format!(
            "--log-outputs={}",
            dir.join(format!("{}.log", m.name)).display()
        ))
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &initial])
        .args(["--initial-cluster-state", "new"])
        .args(["--initial-cluster-token", "fencelock-test"])
        .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
        .args(&tls_args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start {}: {e}", server_bin().display()),
            )
        })?;
        m.pid = child.id();
        m.child = Some(child);
        Ok(())
    }

    fn wait_healthy(&mut self, i: usize) -> io::Result<()> {
        let ep = self.endpoint(i);
        let start = Instant::now();
        loop {
            if let Some(Some(status)) = self
                .members
                .get_mut(i)
                .and_then(|m| m.child.as_mut())
                .map(|c| c.try_wait().ok().flatten())
            {
                return Err(io::Error::other(format!(
                    "etcd member {i} exited with {status}; log:\n{}",
                    self.log(i)
                )));
            }
            let out = self.ctl_at(&ep, &["endpoint", "health"])?;
            if out.status.success() {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("etcd member {i} not healthy in time; log:\n{}", self.log(i)),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn signal(&self, i: usize, sig: Signal) -> io::Result<()> {
        match self.members.get(i).and_then(|m| m.child.as_ref()) {
            Some(child) => signal::kill(as_pid(child.id()), sig).map_err(io::Error::from),
            None => Err(io::Error::other(format!("etcd member {i} is not running"))),
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut child) = m.child.take() {
                stop(&mut child);
            }
        }
    }
}

fn server_bin() -> PathBuf {
    env_or(SERVER_ENV, "etcd")
}

fn ctl_bin() -> PathBuf {
    env_or(CTL_ENV, "etcdctl")
}
