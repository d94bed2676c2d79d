//! What the masquerade tests share: a server that says what it saw and echoes,
//! and clients that run in the cluster's namespaces from the test process itself
//! (a socket belongs to the namespace it was created in, whichever thread then
//! uses it).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use lb_tests::netns::NetNs;
use socket2::{Domain, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Connects, reads and writes that take longer failed.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP server in one of the test's namespaces: it tells each connection the
/// address it came from as the server saw it (`ip:port\n`), then echoes every
/// byte back until the client's EOF. What an outside host sees of a masqueraded
/// flow, and whether the flow's data arrives intact both ways.
pub struct PeerEcho {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    failures: Arc<Mutex<Vec<String>>>,
    /// Last: dropping it ends the server's tasks and closes its sockets.
    _rt: tokio::runtime::Runtime,
}

impl PeerEcho {
    /// Listens on every address of `binds` in `ns`.
    pub fn start(ns: &NetNs, binds: &[SocketAddr]) -> Result<PeerEcho> {
        let listeners: Vec<std::net::TcpListener> =
            ns.run_in(|| binds.iter().map(|a| listen(*a)).collect())?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let peers = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(Mutex::new(Vec::new()));
        for listener in listeners {
            let listener = {
                let _in_runtime = rt.enter();
                tokio::net::TcpListener::from_std(listener)?
            };
            rt.spawn(accept_loop(
                listener,
                Arc::clone(&peers),
                Arc::clone(&failures),
            ));
        }
        Ok(PeerEcho {
            peers,
            failures,
            _rt: rt,
        })
    }

    /// Every connection's source as the server saw it, in accept order.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("not poisoned").clone()
    }

    /// Connections that ended with an error (a reset, say), with the error.
    pub fn failures(&self) -> Vec<String> {
        self.failures.lock().expect("not poisoned").clone()
    }
}

/// A listening socket with room for thousands of connections arriving at once.
fn listen(addr: SocketAddr) -> Result<std::net::TcpListener> {
    let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    s.set_reuse_address(true)?;
    s.bind(&addr.into())
        .with_context(|| format!("binding the echo server to {addr}"))?;
    s.listen(8192)?;
    s.set_nonblocking(true)?;
    Ok(s.into())
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    failures: Arc<Mutex<Vec<String>>>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                peers.lock().expect("not poisoned").push(peer);
                let failures = Arc::clone(&failures);
                tokio::spawn(async move {
                    if let Err(e) = echo(stream, peer).await {
                        failures
                            .lock()
                            .expect("not poisoned")
                            .push(format!("{peer}: {e}"));
                    }
                });
            }
            Err(e) => {
                failures
                    .lock()
                    .expect("not poisoned")
                    .push(format!("accept: {e}"));
                // Out of descriptors, say: the clients will time out and say so.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn echo(mut stream: tokio::net::TcpStream, peer: SocketAddr) -> std::io::Result<()> {
    stream.write_all(format!("{peer}\n").as_bytes()).await?;
    let (mut r, mut w) = stream.split();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return w.shutdown().await;
        }
        w.write_all(&buf[..n]).await?;
    }
}

/// A blocking TCP connection from `ns` (from `bind` when given) to a
/// [`PeerEcho`] at `to`, `tune` applied to the socket before it connects; the
/// address the server saw it come from.
pub fn connect(
    ns: &NetNs,
    bind: Option<SocketAddr>,
    to: SocketAddr,
    tune: impl FnOnce(&Socket) -> std::io::Result<()> + Send,
) -> Result<(TcpStream, SocketAddr)> {
    let stream = ns.run_in(|| {
        let s = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
        tune(&s)?;
        if let Some(bind) = bind {
            s.bind(&bind.into())
                .with_context(|| format!("binding {bind} in {}", ns.name()))?;
        }
        s.connect_timeout(&to.into(), IO_TIMEOUT)
            .with_context(|| format!("connecting to {to} from {}", ns.name()))?;
        Ok(TcpStream::from(s))
    })?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let seen = read_peer_line(&stream).with_context(|| format!("{to}'s first line"))?;
    Ok((stream, seen))
}

/// The server's `ip:port\n`, read byte by byte so no echoed data is taken with it.
fn read_peer_line(mut stream: &TcpStream) -> Result<SocketAddr> {
    let mut line = Vec::new();
    let mut byte = [0u8];
    while line.len() < 64 {
        stream.read_exact(&mut byte)?;
        if byte[0] == b'\n' {
            let text = String::from_utf8_lossy(&line);
            return text
                .parse()
                .with_context(|| format!("not an address: {text:?}"));
        }
        line.push(byte[0]);
    }
    bail!(
        "no line within 64 bytes: {:?}",
        String::from_utf8_lossy(&line)
    )
}

