//! lb-probe: the client of the testbed. Runs inside a client pod's namespace and the
//! test cgroup (where the socket programs are attached), talks to a Service VIP the
//! way an application would, and prints one JSON report on stdout (see
//! `lb_tests::probe`). Failures of single attempts are data, not errors: they are
//! counted by errno name so tests can assert on them.

use std::collections::BTreeSet;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lb_tests::probe::{HoldHello, Tally, TcpReport, UdpConnectedReport, UdpReport};
use lb_tests::util::io_error_name;

/// A connect that has not completed by then counts as ETIMEDOUT; far above any
/// local connect, so a hit means the SYN went nowhere.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait for the greeting line of a TCP backend.
const TCP_READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait for a UDP answer; a miss counts as EAGAIN.
const UDP_RECV_TIMEOUT: Duration = Duration::from_secs(1);

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
        to: SocketAddrV4,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// N unconnected UDP requests (sendto/recvfrom).
    Udp {
        #[arg(long)]
        to: SocketAddrV4,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Datagrams sent from one socket before the next socket is opened.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        per_socket: u32,
    },
    /// N connected UDP requests (connect/send/recv), each on a new socket.
    UdpConnected {
        #[arg(long)]
        to: SocketAddrV4,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// One TCP connection kept open: prints {"backend":..}, then sends each stdin line
    /// and prints the reply line; exits on stdin EOF.
    Hold {
        #[arg(long)]
        to: SocketAddrV4,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.mode {
        Mode::Tcp { to, count } => print_json(&tcp(to, count)),
        Mode::Udp {
            to,
            count,
            per_socket,
        } => udp(to, count, per_socket).and_then(|r| print_json(&r)),
        Mode::UdpConnected { to, count } => udp_connected(to, count).and_then(|r| print_json(&r)),
        Mode::Hold { to } => hold(to),
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

fn tcp(to: SocketAddrV4, count: u32) -> TcpReport {
    let mut report = TcpReport::default();
    for _ in 0..count {
        report.tally.attempts += 1;
        let start = Instant::now();
        let conn = TcpStream::connect_timeout(&SocketAddr::V4(to), CONNECT_TIMEOUT);
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        report.max_connect_ms = report.max_connect_ms.max(ms);
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                record(&mut report.tally, "connect", &e);
                continue;
            }
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

fn new_udp_socket() -> Result<UdpSocket> {
    let socket = UdpSocket::bind("0.0.0.0:0").context("binding a UDP socket")?;
    socket.set_read_timeout(Some(UDP_RECV_TIMEOUT))?;
    Ok(socket)
}

fn udp(to: SocketAddrV4, count: u32, per_socket: u32) -> Result<UdpReport> {
    let mut report = UdpReport::default();
    let mut buf = [0u8; 2048];
    let mut socket = None;
    for i in 0..count {
        if i % per_socket == 0 {
            socket = Some(new_udp_socket()?);
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

fn udp_connected(to: SocketAddrV4, count: u32) -> Result<UdpConnectedReport> {
    let mut report = UdpConnectedReport::default();
    let mut buf = [0u8; 2048];
    for _ in 0..count {
        report.tally.attempts += 1;
        let socket = new_udp_socket()?;
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

fn hold(to: SocketAddrV4) -> Result<()> {
    let stream = TcpStream::connect_timeout(&SocketAddr::V4(to), CONNECT_TIMEOUT)
        .with_context(|| format!("connect {to}"))?;
    stream.set_read_timeout(Some(TCP_READ_TIMEOUT))?;
    let mut reader = BufReader::new(&stream);
    let backend = read_line(&mut reader).context("reading the greeting")?;
    print_json(&HoldHello { backend })?;
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
