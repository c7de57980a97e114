//! A real ZooKeeper ensemble (N JVMs running `QuorumPeerMain`), or one standalone server, on
//! loopback for integration tests; and the classpath of Apache Curator for interop peers.

use std::fs;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use tempfile::TempDir;

use crate::free_port;
use crate::proc::{as_pid, env_or, stop};
use crate::{Lan, TestTls};

/// Overrides the `java` found on `PATH`.
const JAVA_ENV: &str = "FENCELOCK_JAVA";
/// Overrides `/usr/share/java`, where Debian installs ZooKeeper's and Curator's jars.
const JARS_ENV: &str = "FENCELOCK_JAVA_LIBS";

const READY_TIMEOUT: Duration = Duration::from_secs(40);

/// How many times [`ZkEnsemble::start`] starts an ensemble whose server exited while forming.
const START_ATTEMPTS: usize = 3;

/// Why one start of an ensemble failed: a server exited (retried on new ports), or anything
/// else (returned at once).
enum Failed {
    Exited(io::Error),
    Other(io::Error),
}

/// ZooKeeper's tick in the ensembles started here: sessions may last 2 to 20 ticks, 1 s to
/// 10 s.
pub const ZK_TICK: Duration = Duration::from_millis(500);

/// The jars a ZooKeeper server needs (Debian's `zookeeper` package).
const SERVER_JARS: &[&str] = &[
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "slf4j-api.jar",
    "slf4j-simple.jar",
    "netty-handler.jar",
    "netty-common.jar",
    "netty-transport.jar",
    "netty-buffer.jar",
    "netty-resolver.jar",
    "netty-codec.jar",
    "netty-transport-native-epoll.jar",
    "netty-transport-native-unix-common.jar",
];

/// What Curator adds to that (`libcurator-recipes-java`, `libcurator-framework-java`).
const CURATOR_JARS: &[&str] = &[
    "curator-client.jar",
    "curator-framework.jar",
    "curator-recipes.jar",
    "guava.jar",
];

fn jars_dir() -> PathBuf {
    env_or(JARS_ENV, "/usr/share/java")
}

