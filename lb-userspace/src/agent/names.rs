//! The frontends' names by id (`rev_nat_id`), as of the last sync, for the
//! per-Service metrics: a scrape reads only the counter maps, never the whole
//! service table.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tracing::debug;

use crate::datapath::maps::PinnedMaps;
use crate::model::Frontend;
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
    pub(super) fn serve_scrapes(&self, status: &AgentStatus, maps: PinnedMaps) {
        let names = self.clone();
        status.on_scrape(move |status| {
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
