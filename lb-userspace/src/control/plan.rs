//! Desired state + current map contents -> ordered map operations. Pure: no kernel,
//! no I/O, so every ordering and capacity rule is unit-tested.

use std::collections::{BTreeMap, BTreeSet};

// Keyed by the ids this agent hands out (or by map values), never by names from the
// API: a fast hash without seed is safe, and SipHash was 8% of a 100k start.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use lb_common::{map_names, Backend, ServiceKey, ServiceValue};

use super::ids::IdAllocator;
use super::known::{allocators, Entries, KnownTable};
use super::maglev::{self, MaglevError, TABLE_SIZES};
use super::maglev_tables::MaglevTables;
use crate::datapath::codec::{
    backend_value, master_value, slot_value, Capacity, FrontendKey, MAX_BACKENDS_PER_FRONTEND,
};
use crate::datapath::snapshot::{MapOp, MapSnapshot};
use crate::model::{DesiredState, Frontend, FrontendSpec, Scope};

/// A frontend the plan leaves as it is in the kernel, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    #[error(
        "service {service} ({frontend}): {map} is full ({capacity} entries); \
         kept its previous state; raise the map size with --{flag}"
    )]
    MapFull {
        service: String,
        frontend: Frontend,
        map: &'static str,
        capacity: u32,
        flag: &'static str,
    },
    #[error("service {service} ({frontend}): {count} endpoints exceed the {max} slots one frontend can hold")]
    TooManyBackends {
        service: String,
        frontend: Frontend,
        count: usize,
        max: usize,
    },
    #[error("no free frontend id left (all {max} in use); {service} ({frontend}) not programmed")]
    OutOfIds {
        service: String,
        frontend: Frontend,
        max: u32,
    },
    /// The frontend is programmed, with random picks instead of Maglev.
    #[error(
        "service {service} ({frontend}): no room in {map} for its Maglev table of \
         {slots} slots ({free} of {capacity} slots free); new flows pick a backend at \
         random until there is; raise --{flag}"
    )]
    MaglevFull {
        service: String,
        frontend: Frontend,
        map: &'static str,
        slots: u32,
        free: u64,
        capacity: u32,
        flag: &'static str,
    },
    /// The frontend is programmed, with random picks instead of Maglev.
    #[error(
        "service {service} ({frontend}): no Maglev table ({reason}); new flows pick a \
         backend at random"
    )]
    MaglevUnusable {
        service: String,
        frontend: Frontend,
        reason: MaglevError,
    },
}

/// Result of planning: operations to apply in order, and the frontends skipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<MapOp>,
    pub rejected: Vec<ReconcileError>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Plans `desired` into maps that are empty (`known` holds nothing yet) `piece`
/// frontends at a time, each piece against what the pieces before it wrote, as one
/// change is planned. `known` records each piece as planned; `write` then gets it,
/// in order, before the next is planned, and may hand it on to be written while
/// the next is planned. Every prefix of the writes is thus a consistent table,
/// as with one plan, but the writes of a start are never all held at once. After
/// an error `known` is ahead of the maps: drop it. An external entry stays in the
/// piece of its internal twin (the master's flag names it).
pub fn plan_in_pieces<E>(
    desired: &DesiredState,
    known: &mut KnownTable,
    capacity: Capacity,
    piece: usize,
    mut write: impl FnMut(Plan) -> Result<(), E>,
) -> Result<(), E> {
    // At most one backend entry per desired backend (twins share theirs).
    known.snapshot.backends.reserve(desired.backend_count());
    let mut changed = BTreeSet::new();
    let mut frontends = desired.frontends.keys().peekable();
    while let Some(frontend) = frontends.next() {
        changed.insert(*frontend);
        let at_twin = frontends.peek().is_some_and(|f| f.scope == Scope::External);
        if frontends.peek().is_none() || (changed.len() >= piece && !at_twin) {
            let plan = plan_changes(desired, &changed, known, capacity);
            known.apply(&plan.ops);
            write(plan)?;
            changed.clear();
        }
    }
    Ok(())
}