fn classpath(jars: &[&[&str]]) -> String {
    let dir = jars_dir();
    jars.iter()
        .flat_map(|set| set.iter())
        .map(|j| dir.join(j).display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

/// The `java` binary the kit runs.
pub fn java_bin() -> PathBuf {
    env_or(JAVA_ENV, "java")
}

/// The classpath of a Curator client (Curator, ZooKeeper's client and their dependencies),
/// for a test's own Java program.
pub fn curator_classpath() -> String {
    classpath(&[SERVER_JARS, CURATOR_JARS])
}

/// JVM options that keep a small test JVM cheap on a shared machine: a small heap, the
/// serial collector and the quick compiler only.
pub const SMALL_JVM: &[&str] = &[
    "-Xmx96m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:CICompilerCount=1",
];

#[derive(Debug)]
struct Server {
    client_port: u16,
    /// The TLS client port, when the ensemble serves TLS.
    secure_port: Option<u16>,
    peer_port: u16,
    election_port: u16,
    child: Option<Child>,
    pid: u32,
}

/// N ZooKeeper servers on free loopback ports with `tickTime=500` (sessions of 1 s to 2 min:
/// `maxSessionTimeout=120000` lets the tests' one-minute leases keep their session), each with its own data
/// directory in one temporary directory (`n == 1` starts a standalone server). Container
/// nodes left empty are deleted within a second (`znode.container.checkIntervalMs=500`), so
/// tests can see a lock's parent go and come back. The servers write their transaction logs
/// without `fsync` (`forceSync=no`), as the test PostgreSQL runs with `fsync=off`: a server
/// killed keeps what it wrote, and only a machine crash would lose it. With `fsync`, one
/// ephemeral create+delete took 5 ms at the median and 230 ms at p99 on an idle 2-core test
/// machine (0.7 ms and 9 ms without); stalls of that kind, under a full test run's disk load,
/// are the likely reason a three-server ensemble once left a release unanswered for 5 s.
/// Every server is killed (SIGKILL, paused or not) and reaped on drop.
#[derive(Debug)]
pub struct ZkEnsemble {
    servers: Vec<Server>,
    dir: TempDir,
    /// Server `i` runs on host `i` of this network, when the ensemble was started on one.
    lan: Option<Arc<Lan>>,
    tls: Option<TestTls>,
}

impl ZkEnsemble {
    /// Starts `n` servers and waits until every one serves clients (`srvr` reports a mode).
    ///
    /// A server that exits while the ensemble forms has almost always lost one of its three
    /// ports to another process between [`free_port`] and its bind; the whole ensemble is
    /// then started again on new ports (every server's configuration names every port), up
    /// to [`START_ATTEMPTS`] times.
    pub fn start(n: usize) -> io::Result<ZkEnsemble> {
        Self::start_with(n, None, None)
    }

    /// Starts one server on each host of `lan`, so that [`Lan::isolate`] cuts a server off
    /// from its peers and from every client that reaches it through the hub. Its
    /// [`ZkEnsemble::endpoints`] are the hosts' addresses: clients reach them through a
    /// [`crate::FaultProxy::start_from`] the hub, or, to stay connected to a server that is
    /// cut off from its peers, from the server's own host ([`Lan::host_path`]).
    pub fn start_on(lan: Arc<Lan>) -> io::Result<ZkEnsemble> {
        Self::start_with(lan.len(), Some(lan), None)
    }

    /// Like [`ZkEnsemble::start`], each server also serving clients over TLS on a second port
    /// ([`ZkEnsemble::tls_url`]) with `tls.server_cert`, and requiring a client certificate
    /// signed by `tls.ca` there (`ssl.clientAuth=need`); the plain port stays for the kit's
    /// own readiness checks, and the servers talk plain to each other.
    pub fn start_tls(n: usize, tls: &TestTls) -> io::Result<ZkEnsemble> {
        Self::start_with(n, None, Some(tls.clone()))
    }

    fn start_with(n: usize, lan: Option<Arc<Lan>>, tls: Option<TestTls>) -> io::Result<ZkEnsemble> {
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start_once(n, lan.clone(), tls.clone()) {
                Ok(ensemble) => return Ok(ensemble),
                Err(Failed::Exited(e)) => last = Some(e),
                Err(Failed::Other(e)) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("ZooKeeper ensemble never started")))
    }

    fn start_once(
        n: usize,
        lan: Option<Arc<Lan>>,
        tls: Option<TestTls>,
    ) -> Result<ZkEnsemble, Failed> {
        let dir = tempfile::Builder::new()
            .prefix("fencelock-zk")
            .tempdir()
            .map_err(Failed::Other)?;
        let servers = (0..n)
            .map(|_| Server {
                client_port: free_port(),
                secure_port: tls.as_ref().map(|_| free_port()),
                peer_port: free_port(),
                election_port: free_port(),
                child: None,
                pid: 0,
            })
            .collect();
        let mut ensemble = ZkEnsemble {
            servers,
            dir,
            lan,
            tls,
        };
        for i in 0..n {
            ensemble.write_config(i).map_err(Failed::Other)?;
            ensemble.launch(i).map_err(Failed::Other)?;
        }
        for i in 0..n {
            if let Some(e) = ensemble.serving_or_exited(i) {
                return Err(e);
            }
        }
        Ok(ensemble)
    }

    fn serving_or_exited(&mut self, i: usize) -> Option<Failed> {
        let e = self.wait_serving(i).err()?;
        let exited = self
            .servers
            .get_mut(i)
            .and_then(|s| s.child.as_mut())
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
        Some(if exited {
            Failed::Exited(e)
        } else {
            Failed::Other(e)
        })
    }

    /// `host:port` of every server, in server order.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.servers.len())
            .map(|i| self.addr(i).to_string())
            .collect()
    }

    /// Server `i`'s host: its own address on a test network, else loopback.
    fn host(&self, i: usize) -> std::net::Ipv4Addr {
        self.lan
            .as_ref()
            .map_or(std::net::Ipv4Addr::LOCALHOST, |l| l.ip(i))
    }

    /// Server `i`'s plain client address.
    pub fn addr(&self, i: usize) -> SocketAddr {
        let port = self.servers.get(i).map_or(0, |s| s.client_port);
        SocketAddr::from((self.host(i), port))
    }

    /// `host:port` of every server's TLS client port (empty without TLS).
    pub fn secure_endpoints(&self) -> Vec<String> {
        (0..self.servers.len())
            .filter_map(|i| {
                let port = self.servers[i].secure_port?;
                Some(SocketAddr::from((self.host(i), port)).to_string())
            })
            .collect()
    }

    /// `zks://h1:p1,...?ca=...&cert=...&key=...` with the kit's client certificate, for an
    /// ensemble started with [`ZkEnsemble::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        let t = self.tls.as_ref()?;
        Some(format!(
            "zks://{}?ca={}&cert={}&key={}",
            self.secure_endpoints().join(","),
            t.ca.display(),
            t.client_cert.display(),
            t.client_key.display()
        ))
    }

    /// The ZooKeeper connect string, `h1:p1,h2:p2,...`, as Curator and kazoo take it.
    pub fn connect_string(&self) -> String {
        self.endpoints().join(",")
    }

    /// `zk://h1:p1,h2:p2,...` for every server.
    pub fn url(&self) -> String {
        format!("zk://{}", self.connect_string())
    }

    /// The number of servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// Whether the ensemble has no server.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The pid of server `i`'s current (or last) process.
    pub fn pid(&self, i: usize) -> u32 {
        self.servers.get(i).map_or(0, |s| s.pid)
    }

    /// Kills server `i` with SIGKILL (a crash) and reaps it. Its data stays for a restart.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.servers.get_mut(i).and_then(|s| s.child.take()) {
            stop(&mut child);
        }
    }

    /// Starts server `i` again on the same ports with its data, without waiting.
    pub fn relaunch(&mut self, i: usize) -> io::Result<()> {
        self.kill(i);
        self.launch(i)
    }

    /// Starts server `i` again and waits until it serves clients (which, in an ensemble,
    /// needs a quorum of servers up).
    pub fn restart(&mut self, i: usize) -> io::Result<()> {
        self.relaunch(i)?;
        self.wait_serving(i)
    }

    /// Freezes server `i` with SIGSTOP: its connections stay open and unanswered.
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.signal(i, Signal::SIGSTOP)
    }

    /// Lets a server frozen by [`ZkEnsemble::pause`] run again.
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.signal(i, Signal::SIGCONT)
    }

    /// Server `i`'s answer to a four-letter command (`srvr`, `ruok`, `mntr`), or an error
    /// when it does not answer within a second.
    pub fn four_letters(&self, i: usize, cmd: &str) -> io::Result<String> {
        let addr = self.addr(i);
        match &self.lan {
            None => four_letters_at(addr, cmd),
            // Asked from the hub, where every host is one hop away.
            Some(lan) => {
                let ns = fs::File::open(lan.hub_path())?;
                let cmd = cmd.to_owned();
                std::thread::spawn(move || {
                    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(io::Error::from)?;
                    four_letters_at(addr, &cmd)
                })
                .join()
                .map_err(|_| io::Error::other("the four-letter command's thread panicked"))?
            }
        }
    }

    /// Server `i`'s mode as `srvr` reports it: `leader`, `follower` or `standalone`.
    pub fn mode(&self, i: usize) -> Option<String> {
        let text = self.four_letters(i, "srvr").ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("Mode: "))
            .map(|m| m.trim().to_owned())
    }

    /// The index of the server that is leader now (or the standalone server).
    pub fn leader(&self) -> io::Result<usize> {
        (0..self.servers.len())
            .filter(|&i| self.servers[i].child.is_some())
            .find(|&i| matches!(self.mode(i).as_deref(), Some("leader" | "standalone")))
            .ok_or_else(|| io::Error::other("no server reports itself leader"))
    }

    /// Waits until some server is leader again (after a kill or restart), returning it.
    pub fn wait_leader(&self, within: Duration) -> io::Result<usize> {
        let start = Instant::now();
        loop {
            match self.leader() {
                Ok(i) => return Ok(i),
                Err(e) if start.elapsed() > within => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Waits until server `i` serves clients (its mode is known).
    pub fn wait_serving(&mut self, i: usize) -> io::Result<()> {
        let start = Instant::now();
        loop {
            if let Some(Some(status)) = self
                .servers
                .get_mut(i)
                .and_then(|s| s.child.as_mut())
                .map(|c| c.try_wait().ok().flatten())
            {
                return Err(io::Error::other(format!(
                    "ZooKeeper server {i} exited with {status}; log:\n{}",
                    self.log(i)
                )));
            }
            if self.mode(i).is_some() {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "ZooKeeper server {i} not serving in time; log:\n{}",
                        self.log(i)
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The temporary directory holding every server's data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Server `i`'s log so far, for assertion messages.
    pub fn log(&self, i: usize) -> String {
        fs::read(self.dir.path().join(format!("{i}/server.log")))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn write_config(&self, i: usize) -> io::Result<()> {
        let base = self.dir.path().join(i.to_string());
        fs::create_dir_all(base.join("data"))?;
        let standalone = self.servers.len() == 1;
        let s = &self.servers[i];
        let mut cfg = format!(
            "tickTime={}\ninitLimit=10\nsyncLimit=5\ndataDir={}\nclientPort={}\n\
             clientPortAddress={}\nadmin.enableServer=false\n\
             maxSessionTimeout=120000\n4lw.commands.whitelist=ruok,srvr,stat,mntr\n\
             forceSync=no\n",
            ZK_TICK.as_millis(),
            base.join("data").display(),
            s.client_port,
            self.host(i)
        );
        if let (Some(port), Some(t)) = (s.secure_port, &self.tls) {
            // ZooKeeper 3.8 reads PEM stores: the key store holds the key and the chain.
            let store = base.join("keystore.pem");
            let mut pem = fs::read(&t.server_key)?;
            pem.extend(fs::read(&t.server_cert)?);
            fs::write(&store, pem)?;
            cfg.push_str(&format!(
                "secureClientPort={port}\n\
                 serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n\
                 ssl.keyStore.location={}\nssl.keyStore.type=PEM\n\
                 ssl.trustStore.location={}\nssl.trustStore.type=PEM\n\
                 ssl.clientAuth=need\n",
                store.display(),
                t.ca.display()
            ));
        }
        if !standalone {
            fs::write(base.join("data/myid"), format!("{}\n", i + 1))?;
            for (j, peer) in self.servers.iter().enumerate() {
                cfg.push_str(&format!(
                    "server.{}={}:{}:{}\n",
                    j + 1,
                    self.host(j),
                    peer.peer_port,
                    peer.election_port
                ));
            }
        }
        fs::write(base.join("zoo.cfg"), cfg)
    }

    fn launch(&mut self, i: usize) -> io::Result<()> {
        let base = self.dir.path().join(i.to_string());
        let main = if self.servers.len() == 1 {
            "org.apache.zookeeper.server.ZooKeeperServerMain"
        } else {
            "org.apache.zookeeper.server.quorum.QuorumPeerMain"
        };
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(base.join("server.log"))?;
        let mut java = match &self.lan {
            None => Command::new(java_bin()),
            Some(lan) => lan.command(i, java_bin()),
        };
        let child = java
            .args(SMALL_JVM)
            .arg("-Dznode.container.checkIntervalMs=500")
            .arg("-Dzookeeper.jmx.log4j.disable=true")
            // Warnings and errors only: the log says why a server exited, without the
            // chatter of every session.
            .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
            .arg("-cp")
            .arg(classpath(&[SERVER_JARS]))
            .arg(main)
            .arg(base.join("zoo.cfg"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot start {}: {e}", java_bin().display()),
                )
            })?;
        let Some(s) = self.servers.get_mut(i) else {
            return Err(io::Error::other(format!("no server {i}")));
        };
        s.pid = child.id();
        s.child = Some(child);
        Ok(())
    }

    fn signal(&self, i: usize, sig: Signal) -> io::Result<()> {
        match self.servers.get(i).and_then(|s| s.child.as_ref()) {
            Some(child) => signal::kill(as_pid(child.id()), sig).map_err(io::Error::from),
            None => Err(io::Error::other(format!(
                "ZooKeeper server {i} is not running"
            ))),
        }
    }
}

impl Drop for ZkEnsemble {
    fn drop(&mut self) {
        for s in &mut self.servers {
            if let Some(mut child) = s.child.take() {
                stop(&mut child);
            }
        }
    }
}

/// Sends a four-letter command to the ZooKeeper client port `port` on loopback and reads the
/// answer until the server closes the connection.
pub fn four_letters(port: u16, cmd: &str) -> io::Result<String> {
    four_letters_at(SocketAddr::from(([127, 0, 0, 1], port)), cmd)
}

fn four_letters_at(addr: SocketAddr, cmd: &str) -> io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    stream.write_all(cmd.as_bytes())?;
    let mut out = String::new();
    stream.read_to_string(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classpaths_name_debian_jars() {
        let cp = curator_classpath();
        assert!(cp.contains("/curator-recipes.jar"), "{cp}");
        assert!(cp.contains("/zookeeper.jar"), "{cp}");
        assert_eq!(
            cp.split(':').count(),
            SERVER_JARS.len() + CURATOR_JARS.len()
        );
    }
}
