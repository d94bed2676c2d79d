//! The benchmark's own server and client, run inside the bench's namespaces as
//! `lb-bench serve` / `lb-bench client` (compiled, single-threaded per connection:
//! the client's own cost must stay small next to the datapath's).
//!
//! Request/response protocol (port `RR_PORT`): the client connects, writes a
//! `REQ_LEN`-byte request, reads the `RESP_LEN`-byte response (the server's name,
//! space-padded), and closes. The server closes after answering, so TIME_WAIT stays
//! on the server side and the client never runs out of ports.
//!
//! Bulk (port `BULK_PORT`): the client writes for a fixed time, shuts down its side;
//! the server counts the bytes and answers with the count (8 bytes, big endian).
//! The client writes [`pattern`] over and over; on `BULK_VERIFY_PORT` the server
//! also compares every byte with it and counts only the bytes before the first
//! that differs, so a transfer whose data arrived changed or out of place fails
//! the client's count check. (The comparison costs the server some CPU: only the
//! rows that claim verified data use that port, and both sides of their pairs.)

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub const RR_PORT: u16 = 9000;
pub const BULK_PORT: u16 = 9001;
pub const BULK_VERIFY_PORT: u16 = 9002;
/// Length of the bulk client's write, and period of the pattern it writes.
const PATTERN_LEN: usize = 128 * 1024;
pub const REQ_LEN: usize = 64;
pub const RESP_LEN: usize = 64;
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every network namespace, so the
/// orchestrator and a client can compare timestamps.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `lb-bench serve --name N`: request/response and bulk servers, until killed.
pub fn serve(name: &str) -> Result<()> {
    // `::` with the default bindv6only=0: one socket per port for both families.
    let rr = TcpListener::bind(("::", RR_PORT)).context("bind rr port")?;
    let bulk = TcpListener::bind(("::", BULK_PORT)).context("bind bulk port")?;
    let verify =
        TcpListener::bind(("::", BULK_VERIFY_PORT)).context("bind the verified bulk port")?;
    let mut resp = name.as_bytes().to_vec();
    resp.resize(RESP_LEN, b' ');
    for (listener, verified) in [(bulk, false), (verify, true)] {
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let _ = serve_bulk(stream, verified);
                });
            }
        });
    }
    println!("listening");
    let mut req = [0u8; REQ_LEN];
    // Sequential on purpose: the client is sequential too.
    for stream in rr.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
        if stream.read_exact(&mut req).is_ok() {
            let _ = stream.write_all(&resp);
        }
    }
    Ok(())
}

/// Counts a bulk stream's bytes (with `verified`, those before the first byte
/// that is not [`pattern`]'s) and answers with the count.
fn serve_bulk(mut stream: TcpStream, verified: bool) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut buf = vec![0u8; 256 * 1024];
    let expected = pattern();
    let mut total: u64 = 0;
    let mut intact = true;
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        if verified && intact {
            let good = matching_prefix(&expected, total, &buf[..n]);
            intact = good == n;
            total += good as u64;
        } else if !verified {
            total += n as u64;
        }
    }
    stream.write_all(&total.to_be_bytes())
}

/// What the bulk client writes: `PATTERN_LEN` bytes of a linear congruential
/// sequence, so a segment delivered in the wrong place differs from what the
/// server expects there.
pub fn pattern() -> Vec<u8> {
    let mut x: u32 = 0x6c62_2026;
    (0..PATTERN_LEN)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (x >> 16) as u8
        })
        .collect()
}

/// How many leading bytes of `got`, the stream's bytes from offset `at` on,
/// equal the repeated `pattern`.
fn matching_prefix(pattern: &[u8], at: u64, got: &[u8]) -> usize {
    let mut done = 0;
    while done < got.len() {
        let offset = ((at + done as u64) % pattern.len() as u64) as usize;
        let n = (pattern.len() - offset).min(got.len() - done);
        let (want, have) = (&pattern[offset..offset + n], &got[done..done + n]);
        if want != have {
            return done + want.iter().zip(have).take_while(|(a, b)| a == b).count();
        }
        done += n;
    }
    done
}