/// Plans only the frontends in `changed` (as `desired` now has them, or removed
/// when it has them no more) against `known`, with the same per-frontend order
/// and capacity rules as [`plan`]; the rest of the table is not looked at. An
/// internal frontend whose external entry came or went must be in `changed` too
/// (its master's flag follows). `known` hands out the ids; apply the ops to it
/// (`KnownTable::apply`) once they are written.
pub fn plan_changes(
    desired: &DesiredState,
    changed: &BTreeSet<Frontend>,
    known: &mut KnownTable,
    capacity: Capacity,
) -> Plan {
    let groups: Vec<(Frontend, Entries)> = changed
        .iter()
        .map(|f| (*f, known.entries_of(FrontendKey::of(f))))
        .collect();
    // Backend ids belong to one frontend: what names them is in these entries.
    let mut refs: HashMap<u32, usize> = HashMap::default();
    for (_, entries) in &groups {
        for value in entries.slots.values() {
            *refs.entry(value.backend_id).or_default() += 1;
        }
    }
    let placeholder = || IdAllocator::new([], 0);
    let ids = (
        std::mem::replace(&mut known.backend_ids, placeholder()),
        std::mem::replace(&mut known.rev_nat_ids, placeholder()),
    );
    let tables = std::mem::replace(&mut known.maglev, MaglevTables::new(0, 0));
    let mut planner = Planner::new(desired, &known.snapshot, capacity, refs, ids, tables);
    // Upserts first, removals after them, as in a full plan.
    for (frontend, entries) in &groups {
        if let Some(spec) = desired.frontends.get(frontend) {
            planner.upsert(frontend, spec, entries);
        }
    }
    for (frontend, entries) in &groups {
        if !desired.frontends.contains_key(frontend) {
            planner.remove(FrontendKey::of(frontend), entries);
        }
    }
    planner.finish();
    let Planner {
        mut ops,
        rejected,
        backend_ids,
        rev_nat_ids,
        tables,
        ..
    } = planner;
    known.backend_ids = backend_ids;
    known.rev_nat_ids = rev_nat_ids;
    known.maglev = tables;
    group_backend_writes(&mut ops);
    Plan { ops, rejected }
}

/// A frontend the planner accepted: its slot count, the backends it wants (with
/// the ids they keep), and its frontend id.
struct Admitted {
    count: u16,
    wanted: Vec<(Backend, Option<u32>)>,
    rev_nat_id: u32,
}

struct Planner<'a> {
    desired: &'a DesiredState,
    current: &'a MapSnapshot,
    capacity: Capacity,
    ops: Vec<MapOp>,
    rejected: Vec<ReconcileError>,
    /// Entries the maps may hold at some point of the plan: the current ones plus every
    /// new key accepted so far. Deletions are not subtracted as they run last.
    services_used: u64,
    backends_used: u64,
    backend_ids: IdAllocator,
    rev_nat_ids: IdAllocator,
    /// Ids a frontend of this plan has taken (kept or left in place), so that a
    /// corrupted table naming one id from two frontends cannot make them share it.
    claimed_backends: HashSet<u32>,
    claimed_rev_nat_ids: HashSet<u32>,
    /// How many slot entries name each backend id once the ops so far have run; a
    /// backend is deleted only when nothing names it.
    refs: HashMap<u32, usize>,
    deleted: HashSet<u32>,
    /// The Maglev tables: where each set's table is, and room for new ones.
    tables: MaglevTables,
    /// Stale tables (built with another seed) when the plan began: while there
    /// are any, the arena's header keeps naming the old seed.
    stale_at_start: usize,
    /// The plan writes a table.
    wrote_table: bool,
}

