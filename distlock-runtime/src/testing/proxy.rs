//! A TCP proxy that injects network faults between a client and a server.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// What a [`FaultProxy`] does to the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything at once.
    Pass,
    /// Deliver each chunk read from now on this long after it was read (each direction, in
    /// order: what is read later, whatever the fault then, is delivered after it).
    Latency(Duration),
    /// Let nothing through, in either direction: a network partition. Like TCP after a
    /// partition heals, what was sent meanwhile is delivered once traffic passes again (or the
    /// connection is [reset](FaultProxy::reset)).
    Blackhole,
}

/// A TCP proxy on a loopback port in front of a server, that can add latency, swallow
/// traffic, or reset every connection: network faults without touching the server.
///
/// Stopped (listener and connections closed) on drop.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    shared: Arc<ProxyShared>,
}

#[derive(Debug)]
struct ProxyShared {
    fault: Mutex<Fault>,
    /// Bumped by `reset`: connections from an older generation close.
    generation: AtomicU64,
    stopped: std::sync::atomic::AtomicBool,
    /// Chunks held back by [`Fault::Latency`] so far.
    delayed: AtomicU64,
    /// Of those, the ones delivered (or given up at a write that failed) since.
    delivered_late: AtomicU64,
}

impl FaultProxy {
    /// Starts a proxy in front of `127.0.0.1:target_port`, forwarding as-is.
    pub fn start(target_port: u16) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(ProxyShared {
            fault: Mutex::new(Fault::Pass),
            generation: AtomicU64::new(0),
            stopped: std::sync::atomic::AtomicBool::new(false),
            delayed: AtomicU64::new(0),
            delivered_late: AtomicU64::new(0),
        });
        let accepting = shared.clone();
        std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if accepting.stopped.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
                        continue;
                    };
                    let generation = accepting.generation.load(Ordering::Acquire);
                    for (from, to) in [
                        (client.try_clone(), server.try_clone()),
                        (Ok(server), Ok(client)),
                    ] {
                        if let (Ok(from), Ok(to)) = (from, to) {
                            let shared = accepting.clone();
                            let _ = std::thread::Builder::new()
                                .name("fault-proxy-pipe".into())
                                .spawn(move || pipe(from, to, &shared, generation));
                        }
                    }
                }
            })?;
        Ok(Self { port, shared })
    }

    /// The loopback port the proxy listens on (what a Cluster node behind it announces).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<proxy port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Sets what happens to traffic from now on.
    pub fn set(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap_or_else(|e| e.into_inner()) = fault;
    }

    /// How many chunks [`Fault::Latency`] has held back so far, in either direction: a test
    /// that delays one request can wait until the proxy has taken it, then let the rest pass
    /// (a chunk read under a latency is delivered late even if the fault changes meanwhile).
    pub fn delayed(&self) -> u64 {
        self.shared.delayed.load(Ordering::Acquire)
    }

    /// How many chunks [`Fault::Latency`] holds back right now, not yet delivered: a test
    /// waits for 0 to know that everything held back has arrived (or could not be written).
    pub fn held_back(&self) -> u64 {
        let delivered = self.shared.delivered_late.load(Ordering::Acquire);
        self.delayed().saturating_sub(delivered)
    }

    /// Closes every open connection (the peers see a reset or end of stream); new ones are
    /// accepted as before.
    pub fn reset(&self) {
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::Release);
        self.reset();
        // Wake the accept loop so that it sees `stopped`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Copies `from` to `to` under the proxy's current fault, until either side closes or the
/// proxy resets: this thread reads, and a second one delivers each chunk when it is due.
fn pipe(mut from: TcpStream, to: TcpStream, shared: &Arc<ProxyShared>, generation: u64) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let (chunks, due) = mpsc::channel::<Option<Chunk>>();
    let deliver = {
        let shared = shared.clone();
        let from = from.try_clone();
        std::thread::Builder::new()
            .name("fault-proxy-deliver".into())
            .spawn(move || deliver(due, to, from.ok(), &shared, generation))
    };
    let mut buf = [0u8; 16 * 1024];
    loop {
        if shared.generation.load(Ordering::Acquire) != generation {
            let _ = from.shutdown(std::net::Shutdown::Both);
            break;
        }
        if *shared.fault.lock().unwrap_or_else(|e| e.into_inner()) == Fault::Blackhole {
            // Leave the bytes in the socket buffers until the partition heals.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue;
            }
            Err(_) => break,
        };
        // Read just before a partition began: hold the bytes until it heals.
        let fault = loop {
            let fault = *shared.fault.lock().unwrap_or_else(|e| e.into_inner());
            if fault != Fault::Blackhole || shared.generation.load(Ordering::Acquire) != generation
            {
                break fault;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut at = Instant::now();
        let late = matches!(fault, Fault::Latency(_));
        if let Fault::Latency(delay) = fault {
            shared.delayed.fetch_add(1, Ordering::AcqRel);
            at += delay;
        }
        if chunks.send(Some((at, late, buf[..n].to_vec()))).is_err() {
            break;
        }
    }
    // End of stream: once everything read has been delivered, so is the end.
    let _ = chunks.send(None);
    drop(chunks);
    if let Ok(deliver) = deliver {
        let _ = deliver.join();
    }
}

/// A chunk read: when it is due, whether a latency held it back, its bytes.
type Chunk = (Instant, bool, Vec<u8>);

/// Writes each chunk to `to` when it is due, in order; at the end of the stream (`None`),
/// shuts `to`'s write side. A reset closes both sides, delivering nothing more.
fn deliver(
    due: mpsc::Receiver<Option<Chunk>>,
    mut to: TcpStream,
    from: Option<TcpStream>,
    shared: &ProxyShared,
    generation: u64,
) {
    let reset = |to: &TcpStream| {
        let _ = to.shutdown(std::net::Shutdown::Both);
        if let Some(from) = &from {
            let _ = from.shutdown(std::net::Shutdown::Both);
        }
    };
    while let Ok(chunk) = due.recv() {
        let Some((at, late, bytes)) = chunk else {
            if shared.generation.load(Ordering::Acquire) != generation {
                return reset(&to);
            }
            let _ = to.shutdown(std::net::Shutdown::Write);
            return;
        };
        while let Some(left) = at.checked_duration_since(Instant::now()) {
            if shared.generation.load(Ordering::Acquire) != generation {
                return reset(&to);
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
        if shared.generation.load(Ordering::Acquire) != generation {
            return reset(&to);
        }
        let written = to.write_all(&bytes);
        if late {
            shared.delivered_late.fetch_add(1, Ordering::AcqRel);
        }
        if written.is_err() {
            return;
        }
    }
}
