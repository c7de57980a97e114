//! A fault-injecting TCP proxy on loopback, placed between clients and one
//! engine node.
//!
//! Most real outages are network faults, not dead processes: a switch drops
//! packets, a link turns slow, a firewall resets connections, one direction
//! of a path fails. This proxy reproduces each of them on 127.0.0.1, per node
//! and while traffic flows, without root, network namespaces or `tc netem`
//! (which this kind of machine lacks). A proxy is also the only way to cut
//! one client off from a node while the other clients still reach it: each
//! client gets its own proxy in front of the same server.
//!
//! Bytes held by a fault are kept, in order, and delivered when the fault is
//! lifted, as TCP's retransmissions would deliver them after a partition
//! heals: a request a client gave up on may still run on the server later,
//! which is exactly what a lock must survive.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::socket::{setsockopt, sockopt};

/// What the proxy does to the traffic it carries. Set with
/// [`FaultProxy::set`]; a change applies at once to every open connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Bytes pass both ways as they come.
    Pass,
    /// Every byte is delivered this much later, in each direction (so a
    /// request and its answer take twice this longer).
    Latency(Duration),
    /// Connections are accepted, and bytes are held both ways: nothing is
    /// delivered and nothing is closed, as behind a dead link. A client sees
    /// no error, only silence.
    Blackhole,
    /// Every open connection is reset (RST) and new ones are reset as soon
    /// as they are accepted.
    Reset,
    /// Bytes from the client to the server are held; answers still pass.
    CutToServer,
    /// Bytes from the server to the client are held; requests still pass.
    CutToClient,
}