/// Compute the operations that turn `current` into `desired`.
///
/// Per frontend, backends are written before the slots naming them and slots before
/// the master counting them; entries no longer needed go after the master, and whole
/// frontends that disappear go after every other change. A reader of the maps at any
/// point of the plan therefore finds every slot its master counts and every backend
/// those slots name.
pub fn plan(desired: &DesiredState, current: &MapSnapshot, capacity: Capacity) -> Plan {
    let mut groups: BTreeMap<FrontendKey, Entries> = BTreeMap::new();
    // Keys with padding set can never match a lookup; they only take room.
    let mut garbage: Vec<(ServiceKey, ServiceValue)> = Vec::new();
    let mut refs: HashMap<u32, usize> = HashMap::default();
    for (key, value) in current.services.iter() {
        if key.backend_slot != 0 {
            *refs.entry(value.backend_id).or_default() += 1;
        }
        if key._pad != [0; 2] || Scope::from_number(key.scope).is_none() {
            garbage.push((key, *value));
            continue;
        }
        let entries = groups.entry(FrontendKey::of_key(&key)).or_default();
        if key.backend_slot == 0 {
            entries.master = Some(*value);
        } else {
            entries.slots.insert(key.backend_slot, *value);
        }
    }
    let ids = allocators(current, capacity);
    let tables = MaglevTables::from_snapshot(current, capacity.maglev_slots, capacity.maglev_seed);
    let mut planner = Planner::new(desired, current, capacity, refs, ids, tables);
    // Into empty maps (a start) the plan writes each master, slot and backend once:
    // room for exactly that, where growing by doubling held up to twice as much
    // (11.5 MB for 210k writes at 10k Services).
    if current.services.is_empty() {
        planner
            .ops
            .reserve(desired.frontends.len() + 2 * desired.backend_count());
    }

    for (frontend, spec) in &desired.frontends {
        let entries = groups
            .remove(&FrontendKey::of(frontend))
            .unwrap_or_default();
        planner.upsert(frontend, spec, &entries);
    }
    for (key, entries) in &groups {
        planner.remove(*key, entries);
    }
    for (key, value) in &garbage {
        if key.backend_slot == 0 {
            planner.ops.push(MapOp::DeleteService { key: *key });
        } else {
            planner.delete_slot(*key, value);
        }
    }
    // Leftovers of an interrupted plan: backends no slot names.
    planner.delete_unreferenced(current.backends.keys().copied());
    planner.finish();
    group_backend_writes(&mut planner.ops);
    Plan {
        ops: planner.ops,
        rejected: planner.rejected,
    }
}

/// Moves the Maglev tables and backend inserts that come before the first removal
/// ahead of the service inserts there (tables first), keeping every other order.
/// Backend ids belong to one frontend and a new one is free until its slot names
/// it, a new table's extent is free until its master names it (and a stale table
/// is rewritten with the same set, so its positions stay valid), so each frontend
/// still sees its table and backends before its slots and master; and the kernel
/// then gets long runs (tables, backends, services) it can take as batches instead
/// of runs of a dozen.
fn group_backend_writes(ops: &mut [MapOp]) {
    let puts = ops
        .iter()
        .position(|op| {
            matches!(
                op,
                MapOp::DeleteService { .. } | MapOp::DeleteBackend { .. }
            )
        })
        .unwrap_or(ops.len());
    ops[..puts].sort_by_key(|op| match op {
        MapOp::PutMaglev { .. } => 0,
        MapOp::PutBackend { .. } => 1,
        _ => 2,
    });
}

impl<'a> Planner<'a> {
    fn new(
        desired: &'a DesiredState,
        current: &'a MapSnapshot,
        capacity: Capacity,
        refs: HashMap<u32, usize>,
        (backend_ids, rev_nat_ids): (IdAllocator, IdAllocator),
        tables: MaglevTables,
    ) -> Self {
        Planner {
            stale_at_start: tables.stale(),
            tables,
            wrote_table: false,
            desired,
            current,
            capacity,
            ops: Vec::new(),
            rejected: Vec::new(),
            services_used: current.services.len() as u64,
            backends_used: current.backends.len() as u64,
            backend_ids,
            rev_nat_ids,
            claimed_backends: HashSet::default(),
            claimed_rev_nat_ids: HashSet::default(),
            refs,
            deleted: HashSet::default(),
        }
    }

