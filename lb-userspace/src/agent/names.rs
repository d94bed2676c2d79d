//! The frontends' names by id (`rev_nat_id`), as of the last sync, for the
//! per-Service metrics: a scrape reads only the counter maps, never the whole
//! service table.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::debug;

use crate::datapath::codec::backend_addr;
use crate::datapath::conntrack::monotonic_now_ns;
use crate::datapath::maps::{MapsError, PinnedMaps, QuarantineMap};
use crate::model::Frontend;
use crate::ops::metrics::QuarantineCounters;
use crate::ops::AgentStatus;

/// How the frontend names change with a sync.
pub(super) enum NamesUpdate {
    Unchanged,
    Replace(BTreeMap<u32, Frontend>),
    /// Ids whose name is now this, or gone (`None`).
    Patch(Vec<(u32, Option<Frontend>)>),
}

#[derive(Clone, Default)]
pub(super) struct FrontendNames(Arc<Mutex<BTreeMap<u32, Frontend>>>);

impl FrontendNames {
    /// Fills the datapath counters of a scrape from `maps` (a handle of its own),
    /// naming the per-Service rows.
    /// `quarantine` (absent: not served) names the backends passive health has a
    /// record of.
    pub(super) fn serve_scrapes(
        &self,
        status: &AgentStatus,
        maps: PinnedMaps,
        quarantine: Option<QuarantineMap>,
    ) {
        let names = self.clone();
        status.on_scrape(move |status| {
            if let Some(quarantine) = &quarantine {
                match quarantine_rows(&maps, quarantine, &names) {
                    Ok(rows) => status.set_quarantine_counters(&rows),
                    Err(e) => debug!("reading the quarantine map: {e}"),
                }
            }
            match maps.stats() {
                Ok(counters) => status.set_datapath_counters(&counters),
                Err(e) => debug!("reading the datapath counters: {e}"),
            }
            match maps.service_stats() {
                Ok(counters) => {
                    let names = names.0.lock();
                    let rows: Vec<(String, u64, u64)> = counters
                        .iter()
                        .filter_map(|(id, c)| {
                            Some((names.get(id)?.to_string(), c.connections, c.no_backend))
                        })
                        .collect();
                    status.set_service_counters(&rows);
                }
                Err(e) => debug!("reading the per-service counters: {e}"),
            }
        });
    }

    pub(super) fn update(&self, update: NamesUpdate) {
        let mut names = self.0.lock();
        match update {
            NamesUpdate::Unchanged => {}
            NamesUpdate::Replace(all) => *names = all,
            NamesUpdate::Patch(patch) => {
                for (id, name) in patch {
                    match name {
                        Some(name) => names.insert(id, name),
                        None => names.remove(&id),
                    };
                }
            }
        }
    }
}

/// Passive health's rows for a scrape: each (frontend, backend) with a record,
/// named; a backend or frontend since removed is left out. Costs the records (a
/// few), not the table: each backend is looked up by id.
fn quarantine_rows(
    maps: &PinnedMaps,
    quarantine: &QuarantineMap,
    names: &FrontendNames,
) -> Result<Vec<(String, String, QuarantineCounters)>, MapsError> {
    let now = monotonic_now_ns();
    let entries = quarantine.entries()?;
    let names = names.0.lock();
    let mut rows = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        let Some(frontend) = names.get(&key.rev_nat_id) else {
            continue;
        };
        let Some(backend) = maps.backend(key.backend_id)? else {
            continue;
        };
        let addr = backend_addr(&backend);
        rows.push((
            frontend.to_string(),
            std::net::SocketAddr::new(addr.ip, addr.port).to_string(),
            QuarantineCounters {
                quarantines: value.quarantines,
                skips: value.skips,
                active: value.is_active(now),
            },
        ));
    }
    Ok(rows)
}