impl Fault {
    /// Whether bytes going `dir` may be delivered now, and after what delay.
    fn passes(self, dir: Dir) -> Option<Duration> {
        match (self, dir) {
            (Fault::Pass, _) => Some(Duration::ZERO),
            (Fault::Latency(d), _) => Some(d),
            (Fault::CutToServer, Dir::ToClient) | (Fault::CutToClient, Dir::ToServer) => {
                Some(Duration::ZERO)
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    ToServer,
    ToClient,
}

/// The two sockets of one proxied connection, kept so a reset can reach them.
struct Pair {
    client: TcpStream,
    server: TcpStream,
}

impl Pair {
    /// Makes the last close of each socket send RST instead of FIN, and
    /// wakes the threads blocked reading them so that they let go.
    fn reset(&self) {
        for s in [&self.client, &self.server] {
            let _ = setsockopt(&s.as_fd(), sockopt::Linger, &abort_on_close());
            // SHUT_RD sends nothing on Linux; it only makes blocked reads
            // return, so the pumps exit and the final close is the RST.
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

fn abort_on_close() -> nix::libc::linger {
    nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    }
}

struct State {
    fault: Fault,
    /// Bumped by every [`Fault::Reset`], so pumps of older connections know
    /// to stop even if the fault has been lifted again since.
    resets: u64,
    conns: Vec<(u64, Arc<Pair>)>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    next_conn: AtomicU64,
    accepted: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A pump that panicked leaves consistent state behind (every field is
        // replaced whole), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A TCP proxy from a free loopback port to one target address, applying a
/// [`Fault`] that tests change while traffic flows.
///
/// Its threads stop and its connections close when the value is dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("target", &self.target)
            .field("fault", &self.fault())
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy to `target`, passing traffic until told otherwise.
    pub fn start(target: SocketAddr) -> io::Result<FaultProxy> {
        Self::start_in(target, None)
    }

    fn start_in(target: SocketAddr, netns: Option<std::fs::File>) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                fault: Fault::Pass,
                resets: 0,
                conns: Vec::new(),
            }),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            next_conn: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("proxy-{}", addr.port()))
                .spawn(move || {
                    // The listener was made here, in this process's namespace; only the
                    // connections this thread opens from now on belong to the other one.
                    if let Some(ns) = netns {
                        if nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                            return;
                        }
                    }
                    accept_loop(listener, target, shared)
                })?
        };
        Ok(FaultProxy {
            addr,
            target,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Like [`FaultProxy::start`], listening on loopback here but connecting to `target` from
    /// the network namespace at `netns` (a [`crate::Lan`]'s hub), so that clients of this
    /// namespace reach the hosts of a test's own network.
    pub fn start_from(target: SocketAddr, netns: &std::path::Path) -> io::Result<FaultProxy> {
        let ns = std::fs::File::open(netns)?;
        Self::start_in(target, Some(ns))
    }

    /// Starts a proxy to a server on 127.0.0.1 at `port`.
    pub fn to_port(port: u16) -> io::Result<FaultProxy> {
        FaultProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
    }

    /// The proxy's own address, for clients to connect to instead of the
    /// target's.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Where the proxy forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// How many client connections the proxy has accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// The fault now applied.
    pub fn fault(&self) -> Fault {
        self.shared.lock().fault
    }

    /// Applies `fault` from now on, to open connections and new ones.
    pub fn set(&self, fault: Fault) {
        let mut st = self.shared.lock();
        st.fault = fault;
        if fault == Fault::Reset {
            st.resets += 1;
            for (_, pair) in st.conns.drain(..) {
                pair.reset();
            }
        }
        drop(st);
        self.shared.changed.notify_all();
    }

    /// Lifts any fault: the same as `set(Fault::Pass)`.
    pub fn heal(&self) {
        self.set(Fault::Pass);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let mut st = self.shared.lock();
            for (_, pair) in st.conns.drain(..) {
                pair.reset();
            }
        }
        self.shared.changed.notify_all();
        // The acceptor is blocked in accept(); one connection wakes it to see
        // the stop flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = conn else { continue };
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let fault = shared.lock().fault;
        if fault == Fault::Reset {
            let _ = setsockopt(&client.as_fd(), sockopt::Linger, &abort_on_close());
            continue;
        }
        // A refused target shows as a reset, as a dead server's port would.
        let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
            let _ = setsockopt(&client.as_fd(), sockopt::Linger, &abort_on_close());
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let _ = start_pumps(client, server, &shared);
    }
}

fn start_pumps(client: TcpStream, server: TcpStream, shared: &Arc<Shared>) -> io::Result<()> {
    let pair = Arc::new(Pair {
        client: client.try_clone()?,
        server: server.try_clone()?,
    });
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let generation = {
        let mut st = shared.lock();
        st.conns.push((id, pair));
        st.resets
    };
    let live = Arc::new(AtomicU64::new(2));
    for (src, dst, dir) in [
        (client.try_clone()?, server.try_clone()?, Dir::ToServer),
        (server, client, Dir::ToClient),
    ] {
        let shared = shared.clone();
        let live = live.clone();
        std::thread::Builder::new()
            .name(format!("proxy-conn-{id}"))
            .spawn(move || {
                pump(src, dst, dir, generation, &shared);
                if live.fetch_sub(1, Ordering::SeqCst) == 1 {
                    shared.lock().conns.retain(|(c, _)| *c != id);
                }
            })?;
    }
    Ok(())
}

/// One chunk read from the source, with the time it arrived.
struct Chunk {
    at: Instant,
    bytes: Vec<u8>,
}

/// The chunks read and not yet delivered, whether the reader has stopped, and the condition a
/// delivering thread waits on.
type ChunkQueue = Arc<(Mutex<(VecDeque<Chunk>, bool)>, Condvar)>;

/// Carries one direction of a connection: a reader thread queues what
/// arrives, and this thread delivers it when the fault allows, so that held
/// or delayed bytes never stop the reading (a full socket buffer would turn
/// a one-way cut into a two-way one).
fn pump(mut src: TcpStream, mut dst: TcpStream, dir: Dir, generation: u64, shared: &Arc<Shared>) {
    let queue: ChunkQueue = Arc::default();
    let reader = {
        let queue = queue.clone();
        let shared = shared.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match src.read(&mut buf) {
                    Ok(0) | Err(_) => 0,
                    Ok(n) => n,
                };
                let (lock, cv) = &*queue;
                let mut q = lock.lock().unwrap_or_else(PoisonError::into_inner);
                if n == 0 {
                    q.1 = true;
                } else {
                    q.0.push_back(Chunk {
                        at: Instant::now(),
                        bytes: buf[..n].to_vec(),
                    });
                }
                drop(q);
                cv.notify_all();
                // The writer waits on the proxy's condition variable for
                // fault changes; wake it for new bytes too. Taking its lock
                // first means the writer is either before its check (and
                // sees the bytes) or already waiting (and gets the wake-up).
                drop(shared.lock());
                shared.changed.notify_all();
                if n == 0 {
                    return;
                }
            }
        })
    };
    deliver(&mut dst, dir, generation, shared, &queue);
    let _ = reader.join();
}

