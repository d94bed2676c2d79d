//! lb-load: continuous TCP load on a Service VIP, run in a client pod's namespace and
//! the test cgroup while a test restarts the agent or rewrites endpoints.
//!
//! - `--workers` threads open short connections back to back (connect, read the
//!   backend's greeting line, close), pausing `--pause-ms` between two;
//! - `--long-lived` connections stay open for the whole run and exchange a line every
//!   `--interval-ms` (lb-echo answers `<name> <line>`); a reset, an EOF or a wrong
//!   answer marks the connection broken.
//!
//! Output: JSON lines (`lb_tests::load::LoadLine`): `ready`, `progress` every
//! `--progress-ms`, and a final `report`. Stops on a `stop` line or EOF on stdin, or
//! after `--max-duration-ms`. Failures are data: counted by errno name, never fatal.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use lb_tests::load::{
    FailureSample, LoadLine, LoadReport, LongLivedHello, LongLivedReport, Progress,
};
use lb_tests::util::io_error_name;

/// A connect still pending after this counts as ETIMEDOUT.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait for a greeting or an answer; a miss counts as EAGAIN.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_SAMPLES: usize = 10;

#[derive(Parser)]
#[command(about = "Continuous TCP load on a VIP; JSON lines on stdout")]
struct Cli {
    #[arg(long)]
    to: SocketAddrV4,
    #[arg(long, default_value_t = 10)]
    long_lived: u32,
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
    #[arg(long, default_value_t = 2)]
    workers: u32,
    #[arg(long, default_value_t = 3)]
    pause_ms: u64,
    #[arg(long, default_value_t = 100)]
    progress_ms: u64,
    #[arg(long, default_value_t = 120_000)]
    max_duration_ms: u64,
}

/// Counters shared by the workers.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    attempts: AtomicU64,
    successes: AtomicU64,
    failed: AtomicU64,
    broken: AtomicU64,
    details: Mutex<Details>,
}

#[derive(Default)]
struct Details {
    failures: BTreeMap<String, u64>,
    samples: Vec<FailureSample>,
    backends: BTreeMap<String, u64>,
    max_connect_ms: f64,
}

impl Shared {
    fn fail(&self, started: Instant, op: &str, e: &io::Error) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let name = io_error_name(e);
        let mut d = self.details.lock().unwrap();
        if d.samples.len() < MAX_SAMPLES {
            d.samples.push(FailureSample {
                at_ms: ms(started.elapsed()),
                op: op.into(),
                error: format!("{name} ({e})"),
            });
        }
        *d.failures.entry(name).or_default() += 1;
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn read_line(reader: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(line.trim_end().to_string())
}

fn connect(to: SocketAddrV4) -> io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&SocketAddr::V4(to), CONNECT_TIMEOUT)?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    Ok(stream)
}

/// One short connection: connect, greeting, close.
fn short_attempt(shared: &Shared, started: Instant, to: SocketAddrV4) {
    shared.attempts.fetch_add(1, Ordering::Relaxed);
    let t0 = Instant::now();
    let stream = connect(to);
    let connect_ms = t0.elapsed().as_secs_f64() * 1000.0;
    {
        let mut d = shared.details.lock().unwrap();
        d.max_connect_ms = d.max_connect_ms.max(connect_ms);
    }
    let stream = match stream {
        Ok(s) => s,
        Err(e) => return shared.fail(started, "connect", &e),
    };
    match read_line(&mut BufReader::new(&stream)) {
        Ok(name) if !name.is_empty() => {
            shared.successes.fetch_add(1, Ordering::Relaxed);
            *shared
                .details
                .lock()
                .unwrap()
                .backends
                .entry(name)
                .or_default() += 1;
        }
        Ok(_) => shared.fail(
            started,
            "greeting",
            &io::Error::new(io::ErrorKind::InvalidData, "empty greeting"),
        ),
        Err(e) => shared.fail(started, "greeting", &e),
    }
}

fn worker(shared: Arc<Shared>, started: Instant, to: SocketAddrV4, pause: Duration) {
    // Bounded by the stop flag, which main sets at the latest at --max-duration-ms.
    while !shared.stopped() {
        short_attempt(&shared, started, to);
        thread::sleep(pause);
    }
}

/// A long-lived connection opened, or the error that prevented it.
struct Opened {
    hello: LongLivedHello,
    conn: Option<(TcpStream, BufReader<TcpStream>)>,
    error: Option<String>,
}

