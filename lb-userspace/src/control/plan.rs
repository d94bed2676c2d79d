//! Desired state + current map contents -> ordered map operations. Pure: no kernel,
//! no I/O, so every ordering and capacity rule is unit-tested.

use std::collections::{BTreeMap, BTreeSet};

// Keyed by the ids this agent hands out (or by map values), never by names from the
// API: a fast hash without seed is safe, and SipHash was 8% of a 100k start.
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

use lb_common::{map_names, Backend, ServiceKey, ServiceValue};

use super::ids::IdAllocator;
use super::known::{allocators, Entries, KnownTable};
use crate::datapath::codec::{
    backend_value, master_value, slot_value, Capacity, FrontendKey, MapOp, MapSnapshot,
};
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

/// Most backends one frontend can have: slot numbers are `u16` and slot 0 is the master.
pub const MAX_BACKENDS_PER_FRONTEND: usize = u16::MAX as usize - 1;
/// Largest `rev_nat_id`; 0 is reserved for "none". Ids are 32-bit in the maps; this
/// leaves room far beyond any service map while keeping counts in a `u32`.
pub const MAX_REV_NAT_ID: u32 = u32::MAX - 1;

/// Plans `desired` into maps that are empty (`known` holds nothing yet) `piece`
/// frontends at a time, each piece against what the pieces before it wrote, as one
/// change is planned. `write` gets each piece's plan before the next is planned;
/// `known` then records it. Every prefix of the writes is thus a consistent table,
/// as with one plan, but the writes of a start are never all held at once. An
/// external entry stays in the piece of its internal twin (the master's flag
/// names it).
pub fn plan_in_pieces<E>(
    desired: &DesiredState,
    known: &mut KnownTable,
    capacity: Capacity,
    piece: usize,
    mut write: impl FnMut(&Plan) -> Result<(), E>,
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
            write(&plan)?;
            known.apply(&plan.ops);
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
    let mut planner = Planner::new(desired, &known.snapshot, capacity, refs, ids);
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
    let Planner {
        mut ops,
        rejected,
        backend_ids,
        rev_nat_ids,
        ..
    } = planner;
    known.backend_ids = backend_ids;
    known.rev_nat_ids = rev_nat_ids;
    group_backend_writes(&mut ops);
    Plan { ops, rejected }
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
    let mut planner = Planner::new(desired, current, capacity, refs, ids);
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
    group_backend_writes(&mut planner.ops);
    Plan {
        ops: planner.ops,
        rejected: planner.rejected,
    }
}

/// Moves the backend inserts that come before the first removal ahead of the
/// service inserts there, keeping every other order. Backend ids belong to one
/// frontend and a new one is free until its slot names it, so each frontend still
/// sees its backends before its slots and master; and the kernel then gets two long
/// runs (backends, services) it can take as batches instead of runs of a dozen.
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
    ops[..puts].sort_by_key(|op| !matches!(op, MapOp::PutBackend { .. }));
}

