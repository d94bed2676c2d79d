//! The `dsr` row: a NodePort to a backend on another node, entered through a node
//! in `--lb-mode dsr` (node3) against one in `--lb-mode snat` (node1), in the bed of
//! [`crate::entry`]. The backend's node (node2) runs SNAT mode; it takes DSR
//! packets whatever its own mode.
//!
//! Measured per repetition:
//! - **latency**: one `paired-lat` client run, connections (connect, request,
//!   response, close) to the two entry nodes interleaved one by one, p50 and p99
//!   of each;
//! - **the entry node's packets per connection**: a `lat` run of
//!   [`COUNTED`] connections through each entry node in turn (the order swapped
//!   every repetition), its devices' received + sent packets over the connections
//!   made (warm-up included). With DSR every frame the entry node receives must be
//!   one the client sent (no reply crossed it); with SNAT it must carry the replies
//!   too (the control of that count);
//! - **CPU per connection of the whole path**: one `paired-cpu` run (see
//!   `crate::cpu`). Client, both nodes' datapaths and the server all run in
//!   softirq or task context on the one CPU the client and servers are pinned to,
//!   so this is the path's cost, entry node and backend's node together, not the
//!   entry node's alone: DSR moves the replies' translation from the entry node to
//!   the backend's node and removes their two extra hops.
//!
//! Counters checked over the row: the DSR entry node sent a SYN with the frontend
//! per DSR connection (`dsr_encapsulated`), the backend's node took it off
//! (`dsr_decapsulated`) and rewrote the replies (`dsr_reply_rewritten`); the SNAT
//! entry node did nothing DSR; neither entry node dropped a new flow's packet for
//! want of a conntrack entry or SNAT port.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::cpu::CpuCost;
use crate::entry::{
    ensure_none, ensure_not_starved, packets, sum, EntryBed, BACKEND, CONTROL, MEASURED,
};
use crate::run::{paired_cpu_args, Config, Samples, Stat};

/// Connections of each packet-counting run (after the client's 200 warm-up ones).
const COUNTED: u64 = 500;
/// Connections the client's `lat` mode makes before it measures.
const WARM_UP: u64 = 200;
/// Frames an entry node may receive beyond the client's over a counted run:
/// neighbour discovery the switch floods, nothing more.
const SLACK: u64 = 20;
/// The dispatch measured (the default).
const DISPATCH: &str = "opt";

/// The `dsr` row, as stored in results.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DsrResult {
    /// `--dsr-dispatch` of the DSR entry node.
    pub dispatch: String,
    /// Per repetition, from the paired latency runs: p50 and p99 of connect,
    /// request, response and close, µs, through each entry node.
    pub dsr_p50_us: Option<Stat>,
    pub snat_p50_us: Option<Stat>,
    pub dsr_p99_us: Option<Stat>,
    pub snat_p99_us: Option<Stat>,
    /// Per repetition: DSR / SNAT.
    pub p50_ratio: Option<Stat>,
    pub p99_ratio: Option<Stat>,
    /// Per repetition: packets received + sent on the entry node's devices per
    /// connection.
    pub dsr_entry_packets: Option<Stat>,
    pub snat_entry_packets: Option<Stat>,
    /// Per repetition: DSR / SNAT.
    pub entry_packets_ratio: Option<Stat>,
    /// Connections each packet count is over (warm-up included).
    pub counted_connections: u64,
    /// CPU per connection of the whole path (client, entry node, backend's node,
    /// server, on one CPU), DSR as the target, SNAT as the baseline.
    pub path_cpu: Option<CpuCost>,
    /// Failed connections over the row.
    pub errors: u64,
}

/// What one counted run saw: the entry node's and the client's packets.
struct Counted {
    entry_rx: u64,
    entry_tx: u64,
    client_rx: u64,
    client_tx: u64,
    connections: u64,
}

impl Counted {
    fn per_connection(&self) -> f64 {
        (self.entry_rx + self.entry_tx) as f64 / self.connections as f64
    }
}

