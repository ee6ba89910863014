//! A TCP proxy for broker outage tests: forward a loopback port to the broker, then
//! [`cut`](TcpProxy::cut) every connection (the broker "goes away") and
//! [`restore`](TcpProxy::restore) it.
//!
//! Test helper only: it listens on 127.0.0.1, forwards to one upstream address, serves
//! at most [`MAX_CONNECTIONS`] connections at a time and gives up connecting upstream
//! after [`CONNECT_TIMEOUT`]. It runs on its own OS threads with blocking std sockets,
//! so it needs no tokio feature beyond what `pgoutbox-core` already uses and works from
//! any test runtime (`#[tokio::test]` included).
//!
//! ```no_run
//! # fn main() -> std::io::Result<()> {
//! use pgoutbox_core::conformance::proxy::TcpProxy;
//!
//! let proxy = TcpProxy::start("127.0.0.1:4222".parse().unwrap())?;
//! let url = format!("nats://{}", proxy.addr()); // connect the publisher here
//! proxy.cut(); // outage: connections closed, new ones refused
//! proxy.restore(); // the broker is back
//! # Ok(())
//! # }
//! ```

use std::io;
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Most connections a proxy forwards at a time; more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// Longest time the proxy waits to connect to the upstream address.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Forwards `127.0.0.1:<port>` to an upstream address while up; when cut, every
/// connection is closed and new ones are closed at once. Dropping it cuts it and
/// stops listening.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Forwarding (not cut).
    up: AtomicBool,
    /// Dropped: the accept thread must end.
    closed: AtomicBool,
    connections: Mutex<Vec<Connection>>,
}

/// Both sockets of one forwarded connection, to shut them down at a cut.
#[derive(Debug)]
struct Connection {
    inbound: TcpStream,
    outbound: TcpStream,
    /// Directions finished copying (2: the connection is over).
    finished: Arc<AtomicU8>,
}

impl Connection {
    fn shutdown(&self) {
        let _ = self.inbound.shutdown(Shutdown::Both);
        let _ = self.outbound.shutdown(Shutdown::Both);
    }
}

impl Shared {
    fn connections(&self) -> MutexGuard<'_, Vec<Connection>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl TcpProxy {
    /// Listen on a free port of 127.0.0.1 and forward each connection to `upstream`.
    pub fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            up: AtomicBool::new(true),
            ..Shared::default()
        });
        let accept = thread::Builder::new()
            .name(format!("tcp-proxy-{}", addr.port()))
            .spawn({
                let shared = Arc::clone(&shared);
                move || accept_loop(&listener, upstream, &shared)
            })?;
        Ok(Self {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address to connect to instead of the upstream one.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Outage: close every connection and refuse new ones.
    pub fn cut(&self) {
        let mut connections = self.shared.connections();
        self.shared.up.store(false, Ordering::SeqCst);
        for connection in connections.drain(..) {
            connection.shutdown();
        }
    }

    /// End of the outage: forward new connections again.
    pub fn restore(&self) {
        self.shared.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.cut();
        // Wake the accept thread up so that it sees `closed`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, upstream: SocketAddr, shared: &Shared) {
    for inbound in listener.incoming() {
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        let Ok(inbound) = inbound else {
            // e.g. too many open files: do not spin.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        if !shared.up.load(Ordering::SeqCst) {
            continue; // dropped: closed at once
        }
        let Ok(outbound) = TcpStream::connect_timeout(&upstream, CONNECT_TIMEOUT) else {
            continue;
        };
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        let (Ok(inbound_copy), Ok(outbound_copy)) = (inbound.try_clone(), outbound.try_clone())
        else {
            continue;
        };
        let finished = Arc::new(AtomicU8::new(0));
        {
            let mut connections = shared.connections();
            connections.retain(|c| c.finished.load(Ordering::SeqCst) < 2);
            // Checked under the lock: a cut in between would miss this connection.
            if !shared.up.load(Ordering::SeqCst) || connections.len() >= MAX_CONNECTIONS {
                continue;
            }
            connections.push(Connection {
                inbound: inbound_copy,
                outbound: outbound_copy,
                finished: Arc::clone(&finished),
            });
        }
        let (Ok(inbound_read), Ok(outbound_read)) = (inbound.try_clone(), outbound.try_clone())
        else {
            let _ = inbound.shutdown(Shutdown::Both);
            let _ = outbound.shutdown(Shutdown::Both);
            continue;
        };
        pump(inbound_read, outbound, Arc::clone(&finished));
        pump(outbound_read, inbound, finished);
    }
}

/// Copy `from` to `to` on a thread until end of stream, then pass the end of stream
/// on; at an error (e.g. a cut), close both sockets.
fn pump(mut from: TcpStream, mut to: TcpStream, finished: Arc<AtomicU8>) {
    let spawned = thread::Builder::new()
        .name("tcp-proxy-pump".into())
        .spawn(move || {
            if io::copy(&mut from, &mut to).is_ok() {
                let _ = to.shutdown(Shutdown::Write);
            } else {
                let _ = from.shutdown(Shutdown::Both);
                let _ = to.shutdown(Shutdown::Both);
            }
            finished.fetch_add(1, Ordering::SeqCst);
        });
    drop(spawned);
}

/// A port on 127.0.0.1 nothing listens on (bound, then released): the address of an
/// unreachable broker.
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local address").port()
}
