//! The `xdp-bulk` row: a bulk TCP transfer to a NodePort whose backend runs on
//! another node, entered through a node running `lb_xdp` in front of TC
//! (`--xdp native`, node3) against one running TC alone (`--xdp off`, node1), both
//! SNAT, in the bed of [`crate::entry`]. The target is "bulk TCP no worse than TC"
//! (issue 23).
//!
//! The network is made fit for XDP on veths (`ClusterBuilder::xdp_ready`) for both
//! entry nodes alike: the switch's ports run a pass program, and the client and
//! the server send complete checksums, so their segments are MSS-sized (no TSO) on
//! both paths; the figures are therefore lower than the TC rows' bulk figures,
//! whose client hands 64 KB GSO packets to the veth.
//!
//! Per repetition one `paired-bulk` client run: [`crate::netio::PAIRED_BULK_ROUNDS`]
//! windows to each entry node in turn, to the server's verified bulk port (every
//! byte compared with what the client wrote). The ratio is taken per round.
//!
//! Counters checked: on the XDP node, `lb_xdp` sent on (`xdp_tx`, `xdp_redirect`)
//! all but a hundredth of the frames its uplink received, both directions; on the
//! TC node no XDP counter grew and TC followed (`tc_ct_hit`) as many.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::entry::{ensure_none, ensure_not_starved, sum, EntryBed, CONTROL, MEASURED};
use crate::run::{Config, Stat};

/// Frames an uplink may receive that are not the transfer's (neighbour
/// discovery), beyond a hundredth.
const SLACK: u64 = 20;

/// The `xdp-bulk` row, as stored in results.json.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct XdpBulkResult {
    /// Per repetition: MB/s (10^6 bytes) through the XDP node, mean of its windows.
    pub xdp_mb_per_sec: Option<Stat>,
    /// The same through the TC node.
    pub tc_mb_per_sec: Option<Stat>,
    /// Per repetition: the median over rounds of XDP MB/s / TC MB/s.
    pub ratio: Option<Stat>,
    /// Of the frames the XDP node's uplink received, the share `lb_xdp` sent on.
    pub xdp_share: f64,
}

pub fn run(exe: &Path, lb: &Path, cfg: &Config) -> Result<XdpBulkResult> {
    let bed = EntryBed::build(exe, lb, cfg, true, |node| {
        let xdp = if node == MEASURED { "native" } else { "off" };
        vec!["--xdp".to_string(), xdp.to_string()]
    })?;
    bed.ensure_xdp(MEASURED, true)?;
    bed.ensure_xdp(CONTROL, false)?;
    let before = bed.stats()?;
    let uplink_before = [rx(&bed, CONTROL)?, rx(&bed, MEASURED)?];
    let (mut xdp, mut tc, mut ratios) = (vec![], vec![], vec![]);
    for rep in 0..cfg.reps {
        lb_tests::interrupt::check()?;
        let r = bed
            .client(
                EntryBed::bulk(MEASURED),
                &[
                    "--mode".into(),
                    "paired-bulk".into(),
                    "--secs".into(),
                    (2.0 * cfg.bulk_secs).to_string(),
                    "--baseline".into(),
                    EntryBed::bulk(CONTROL).to_string(),
                ],
            )
            .with_context(|| bed.all_stats())?;
        let (x, t, ratio) = match (r.mb_per_sec, r.baseline_mb_per_sec, r.bulk_ratio) {
            (Some(x), Some(t), Some(ratio)) => (x, t, ratio),
            _ => anyhow::bail!("the paired bulk run reported no figures: {r:?}"),
        };
        println!(
            "  xdp-bulk   rep {rep}: XDP {x:.0} MB/s, TC {t:.0} MB/s, XDP/TC {ratio:.3}x (median of {} rounds)",
            r.count
        );
        xdp.push(x);
        tc.push(t);
        ratios.push(ratio);
    }
    let received = [
        rx(&bed, CONTROL)? - uplink_before[0],
        rx(&bed, MEASURED)? - uplink_before[1],
    ];
    let grown = bed.stats_since(&before)?;
    let xdp_share = ensure_path(&grown, received).with_context(|| bed.all_stats())?;
    Ok(XdpBulkResult {
        xdp_mb_per_sec: Stat::of(xdp),
        tc_mb_per_sec: Stat::of(tc),
        ratio: Stat::of(ratios),
        xdp_share,
    })
}

/// Frames node `node`'s uplink received.
fn rx(bed: &EntryBed, node: usize) -> Result<u64> {
    crate::pps::link_json(bed.node_ns(node), "eth0", true)?["stats64"]["rx"]["packets"]
        .as_u64()
        .with_context(|| format!("no rx packet count for node{}'s eth0", node + 1))
}

/// Each entry node carried the transfer on the path it is measured for
/// (`received`: frames each uplink received, control first); the XDP node's share.
fn ensure_path(grown: &[BTreeMap<String, u64>], received: [u64; 2]) -> Result<f64> {
    let [tc_frames, xdp_frames] = received;
    ensure!(
        xdp_frames > 0 && tc_frames > 0,
        "an entry node received nothing"
    );
    let sent_on = sum(&grown[MEASURED], &["xdp_tx", "xdp_redirect"]);
    ensure!(
        sent_on + xdp_frames / 100 + SLACK >= xdp_frames,
        "node3's uplink received {xdp_frames} frames, lb_xdp sent on {sent_on}: the rest \
         went to TC (counters grown: {:?})",
        grown[MEASURED]
    );
    ensure_none(&grown[CONTROL], "xdp_", "node1 (TC)")?;
    for node in [CONTROL, MEASURED] {
        ensure_not_starved(&grown[node], node)?;
    }
    let followed = sum(&grown[CONTROL], &["tc_ct_hit", "tc_new_flow"]);
    ensure!(
        followed + tc_frames / 100 + SLACK >= tc_frames,
        "node1's uplink received {tc_frames} frames, TC followed {followed} (counters \
         grown: {:?})",
        grown[CONTROL]
    );
    Ok(sent_on as f64 / xdp_frames as f64)
}