    fn upsert(&mut self, frontend: &Frontend, spec: &FrontendSpec, entries: &Entries) {
        let Some(admitted) = self.admit(frontend, spec, entries) else {
            return;
        };
        let key = FrontendKey::of(frontend);
        let mut ids = Vec::with_capacity(admitted.wanted.len());
        for (backend, id) in admitted.wanted {
            let id = match id {
                Some(id) => id,
                None => {
                    let id = self
                        .backend_ids
                        .alloc()
                        .expect("free ids were counted before accepting the frontend");
                    self.ops.push(MapOp::PutBackend { id, backend });
                    id
                }
            };
            self.claimed_backends.insert(id);
            ids.push(id);
        }
        let count = admitted.count;
        for (slot, &id) in (1..=count).zip(&ids) {
            self.put_slot(
                key.slot(slot),
                entries.slots.get(&slot),
                slot_value(id, admitted.rev_nat_id),
            );
        }
        let external_scope = frontend.scope == Scope::Internal
            && self
                .desired
                .frontends
                .contains_key(&frontend.with_scope(Scope::External));
        let maglev = self.maglev_table(frontend, spec);
        let master = master_value(spec, count, admitted.rev_nat_id, external_scope, maglev);
        if entries.master != Some(master) {
            self.ops.push(MapOp::PutService {
                key: key.slot(0),
                value: master,
            });
        }
        for (&slot, old) in entries.slots.range(count + 1..) {
            self.delete_slot(key.slot(slot), old);
        }
        let kept: HashSet<u32> = ids.into_iter().collect();
        let dropped: BTreeSet<u32> = entries
            .slots
            .values()
            .map(|v| v.backend_id)
            .filter(|id| !kept.contains(id))
            .collect();
        self.delete_unreferenced(dropped);
    }

    /// The Maglev table of an admitted frontend that wants one (its first slot and
    /// size's index), written first when it is new or stale. `None`: random, for a
    /// frontend without Maglev or backends, or (reported) one whose table has no
    /// room or whose backends give no table.
    fn maglev_table(&mut self, frontend: &Frontend, spec: &FrontendSpec) -> Option<(u32, usize)> {
        if !spec.maglev || spec.backends.is_empty() {
            return None;
        }
        let unusable = |reason| ReconcileError::MaglevUnusable {
            service: spec.service.to_string(),
            frontend: *frontend,
            reason,
        };
        // In (address, port) order, as the slots: a table's positions are slots.
        let set = match maglev::identities(spec.backends.iter().map(|b| (b.ip, b.port))) {
            Ok(set) => set,
            Err(reason) => {
                self.rejected.push(unusable(reason));
                return None;
            }
        };
        let rung = match maglev::table_rung(set.len()) {
            Ok(rung) => rung,
            Err(reason) => {
                self.rejected.push(unusable(reason));
                return None;
            }
        };
        let Some(placed) = self.tables.place(&set, rung) else {
            self.rejected.push(ReconcileError::MaglevFull {
                service: spec.service.to_string(),
                frontend: *frontend,
                map: map_names::MAGLEV,
                slots: lb_common::maglev::extent_slots(TABLE_SIZES[rung]),
                free: self.tables.free_slots(),
                capacity: self.tables.capacity(),
                flag: "maglev-table-slots",
            });
            return None;
        };
        if placed.write {
            let size = TABLE_SIZES[placed.rung];
            match maglev::build(&set, size, self.tables.seed()) {
                Ok(table) => {
                    self.ops.push(MapOp::PutMaglev {
                        first_slot: placed.first,
                        positions: table.into(),
                    });
                    self.wrote_table = true;
                }
                Err(reason) => {
                    // Not reached: the set and size come from the same rules as
                    // build's checks.
                    self.rejected.push(unusable(reason));
                    return None;
                }
            }
        }
        Some((placed.first, placed.rung))
    }

    /// After every frontend: the arena's header names this agent's seed once every
    /// table in use was built with it (never while a table built with another
    /// seed was left from before this plan: a restart must then rebuild it).
    fn finish(&mut self) {
        let seed = self.tables.seed();
        if self.current.maglev_seed != seed
            && self.stale_at_start == 0
            && (self.wrote_table || !self.tables.is_empty())
        {
            self.ops.push(MapOp::PutMaglevSeed { seed });
        }
    }