/// The same as [`read_peer_line`] for a Tokio stream.
pub async fn read_peer_line_async(stream: &mut tokio::net::TcpStream) -> Result<SocketAddr> {
    let mut line = Vec::new();
    while line.len() < 64 {
        let byte = stream.read_u8().await?;
        if byte == b'\n' {
            let text = String::from_utf8_lossy(&line);
            return text
                .parse()
                .with_context(|| format!("not an address: {text:?}"));
        }
        line.push(byte);
    }
    bail!(
        "no line within 64 bytes: {:?}",
        String::from_utf8_lossy(&line)
    )
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Bytes `at..at + buf.len()` of the pseudo-random stream `seed`. Every
/// connection sends its own, so data delivered to another connection, or to
/// another place in this one, fails the comparison.
pub fn fill(seed: u64, at: u64, buf: &mut [u8]) {
    let mut word_at = u64::MAX;
    let mut word = [0u8; 8];
    for (i, b) in buf.iter_mut().enumerate() {
        let k = at + i as u64;
        if k / 8 != word_at {
            word_at = k / 8;
            word = splitmix64(seed.wrapping_mul(0x100_0000_01b3) ^ word_at).to_le_bytes();
        }
        *b = word[(k % 8) as usize];
    }
}

/// Raises this process's open-file limit to its hard limit: a test that holds
/// thousands of connections, both ends in this process, needs two descriptors
/// each.
pub fn raise_open_files(at_least: u64) -> Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            bail!("getrlimit: {}", std::io::Error::last_os_error());
        }
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            bail!("setrlimit: {}", std::io::Error::last_os_error());
        }
    }
    ensure!(
        limit.rlim_max >= at_least,
        "the test needs {at_least} open files; the hard limit is {} (raise it: ulimit -Hn)",
        limit.rlim_max
    );
    Ok(())
}

/// A TCP stream kept busy through a [`PeerEcho`]: a writer sends its pattern in
/// small chunks until told to stop, then shuts its side; a reader compares every
/// echoed byte with what was written there.
pub struct Stream {
    /// The source the server saw.
    pub seen: SocketAddr,
    /// The local address (the pod's).
    pub local: SocketAddr,
    stop: Arc<AtomicBool>,
    echoed: Arc<AtomicU64>,
    writer: JoinHandle<Result<u64>>,
    reader: JoinHandle<Result<u64>>,
}

/// What the writer sends per chunk, and how often: a steady trickle (about
/// 800 KB/s a stream), so a stream always has segments in flight.
const CHUNK: usize = 8 * 1024;
const CHUNK_EVERY: Duration = Duration::from_millis(10);

impl Stream {
    pub fn start(
        ns: &NetNs,
        bind: Option<SocketAddr>,
        to: SocketAddr,
        seed: u64,
    ) -> Result<Stream> {
        let (stream, seen) = connect(ns, bind, to, |_| Ok(()))?;
        let local = stream.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let echoed = Arc::new(AtomicU64::new(0));
        let mut out = stream.try_clone()?;
        let writer = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || -> Result<u64> {
                let mut chunk = vec![0u8; CHUNK];
                let mut at = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    fill(seed, at, &mut chunk);
                    out.write_all(&chunk)
                        .with_context(|| format!("writing at byte {at}"))?;
                    at += CHUNK as u64;
                    std::thread::sleep(CHUNK_EVERY);
                }
                out.shutdown(Shutdown::Write)?;
                Ok(at)
            })
        };
        let mut input = stream;
        let reader = {
            let echoed = Arc::clone(&echoed);
            std::thread::spawn(move || -> Result<u64> {
                let mut buf = vec![0u8; 64 * 1024];
                let mut want = vec![0u8; 64 * 1024];
                let mut at = 0u64;
                loop {
                    let n = input
                        .read(&mut buf)
                        .with_context(|| format!("reading the echo at byte {at}"))?;
                    if n == 0 {
                        return Ok(at);
                    }
                    fill(seed, at, &mut want[..n]);
                    if let Some(i) = (0..n).find(|&i| buf[i] != want[i]) {
                        bail!("echoed byte {} differs from what was sent", at + i as u64);
                    }
                    at += n as u64;
                    echoed.store(at, Ordering::Relaxed);
                }
            })
        };
        Ok(Stream {
            seen,
            local,
            stop,
            echoed,
            writer,
            reader,
        })
    }

    /// Bytes echoed back and verified so far.
    pub fn echoed(&self) -> u64 {
        self.echoed.load(Ordering::Relaxed)
    }

    /// Whether both threads still run (neither failed nor finished).
    pub fn alive(&self) -> bool {
        !self.writer.is_finished() && !self.reader.is_finished()
    }

    /// Stops writing and waits for the echo of everything written: the bytes,
    /// or what broke the stream.
    pub fn finish(self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let written = self
            .writer
            .join()
            .map_err(|_| anyhow::anyhow!("the writer panicked"))?
            .context("writer")?;
        let echoed = self
            .reader
            .join()
            .map_err(|_| anyhow::anyhow!("the reader panicked"))?
            .context("reader")?;
        ensure!(
            echoed == written,
            "{written} bytes written, {echoed} echoed before the server's EOF"
        );
        Ok(written)
    }
}

#[test]
fn the_pattern_is_the_same_in_any_pieces_and_differs_between_seeds() {
    let mut whole = vec![0u8; 100];
    fill(7, 3, &mut whole);
    let mut pieces = vec![0u8; 100];
    let (a, b) = pieces.split_at_mut(13);
    fill(7, 3, a);
    fill(7, 16, b);
    assert_eq!(whole, pieces);
    let mut other = vec![0u8; 100];
    fill(8, 3, &mut other);
    assert_ne!(whole, other);
    // Bytes one place further on are not the bytes expected here.
    assert_ne!(whole[1..], whole[..99]);
}