/// Connections per mode over the row, for the counter checks.
#[derive(Default)]
struct Connections {
    dsr: u64,
    snat: u64,
}

pub fn run(exe: &Path, lb: &Path, cfg: &Config) -> Result<DsrResult> {
    let bed = EntryBed::build(exe, lb, cfg, false, |node| {
        let mode = if node == MEASURED { "dsr" } else { "snat" };
        ["--lb-mode", mode, "--dsr-dispatch", DISPATCH]
            .map(String::from)
            .to_vec()
    })?;
    let (dsr, snat) = (EntryBed::rr(MEASURED), EntryBed::rr(CONTROL));
    let before = bed.stats()?;
    let mut seen = Connections::default();
    let (mut p50, mut p99, mut packets) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut cpu_runs, mut errors) = (Vec::new(), 0);
    for rep in 0..cfg.reps {
        lb_tests::interrupt::check()?;
        let order = if rep % 2 == 0 {
            [CONTROL, MEASURED]
        } else {
            [MEASURED, CONTROL]
        };
        for node in order {
            let c = count(&bed, node).with_context(|| bed.all_stats())?;
            if node == MEASURED {
                seen.dsr += c.connections;
                packets.target.push(c.per_connection());
            } else {
                seen.snat += c.connections;
                packets.baseline.push(c.per_connection());
            }
        }
        let lat = bed.client(
            dsr,
            &[
                "--mode".into(),
                "paired-lat".into(),
                "--count".into(),
                cfg.lat_count.to_string(),
                "--baseline".into(),
                snat.to_string(),
            ],
        )?;
        errors += lat.errors;
        seen.dsr += lat.count;
        let both = |t: Option<f64>, b: Option<f64>| {
            t.zip(b)
                .context("the paired run reported no latency for one side")
        };
        let (t, b) = both(lat.p50_us, lat.baseline_p50_us)?;
        p50.push(t, b);
        let (t, b) = both(lat.p99_us, lat.baseline_p99_us)?;
        p99.push(t, b);
        let cpu = bed.client(dsr, &paired_cpu_args(cfg, snat, &bed.server_pids(), None))?;
        errors += cpu.errors;
        let cpu = cpu
            .cpu
            .context("the paired-cpu run reported no CPU figures")?;
        seen.dsr += cpu.target.connections;
        seen.snat += cpu.baseline.connections;
        let now = CpuCost::of(std::slice::from_ref(&cpu));
        let wall = (
            cpu.target.wall_ns as f64 / 1e9,
            cpu.baseline.wall_ns as f64 / 1e9,
        );
        cpu_runs.push(cpu);
        println!(
            "  dsr        rep {rep}: p50 {:.1} vs {:.1} us ({:.3}x), p99 {:.1} vs {:.1} us ({:.3}x), entry node {:.1} vs {:.1} packets/conn ({:.3}x){}",
            p50.target.last().copied().unwrap_or_default(),
            p50.baseline.last().copied().unwrap_or_default(),
            p50.ratios.last().copied().unwrap_or_default(),
            p99.target.last().copied().unwrap_or_default(),
            p99.baseline.last().copied().unwrap_or_default(),
            p99.ratios.last().copied().unwrap_or_default(),
            packets.target.last().copied().unwrap_or_default(),
            packets.baseline.last().copied().unwrap_or_default(),
            packets.ratio_last(),
            now.map(|c| format!(
                ", path CPU {:.1} vs {:.1} us/conn ({:.3}x, ticks {:.3}x; blocks took {:.1} vs {:.1} s)",
                c.kernel_us, c.baseline_kernel_us, c.ratio, c.ticks_ratio, wall.0, wall.1
            ))
            .unwrap_or_default()
        );
    }
    let grown = bed.stats_since(&before)?;
    if std::env::var_os("LB_BENCH_ENTRY_DEBUG").is_some() {
        for (node, g) in grown.iter().enumerate() {
            eprintln!("    node{} counters grown: {g:?}", node + 1);
        }
    }
    ensure_path(&grown, &seen).with_context(|| bed.all_stats())?;
    packets.ratios = packets
        .target
        .iter()
        .zip(&packets.baseline)
        .map(|(d, s)| d / s)
        .collect();
    Ok(DsrResult {
        dispatch: DISPATCH.into(),
        dsr_p50_us: Stat::of(p50.target),
        snat_p50_us: Stat::of(p50.baseline),
        dsr_p99_us: Stat::of(p99.target),
        snat_p99_us: Stat::of(p99.baseline),
        p50_ratio: Stat::of(p50.ratios),
        p99_ratio: Stat::of(p99.ratios),
        dsr_entry_packets: Stat::of(packets.target),
        snat_entry_packets: Stat::of(packets.baseline),
        entry_packets_ratio: Stat::of(packets.ratios),
        counted_connections: COUNTED + WARM_UP,
        path_cpu: CpuCost::of(&cpu_runs),
        errors,
    })
}