impl<'a> Planner<'a> {
    fn new(
        desired: &'a DesiredState,
        current: &'a MapSnapshot,
        capacity: Capacity,
        refs: HashMap<u32, usize>,
        (backend_ids, rev_nat_ids): (IdAllocator, IdAllocator),
    ) -> Self {
        Planner {
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
            return;
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
            return;
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
            return;
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
                    return;
                }
            },
        };

        self.services_used += new_service_keys;
        self.backends_used += new_backends;
        self.claimed_rev_nat_ids.insert(rev_nat_id);
        let key = FrontendKey::of(frontend);
        let mut ids = Vec::with_capacity(n);
        for (backend, id) in wanted {
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
        for (slot, &id) in (1..=count).zip(&ids) {
            self.put_slot(
                key.slot(slot),
                entries.slots.get(&slot),
                slot_value(id, rev_nat_id),
            );
        }
        let external_scope = frontend.scope == Scope::Internal
            && self
                .desired
                .frontends
                .contains_key(&frontend.with_scope(Scope::External));
        let master = master_value(spec, count, rev_nat_id, external_scope);
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
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::datapath::codec::service_key;
    use crate::datapath::table;
    use crate::model::{BackendAddr, Protocol};

    const ROOMY: Capacity = Capacity {
        services: 1 << 20,
        backends: 1 << 20,
        frontend_ids: MAX_REV_NAT_ID,
    };

    fn fe(last: u8, port: u16, protocol: Protocol) -> Frontend {
        Frontend::internal(Ipv4Addr::new(10, 96, 0, last).into(), port, protocol)
    }

    fn tcp(last: u8) -> Frontend {
        fe(last, 80, Protocol::Tcp)
    }

    fn be(last: u8, port: u16) -> BackendAddr {
        BackendAddr {
            ip: Ipv4Addr::new(10, 244, 0, last).into(),
            port,
            local: false,
        }
    }

    fn spec(backends: &[u8], affinity: Option<u32>) -> FrontendSpec {
        FrontendSpec {
            service: "default/web:http".into(),
            backends: std::sync::Arc::new(backends.iter().map(|&b| be(b, 8080)).collect()),
            affinity_timeout_sec: affinity,
            source_ranges: None,
        }
    }

    fn state(frontends: &[(Frontend, &[u8], Option<u32>)]) -> DesiredState {
        DesiredState {
            frontends: frontends
                .iter()
                .map(|(f, b, a)| (*f, spec(b, *a)))
                .collect(),
            ..DesiredState::default()
        }
    }

    /// Every master counts only slots that are present and name present backends of
    /// its protocol; the first violation in words.
    fn half_written(s: &MapSnapshot) -> Option<String> {
        for (key, master) in s.services.iter().filter(|(k, _)| k.backend_slot == 0) {
            for slot in 1..=master.count {
                let slot_key = ServiceKey {
                    backend_slot: slot,
                    ..key
                };
                let Some(value) = s.services.get(&slot_key) else {
                    return Some(format!(
                        "{key:?} counts {} but slot {slot} is missing",
                        master.count
                    ));
                };
                let Some(backend) = s.backends.get(&value.backend_id) else {
                    return Some(format!(
                        "slot {slot} of {key:?} names missing backend {}",
                        value.backend_id
                    ));
                };
                if backend.proto != key.proto || value.rev_nat_id != master.rev_nat_id {
                    return Some(format!("slot {slot} of {key:?} disagrees with its master"));
                }
            }
        }
        None
    }

    fn assert_never_half_written(s: &MapSnapshot, context: &str) {
        if let Some(problem) = half_written(s) {
            panic!("{context}: {problem}");
        }
    }

    /// The snapshot holds exactly `desired`: nothing missing, nothing left over.
    fn assert_programs(s: &MapSnapshot, desired: &DesiredState) {
        let table = table::decode(s);
        let got: BTreeMap<Frontend, (BTreeSet<BackendAddr>, Option<u32>)> = table
            .iter()
            .map(|f| {
                assert!(f.problems.is_empty(), "{:?}", f.problems);
                let backends: Vec<BackendAddr> = f
                    .backends
                    .iter()
                    .map(|b| BackendAddr {
                        ip: b.ip,
                        port: b.port,
                        local: b.local,
                    })
                    .collect();
                assert!(
                    backends.windows(2).all(|w| w[0] < w[1]),
                    "slots are not in sorted order"
                );
                (
                    f.frontend,
                    (backends.into_iter().collect(), f.affinity_timeout_sec),
                )
            })
            .collect();
        let want: BTreeMap<Frontend, (BTreeSet<BackendAddr>, Option<u32>)> = desired
            .frontends
            .iter()
            .map(|(f, spec)| (*f, ((*spec.backends).clone(), spec.affinity_timeout_sec)))
            .collect();
        assert_eq!(got, want);
        assert_eq!(
            s.services.len(),
            desired.frontends.len() + desired.backend_count()
        );
        assert_eq!(s.backends.len(), desired.backend_count(), "backends leaked");
        let revs: BTreeSet<u32> = table.iter().map(|f| f.rev_nat_id).collect();
        assert_eq!(revs.len(), table.len(), "frontend ids shared");
        assert!(!revs.contains(&0));
    }

    /// Plan `to` from `from`, check the invariant after every op and the result, and
    /// return the new snapshot and the ops.
    fn transition(from: &MapSnapshot, to: &DesiredState) -> (MapSnapshot, Vec<MapOp>) {
        let plan = plan(to, from, ROOMY);
        assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
        let mut s = from.clone();
        assert_never_half_written(&s, "before");
        for (i, op) in plan.ops.iter().enumerate() {
            s.apply(std::slice::from_ref(op));
            if let Some(problem) = half_written(&s) {
                panic!("after op {i} {op:?} of {:#?}: {problem}", plan.ops);
            }
        }
        assert_programs(&s, to);
        let again = super::plan(to, &s, ROOMY);
        assert!(again.is_empty(), "second plan not empty: {:?}", again.ops);
        (s, plan.ops)
    }

    fn program(desired: &DesiredState) -> MapSnapshot {
        transition(&MapSnapshot::default(), desired).0
    }

    fn backend_ids(s: &MapSnapshot, f: Frontend) -> BTreeMap<BackendAddr, u32> {
        table::decode(s)
            .into_iter()
            .find(|p| p.frontend == f)
            .unwrap()
            .backends
            .iter()
            .map(|b| {
                (
                    BackendAddr {
                        ip: b.ip,
                        port: b.port,
                        local: b.local,
                    },
                    b.id,
                )
            })
            .collect()
    }

    fn rev_nat_id(s: &MapSnapshot, f: Frontend) -> u32 {
        s.services[&service_key(&f, 0)].rev_nat_id
    }

    #[test]
    fn named_transitions_are_never_half_written() {
        let (a, b, u) = (tcp(1), tcp(2), fe(3, 53, Protocol::Udp));
        let cases: Vec<(&str, DesiredState, DesiredState)> = vec![
            ("create", state(&[]), state(&[(a, &[1, 2, 3], None)])),
            (
                "add backend in the middle",
                state(&[(a, &[1, 3], None)]),
                state(&[(a, &[1, 2, 3], None)]),
            ),
            (
                "remove backend in the middle",
                state(&[(a, &[1, 2, 3], None)]),
                state(&[(a, &[1, 3], None)]),
            ),
            (
                "replace all backends",
                state(&[(a, &[1, 2], None)]),
                state(&[(a, &[3, 4, 5], None)]),
            ),
            (
                "shrink to zero",
                state(&[(a, &[1, 2, 3], None)]),
                state(&[(a, &[], None)]),
            ),
            (
                "grow from zero",
                state(&[(a, &[], None)]),
                state(&[(a, &[1, 2, 3, 4], None)]),
            ),
            (
                "remove frontend",
                state(&[(a, &[1, 2], None), (b, &[1], None)]),
                state(&[(b, &[1], None)]),
            ),
            (
                "remove everything",
                state(&[(a, &[1, 2], None), (u, &[3], None)]),
                state(&[]),
            ),
            (
                "affinity on",
                state(&[(a, &[1], None)]),
                state(&[(a, &[1], Some(10_800))]),
            ),
            (
                "affinity timeout",
                state(&[(a, &[1], Some(10_800))]),
                state(&[(a, &[1, 2], Some(60))]),
            ),
            (
                "affinity off",
                state(&[(a, &[1], Some(60))]),
                state(&[(a, &[1], None)]),
            ),
            (
                "several frontends at once",
                state(&[(a, &[1, 2], None), (b, &[3], Some(5)), (u, &[], None)]),
                state(&[
                    (a, &[2, 4], Some(5)),
                    (u, &[1, 2, 3], None),
                    (tcp(4), &[9], None),
                ]),
            ),
            (
                "same backends in two frontends",
                state(&[(a, &[1, 2], None)]),
                state(&[(a, &[1, 2], None), (b, &[1, 2], None)]),
            ),
        ];
        for (name, from, to) in cases {
            let start = program(&from);
            let (end, ops) = transition(&start, &to);
            // And back again.
            let (_, back) = transition(&end, &from);
            assert!(!ops.is_empty() && !back.is_empty(), "{name}");
        }
    }

    #[test]
    fn external_scope_entry_is_flagged_on_the_internal_master() {
        let internal = tcp(9);
        let external = internal.with_scope(Scope::External);
        let mut d = state(&[(internal, &[1, 2], None), (external, &[1], None)]);
        let s = program(&d);
        assert_programs(&s, &d);
        let flags = |s: &MapSnapshot, f: Frontend| s.services[&service_key(&f, 0)].flags;
        assert_ne!(flags(&s, internal) & lb_common::SVC_FLAG_EXTERNAL_SCOPE, 0);
        assert_eq!(flags(&s, external) & lb_common::SVC_FLAG_EXTERNAL_SCOPE, 0);
        assert_eq!(service_key(&external, 0).scope, lb_common::SCOPE_EXTERNAL);

        // Dropping the external entry clears the flag before the entry goes, so no
        // reader follows the flag to a missing entry.
        d.frontends.remove(&external);
        let (after, ops) = transition(&s, &d);
        assert_eq!(
            flags(&after, internal) & lb_common::SVC_FLAG_EXTERNAL_SCOPE,
            0
        );
        let flag_cleared = ops
            .iter()
            .position(|op| matches!(op, MapOp::PutService { key, .. } if *key == service_key(&internal, 0)))
            .unwrap();
        let external_gone = ops
            .iter()
            .position(|op| matches!(op, MapOp::DeleteService { key } if *key == service_key(&external, 0)))
            .unwrap();
        assert!(flag_cleared < external_gone);
    }

    #[test]
    fn unchanged_state_needs_no_ops() {
        let d = state(&[(tcp(1), &[1, 2], Some(60)), (tcp(2), &[], None)]);
        let s = program(&d);
        let p = plan(&d, &s, ROOMY);
        assert!(p.is_empty() && p.rejected.is_empty());
    }

    #[test]
    fn op_order_for_one_frontend() {
        let a = tcp(1);
        let s = program(&state(&[(a, &[1, 2, 3], None)]));
        let ids = backend_ids(&s, a);
        let rev = rev_nat_id(&s, a);
        let p = plan(&state(&[(a, &[1, 4], None)]), &s, ROOMY);
        let new_id = ids.values().max().unwrap() + 1;
        assert_eq!(
            p.ops,
            [
                MapOp::PutBackend {
                    id: new_id,
                    backend: backend_value(&be(4, 8080), Protocol::Tcp),
                },
                MapOp::PutService {
                    key: service_key(&a, 2),
                    value: slot_value(new_id, rev),
                },
                MapOp::PutService {
                    key: service_key(&a, 0),
                    value: master_value(&spec(&[1, 4], None), 2, rev, false),
                },
                MapOp::DeleteService {
                    key: service_key(&a, 3),
                },
                MapOp::DeleteBackend {
                    id: ids[&be(2, 8080)],
                },
                MapOp::DeleteBackend {
                    id: ids[&be(3, 8080)],
                },
            ]
        );
    }

    #[test]
    fn removals_come_after_every_upsert_master_first() {
        let (a, b, c) = (tcp(1), tcp(2), tcp(3));
        let s = program(&state(&[(a, &[1], None), (b, &[2, 3], None)]));
        let p = plan(&state(&[(c, &[4], None)]), &s, ROOMY);
        let first_delete = p
            .ops
            .iter()
            .position(|op| {
                matches!(
                    op,
                    MapOp::DeleteService { .. } | MapOp::DeleteBackend { .. }
                )
            })
            .unwrap();
        assert!(p.ops[..first_delete].len() == 3, "{:?}", p.ops);
        assert_eq!(
            p.ops[first_delete],
            MapOp::DeleteService {
                key: service_key(&a, 0)
            }
        );
        assert_eq!(
            p.ops[first_delete + 1],
            MapOp::DeleteService {
                key: service_key(&a, 1)
            }
        );
        assert!(matches!(
            p.ops[first_delete + 2],
            MapOp::DeleteBackend { .. }
        ));
        assert_eq!(
            p.ops[first_delete + 3],
            MapOp::DeleteService {
                key: service_key(&b, 0)
            }
        );
    }

    #[test]
    fn ids_are_stable_and_not_reused_at_once() {
        let (a, b) = (tcp(1), tcp(2));
        let s = program(&state(&[(a, &[1, 2, 3], None), (b, &[1], None)]));
        let before = backend_ids(&s, a);
        let (rev_a, rev_b) = (rev_nat_id(&s, a), rev_nat_id(&s, b));
        // Backend ids belong to one frontend.
        assert_ne!(before[&be(1, 8080)], backend_ids(&s, b)[&be(1, 8080)]);

        let (s, _) = transition(&s, &state(&[(a, &[0, 2, 3, 9], Some(30)), (b, &[1], None)]));
        let after = backend_ids(&s, a);
        assert_eq!(after[&be(2, 8080)], before[&be(2, 8080)]);
        assert_eq!(after[&be(3, 8080)], before[&be(3, 8080)]);
        assert_eq!((rev_nat_id(&s, a), rev_nat_id(&s, b)), (rev_a, rev_b));
        assert!(after[&be(0, 8080)] > before.values().copied().max().unwrap());
        assert!(after[&be(9, 8080)] > after[&be(0, 8080)]);

        // The id of the backend just removed is not handed out again.
        let removed = before[&be(1, 8080)];
        let (s, _) = transition(
            &s,
            &state(&[(a, &[0, 2, 3, 9, 7], Some(30)), (b, &[1], None)]),
        );
        assert_ne!(backend_ids(&s, a)[&be(7, 8080)], removed);
    }

    #[test]
    fn backend_ids_wrap_past_the_top_and_skip_used_ones() {
        let a = tcp(1);
        let mut s = MapSnapshot::default();
        s.services.insert(
            service_key(&a, 0),
            master_value(&spec(&[1, 2], None), 2, 7, false),
        );
        s.services
            .insert(service_key(&a, 1), slot_value(u32::MAX, 7));
        s.services.insert(service_key(&a, 2), slot_value(1, 7));
        s.backends
            .insert(u32::MAX, backend_value(&be(1, 8080), Protocol::Tcp));
        s.backends
            .insert(1, backend_value(&be(2, 8080), Protocol::Tcp));
        let (s, _) = transition(&s, &state(&[(a, &[1, 2, 3], None)]));
        let ids = backend_ids(&s, a);
        assert_eq!(ids[&be(3, 8080)], 2);
        assert_eq!(ids[&be(1, 8080)], u32::MAX);
        assert_eq!(rev_nat_id(&s, a), 7);
    }

    #[test]
    fn repairs_an_interrupted_plan() {
        let a = tcp(1);
        let mut s = program(&state(&[(a, &[1, 2], None)]));
        // A crash after writing a backend and a slot, before the master.
        s.backends
            .insert(500, backend_value(&be(3, 8080), Protocol::Tcp));
        s.services
            .insert(service_key(&a, 3), slot_value(500, rev_nat_id(&s, a)));
        // And a backend written for a plan that never got to its slot.
        s.backends
            .insert(501, backend_value(&be(4, 8080), Protocol::Tcp));
        let (s, ops) = transition(&s, &state(&[(a, &[1, 2, 3], None)]));
        assert_eq!(backend_ids(&s, a)[&be(3, 8080)], 500);
        assert_eq!(ops.last(), Some(&MapOp::DeleteBackend { id: 501 }));
    }

    #[test]
    fn full_services_map_leaves_the_frontend_untouched() {
        let (a, b, c) = (tcp(1), tcp(2), tcp(3));
        let s = program(&state(&[(a, &[1], None), (c, &[1, 2], None)]));
        assert_eq!(s.services.len(), 5);
        // b needs 3 new keys and a 1 more; c goes away, but only after the others.
        let want = state(&[(a, &[1, 2], None), (b, &[1, 2], None)]);
        let p = plan(
            &want,
            &s,
            Capacity {
                services: 7,
                backends: 100,
                frontend_ids: MAX_REV_NAT_ID,
            },
        );
        assert_eq!(
            p.rejected,
            [ReconcileError::MapFull {
                service: "default/web:http".to_owned(),
                frontend: b,
                map: "LB_SERVICES",
                capacity: 7,
                flag: "services-map-size",
            }]
        );
        assert!(p.rejected[0].to_string().contains("--services-map-size"));
        let mut after = s.clone();
        after.apply(&p.ops);
        assert_never_half_written(&after, "partial plan");
        assert_programs(&after, &state(&[(a, &[1, 2], None)]));
        // With c gone there is room now.
        let p2 = plan(
            &want,
            &after,
            Capacity {
                services: 7,
                backends: 100,
                frontend_ids: MAX_REV_NAT_ID,
            },
        );
        assert!(p2.rejected.is_empty());
    }

    #[test]
    fn full_backends_map_leaves_the_frontend_untouched() {
        let (a, b) = (tcp(1), tcp(2));
        let s = program(&state(&[(a, &[1], None), (b, &[1], None)]));
        // a would need 3 more backends, b 1; deletions in the same plan do not count.
        let want = state(&[(a, &[2, 3, 4], None), (b, &[2], None)]);
        let p = plan(
            &want,
            &s,
            Capacity {
                services: 100,
                backends: 4,
                frontend_ids: MAX_REV_NAT_ID,
            },
        );
        assert!(matches!(
            &p.rejected[..],
            [ReconcileError::MapFull { frontend, map: "LB_BACKENDS", flag: "backends-map-size", capacity: 4, .. }]
                if *frontend == a
        ));
        let mut after = s.clone();
        after.apply(&p.ops);
        assert_programs(&after, &state(&[(a, &[1], None), (b, &[2], None)]));
    }

    #[test]
    fn too_many_backends() {
        let a = tcp(1);
        let mut d = state(&[(a, &[], None), (tcp(2), &[1], None)]);
        let spec = d.frontends.get_mut(&a).unwrap();
        spec.backends = (0..=MAX_BACKENDS_PER_FRONTEND as u32)
            .map(|i| BackendAddr {
                ip: Ipv4Addr::from(0x0a00_0000 + i).into(),
                port: 80,
                local: false,
            })
            .collect::<BTreeSet<_>>()
            .into();
        let p = plan(&d, &MapSnapshot::default(), ROOMY);
        assert!(matches!(
            &p.rejected[..],
            [ReconcileError::TooManyBackends {
                count: 65_535,
                max: 65_534,
                ..
            }]
        ));
        let mut s = MapSnapshot::default();
        s.apply(&p.ops);
        assert_eq!(table::decode(&s).len(), 1);
    }

    #[test]
    fn out_of_frontend_ids() {
        // Ids are 32-bit; a small id space stands in for running out of them.
        const MAX: u32 = 300;
        let tight = Capacity {
            frontend_ids: MAX,
            ..ROOMY
        };
        let mut s = MapSnapshot::default();
        for rev in 1..=MAX {
            let f = Frontend::internal(
                Ipv4Addr::new(10, 97, (rev >> 8) as u8, rev as u8).into(),
                80,
                Protocol::Tcp,
            );
            s.services.insert(
                service_key(&f, 0),
                master_value(&spec(&[], None), 0, rev, false),
            );
        }
        // Everything old goes away, but only after the new frontend would need its id.
        let p = plan(&state(&[(tcp(1), &[1], None)]), &s, tight);
        assert!(matches!(
            &p.rejected[..],
            [ReconcileError::OutOfIds { max: MAX, .. }]
        ));
        assert!(p
            .ops
            .iter()
            .all(|op| matches!(op, MapOp::DeleteService { .. })));
    }

    #[test]
    fn frontend_ids_go_past_16_bits() {
        // 70k frontends: more than a 16-bit id could number.
        let mut desired = DesiredState::default();
        for i in 0..70_000u32 {
            let f = Frontend::internal(
                Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i).into(),
                80,
                Protocol::Tcp,
            );
            desired.frontends.insert(f, spec(&[1], None));
        }
        let p = plan(&desired, &MapSnapshot::default(), ROOMY);
        assert!(p.rejected.is_empty(), "{:?}", &p.rejected[..1]);
        let mut s = MapSnapshot::default();
        s.apply(&p.ops);
        let table = table::decode(&s);
        assert_eq!(table.len(), 70_000);
        let ids: BTreeSet<u32> = table.iter().map(|f| f.rev_nat_id).collect();
        assert_eq!(ids.len(), 70_000);
        assert!(ids.last().copied().unwrap() > u32::from(u16::MAX));
    }

    #[test]
    fn garbage_entries_are_removed_last() {
        let a = tcp(1);
        let mut s = program(&state(&[(a, &[1], None)]));
        let bad = ServiceKey {
            _pad: [1, 0],
            ..service_key(&tcp(9), 0)
        };
        s.services.insert(bad, ServiceValue::default());
        let sctp = ServiceKey {
            proto: 132,
            ..service_key(&tcp(8), 0)
        };
        s.services.insert(sctp, ServiceValue::default());
        let (_, ops) = transition(&s, &state(&[(a, &[1], None)]));
        assert_eq!(
            ops,
            [
                MapOp::DeleteService { key: sctp },
                MapOp::DeleteService { key: bad }
            ]
        );
    }

    /// xorshift64*: a reproducible stream without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn random_state(rng: &mut Rng) -> DesiredState {
        let mut d = DesiredState::default();
        for last in 1..=4u8 {
            for (port, protocol) in [
                (80, Protocol::Tcp),
                (53, Protocol::Udp),
                (53, Protocol::Tcp),
            ] {
                if rng.below(10) < 6 {
                    let backends: Vec<u8> = (0..8).filter(|_| rng.below(3) == 0).collect();
                    let affinity = [None, Some(10_800), Some(60)][rng.below(3) as usize];
                    d.frontends
                        .insert(fe(last, port, protocol), spec(&backends, affinity));
                }
            }
        }
        d
    }

    #[test]
    fn random_transitions_are_never_half_written_and_keep_ids() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut s = MapSnapshot::default();
        for _ in 0..300 {
            let to = random_state(&mut rng);
            let before = table::decode(&s);
            let max_before = s.backends.keys().copied().max().unwrap_or(0);
            let (next, _) = transition(&s, &to);
            for after in table::decode(&next) {
                let Some(old) = before.iter().find(|b| b.frontend == after.frontend) else {
                    continue;
                };
                assert_eq!(after.rev_nat_id, old.rev_nat_id);
                for b in &after.backends {
                    match old
                        .backends
                        .iter()
                        .find(|o| (o.ip, o.port) == (b.ip, b.port))
                    {
                        Some(o) => assert_eq!(o.id, b.id),
                        None => assert!(b.id > max_before),
                    }
                }
            }
            s = next;
        }
    }

    /// The frontends whose spec differs between `a` and `b`, with the internal
    /// twin of each external one (its master's flag follows the external entry).
    fn changed_between(a: &DesiredState, b: &DesiredState) -> BTreeSet<Frontend> {
        let mut changed: BTreeSet<Frontend> = a
            .frontends
            .keys()
            .chain(b.frontends.keys())
            .filter(|f| a.frontends.get(f) != b.frontends.get(f))
            .copied()
            .collect();
        let twins: Vec<Frontend> = changed
            .iter()
            .filter(|f| f.scope == Scope::External)
            .map(|f| f.with_scope(Scope::Internal))
            .collect();
        changed.extend(twins);
        changed
    }

    /// Gives about one internal frontend in `one_in` an external entry, with the
    /// first `backends` of its backends.
    fn add_externals(state: &mut DesiredState, rng: &mut Rng, one_in: u64, backends: usize) {
        let externals: Vec<(Frontend, FrontendSpec)> = state
            .frontends
            .iter()
            .filter(|_| rng.below(one_in) == 0)
            .map(|(f, spec)| {
                let mut spec = spec.clone();
                spec.backends =
                    std::sync::Arc::new(spec.backends.iter().take(backends).copied().collect());
                (f.with_scope(Scope::External), spec)
            })
            .collect();
        state.frontends.extend(externals);
    }

    /// A start written in pieces: every prefix of the writes is consistent, an
    /// external entry is written with its internal twin, and the table ends as one
    /// plan from scratch programs it.
    #[test]
    fn a_start_planned_in_pieces_programs_the_whole_table() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..20 {
            let mut desired = random_state(&mut rng);
            add_externals(&mut desired, &mut rng, 3, usize::MAX);
            let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
            let mut s = MapSnapshot::default();
            let mut pieces = 0;
            plan_in_pieces(&desired, &mut known, ROOMY, 2, |plan| {
                assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
                pieces += 1;
                let planned: BTreeSet<Frontend> = table::decode(&{
                    let mut after = s.clone();
                    after.apply(&plan.ops);
                    after
                })
                .iter()
                .map(|f| f.frontend)
                .collect();
                for f in &planned {
                    let twin = f.with_scope(Scope::External);
                    if f.scope == Scope::Internal && desired.frontends.contains_key(&twin) {
                        assert!(
                            planned.contains(&twin),
                            "round {round}: {f} without its twin"
                        );
                    }
                }
                for op in &plan.ops {
                    s.apply(std::slice::from_ref(op));
                    assert_never_half_written(&s, &format!("round {round}, {op:?}"));
                }
                Ok::<(), ()>(())
            })
            .unwrap();
            assert_eq!(known.snapshot(), &s);
            assert_programs(&s, &desired);
            let internal = desired
                .frontends
                .keys()
                .filter(|f| f.scope == Scope::Internal)
                .count();
            assert!(pieces >= internal / 2, "round {round}: {pieces} pieces");
            assert!(super::plan(&desired, &s, ROOMY).is_empty());
        }
    }

    /// Per-change planning against the kept table, over random transitions (with
    /// external entries coming and going): the kernel's maps hold exactly the
    /// desired state after each change, as a full plan from scratch would program
    /// it, every prefix of the ops is consistent, and a full plan afterwards has
    /// nothing left to do.
    #[test]
    fn planning_only_the_changed_frontends_matches_a_full_plan() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut desired = DesiredState::default();
        let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
        for step in 0..400 {
            let mut next = random_state(&mut rng);
            // Some internal frontends get an external entry of their own backends.
            add_externals(&mut next, &mut rng, 4, 1);
            let changed = changed_between(&desired, &next);
            // Now and then a full plan (start, repair), whose ids the kept table
            // must learn from its ops.
            let plan = if step % 37 == 0 {
                super::plan(&next, known.snapshot(), ROOMY)
            } else {
                plan_changes(&next, &changed, &mut known, ROOMY)
            };
            assert!(plan.rejected.is_empty(), "step {step}: {:?}", plan.rejected);
            let mut s = known.snapshot().clone();
            for (i, op) in plan.ops.iter().enumerate() {
                s.apply(std::slice::from_ref(op));
                if let Some(problem) = half_written(&s) {
                    panic!("step {step}, after op {i} {op:?}: {problem}");
                }
            }
            known.apply(&plan.ops);
            assert_eq!(known.snapshot(), &s);
            assert_programs(known.snapshot(), &next);
            assert_eq!(
                table::decode(known.snapshot())
                    .into_iter()
                    .map(|f| (f.frontend, f.backends.len()))
                    .collect::<Vec<_>>(),
                table::decode(&program(&next))
                    .into_iter()
                    .map(|f| (f.frontend, f.backends.len()))
                    .collect::<Vec<_>>(),
                "step {step}"
            );
            let full = super::plan(&next, known.snapshot(), ROOMY);
            assert!(
                full.is_empty(),
                "step {step}: left for a full plan: {:?}",
                full.ops
            );
            desired = next;
        }
    }

    /// Ids freed by a change are handed out again only after the ones ahead.
    #[test]
    fn a_kept_table_frees_the_ids_of_what_it_deleted() {
        let a = tcp(1);
        let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
        let one = state(&[(a, &[1, 2], None)]);
        let changed: BTreeSet<Frontend> = [a].into();
        let p = plan_changes(&one, &changed, &mut known, ROOMY);
        known.apply(&p.ops);
        let ids: BTreeSet<u32> = known.snapshot().backends.keys().copied().collect();
        assert_eq!(ids, [1, 2].into());
        let p = plan_changes(&state(&[]), &changed, &mut known, ROOMY);
        known.apply(&p.ops);
        assert!(known.snapshot().services.is_empty() && known.snapshot().backends.is_empty());
        assert!(known.backend_ids.used.is_empty() && known.rev_nat_ids.used.is_empty());
        let p = plan_changes(&one, &changed, &mut known, ROOMY);
        known.apply(&p.ops);
        let ids: BTreeSet<u32> = known.snapshot().backends.keys().copied().collect();
        assert_eq!(ids, [3, 4].into(), "not the ids just freed");
    }

    /// A kept table that learnt a full plan's ids hands out the next one above
    /// them, as the full plan's own allocator would (no search from 1 up).
    #[test]
    fn a_kept_table_counts_on_above_the_ids_a_full_plan_wrote() {
        let a = tcp(1);
        let full = plan(
            &state(&[(a, &[1, 2, 3], None)]),
            &MapSnapshot::default(),
            ROOMY,
        );
        let mut known = KnownTable::new(MapSnapshot::default(), ROOMY);
        known.apply(&full.ops);
        assert_eq!(known.backend_ids.next, 4);
        assert_eq!(known.rev_nat_ids.next, 2);
    }
}
