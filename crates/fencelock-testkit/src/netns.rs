//! A small network of its own for a test: one network namespace per host, joined by a bridge
//! in a hub namespace, all created by the test and removed when it ends.
//!
//! A proxy can cut a client off from a server, but not servers from each other when they talk
//! over their own connections (etcd members dialling their peers). Here each host has its own
//! address and link, so taking a host's link down partitions it from every other host and
//! every client at once, as a failed switch port would. Needs root (`ip netns`); nothing
//! touches the machine's own namespace: clients reach the hosts through a [`FaultProxy`] on
//! loopback that connects from the hub (see [`FaultProxy::start_from`]).
//!
//! [`FaultProxy`]: crate::FaultProxy
//! [`FaultProxy::start_from`]: crate::FaultProxy::start_from

use std::io;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Keeps the names of concurrent networks (of this and other test processes) apart.
static NEXT: AtomicU32 = AtomicU32::new(0);

/// A bridge in a hub namespace and `n` host namespaces on it, `10.R.S.(i+1)/24` each.
#[derive(Debug)]
pub struct Lan {
    hub: String,
    hosts: Vec<String>,
    subnet: [u8; 2],
}

impl Lan {
    /// Creates the namespaces, the bridge and one veth pair per host.
    pub fn new(n: usize) -> io::Result<Lan> {
        let seq = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("fl{}x{seq}", std::process::id());
        // A subnet per network, so that two networks of one machine never share addresses
        // (they could not reach each other anyway; this keeps logs unambiguous).
        let mix = std::process::id().wrapping_mul(31).wrapping_add(seq);
        let subnet = [(100 + mix % 100) as u8, ((mix / 100) % 250) as u8];
        let mut lan = Lan {
            hub: format!("{tag}h"),
            hosts: Vec::new(),
            subnet,
        };
        ip(&["netns", "add", &lan.hub])?;
        lan.in_ns_hub(&["link", "set", "lo", "up"])?;
        lan.in_ns_hub(&["link", "add", "br0", "type", "bridge"])?;
        lan.in_ns_hub(&["link", "set", "br0", "up"])?;
        // The hub's own address on the bridge, from which etcdctl and the proxies connect.
        let hub_addr = format!("{}/24", Ipv4Addr::new(10, subnet[0], subnet[1], 254));
        lan.in_ns_hub(&["addr", "add", &hub_addr, "dev", "br0"])?;
        for i in 0..n {
            let ns = format!("{tag}n{i}");
            ip(&["netns", "add", &ns])?;
            lan.hosts.push(ns.clone());
            let port = format!("p{i}");
            // Created in the hub, the peer end moved into the host as its eth0.
            lan.in_ns_hub(&[
                "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            lan.in_ns_hub(&["link", "set", &port, "master", "br0"])?;
            lan.in_ns_hub(&["link", "set", &port, "up"])?;
            let addr = format!("{}/24", lan.ip(i));
            in_ns(&ns, &["addr", "add", &addr, "dev", "eth0"])?;
            in_ns(&ns, &["link", "set", "eth0", "up"])?;
            in_ns(&ns, &["link", "set", "lo", "up"])?;
        }
        Ok(lan)
    }

    /// Host `i`'s address.
    pub fn ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.subnet[0], self.subnet[1], (i + 1) as u8)
    }

    /// The number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether the network has no host.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// `program` run inside host `i`'s namespace (`ip netns exec`, which execs it: the child's
    /// pid is the program's own).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[i]]).arg(program);
        c
    }

    /// `program` run inside the hub, from where every host is one hop away.
    pub fn hub_command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hub]).arg(program);
        c
    }

    /// The hub namespace's file, for [`crate::FaultProxy::start_from`].
    pub fn hub_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.hub)
    }

    /// Host `i`'s namespace file: a [`crate::FaultProxy::start_from`] there reaches the
    /// host's own servers over its loopback, which [`Lan::isolate`] leaves alone.
    pub fn host_path(&self, i: usize) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.hosts[i])
    }

    /// Takes host `i`'s link down: it can reach nobody and nobody can reach it.
    pub fn isolate(&self, i: usize) -> io::Result<()> {
        self.in_ns_hub(&["link", "set", &format!("p{i}"), "down"])
    }

    /// Brings host `i`'s link back up.
    pub fn rejoin(&self, i: usize) -> io::Result<()> {
        self.in_ns_hub(&["link", "set", &format!("p{i}"), "up"])
    }

    fn in_ns_hub(&self, args: &[&str]) -> io::Result<()> {
        in_ns(&self.hub, args)
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        // Deleting a namespace deletes its links; the processes in it are the owner's to stop
        // (by pid) before the network goes.
        for ns in self.hosts.iter().chain([&self.hub]) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

fn in_ns(ns: &str, args: &[&str]) -> io::Result<()> {
    let mut all = vec!["-n", ns];
    all.extend_from_slice(args);
    ip(&all)
}

fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run ip (iproute2): {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}