/// [`COUNTED`] connections through entry node `node` alone, with its devices'
/// and the client's packets counted around them; checks that DSR replies passed
/// the entry node by and SNAT ones did not.
fn count(bed: &EntryBed, node: usize) -> Result<Counted> {
    let (entry_rx0, entry_tx0) = packets(bed.node_ns(node))?;
    let (client_rx0, client_tx0) = packets(bed.client_ns())?;
    let r = bed.client(
        EntryBed::rr(node),
        &[
            "--mode".into(),
            "lat".into(),
            "--count".into(),
            COUNTED.to_string(),
        ],
    )?;
    let (entry_rx, entry_tx) = packets(bed.node_ns(node))?;
    let (client_rx, client_tx) = packets(bed.client_ns())?;
    ensure!(
        r.errors == 0 && r.count == COUNTED,
        "{} of {COUNTED} connections through node{} completed",
        r.count,
        node + 1
    );
    let c = Counted {
        entry_rx: entry_rx - entry_rx0,
        entry_tx: entry_tx - entry_tx0,
        client_rx: client_rx - client_rx0,
        client_tx: client_tx - client_tx0,
        connections: COUNTED + WARM_UP,
    };
    if node == MEASURED {
        ensure!(
            c.entry_rx <= c.client_tx + SLACK,
            "the DSR entry node received {} frames, the client sent {}: replies crossed it",
            c.entry_rx,
            c.client_tx
        );
    } else {
        ensure!(
            c.entry_rx >= c.client_tx + c.client_rx / 2,
            "the SNAT entry node received {} frames, the client sent {} and received {}: \
             the replies did not come back through it",
            c.entry_rx,
            c.client_tx,
            c.client_rx
        );
    }
    Ok(c)
}

/// The counters say each entry node carried its connections the way it is
/// measured for.
fn ensure_path(grown: &[BTreeMap<String, u64>], seen: &Connections) -> Result<()> {
    let check = |node: usize, names: &[&str], at_least: u64| -> Result<()> {
        let n = sum(&grown[node], names);
        ensure!(
            n >= at_least,
            "node{}: {names:?} grew by {n}, expected at least {at_least} (counters grown: {:?})",
            node + 1,
            grown[node]
        );
        Ok(())
    };
    // One SYN with the frontend per DSR connection, at least.
    check(MEASURED, &["dsr_encapsulated"], seen.dsr)?;
    check(BACKEND, &["dsr_decapsulated"], seen.dsr)?;
    // At least the SYN-ACK and the response of each.
    check(BACKEND, &["dsr_reply_rewritten"], 2 * seen.dsr)?;
    ensure_none(&grown[CONTROL], "dsr_", "node1 (SNAT)")?;
    for node in [CONTROL, MEASURED] {
        ensure_not_starved(&grown[node], node)?;
    }
    check(CONTROL, &["tc_new_flow", "tc_ct_hit"], seen.snat)?;
    Ok(())
}
