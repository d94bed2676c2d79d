//! What the agent wrote, remembered between changes, so that one change is planned
//! against its own entries instead of a read of the whole table.

use std::collections::BTreeMap;

use lb_common::{ServiceKey, ServiceValue};

use super::ids::IdAllocator;
use super::maglev_tables::MaglevTables;
use crate::datapath::codec::{Capacity, FrontendKey};
use crate::datapath::snapshot::{MapOp, MapSnapshot};

/// The entries one frontend has in the current maps.
#[derive(Default)]
pub(super) struct Entries {
    pub(super) master: Option<ServiceValue>,
    pub(super) slots: BTreeMap<u16, ServiceValue>,
}

/// The backend and frontend id allocators for a table: every id it names is in use.
pub(super) fn allocators(table: &MapSnapshot, capacity: Capacity) -> (IdAllocator, IdAllocator) {
    let slot_ids = table
        .services
        .iter()
        .filter(|(k, _)| k.backend_slot != 0)
        .map(|(_, v)| v.backend_id);
    let backend_ids = IdAllocator::new(table.backends.keys().copied().chain(slot_ids), u32::MAX);
    let rev_nat_ids = IdAllocator::new(
        table.services.values().map(|v| v.rev_nat_id),
        capacity.frontend_ids,
    );
    (backend_ids, rev_nat_ids)
}

/// What the agent wrote, kept between changes with what planning one change needs
/// without walking the whole table: the ids in use and the Maglev tables. Built
/// once from a snapshot (start, relist, repair: O(table)); then each change costs
/// its own entries.
#[derive(Clone, Debug)]
pub struct KnownTable {
    pub(super) snapshot: MapSnapshot,
    pub(super) backend_ids: IdAllocator,
    pub(super) rev_nat_ids: IdAllocator,
    pub(super) maglev: MaglevTables,
}

impl KnownTable {
    pub fn new(snapshot: MapSnapshot, capacity: Capacity) -> Self {
        let (backend_ids, rev_nat_ids) = allocators(&snapshot, capacity);
        let maglev =
            MaglevTables::from_snapshot(&snapshot, capacity.maglev_slots, capacity.maglev_seed);
        KnownTable {
            snapshot,
            backend_ids,
            rev_nat_ids,
            maglev,
        }
    }

    /// The Maglev tables the masters name.
    pub fn maglev(&self) -> &MaglevTables {
        &self.maglev
    }

    pub fn snapshot(&self) -> &MapSnapshot {
        &self.snapshot
    }

    pub fn into_snapshot(self) -> MapSnapshot {
        self.snapshot
    }

    /// Records `ops` as written: the snapshot follows them, the ids they write are
    /// in use (whichever plan chose them), and the ids of deleted backends and
    /// masters become free again (after the ids ahead of them); a Maglev table no
    /// master names any more is freed, for the next plan to reuse.
    pub fn apply(&mut self, ops: &[MapOp]) {
        // Each master written or deleted: its table before and after.
        let mut masters = Vec::new();
        let mut rewritten = Vec::new();
        for op in ops {
            match *op {
                MapOp::PutBackend { id, .. } => self.backend_ids.mark(id),
                MapOp::PutService { key, value } => {
                    self.rev_nat_ids.mark(value.rev_nat_id);
                    if key.backend_slot == 0 {
                        let old = self.snapshot.services.get(&key).and_then(|m| m.maglev());
                        masters.push((key, old, value.maglev()));
                    }
                }
                MapOp::DeleteBackend { id } => self.backend_ids.release(id),
                MapOp::DeleteService { key } if key.backend_slot == 0 => {
                    if let Some(master) = self.snapshot.services.get(&key) {
                        self.rev_nat_ids.release(master.rev_nat_id);
                        masters.push((key, master.maglev(), None));
                    }
                }
                MapOp::PutMaglev { first_slot, .. } => rewritten.push(first_slot),
                _ => {}
            }
        }
        self.snapshot.apply(ops);
        if !masters.is_empty() || !rewritten.is_empty() {
            self.maglev.record(&masters, &rewritten, &self.snapshot);
        }
    }

    /// The entries `key` has in the table (master and slots), found by key range.
    pub(super) fn entries_of(&self, key: FrontendKey) -> Entries {
        let master = ServiceKey {
            address: key.address,
            port: key.port.to_map(),
            backend_slot: 0,
            proto: key.proto,
            scope: key.scope,
            _pad: [0; 2],
        };
        let mut entries = Entries::default();
        if let Some(group) = self.snapshot.services.group(&master) {
            entries.master = group.master;
            entries.slots = group.slots.iter().copied().collect();
        }
        entries
    }
}