/// What the client measured (one JSON line on stdout).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub mode: String,
    /// Latency mode: per-connection connect+request+close time, microseconds.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub mean_us: Option<f64>,
    pub count: u64,
    pub errors: u64,
    /// Rate mode: cycles that took over 200 ms (a lost SYN, a retransmission).
    #[serde(default)]
    pub stalls: u64,
    /// Rate mode: completed connections per second.
    pub conn_per_sec: Option<f64>,
    /// Bulk mode: MB/s (10^6 bytes).
    pub mb_per_sec: Option<f64>,
    /// Watch mode: CLOCK_MONOTONIC (ns) of the first answer from `--until`.
    pub seen_at_ns: Option<u64>,
    /// Paired modes: the same figures for `--baseline`, measured interleaved with
    /// the target's so that both see the same machine.
    #[serde(default)]
    pub baseline_p50_us: Option<f64>,
    #[serde(default)]
    pub baseline_p99_us: Option<f64>,
    #[serde(default)]
    pub baseline_mb_per_sec: Option<f64>,
    /// Paired bulk: median over rounds of target MB/s / baseline MB/s.
    #[serde(default)]
    pub bulk_ratio: Option<f64>,
    /// Paired CPU: what each side cost (see [`PairedCpu`]).
    #[serde(default)]
    pub cpu: Option<PairedCpu>,
    /// Names of the backends that answered (first few).
    pub backends: Vec<String>,
    /// Paced mode: failed connections whose connect was refused (ECONNREFUSED).
    #[serde(default)]
    pub refused: u64,
    /// Paced mode: when each failed connection began, ms after the first began.
    #[serde(default)]
    pub failed_at_ms: Vec<f64>,
}

/// One side of a paired CPU run: the sums over its blocks.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CpuSide {
    /// Connections that completed.
    pub connections: u64,
    /// Exact CPU time of client, servers and ksoftirqd (user time included), ns.
    pub tasks_ns: u64,
    /// Of which ksoftirqd (softirq work deferred past its budget).
    pub ksoftirqd_ns: u64,
    /// The pinned CPU's /proc/stat counters, USER_HZ ticks.
    pub ticks: crate::cpu::Ticks,
    /// Wall time of the blocks, ns.
    pub wall_ns: u64,
}

/// What a `paired-cpu` run measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PairedCpu {
    pub target: CpuSide,
    pub baseline: CpuSide,
    /// User time of client and servers over the whole run (both sides), ns.
    pub user_ns: u64,
    /// CPU time of the agent (all threads, whichever CPU) over the whole run, ns.
    pub agent_ns: Option<u64>,
    /// USER_HZ, the unit of `ticks`.
    pub user_hz: u64,
}

/// One connection: connect, request, response, close. Returns the backend name.
fn one_rr(to: SocketAddr, req: &[u8; REQ_LEN], resp: &mut [u8; RESP_LEN]) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.write_all(req)?;
    s.read_exact(resp)?;
    Ok(())
}

/// [`one_rr`], closed with a reset: the watch loop opens thousands of connections a
/// second to one backend address, and with an orderly close each would sit in
/// TIME_WAIT for a minute. Over a run of 200 changes they took up the client's
/// ephemeral ports, connect() began to fail or search, and the change latency it
/// measured grew from 1.9 ms (60 changes) to 9 ms (200), whatever the agent did.
fn one_rr_reset(to: SocketAddr, req: &[u8; REQ_LEN], resp: &mut [u8; RESP_LEN]) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO))?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.write_all(req)?;
    s.read_exact(resp)?;
    Ok(())
}

/// Whether a connection failed because its connect was refused (a RST to the SYN).
fn refused(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::raw_os_error)
        == Some(libc::ECONNREFUSED)
}

fn name_of(resp: &[u8]) -> String {
    String::from_utf8_lossy(resp).trim().to_string()
}