fn deliver(
    dst: &mut TcpStream,
    dir: Dir,
    generation: u64,
    shared: &Shared,
    queue: &(Mutex<(VecDeque<Chunk>, bool)>, Condvar),
) {
    let (lock, _) = queue;
    loop {
        let st = shared.lock();
        if st.resets != generation || shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let allowed = st.fault.passes(dir);
        let next = {
            let mut q = lock.lock().unwrap_or_else(PoisonError::into_inner);
            match (allowed, q.0.front()) {
                (Some(delay), Some(chunk)) => {
                    let due = chunk.at + delay;
                    let now = Instant::now();
                    if due <= now {
                        q.0.pop_front().map(Ok)
                    } else {
                        Some(Err(due - now))
                    }
                }
                // Source closed and everything delivered: pass the close on.
                (_, None) if q.1 => {
                    let _ = dst.shutdown(Shutdown::Write);
                    return;
                }
                _ => None,
            }
        };
        match next {
            Some(Ok(chunk)) => {
                drop(st);
                if dst.write_all(&chunk.bytes).is_err() {
                    return;
                }
            }
            Some(Err(wait)) => {
                let _ = shared
                    .changed
                    .wait_timeout(st, wait)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            None => {
                // Held, or nothing to send: wait for new bytes or a fault
                // change. The timeout only bounds a missed wake-up.
                let _ = shared
                    .changed
                    .wait_timeout(st, Duration::from_millis(50))
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback, for the proxy to stand in front of.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let Ok(mut c) = c else { return };
                std::thread::spawn(move || {
                    let mut r = c.try_clone().unwrap();
                    let _ = io::copy(&mut r, &mut c);
                });
            }
        });
        addr
    }

    fn round_trip(s: &mut TcpStream, msg: &[u8]) -> io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    #[test]
    fn passes_then_holds_then_delivers_in_order() {
        let p = FaultProxy::start(echo()).unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        assert_eq!(round_trip(&mut s, b"one").unwrap(), b"one");

        p.set(Fault::Blackhole);
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        s.write_all(b"two").unwrap();
        let mut buf = [0u8; 3];
        let err = s.read_exact(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");

        p.heal();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"two");
    }

    #[test]
    fn one_way_cut_holds_only_answers() {
        let p = FaultProxy::start(echo()).unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        p.set(Fault::CutToClient);
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        s.write_all(b"req").unwrap();
        let mut buf = [0u8; 3];
        assert!(s.read_exact(&mut buf).is_err());
        // The request reached the server (the echo answered into the held
        // queue), so lifting the cut delivers the answer.
        p.heal();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"req");
    }

    #[test]
    fn latency_delays_each_direction() {
        let p = FaultProxy::start(echo()).unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        p.set(Fault::Latency(Duration::from_millis(60)));
        let t = Instant::now();
        assert_eq!(round_trip(&mut s, b"x").unwrap(), b"x");
        let rtt = t.elapsed();
        assert!(rtt >= Duration::from_millis(120), "{rtt:?}");
        assert!(rtt < Duration::from_secs(3), "{rtt:?}");
    }

    #[test]
    fn reset_breaks_open_and_new_connections() {
        let p = FaultProxy::start(echo()).unwrap();
        let mut s = TcpStream::connect(p.addr()).unwrap();
        assert_eq!(round_trip(&mut s, b"a").unwrap(), b"a");
        p.set(Fault::Reset);
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 1];
        let err = s
            .write_all(b"b")
            .and_then(|()| s.read_exact(&mut buf))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");

        let mut s2 = TcpStream::connect(p.addr()).unwrap();
        s2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let err = round_trip(&mut s2, b"c").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            "{err}"
        );

        p.heal();
        let mut s3 = TcpStream::connect(p.addr()).unwrap();
        assert_eq!(round_trip(&mut s3, b"d").unwrap(), b"d");
    }
}