fn open_long_lived(to: SocketAddrV4) -> Opened {
    let opened = (|| -> io::Result<_> {
        let stream = connect(to)?;
        let local = stream.local_addr()?.to_string();
        let mut reader = BufReader::new(stream.try_clone()?);
        let backend = read_line(&mut reader)?;
        Ok((backend, local, stream, reader))
    })();
    match opened {
        Ok((backend, local, stream, reader)) => Opened {
            hello: LongLivedHello { backend, local },
            conn: Some((stream, reader)),
            error: None,
        },
        Err(e) => Opened {
            hello: LongLivedHello {
                backend: String::new(),
                local: String::new(),
            },
            conn: None,
            error: Some(format!("open: {}", io_error_name(&e))),
        },
    }
}

/// Exchange a line every `interval` until stopped or broken.
fn long_lived(
    shared: Arc<Shared>,
    started: Instant,
    opened: Opened,
    interval: Duration,
) -> LongLivedReport {
    let mut report = LongLivedReport {
        backend: opened.hello.backend.clone(),
        local: opened.hello.local.clone(),
        broken: opened.error,
        ..LongLivedReport::default()
    };
    let Some((mut stream, mut reader)) = opened.conn else {
        report.broken_at_ms = Some(ms(started.elapsed()));
        shared.broken.fetch_add(1, Ordering::Relaxed);
        return report;
    };
    let mut seq: u64 = 0;
    while !shared.stopped() {
        seq += 1;
        let result = stream
            .write_all(format!("{seq}\n").as_bytes())
            .and_then(|()| read_line(&mut reader));
        let why = match result {
            Ok(answer) if answer == format!("{} {seq}", report.backend) => None,
            Ok(answer) => Some(format!("mismatch: sent {seq}, got {answer:?}")),
            Err(e) => Some(io_error_name(&e)),
        };
        if let Some(why) = why {
            report.broken = Some(why);
            report.broken_at_ms = Some(ms(started.elapsed()));
            shared.broken.fetch_add(1, Ordering::Relaxed);
            return report;
        }
        report.exchanges += 1;
        thread::sleep(interval);
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
    report
}

fn print(line: &LoadLine) {
    let text = serde_json::to_string(line).expect("serializable");
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

fn progress(shared: &Shared, started: Instant) -> Progress {
    Progress {
        elapsed_ms: ms(started.elapsed()),
        attempts: shared.attempts.load(Ordering::Relaxed),
        successes: shared.successes.load(Ordering::Relaxed),
        failures: shared.failed.load(Ordering::Relaxed),
        broken: shared.broken.load(Ordering::Relaxed),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let shared = Arc::new(Shared::default());
    let started = Instant::now();

    // Stop on a `stop` line or EOF (or a read error) on stdin.
    {
        let shared = Arc::clone(&shared);
        thread::spawn(move || {
            for line in io::stdin().lock().lines() {
                match line {
                    Ok(l) if l.trim() == "stop" => break,
                    Ok(_) => continue,
                    Err(_) => break,
                }
            }
            shared.stop.store(true, Ordering::Relaxed);
        });
    }

    let opened: Vec<Opened> = (0..cli.long_lived)
        .map(|_| open_long_lived(cli.to))
        .collect();
    print(&LoadLine::Ready {
        long_lived: opened.iter().map(|o| o.hello.clone()).collect(),
    });
    let interval = Duration::from_millis(cli.interval_ms);
    let long_threads: Vec<_> = opened
        .into_iter()
        .map(|o| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || long_lived(shared, started, o, interval))
        })
        .collect();
    let pause = Duration::from_millis(cli.pause_ms);
    let workers: Vec<_> = (0..cli.workers)
        .map(|_| {
            let shared = Arc::clone(&shared);
            thread::spawn(move || worker(shared, started, cli.to, pause))
        })
        .collect();

    let max = Duration::from_millis(cli.max_duration_ms);
    let tick = Duration::from_millis(cli.progress_ms.max(10));
    // Bounded: at most max / tick rounds.
    while !shared.stopped() && started.elapsed() < max {
        thread::sleep(tick);
        print(&LoadLine::Progress(progress(&shared, started)));
    }
    shared.stop.store(true, Ordering::Relaxed);

    for w in workers {
        let _ = w.join();
    }
    let long_lived: Vec<LongLivedReport> = long_threads
        .into_iter()
        .map(|t| t.join().unwrap_or_default())
        .collect();
    let d = shared.details.lock().unwrap();
    let report = LoadReport {
        elapsed_ms: ms(started.elapsed()),
        attempts: shared.attempts.load(Ordering::Relaxed),
        successes: shared.successes.load(Ordering::Relaxed),
        failures: d.failures.clone(),
        failure_samples: d.samples.clone(),
        backends: d.backends.clone(),
        max_connect_ms: d.max_connect_ms,
        long_lived,
    };
    print(&LoadLine::Report(report));
    ExitCode::SUCCESS
}
