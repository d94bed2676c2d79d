//! lb-probe: the client of the testbed. Runs inside a client pod's namespace and the
//! test cgroup (where the socket programs are attached), talks to a Service VIP the
//! way an application would, and prints one JSON report on stdout (see
//! `lb_tests::probe`). Failures of single attempts are data, not errors: they are
//! counted by errno name so tests can assert on them.

use std::collections::BTreeSet;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lb_tests::probe::{
    BulkReport, FollowEvent, HoldHello, PatternStream, ReachReport, ReachResult, SeqAttempt,
    SeqReport, Tally, TcpReport, UdpConnectedReport, UdpEchoReport, UdpReport, WhoamiAnswer,
    WhoamiReport,
};
use lb_tests::util::io_error_name;

/// A connect that has not completed by then counts as ETIMEDOUT; far above any
/// local connect, so a hit means the SYN went nowhere.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait for the greeting line of a TCP backend.
const TCP_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait for a UDP answer; a miss counts as EAGAIN.
const UDP_RECV_TIMEOUT: Duration = Duration::from_secs(1);
/// Bulk transfers are written and read in pieces of this size.
const BULK_CHUNK: usize = 64 * 1024;

#[derive(Parser)]
#[command(about = "Client probe for the lb testbed; prints a JSON report")]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// N sequential TCP connections, each on a new socket.
    Tcp {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Give up a connect after this long (counted as ETIMEDOUT).
        #[arg(long, default_value_t = 2000)]
        connect_timeout_ms: u64,
    },
    /// N unconnected UDP requests (sendto/recvfrom).
    Udp {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Datagrams sent from one socket before the next socket is opened.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        per_socket: u32,
    },
    /// TCP connections one after another, a new socket each, one every
    /// INTERVAL_MS: each reported in order (when it began, who answered or the
    /// errno). Stops after COUNT, or WINDOW_MS after the first failure.
    TcpSeq {
        #[command(flatten)]
        seq: SeqArgs,
        /// Give up a connect after this long (counted as ETIMEDOUT).
        #[arg(long, default_value_t = 2000)]
        connect_timeout_ms: u64,
    },
    /// UDP requests one after another, each from a new connected socket (so a
    /// closed port's ICMP error shows as ECONNREFUSED on the receive), one every
    /// INTERVAL_MS: each reported in order (when it began, who answered or the
    /// errno; EAGAIN when no answer came within RECV_TIMEOUT_MS). Stops after
    /// COUNT, or WINDOW_MS after the first failure.
    UdpSeq {
        #[command(flatten)]
        seq: SeqArgs,
        /// Wait this long for the answer (or the error).
        #[arg(long, default_value_t = 500)]
        recv_timeout_ms: u64,
        /// Attempt i sends from local port FIRST_PORT + i, so that no attempt
        /// lands on an earlier one's flow (the kernel's random pick repeats a port
        /// about once in a few hundred). Without it, the kernel picks.
        #[arg(long)]
        first_port: Option<u16>,
    },
    /// N connected UDP requests (connect/send/recv), each on a new socket.
    UdpConnected {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// One TCP connection kept open: prints {"backend":..}, then sends each stdin line
    /// and prints the reply line; exits on stdin EOF.
    Hold {
        #[arg(long)]
        to: SocketAddr,
    },
    /// One connected UDP socket sending a datagram every INTERVAL_MS: prints a JSON
    /// line (FollowEvent) when the answering backend changes or a call fails; after a
    /// failure it connects a new socket to the same address, as a DNS client does.
    /// Ends on stdin EOF, or after MAX_SECS.
    UdpFollow {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 20)]
        interval_ms: u64,
        #[arg(long, default_value_t = 60)]
        max_secs: u64,
    },
    /// N requests to an lb-echo `--whoami-port`: each a new TCP connection, or with
    /// --udp a datagram from a new unconnected socket. Reports who answered and the
    /// client address each backend saw.
    Whoami {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long)]
        udp: bool,
        /// Give up a connect after this long (counted as ETIMEDOUT).
        #[arg(long, default_value_t = 2000)]
        connect_timeout_ms: u64,
        /// Send request `i` from this local port plus `i` (the same client flow
        /// each run, e.g. through two nodes); default: a port the kernel picks.
        #[arg(long)]
        from_port: Option<u16>,
    },
    /// N datagrams of SIZE bytes (larger than the MTU: IP fragments) to an lb-echo
    /// `--bulk-port`, each from a new unconnected socket; each answer must echo the
    /// datagram byte for byte.
    UdpEcho {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65_000))]
        size: u32,
    },
    /// One attempt to each target at once (a thread each), for reachability
    /// matrices: a TCP connect and lb-echo's greeting, or a connected UDP socket's
    /// datagram and lb-echo's answer (sent again every 100 ms while none came).
    /// With LOCAL_PORTS (`LO-HI`) every socket takes a free port of that range at
    /// random instead of the kernel's pick. Each attempt gives up after TIMEOUT_MS: a
    /// dropped SYN or datagram costs that long, not the usual seconds.
    Reach {
        #[arg(long)]
        tcp: Vec<SocketAddr>,
        #[arg(long)]
        udp: Vec<SocketAddr>,
        #[arg(long, default_value_t = 400)]
        timeout_ms: u64,
        #[arg(long, value_parser = parse_port_range)]
        local_ports: Option<(u16, u16)>,
    },
    /// One TCP connection to an lb-echo `--bulk-port`: sends BYTES of a pseudo-random
    /// stream while reading the echo back, and compares every byte.
    Bulk {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        bytes: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// A read or write that makes no progress for this long ends the transfer.
        #[arg(long, default_value_t = 10_000)]
        stall_timeout_ms: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.mode {
        Mode::Tcp {
            to,
            count,
            connect_timeout_ms,
        } => print_json(&tcp(to, count, Duration::from_millis(connect_timeout_ms))),
        Mode::Udp {
            to,
            count,
            per_socket,
        } => udp(to, count, per_socket).and_then(|r| print_json(&r)),
        Mode::TcpSeq {
            seq,
            connect_timeout_ms,
        } => print_json(&tcp_seq(
            seq.to,
            seq.count,
            seq.pace(),
            Duration::from_millis(connect_timeout_ms),
        )),
        Mode::UdpSeq {
            seq,
            recv_timeout_ms,
            first_port,
        } => print_json(&udp_seq(
            seq.to,
            seq.count,
            seq.pace(),
            Duration::from_millis(recv_timeout_ms),
            first_port,
        )),
        Mode::UdpConnected { to, count } => udp_connected(to, count).and_then(|r| print_json(&r)),
        Mode::Hold { to } => hold(to),
        Mode::UdpFollow {
            to,
            interval_ms,
            max_secs,
        } => udp_follow(
            to,
            Duration::from_millis(interval_ms),
            Duration::from_secs(max_secs),
        ),
        Mode::Whoami {
            to,
            count,
            udp,
            connect_timeout_ms,
            from_port,
        } => {
            let report = if udp {
                whoami_udp(to, count, from_port)
            } else {
                Ok(whoami_tcp(
                    to,
                    count,
                    Duration::from_millis(connect_timeout_ms),
                    from_port,
                ))
            };
            report.and_then(|r| print_json(&r))
        }
        Mode::Reach {
            tcp,
            udp,
            timeout_ms,
            local_ports,
        } => print_json(&reach(
            &tcp,
            &udp,
            Duration::from_millis(timeout_ms),
            local_ports,
        )),
        Mode::UdpEcho { to, count, size } => {
            udp_echo(to, count, size as usize).and_then(|r| print_json(&r))
        }
        Mode::Bulk {
            to,
            bytes,
            seed,
            stall_timeout_ms,
        } => print_json(&bulk(
            to,
            bytes,
            seed,
            Duration::from_millis(stall_timeout_ms),
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb-probe: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_json<T: serde::Serialize>(report: &T) -> Result<()> {
    let mut out = io::stdout().lock();
    serde_json::to_writer(&mut out, report)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

fn record(tally: &mut Tally, op: &str, e: &io::Error) {
    tally.error(op, io_error_name(e), &e.to_string());
}

/// Read one line (without the newline); an empty read is an error (`EOF`).
fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(line.trim_end().to_string())
}

/// The unspecified address of `to`'s family.
fn unspecified(to: SocketAddr) -> std::net::IpAddr {
    if to.is_ipv6() {
        std::net::Ipv6Addr::UNSPECIFIED.into()
    } else {
        std::net::Ipv4Addr::UNSPECIFIED.into()
    }
}

/// A TCP connection to `to` from local port `port`: SO_REUSEADDR lets the port be
/// used again towards other destinations while an earlier connection from it is in
/// TIME_WAIT.
fn connect_from(to: SocketAddr, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&SocketAddr::new(unspecified(to), port).into())?;
    socket.connect_timeout(&to.into(), timeout)?;
    Ok(socket.into())
}

/// One counted connect attempt: the stream, or the error recorded in `tally`; the
/// connect time goes into `max_ms`.
fn timed_connect(
    to: SocketAddr,
    timeout: Duration,
    tally: &mut Tally,
    max_ms: &mut f64,
) -> Option<TcpStream> {
    timed_connect_from(to, None, timeout, tally, max_ms)
}

/// [`timed_connect`] from local port `from` when given.
fn timed_connect_from(
    to: SocketAddr,
    from: Option<u16>,
    timeout: Duration,
    tally: &mut Tally,
    max_ms: &mut f64,
) -> Option<TcpStream> {
    tally.attempts += 1;
    let start = Instant::now();
    let conn = match from {
        Some(port) => connect_from(to, port, timeout),
        None => TcpStream::connect_timeout(&to, timeout),
    };
    *max_ms = max_ms.max(start.elapsed().as_secs_f64() * 1000.0);
    match conn {
        Ok(stream) => Some(stream),
        Err(e) => {
            record(tally, "connect", &e);
            None
        }
    }
}

fn tcp(to: SocketAddr, count: u32, connect_timeout: Duration) -> TcpReport {
    let mut report = TcpReport::default();
    for _ in 0..count {
        let Some(stream) = timed_connect(
            to,
            connect_timeout,
            &mut report.tally,
            &mut report.max_connect_ms,
        ) else {
            continue;
        };
        match stream.peer_addr() {
            Ok(peer) => {
                report.peers.insert(peer.to_string());
            }
            Err(e) => record(&mut report.tally, "getpeername", &e),
        }
        let greeting = stream
            .set_read_timeout(Some(TCP_READ_TIMEOUT))
            .and_then(|()| read_line(&mut BufReader::new(&stream)));
        match greeting {
            Ok(name) => report.tally.answer(&name),
            Err(e) => record(&mut report.tally, "read", &e),
        }
    }
    report
}

/// How `tcp-seq` and `udp-seq` space their attempts: one every `interval` from the
/// start, and with `window` only for that long after the first failure.
struct Pace {
    interval: Duration,
    window: Option<Duration>,
}

/// What `tcp-seq` and `udp-seq` share: the target and the pacing.
#[derive(clap::Args)]
struct SeqArgs {
    #[arg(long)]
    to: SocketAddr,
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[arg(long, default_value_t = 10)]
    interval_ms: u64,
    /// Keep going this long after the first failure, then stop.
    #[arg(long)]
    window_ms: Option<u64>,
}

impl SeqArgs {
    fn pace(&self) -> Pace {
        Pace {
            interval: Duration::from_millis(self.interval_ms),
            window: self.window_ms.map(Duration::from_millis),
        }
    }
}

/// `count` attempts paced as `pace` says; `attempt` makes one (given when it
/// began, for its timing) and returns the backend's name or the failed call's
/// error.
fn seq(
    count: u32,
    pace: &Pace,
    mut attempt: impl FnMut(Instant, &mut SeqAttempt) -> io::Result<String>,
) -> SeqReport {
    let mut report = SeqReport::default();
    let start = Instant::now();
    let mut failed_at: Option<Instant> = None;
    for i in 0..count {
        if let (Some(at), Some(window)) = (failed_at, pace.window) {
            if at.elapsed() >= window {
                break;
            }
        }
        // Paced from the start, so a slow attempt does not shift the rest.
        let due = start + pace.interval * i;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let began = Instant::now();
        let mut one = SeqAttempt {
            at_ms: began.duration_since(start).as_secs_f64() * 1000.0,
            ..SeqAttempt::default()
        };
        match attempt(began, &mut one) {
            Ok(name) => one.backend = Some(name),
            Err(e) => {
                one.error = Some(io_error_name(&e));
                failed_at.get_or_insert(began);
            }
        }
        if one.connect_ms == 0.0 {
            one.connect_ms = began.elapsed().as_secs_f64() * 1000.0;
        }
        report.attempts.push(one);
    }
    report
}

fn tcp_seq(to: SocketAddr, count: u32, pace: Pace, connect_timeout: Duration) -> SeqReport {
    seq(count, &pace, |began, attempt| {
        let stream = TcpStream::connect_timeout(&to, connect_timeout);
        attempt.connect_ms = began.elapsed().as_secs_f64() * 1000.0;
        let stream = stream?;
        attempt.local_port = stream.local_addr()?.port();
        stream.set_read_timeout(Some(TCP_READ_TIMEOUT))?;
        read_line(&mut BufReader::new(&stream))
    })
}

fn udp_seq(
    to: SocketAddr,
    count: u32,
    pace: Pace,
    recv_timeout: Duration,
    first_port: Option<u16>,
) -> SeqReport {
    let mut buf = [0u8; 2048];
    let mut next_port = first_port;
    seq(count, &pace, |_, attempt| {
        // A new socket each time: a new flow for the datapath, and no error left
        // over from an earlier datagram.
        let port = next_port.unwrap_or(0);
        next_port = next_port.map(|p| p.wrapping_add(1));
        let socket = UdpSocket::bind(SocketAddr::new(unspecified(to), port))?;
        socket.set_read_timeout(Some(recv_timeout))?;
        socket.connect(to)?;
        attempt.local_port = socket.local_addr()?.port();
        socket.send(b"ping")?;
        let n = socket.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
    })
}

fn new_udp_socket(to: SocketAddr) -> Result<UdpSocket> {
    new_udp_socket_from(to, 0)
}

/// A UDP socket of `to`'s family bound to local port `port` (0: any).
fn new_udp_socket_from(to: SocketAddr, port: u16) -> Result<UdpSocket> {
    // The target's family: an IPv6 address (IPv4-mapped ones too) takes an AF_INET6
    // socket, as a dual-stack application's would.
    let any = SocketAddr::new(unspecified(to), port);
    let socket = UdpSocket::bind(any).context("binding a UDP socket")?;
    socket.set_read_timeout(Some(UDP_RECV_TIMEOUT))?;
    Ok(socket)
}

fn udp(to: SocketAddr, count: u32, per_socket: u32) -> Result<UdpReport> {
    let mut report = UdpReport::default();
    let mut buf = [0u8; 2048];
    let mut socket = None;
    for i in 0..count {
        if i % per_socket == 0 {
            socket = Some(new_udp_socket(to)?);
            report.per_socket.push(BTreeSet::new());
        }
        let socket = socket.as_ref().expect("opened above");
        report.tally.attempts += 1;
        if let Err(e) = socket.send_to(b"ping", to) {
            record(&mut report.tally, "sendto", &e);
            continue;
        }
        match socket.recv_from(&mut buf) {
            Ok((n, from)) => {
                let name = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                report.sources.insert(from.to_string());
                report.tally.answer(&name);
                report.per_socket.last_mut().expect("pushed").insert(name);
            }
            Err(e) => record(&mut report.tally, "recvfrom", &e),
        }
    }
    Ok(report)
}

fn udp_echo(to: SocketAddr, count: u32, size: usize) -> Result<UdpEchoReport> {
    let mut report = UdpEchoReport {
        size,
        ..UdpEchoReport::default()
    };
    let mut buf = vec![0u8; 65_536];
    for i in 0..count {
        report.tally.attempts += 1;
        let mut datagram = vec![0u8; size];
        PatternStream::new(u64::from(i)).fill(&mut datagram);
        let socket = new_udp_socket(to)?;
        if let Err(e) = socket.send_to(&datagram, to) {
            record(&mut report.tally, "sendto", &e);
            continue;
        }
        match socket.recv_from(&mut buf) {
            Ok((n, from)) => {
                report.sources.insert(from.to_string());
                // `<name>\n` and the datagram.
                let answer = &buf[..n];
                let split = answer.iter().position(|b| *b == b'\n');
                match split {
                    Some(at) if answer[at + 1..] == datagram[..] => {
                        report.tally.answer(&String::from_utf8_lossy(&answer[..at]));
                    }
                    _ => report.tally.error(
                        "recvfrom",
                        "MISMATCH".into(),
                        &format!("{n} bytes back for {size} sent"),
                    ),
                }
            }
            Err(e) => record(&mut report.tally, "recvfrom", &e),
        }
    }
    Ok(report)
}

fn udp_connected(to: SocketAddr, count: u32) -> Result<UdpConnectedReport> {
    let mut report = UdpConnectedReport::default();
    let mut buf = [0u8; 2048];
    for _ in 0..count {
        report.tally.attempts += 1;
        let socket = new_udp_socket(to)?;
        if let Err(e) = socket.connect(to) {
            record(&mut report.tally, "connect", &e);
            continue;
        }
        match socket.peer_addr() {
            Ok(peer) => {
                report.peers.insert(peer.to_string());
            }
            Err(e) => record(&mut report.tally, "getpeername", &e),
        }
        if let Err(e) = socket.send(b"ping") {
            record(&mut report.tally, "send", &e);
            continue;
        }
        match socket.recv(&mut buf) {
            Ok(n) => {
                let name = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                report.tally.answer(&name);
            }
            Err(e) => record(&mut report.tally, "recv", &e),
        }
    }
    Ok(report)
}

fn hold(to: SocketAddr) -> Result<()> {
    let stream = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
        .with_context(|| format!("connect {to}"))?;
    stream.set_read_timeout(Some(TCP_READ_TIMEOUT))?;
    let mut reader = BufReader::new(&stream);
    let backend = read_line(&mut reader).context("reading the greeting")?;
    let local = stream.local_addr().ok().map(|a| a.to_string());
    print_json(&HoldHello { backend, local })?;
    let mut writer = &stream;
    for line in io::stdin().lock().lines() {
        let line = line?;
        writer.write_all(format!("{line}\n").as_bytes())?;
        let reply = read_line(&mut reader).context("reading the echo")?;
        let mut out = io::stdout().lock();
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

fn udp_follow(to: SocketAddr, interval: Duration, max: Duration) -> Result<()> {
    let started = Instant::now();
    let stdin_closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let closed = stdin_closed.clone();
    std::thread::spawn(move || {
        let _ = io::copy(&mut io::stdin().lock(), &mut io::sink());
        closed.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let print = |socket: u32, answer: Option<String>, error: Option<String>| {
        print_json(&FollowEvent {
            at_ms: started.elapsed().as_millis() as u64,
            socket,
            answer,
            error,
        })
    };
    let connect = || -> Result<UdpSocket> {
        let socket = new_udp_socket(to)?;
        socket
            .connect(to)
            .with_context(|| format!("connect {to}"))?;
        Ok(socket)
    };
    let mut socket_no = 0;
    let mut socket = connect()?;
    let mut last: Option<String> = None;
    let mut buf = [0u8; 2048];
    while !stdin_closed.load(std::sync::atomic::Ordering::Relaxed) && started.elapsed() < max {
        let answer = socket
            .send(b"ping")
            .map_err(|e| ("send", e))
            .and_then(|_| socket.recv(&mut buf).map_err(|e| ("recv", e)));
        match answer {
            Ok(n) => {
                let name = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                if last.as_ref() != Some(&name) {
                    print(socket_no, Some(name.clone()), None)?;
                    last = Some(name);
                }
            }
            // A lost datagram: report it, keep the socket.
            Err((op, e)) if e.kind() == io::ErrorKind::WouldBlock => {
                print(socket_no, None, Some(format!("{op} {}", io_error_name(&e))))?;
            }
            Err((op, e)) => {
                print(socket_no, None, Some(format!("{op} {}", io_error_name(&e))))?;
                socket_no += 1;
                socket = connect()?;
                last = None;
            }
        }
        std::thread::sleep(interval);
    }
    Ok(())
}

/// `LO-HI`, both inclusive, LO <= HI.
fn parse_port_range(text: &str) -> std::result::Result<(u16, u16), String> {
    let (lo, hi) = text
        .split_once('-')
        .ok_or_else(|| format!("{text}: expected LO-HI"))?;
    let port = |p: &str| p.parse::<u16>().map_err(|e| format!("{text}: {p}: {e}"));
    let (lo, hi) = (port(lo)?, port(hi)?);
    if lo == 0 || lo > hi {
        return Err(format!("{text}: expected 1 <= LO <= HI"));
    }
    Ok((lo, hi))
}

fn reach(
    tcp: &[SocketAddr],
    udp: &[SocketAddr],
    timeout: Duration,
    local_ports: Option<(u16, u16)>,
) -> ReachReport {
    let targets = tcp
        .iter()
        .map(|&to| (to, false))
        .chain(udp.iter().map(|&to| (to, true)));
    let results = std::thread::scope(|scope| {
        let attempts: Vec<_> = targets
            .map(|(to, is_udp)| {
                scope.spawn(move || {
                    let start = Instant::now();
                    let outcome = match is_udp {
                        true => reach_udp(to, timeout, local_ports),
                        false => reach_tcp(to, timeout, local_ports),
                    };
                    let (answer, error) = match outcome {
                        Ok(name) => (Some(name), None),
                        Err((op, e)) => (None, Some(format!("{op} {}", io_error_name(&e)))),
                    };
                    ReachResult {
                        protocol: if is_udp { "udp" } else { "tcp" }.into(),
                        to,
                        answer,
                        error,
                        ms: start.elapsed().as_secs_f64() * 1000.0,
                    }
                })
            })
            .collect();
        attempts
            .into_iter()
            .map(|a| a.join().expect("a reach attempt panicked"))
            .collect()
    });
    ReachReport { results }
}

type Attempt = std::result::Result<String, (&'static str, io::Error)>;

/// A socket of `to`'s family bound to a free port of `range` picked at random
/// (the kernel's pick without a range).
fn bound_socket(
    to: SocketAddr,
    udp: bool,
    range: Option<(u16, u16)>,
) -> std::result::Result<socket2::Socket, (&'static str, io::Error)> {
    use socket2::{Domain, Socket, Type};
    let kind = if udp { Type::DGRAM } else { Type::STREAM };
    let socket = Socket::new(Domain::for_address(to), kind, None).map_err(|e| ("socket", e))?;
    let Some((lo, hi)) = range else {
        return Ok(socket);
    };
    // std's hasher is randomly keyed per process: a random number without a crate.
    let random = |salt: u32| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(salt);
        h.finish()
    };
    let span = u64::from(hi - lo) + 1;
    let mut last = None;
    for salt in 0..64 {
        let port = lo + u16::try_from(random(salt) % span).expect("within the range");
        match socket.bind(&SocketAddr::new(unspecified(to), port).into()) {
            Ok(()) => return Ok(socket),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(("bind", e)),
        }
    }
    Err(("bind", last.expect("64 tries ran")))
}

fn reach_tcp(to: SocketAddr, timeout: Duration, range: Option<(u16, u16)>) -> Attempt {
    let socket = bound_socket(to, false, range)?;
    socket
        .connect_timeout(&to.into(), timeout)
        .map_err(|e| ("connect", e))?;
    let stream = TcpStream::from(socket);
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| ("setsockopt", e))?;
    read_line(&mut BufReader::new(&stream)).map_err(|e| ("read", e))
}

/// How often `reach` sends its UDP datagram again while no answer came.
const REACH_UDP_RESEND: Duration = Duration::from_millis(100);

fn reach_udp(to: SocketAddr, timeout: Duration, range: Option<(u16, u16)>) -> Attempt {
    let socket = UdpSocket::from(bound_socket(to, true, range)?);
    socket.connect(to).map_err(|e| ("connect", e))?;
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 2048];
    loop {
        socket.send(b"ping").map_err(|e| ("send", e))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.min(REACH_UDP_RESEND).max(Duration::from_millis(1));
        socket
            .set_read_timeout(Some(wait))
            .map_err(|e| ("setsockopt", e))?;
        match socket.recv(&mut buf) {
            Ok(n) => return Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline => {}
            Err(e) => return Err(("recv", e)),
        }
    }
}

/// Split a whoami answer `<name> <ip:port>`.
fn parse_whoami(text: &str) -> Option<(String, String)> {
    let (name, seen) = text.trim().split_once(' ')?;
    Some((name.to_string(), seen.to_string()))
}

/// The local port of request `i` when requests go from `from` on.
fn port_of(from: Option<u16>, i: u32) -> Option<u16> {
    from.map(|first| first.wrapping_add(i as u16))
}

fn whoami_tcp(
    to: SocketAddr,
    count: u32,
    connect_timeout: Duration,
    from: Option<u16>,
) -> WhoamiReport {
    let mut report = WhoamiReport::default();
    for i in 0..count {
        let Some(stream) = timed_connect_from(
            to,
            port_of(from, i),
            connect_timeout,
            &mut report.tally,
            &mut report.max_connect_ms,
        ) else {
            continue;
        };
        let addrs = stream
            .local_addr()
            .and_then(|l| Ok((l, stream.peer_addr()?)));
        let (local, peer) = match addrs {
            Ok(a) => a,
            Err(e) => {
                record(&mut report.tally, "getsockname/getpeername", &e);
                continue;
            }
        };
        let line = stream
            .set_read_timeout(Some(TCP_READ_TIMEOUT))
            .and_then(|()| read_line(&mut BufReader::new(&stream)));
        match line {
            Ok(text) => match parse_whoami(&text) {
                Some((backend, seen)) => {
                    report.tally.answer(&backend);
                    report.answers.push(WhoamiAnswer {
                        backend,
                        seen,
                        local: local.to_string(),
                        peer: peer.to_string(),
                    });
                }
                None => report
                    .tally
                    .error("read", "BADANSWER".into(), &format!("{text:?}")),
            },
            Err(e) => record(&mut report.tally, "read", &e),
        }
    }
    report
}

fn whoami_udp(to: SocketAddr, count: u32, from: Option<u16>) -> Result<WhoamiReport> {
    let mut report = WhoamiReport::default();
    let mut buf = [0u8; 2048];
    for i in 0..count {
        report.tally.attempts += 1;
        let socket = new_udp_socket_from(to, port_of(from, i).unwrap_or(0))?;
        if let Err(e) = socket.send_to(b"whoami", to) {
            record(&mut report.tally, "sendto", &e);
            continue;
        }
        let local = socket.local_addr()?;
        match socket.recv_from(&mut buf) {
            Ok((n, from)) => {
                let text = String::from_utf8_lossy(&buf[..n]).to_string();
                match parse_whoami(&text) {
                    Some((backend, seen)) => {
                        report.tally.answer(&backend);
                        report.answers.push(WhoamiAnswer {
                            backend,
                            seen,
                            local: local.to_string(),
                            peer: from.to_string(),
                        });
                    }
                    None => {
                        report
                            .tally
                            .error("recvfrom", "BADANSWER".into(), &format!("{text:?}"))
                    }
                }
            }
            Err(e) => record(&mut report.tally, "recvfrom", &e),
        }
    }
    Ok(report)
}

/// Send `bytes` of the pattern on a writer thread while this thread reads the echo
/// back and compares it; both directions at once, so neither side's buffers fill up.
fn bulk(to: SocketAddr, bytes: u64, seed: u64, stall: Duration) -> BulkReport {
    let mut report = BulkReport::default();
    let start = Instant::now();
    let result = bulk_transfer(to, bytes, seed, stall, &mut report);
    report.elapsed_ms = start.elapsed().as_secs_f64() * 1000.0;
    if let Err(e) = result {
        report.error = Some(format!("{e:#}"));
    }
    report
}

fn bulk_transfer(
    to: SocketAddr,
    bytes: u64,
    seed: u64,
    stall: Duration,
    report: &mut BulkReport,
) -> Result<()> {
    let stream = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
        .with_context(|| format!("connect {to}"))?;
    report.local = stream.local_addr()?.to_string();
    report.peer = stream.peer_addr()?.to_string();
    stream.set_read_timeout(Some(stall))?;
    stream.set_write_timeout(Some(stall))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    report.backend = read_line(&mut reader).context("reading the greeting")?;

    let mut writer = stream;
    let sender = std::thread::spawn(move || -> (u64, Option<String>) {
        let mut pattern = PatternStream::new(seed);
        let mut buf = vec![0u8; BULK_CHUNK];
        let mut sent = 0u64;
        while sent < bytes {
            let n = usize::try_from((bytes - sent).min(BULK_CHUNK as u64)).expect("<= chunk");
            pattern.fill(&mut buf[..n]);
            if let Err(e) = writer.write_all(&buf[..n]) {
                return (sent, Some(format!("write after {sent} bytes: {e}")));
            }
            sent += n as u64;
        }
        // EOF for the server, which then closes its side once it echoed everything.
        let err = writer
            .shutdown(Shutdown::Write)
            .err()
            .map(|e| format!("shutdown: {e}"));
        (sent, err)
    });

    let mut expected = PatternStream::new(seed);
    let mut want = vec![0u8; BULK_CHUNK];
    let mut got = vec![0u8; BULK_CHUNK];
    let mut read_error = None;
    loop {
        let n = match reader.read(&mut got) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                read_error = Some(format!(
                    "read after {} bytes: {e} ({})",
                    report.bytes_verified,
                    io_error_name(&e)
                ));
                break;
            }
        };
        expected.fill(&mut want[..n]);
        if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
            report.mismatch_at = Some(report.bytes_verified + i as u64);
            report.bytes_verified += i as u64;
            // Unblock the writer (it may be stuck on a full window) and stop.
            let _ = reader.get_ref().shutdown(Shutdown::Both);
            break;
        }
        report.bytes_verified += n as u64;
        if report.bytes_verified > bytes {
            read_error = Some(format!("received more than the {bytes} bytes sent"));
            break;
        }
    }
    if read_error.is_some() {
        let _ = reader.get_ref().shutdown(Shutdown::Both);
    }
    let (sent, write_error) = sender
        .join()
        .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?;
    report.bytes_sent = sent;
    report.error = read_error.or(write_error);
    Ok(())
}