pub struct ClientArgs {
    pub to: SocketAddr,
    /// Paired modes: the address measured alternately with `to`.
    pub baseline: Option<SocketAddr>,
    pub mode: String,
    pub count: u64,
    pub secs: f64,
    pub cpu: Option<usize>,
    pub until: Option<String>,
    /// paired-cpu: rounds (one block of `count` connections to each address).
    pub rounds: u64,
    /// paired-cpu: the servers' pids (their CPU time is part of a connection's).
    pub server_pids: Vec<u32>,
    /// paired-cpu: the agent's pid (its CPU time is reported beside).
    pub agent_pid: Option<u32>,
}

/// `lb-bench client`: measure and print one JSON report.
pub fn client(a: &ClientArgs) -> Result<ClientReport> {
    if let Some(cpu) = a.cpu {
        lb_tests::util::pin_to_cpu(cpu)?;
    }
    let req = [b'x'; REQ_LEN];
    let mut resp = [0u8; RESP_LEN];
    let mut report = ClientReport {
        mode: a.mode.clone(),
        ..Default::default()
    };
    let note = |report: &mut ClientReport, resp: &[u8]| {
        let n = name_of(resp);
        if report.backends.len() < 4 && !report.backends.contains(&n) {
            report.backends.push(n);
        }
    };
    match a.mode.as_str() {
        "lat" => {
            warm_up(a.to, &req, &mut resp)?;
            let mut samples = Vec::with_capacity(a.count as usize);
            for _ in 0..a.count {
                let t = Instant::now();
                match one_rr(a.to, &req, &mut resp) {
                    Ok(()) => {
                        samples.push(t.elapsed().as_nanos() as f64 / 1000.0);
                        note(&mut report, &resp);
                    }
                    Err(_) => report.errors += 1,
                }
            }
            if samples.is_empty() {
                bail!("no connection to {} succeeded", a.to);
            }
            samples.sort_by(f64::total_cmp);
            report.count = samples.len() as u64;
            report.p50_us = Some(percentile(&samples, 0.50));
            report.p99_us = Some(percentile(&samples, 0.99));
            report.mean_us = Some(samples.iter().sum::<f64>() / samples.len() as f64);
        }
        "rate" => {
            warm_up(a.to, &req, &mut resp)?;
            let dur = Duration::from_secs_f64(a.secs);
            let start = Instant::now();
            while start.elapsed() < dur {
                let t = Instant::now();
                match one_rr(a.to, &req, &mut resp) {
                    Ok(()) => report.count += 1,
                    Err(_) => report.errors += 1,
                }
                // A lost SYN costs a 1 s retransmission: count such cycles.
                if t.elapsed() > Duration::from_millis(200) {
                    report.stalls += 1;
                }
            }
            note(&mut report, &resp);
            report.conn_per_sec = Some(report.count as f64 / start.elapsed().as_secs_f64());
        }
        "bulk" => {
            report.count = 1;
            report.mb_per_sec = Some(bulk_window(a.to, a.secs)?);
        }
        "paired-lat" => {
            // One connection to each in turn, the order swapped every pair: drift
            // and interference hit both series alike.
            let baseline = a.baseline.context("paired-lat needs --baseline")?;
            warm_up(a.to, &req, &mut resp)?;
            warm_up(baseline, &req, &mut resp)?;
            let mut target = Vec::with_capacity(a.count as usize);
            let mut base = Vec::with_capacity(a.count as usize);
            for i in 0..a.count {
                let order = if i % 2 == 0 {
                    [(a.to, true), (baseline, false)]
                } else {
                    [(baseline, false), (a.to, true)]
                };
                for (to, is_target) in order {
                    let t = Instant::now();
                    match one_rr(to, &req, &mut resp) {
                        Ok(()) => {
                            let us = t.elapsed().as_nanos() as f64 / 1000.0;
                            if is_target {
                                target.push(us);
                                note(&mut report, &resp);
                            } else {
                                base.push(us);
                            }
                        }
                        Err(_) => report.errors += 1,
                    }
                }
            }
            if target.is_empty() || base.is_empty() {
                bail!("no connection to {} or {baseline} succeeded", a.to);
            }
            target.sort_by(f64::total_cmp);
            base.sort_by(f64::total_cmp);
            report.count = target.len() as u64;
            report.p50_us = Some(percentile(&target, 0.50));
            report.p99_us = Some(percentile(&target, 0.99));
            report.baseline_p50_us = Some(percentile(&base, 0.50));
            report.baseline_p99_us = Some(percentile(&base, 0.99));
        }
        "paired-bulk" => {
            // Short windows to each in turn, order swapped every round; the ratio
            // is taken per round, where both saw nearly the same machine.
            let baseline = a.baseline.context("paired-bulk needs --baseline")?;
            let window = a.secs / PAIRED_BULK_ROUNDS as f64;
            let (mut target, mut base, mut ratios) = (vec![], vec![], vec![]);
            for round in 0..PAIRED_BULK_ROUNDS {
                let (t, b) = if round % 2 == 0 {
                    let t = bulk_window(a.to, window)?;
                    (t, bulk_window(baseline, window)?)
                } else {
                    let b = bulk_window(baseline, window)?;
                    (bulk_window(a.to, window)?, b)
                };
                target.push(t);
                base.push(b);
                ratios.push(t / b);
            }
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            ratios.sort_by(f64::total_cmp);
            report.count = PAIRED_BULK_ROUNDS as u64;
            report.mb_per_sec = Some(mean(&target));
            report.baseline_mb_per_sec = Some(mean(&base));
            report.bulk_ratio = Some(percentile(&ratios, 0.50));
        }
        "paired-cpu" => {
            let baseline = a.baseline.context("paired-cpu needs --baseline")?;
            let cpu = a
                .cpu
                .context("paired-cpu needs --cpu (the CPU whose work it counts)")?;
            warm_up(a.to, &req, &mut resp)?;
            warm_up(baseline, &req, &mut resp)?;
            report.cpu = Some(paired_cpu(a, baseline, cpu, &mut report.errors)?);
            report.count = a.count * a.rounds;
            one_rr(a.to, &req, &mut resp)?;
            note(&mut report, &resp);
        }
        "paced" => {
            // `count` connections over `secs`, each due at its own slot from the
            // start (a slow one does not shift the rest), and no warm-up: every
            // connection counts, the first included.
            let count = a.count.max(1);
            let start = Instant::now();
            for i in 0..count {
                let due = start + Duration::from_secs_f64(a.secs * i as f64 / count as f64);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let began = start.elapsed();
                match one_rr(a.to, &req, &mut resp) {
                    Ok(()) => {
                        report.count += 1;
                        note(&mut report, &resp);
                    }
                    Err(e) => {
                        report.errors += 1;
                        if refused(&e) {
                            report.refused += 1;
                        }
                        report.failed_at_ms.push(began.as_secs_f64() * 1000.0);
                    }
                }
            }
        }
        "watch" => {
            let until = a.until.clone().context("watch needs --until")?;
            println!("watching");
            let _ = std::io::stdout().flush();
            let deadline = Instant::now() + Duration::from_secs_f64(a.secs);
            while Instant::now() < deadline {
                match one_rr_reset(a.to, &req, &mut resp) {
                    Ok(()) => {
                        report.count += 1;
                        if name_of(&resp) == until {
                            report.seen_at_ns = Some(monotonic_ns());
                            break;
                        }
                    }
                    Err(_) => {
                        report.errors += 1;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            }
            note(&mut report, &resp);
        }
        other => bail!("unknown client mode {other}"),
    }
    Ok(report)
}

/// Blocks of `a.count` connections, alternately to `a.to` and to `baseline` (the
/// order swapped every round, so drift and a slow moment hit both sides alike), each
/// between two reads of the CPU's counters and the tasks' clocks (crate::cpu).
fn paired_cpu(
    a: &ClientArgs,
    baseline: SocketAddr,
    cpu: usize,
    errors: &mut u64,
) -> Result<PairedCpu> {
    let probe = crate::cpu::Probe::new(cpu, &a.server_pids)?;
    let agent = |pid: Option<u32>| pid.map(crate::cpu::process_ns).transpose();
    let (agent0, user0) = (agent(a.agent_pid)?, probe.user_ns()?);
    let req = [b'x'; REQ_LEN];
    let mut resp = [0u8; RESP_LEN];
    let mut out = PairedCpu {
        user_hz: crate::cpu::user_hz(),
        ..Default::default()
    };
    for round in 0..a.rounds {
        let order = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_target in order {
            let to = if is_target { a.to } else { baseline };
            let (t0, before) = (monotonic_ns(), probe.read()?);
            let mut done = 0;
            for _ in 0..a.count {
                match one_rr(to, &req, &mut resp) {
                    Ok(()) => done += 1,
                    Err(_) => *errors += 1,
                }
            }
            let after = probe.read()?;
            let side = if is_target {
                &mut out.target
            } else {
                &mut out.baseline
            };
            side.wall_ns += monotonic_ns() - t0;
            side.connections += done;
            side.tasks_ns += after.tasks_ns - before.tasks_ns;
            side.ksoftirqd_ns += after.ksoftirqd_ns - before.ksoftirqd_ns;
            side.ticks.add(&after.ticks.since(&before.ticks));
        }
    }
    out.user_ns = probe.user_ns()?.saturating_sub(user0);
    out.agent_ns = match (agent0, agent(a.agent_pid)?) {
        (Some(a0), Some(a1)) => Some(a1 - a0),
        _ => None,
    };
    if out.target.connections == 0 || out.baseline.connections == 0 {
        bail!("no connection to {} or {baseline} succeeded", a.to);
    }
    Ok(out)
}

/// Rounds of a paired bulk run (each one window to each address). With 8, the
/// median per-run ratio still spread ±9% at S=1; more, shorter windows over the same
/// time narrow the median (slow start costs both sides alike).
pub const PAIRED_BULK_ROUNDS: usize = 16;

/// One bulk connection sending for `secs`; MB/s (10^6 bytes) as the server counted.
fn bulk_window(to: SocketAddr, secs: f64) -> Result<f64> {
    let mut s = TcpStream::connect_timeout(&to, IO_TIMEOUT)?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let buf = pattern();
    let dur = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut sent: u64 = 0;
    while start.elapsed() < dur {
        s.write_all(&buf)?;
        sent += buf.len() as u64;
    }
    s.shutdown(Shutdown::Write)?;
    let mut count = [0u8; 8];
    s.read_exact(&mut count)?;
    let elapsed = start.elapsed().as_secs_f64();
    let got = u64::from_be_bytes(count);
    if got != sent {
        bail!("bulk to {to}: sent {sent} bytes, the server counted {got} (on the verified port: intact)");
    }
    Ok(sent as f64 / elapsed / 1e6)
}

/// 200 connections first (caches, ARP, conntrack); fails fast if the first ones fail.
fn warm_up(to: SocketAddr, req: &[u8; REQ_LEN], resp: &mut [u8; RESP_LEN]) -> Result<()> {
    for i in 0..200 {
        if let Err(e) = one_rr(to, req, resp) {
            if i < 3 {
                bail!("connection {i} to {to} failed: {e:#}");
            }
        }
    }
    Ok(())
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let idx = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[idx]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verified_stream_counts_up_to_the_first_wrong_byte_across_the_pattern_edge() {
        let p = pattern();
        assert_eq!(p.len(), PATTERN_LEN);
        // Not a constant: a shifted segment must not match.
        assert_ne!(p[..64], p[1..65]);
        // A read that wraps around the pattern's end.
        let at = PATTERN_LEN as u64 * 3 - 10;
        let mut got: Vec<u8> = p[PATTERN_LEN - 10..].to_vec();
        got.extend_from_slice(&p[..30]);
        assert_eq!(matching_prefix(&p, at, &got), 40);
        got[25] ^= 1;
        assert_eq!(matching_prefix(&p, at, &got), 25);
        // The right bytes at the wrong offset.
        assert_eq!(matching_prefix(&p, 1, &p[..100]), 0);
    }
}
