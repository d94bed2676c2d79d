//! lb-echo: the backend "pod" server of the testbed.
//!
//! `lb-echo --name pod-a --port 8080 [--port 5353 ...]` listens on TCP and UDP
//! 0.0.0.0:PORT for each port and prints `listening` once every socket is bound.
//! - TCP: on accept, writes `<name>\n`, then answers each line with `<name> <line>\n`.
//! - UDP: answers each datagram with `<name>`.
//!
//! The name in every answer is how a test learns which backend it reached. Threads and
//! std only: it has to start fast and never be the thing under test.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::sync::Arc;
use std::thread;

struct Args {
    name: String,
    ports: Vec<u16>,
}

fn parse_args() -> Result<Args, String> {
    let mut name = None;
    let mut ports = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--name" => name = Some(value()?),
            "--port" => {
                let v = value()?;
                ports.push(v.parse().map_err(|e| format!("bad port {v}: {e}"))?);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let name = name.ok_or("--name is required")?;
    if ports.is_empty() {
        return Err("at least one --port is required".into());
    }
    Ok(Args { name, ports })
}

fn serve_tcp_conn(name: &str, stream: TcpStream) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    writer.write_all(format!("{name}\n").as_bytes())?;
    for line in BufReader::new(stream).lines() {
        writer.write_all(format!("{name} {}\n", line?).as_bytes())?;
    }
    Ok(())
}

fn serve_tcp(name: Arc<str>, listener: TcpListener) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let name = Arc::clone(&name);
        // A connection's errors (client reset) only end that connection.
        thread::spawn(move || {
            let _ = serve_tcp_conn(&name, stream);
        });
    }
}

fn serve_udp(name: Arc<str>, socket: UdpSocket) {
    let mut buf = [0u8; 2048];
    loop {
        let Ok((_, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let _ = socket.send_to(name.as_bytes(), from);
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lb-echo: {e}\nusage: lb-echo --name NAME --port PORT [--port PORT...]");
            return ExitCode::from(2);
        }
    };
    let name: Arc<str> = args.name.into();
    let mut handles = Vec::new();
    for port in args.ports {
        let addr = (Ipv4Addr::UNSPECIFIED, port);
        let (tcp, udp) = match (TcpListener::bind(addr), UdpSocket::bind(addr)) {
            (Ok(t), Ok(u)) => (t, u),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("lb-echo: cannot bind port {port}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let n = Arc::clone(&name);
        handles.push(thread::spawn(move || serve_tcp(n, tcp)));
        let n = Arc::clone(&name);
        handles.push(thread::spawn(move || serve_udp(n, udp)));
    }
    // Everything is bound: the testbed waits for this line before using the pod.
    println!("listening");
    let _ = std::io::stdout().flush();
    for h in handles {
        let _ = h.join();
    }
    ExitCode::SUCCESS
}
