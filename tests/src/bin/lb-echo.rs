//! lb-echo: the backend "pod" server of the testbed.
//!
//! `lb-echo --name pod-a --port 8080 [--port 5353 ...]` listens on TCP and UDP
//! 0.0.0.0:PORT and [::]:PORT (IPv6 only, so IPv4 peers keep their own address) for
//! each port and prints `listening` once every socket is bound. Without IPv6 in the
//! namespace only the IPv4 sockets are bound.
//! - TCP: on accept, writes `<name>\n`, then answers each line with `<name> <line>\n`.
//! - UDP: answers each datagram with `<name>`.
//!
//! Optional extra ports (TCP and UDP unless said otherwise):
//! - `--whoami-port P`: tells the client where it came from, as this pod saw it:
//!   TCP writes `<name> <peer-ip>:<peer-port>\n` on accept and closes; UDP answers
//!   each datagram with `<name> <peer-ip>:<peer-port>`. This is how a test checks
//!   whether a backend saw the client's own address or a SNAT address.
//! - `--bulk-port P`: TCP writes `<name>\n`, then echoes every byte it receives
//!   until the client closes its side, then closes too. UDP answers each datagram
//!   (up to 64 KiB: larger than the MTU, so IP fragments both ways) with
//!   `<name>\n` followed by the datagram itself.
//!
//! The name in every answer is how a test learns which backend it reached. Threads and
//! std only: it has to start fast and never be the thing under test.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::sync::Arc;
use std::thread;

struct Args {
    name: String,
    ports: Vec<u16>,
    whoami_ports: Vec<u16>,
    bulk_ports: Vec<u16>,
}

fn parse_port(v: &str) -> Result<u16, String> {
    v.parse().map_err(|e| format!("bad port {v}: {e}"))
}

fn parse_args() -> Result<Args, String> {
    let mut name = None;
    let mut ports = Vec::new();
    let mut whoami_ports = Vec::new();
    let mut bulk_ports = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--name" => name = Some(value()?),
            "--port" => ports.push(parse_port(&value()?)?),
            "--whoami-port" => whoami_ports.push(parse_port(&value()?)?),
            "--bulk-port" => bulk_ports.push(parse_port(&value()?)?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let name = name.ok_or("--name is required")?;
    if ports.is_empty() && whoami_ports.is_empty() && bulk_ports.is_empty() {
        return Err("at least one --port is required".into());
    }
    Ok(Args {
        name,
        ports,
        whoami_ports,
        bulk_ports,
    })
}

fn serve_tcp_conn(name: &str, stream: TcpStream) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    writer.write_all(format!("{name}\n").as_bytes())?;
    for line in BufReader::new(stream).lines() {
        writer.write_all(format!("{name} {}\n", line?).as_bytes())?;
    }
    Ok(())
}

/// `--whoami-port`: the peer address as this end sees it, then close.
fn serve_whoami_conn(name: &str, mut stream: TcpStream) -> std::io::Result<()> {
    let peer = stream.peer_addr()?;
    stream.write_all(format!("{name} {peer}\n").as_bytes())?;
    stream.flush()
}

/// `--bulk-port`: greeting, then every byte back until the client's EOF.
fn serve_bulk_conn(name: &str, stream: TcpStream) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    writer.write_all(format!("{name}\n").as_bytes())?;
    let mut reader = stream;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        writer.write_all(&buf[..n])?;
    }
    writer.shutdown(Shutdown::Write)
}

type ConnHandler = fn(&str, TcpStream) -> std::io::Result<()>;

fn serve_tcp(name: Arc<str>, listener: TcpListener, handler: ConnHandler) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let name = Arc::clone(&name);
        // A connection's errors (client reset) only end that connection.
        thread::spawn(move || {
            let _ = handler(&name, stream);
        });
    }
}

fn serve_udp(name: Arc<str>, socket: UdpSocket, kind: Kind) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let answer = match kind {
            Kind::Whoami => format!("{name} {from}").into_bytes(),
            Kind::Echo => name.as_bytes().to_vec(),
            Kind::Bulk => [format!("{name}\n").as_bytes(), &buf[..n]].concat(),
        };
        let _ = socket.send_to(&answer, from);
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Echo,
    Whoami,
    Bulk,
}

/// A bound socket (TCP listening, or UDP); IPv6 ones take IPv6 peers only.
fn bind(addr: SocketAddr, udp: bool) -> std::io::Result<socket2::Socket> {
    use socket2::{Domain, Socket, Type};
    let kind = if udp { Type::DGRAM } else { Type::STREAM };
    let socket = Socket::new(Domain::for_address(addr), kind, None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    if !udp {
        socket.set_reuse_address(true)?;
    }
    socket.bind(&addr.into())?;
    if !udp {
        socket.listen(1024)?;
    }
    Ok(socket)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "lb-echo: {e}\nusage: lb-echo --name NAME --port PORT [--port PORT...] \
                 [--whoami-port PORT...] [--bulk-port PORT...]"
            );
            return ExitCode::from(2);
        }
    };
    let name: Arc<str> = args.name.into();
    let mut handles = Vec::new();
    let ports = args
        .ports
        .iter()
        .map(|&p| (p, Kind::Echo))
        .chain(args.whoami_ports.iter().map(|&p| (p, Kind::Whoami)))
        .chain(args.bulk_ports.iter().map(|&p| (p, Kind::Bulk)));
    let families = [
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
        SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)),
    ];
    for (port, kind) in ports {
        for any in families {
            let addr = SocketAddr::new(any.ip(), port);
            let (tcp, udp) = match (bind(addr, false), bind(addr, true)) {
                (Ok(tcp), Ok(udp)) => (TcpListener::from(tcp), UdpSocket::from(udp)),
                (Err(e), _) | (_, Err(e))
                    if addr.is_ipv6() && e.raw_os_error() == Some(libc::EAFNOSUPPORT) =>
                {
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("lb-echo: cannot bind {addr}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let handler: ConnHandler = match kind {
                Kind::Echo => serve_tcp_conn,
                Kind::Whoami => serve_whoami_conn,
                Kind::Bulk => serve_bulk_conn,
            };
            let n = Arc::clone(&name);
            handles.push(thread::spawn(move || serve_tcp(n, tcp, handler)));
            let n = Arc::clone(&name);
            handles.push(thread::spawn(move || serve_udp(n, udp, kind)));
        }
    }
    // Everything is bound: the testbed waits for this line before using the pod.
    println!("listening");
    let _ = std::io::stdout().flush();
    for h in handles {
        let _ = h.join();
    }
    ExitCode::SUCCESS
}
