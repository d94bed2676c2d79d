//! The conntrack collector: a thread of its own deletes the entries of flows idle
//! past their timeout. It used to run on the agent's loop, where reading `LB_CT`
//! held every change behind it: on a kernel without preemption even an empty
//! 512k-entry map takes one syscall of about 6 ms to walk (measured here), every
//! few seconds. With `--masquerade bpf` it also expires egress masquerading's
//! translations (`LB_MASQ`) with their flows, by the same timeouts, and reports
//! that map's pressure.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use tracing::{debug, warn};

use crate::datapath::conntrack;
use crate::datapath::maps::{ConntrackMap, MapsError};
use crate::datapath::masquerade::MasqMaps;
use crate::datapath::pins::PinLayout;
use crate::ops::AgentStatus;
use lb_common::map_names;

/// Why the collector could not start.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("cannot start the conntrack collector thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// The running collector; it stops when this is dropped (with the agent).
pub(super) struct Collector {
    /// Never sent on: its drop wakes the thread to end.
    _stop: mpsc::Sender<()>,
}

impl Collector {
    /// Collects every `every`, with its own handles on the pinned maps; with
    /// `masquerade`, `LB_MASQ` too (its pressure goes to `status`).
    pub(super) fn spawn(
        pin: &PinLayout,
        timeouts: conntrack::Timeouts,
        every: Duration,
        masquerade: bool,
        status: Arc<AgentStatus>,
    ) -> Result<Self, CollectorError> {
        let mut map = ConntrackMap::open(pin)?;
        let mut masq = masquerade.then(|| MasqMaps::open(pin)).transpose()?;
        let (stop, stopped) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("lb-ct-gc".into())
            .spawn(move || {
                // Normal priority: expired flows must go as fast as they come.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    collect(&mut map, &timeouts);
                    if let Some(masq) = &mut masq {
                        collect_translations(masq, &timeouts, &status);
                    }
                }
            })
            .map_err(CollectorError::Thread)?;
        Ok(Collector { _stop: stop })
    }
}

fn collect(map: &mut ConntrackMap, timeouts: &conntrack::Timeouts) {
    match collect_idle_flows(map, timeouts) {
        Ok(0) => {}
        Ok(n) => debug!(entries = n, "conntrack entries expired"),
        Err(e) => warn!("conntrack garbage collection failed: {e}"),
    }
}

/// Deletes the entries of flows idle past their timeout. An entry is re-read just
/// before its deletion and kept if a packet touched it since the scan, so a flow
/// that came back to life at the last moment keeps its backend.
fn collect_idle_flows(
    map: &mut ConntrackMap,
    timeouts: &conntrack::Timeouts,
) -> Result<usize, MapsError> {
    let entries = map.entries()?;
    let idle = conntrack::expired(&entries, conntrack::monotonic_now_ns(), timeouts);
    drop(entries);
    let mut removed = 0;
    for (key, seen) in idle {
        let Some(current) = map.get(&key)? else {
            continue;
        };
        // Seen again since it was read: the flow is alive.
        if current.last_seen_ns != seen {
            continue;
        }
        map.remove(&key)?;
        removed += 1;
    }
    Ok(removed)
}

/// Deletes the masquerade translations of flows idle past their timeout, as
/// [`collect_idle_flows`] does (an entry touched since the scan stays); the map's
/// pressure (entries / capacity) goes to `/metrics` on the way.
fn collect_translations(maps: &mut MasqMaps, timeouts: &conntrack::Timeouts, status: &AgentStatus) {
    let result = (|| {
        let entries = maps.translations()?;
        status.set_map_usage(map_names::MASQ, entries.len(), maps.capacity());
        let idle = conntrack::expired(&entries, conntrack::monotonic_now_ns(), timeouts);
        drop(entries);
        let mut removed = 0;
        for (key, seen) in idle {
            let Some(current) = maps.translation(&key)? else {
                continue;
            };
            if current.last_seen_ns != seen {
                continue;
            }
            maps.remove_translation(&key)?;
            removed += 1;
        }
        Ok::<_, MapsError>(removed)
    })();
    match result {
        Ok(0) => {}
        Ok(n) => debug!(entries = n, "masquerade translations expired"),
        Err(e) => warn!("masquerade garbage collection failed: {e}"),
    }
}