    /// Whether `frontend` fits (slots, map room, ids), with the backends it wants
    /// (each with the id it keeps, if any) and its frontend id; a frontend that does
    /// not fit is rejected and stays as the kernel has it.
    fn admit(
        &mut self,
        frontend: &Frontend,
        spec: &FrontendSpec,
        entries: &Entries,
    ) -> Option<Admitted> {
        let n = spec.backends.len();
        if n > MAX_BACKENDS_PER_FRONTEND {
            self.reject(
                entries,
                ReconcileError::TooManyBackends {
                    service: spec.service.to_string(),
                    frontend: *frontend,
                    count: n,
                    max: MAX_BACKENDS_PER_FRONTEND,
                },
            );
            return None;
        }
        let count = n as u16;

        // Backends keep the id they have in this frontend's slots, whatever slot.
        let mut reusable: HashMap<Backend, u32> = HashMap::default();
        for value in entries.slots.values() {
            let id = value.backend_id;
            if self.claimed_backends.contains(&id) {
                continue;
            }
            if let Some(backend) = self.current.backends.get(&id) {
                reusable.entry(*backend).or_insert(id);
            }
        }
        let wanted: Vec<(Backend, Option<u32>)> = spec
            .backends
            .iter()
            .map(|b| {
                let value = backend_value(b, frontend.protocol);
                (value, reusable.get(&value).copied())
            })
            .collect();

        let new_backends = wanted.iter().filter(|(_, id)| id.is_none()).count() as u64;
        let new_service_keys = u64::from(entries.master.is_none())
            + (1..=count)
                .filter(|s| !entries.slots.contains_key(s))
                .count() as u64;
        let full = |map: &'static str, capacity: u32, flag: &'static str| ReconcileError::MapFull {
            service: spec.service.to_string(),
            frontend: *frontend,
            map,
            capacity,
            flag,
        };
        if self.services_used + new_service_keys > u64::from(self.capacity.services) {
            let e = full(
                map_names::SERVICES,
                self.capacity.services,
                "services-map-size",
            );
            self.reject(entries, e);
            return None;
        }
        if self.backends_used + new_backends > u64::from(self.capacity.backends)
            || self.backend_ids.free() < new_backends
        {
            let e = full(
                map_names::BACKENDS,
                self.capacity.backends,
                "backends-map-size",
            );
            self.reject(entries, e);
            return None;
        }
        let rev_nat_id = match entries.master {
            Some(m) if m.rev_nat_id != 0 && !self.claimed_rev_nat_ids.contains(&m.rev_nat_id) => {
                m.rev_nat_id
            }
            _ => match self.rev_nat_ids.alloc() {
                Some(id) => id,
                None => {
                    let e = ReconcileError::OutOfIds {
                        service: spec.service.to_string(),
                        frontend: *frontend,
                        max: self.capacity.frontend_ids,
                    };
                    self.reject(entries, e);
                    return None;
                }
            },
        };
        self.services_used += new_service_keys;
        self.backends_used += new_backends;
        self.claimed_rev_nat_ids.insert(rev_nat_id);
        Some(Admitted {
            count,
            wanted,
            rev_nat_id,
        })
    }

    /// The frontend stays as the kernel has it; its ids stay its own.
    fn reject(&mut self, entries: &Entries, error: ReconcileError) {
        if let Some(master) = entries.master {
            self.claimed_rev_nat_ids.insert(master.rev_nat_id);
        }
        self.claimed_backends
            .extend(entries.slots.values().map(|v| v.backend_id));
        self.rejected.push(error);
    }

    /// Master first, so the frontend stops being translated before its slots go.
    fn remove(&mut self, key: FrontendKey, entries: &Entries) {
        if entries.master.is_some() {
            self.ops.push(MapOp::DeleteService { key: key.slot(0) });
        }
        for (&slot, value) in &entries.slots {
            self.delete_slot(key.slot(slot), value);
        }
        let ids: BTreeSet<u32> = entries.slots.values().map(|v| v.backend_id).collect();
        self.delete_unreferenced(ids);
    }

    fn put_slot(&mut self, key: ServiceKey, old: Option<&ServiceValue>, value: ServiceValue) {
        if old == Some(&value) {
            return;
        }
        if let Some(old) = old {
            self.unref(old.backend_id);
        }
        *self.refs.entry(value.backend_id).or_default() += 1;
        self.ops.push(MapOp::PutService { key, value });
    }

    fn delete_slot(&mut self, key: ServiceKey, old: &ServiceValue) {
        self.unref(old.backend_id);
        self.ops.push(MapOp::DeleteService { key });
    }

    fn unref(&mut self, id: u32) {
        if let Some(n) = self.refs.get_mut(&id) {
            *n = n.saturating_sub(1);
        }
    }

    fn delete_unreferenced(&mut self, ids: impl IntoIterator<Item = u32>) {
        for id in ids {
            let unreferenced = self.refs.get(&id).is_none_or(|&n| n == 0);
            if unreferenced && self.current.backends.contains_key(&id) && self.deleted.insert(id) {
                self.ops.push(MapOp::DeleteBackend { id });
            }
        }
    }
}

#[cfg(test)]
mod tests;
