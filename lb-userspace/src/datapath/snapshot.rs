//! The kernel's service table as the agent holds it: what it read from the pinned
//! maps, or what it wrote to them (its copy, kept between changes).

use std::collections::BTreeMap;

use lb_common::{Backend, ServiceKey, ServiceValue};

/// One map write, applied in plan order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend {
        id: u32,
        backend: Backend,
    },
    PutService {
        key: ServiceKey,
        value: ServiceValue,
    },
    DeleteService {
        key: ServiceKey,
    },
    DeleteBackend {
        id: u32,
    },
    /// One Maglev table, written whole into `LB_MAGLEV` from arena slot
    /// `first_slot` (a multiple of four) on; the entries past its last slot, to
    /// the end of its last 4-slot entry, get position 0.
    PutMaglev {
        first_slot: u32,
        positions: Box<[u16]>,
    },
    /// The seed the tables in `LB_MAGLEV` are built with, into its header entry.
    PutMaglevSeed {
        seed: u64,
    },
}

/// The kernel's service table as read from the pinned maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapSnapshot {
    /// Every `LB_SERVICES` entry (masters and slots).
    pub services: ServiceEntries,
    /// Every `LB_BACKENDS` entry.
    pub backends: BackendEntries,
    /// The seed `LB_MAGLEV`'s header names (its tables are not read: see
    /// `control::maglev_tables`).
    pub maglev_seed: u64,
}

impl MapSnapshot {
    /// Applies `ops` as the kernel applies them to the maps; for tests, dry runs and
    /// the agent's copy of what it wrote.
    pub fn apply(&mut self, ops: &[MapOp]) {
        for op in ops {
            match *op {
                MapOp::PutBackend { id, backend } => {
                    self.backends.insert(id, backend);
                }
                MapOp::PutService { key, value } => {
                    self.services.insert(key, value);
                }
                MapOp::DeleteService { key } => {
                    self.services.remove(&key);
                }
                MapOp::DeleteBackend { id } => {
                    self.backends.remove(&id);
                }
                MapOp::PutMaglev { .. } => {}
                MapOp::PutMaglevSeed { seed } => self.maglev_seed = seed,
            }
        }
    }
}

/// `LB_SERVICES` entries grouped by frontend: each frontend's key once, its
/// master, and its slots in slot order. One B-tree entry per (key, value) was
/// 11.8 MB at 10k Services x 10 endpoints (heaptrack): the 24-byte key repeated
/// for every slot, in nodes about half full. Any key the map can hold is kept,
/// including ones the agent does not write (a stray slot, an unknown protocol,
/// non-zero padding), so the copy compares equal to the map it mirrors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntries {
    groups: BTreeMap<ServiceKey, Group>,
    len: usize,
}

/// One frontend's entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Group {
    /// Slot 0.
    pub master: Option<ServiceValue>,
    /// Slots 1 and up, sorted by slot, kept without growth room.
    pub slots: Vec<(u16, ServiceValue)>,
}

impl Group {
    fn is_empty(&self) -> bool {
        self.master.is_none() && self.slots.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (u16, &ServiceValue)> {
        self.master
            .iter()
            .map(|m| (0, m))
            .chain(self.slots.iter().map(|(slot, v)| (*slot, v)))
    }
}

/// The group a key belongs to: the key of its frontend's master.
fn group_of(key: &ServiceKey) -> ServiceKey {
    ServiceKey {
        backend_slot: 0,
        ..*key
    }
}

impl ServiceEntries {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, key: &ServiceKey) -> Option<&ServiceValue> {
        let group = self.groups.get(&group_of(key))?;
        match key.backend_slot {
            0 => group.master.as_ref(),
            slot => group
                .slots
                .binary_search_by_key(&slot, |(s, _)| *s)
                .ok()
                .map(|at| &group.slots[at].1),
        }
    }

    pub fn contains_key(&self, key: &ServiceKey) -> bool {
        self.get(key).is_some()
    }

    /// Inserts or replaces the entry of `key`; returns the value replaced.
    pub fn insert(&mut self, key: ServiceKey, value: ServiceValue) -> Option<ServiceValue> {
        let group = self.groups.entry(group_of(&key)).or_default();
        let before = match key.backend_slot {
            0 => group.master.replace(value),
            slot => match group.slots.binary_search_by_key(&slot, |(s, _)| *s) {
                Ok(at) => Some(std::mem::replace(&mut group.slots[at].1, value)),
                Err(at) => {
                    // Exactly one more place: slots come one at a time, and a
                    // vector's doubling would leave up to half of it unused.
                    group.slots.reserve_exact(1);
                    group.slots.insert(at, (slot, value));
                    None
                }
            },
        };
        if before.is_none() {
            self.len += 1;
        }
        before
    }

    /// Removes the entry of `key`; returns its value.
    pub fn remove(&mut self, key: &ServiceKey) -> Option<ServiceValue> {
        let group_key = group_of(key);
        let group = self.groups.get_mut(&group_key)?;
        let removed = match key.backend_slot {
            0 => group.master.take(),
            slot => group
                .slots
                .binary_search_by_key(&slot, |(s, _)| *s)
                .ok()
                .map(|at| group.slots.remove(at).1),
        };
        if group.is_empty() {
            self.groups.remove(&group_key);
        } else if group.slots.capacity() > 2 * group.slots.len() + 4 {
            group.slots.shrink_to_fit();
        }
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    /// The entries of the frontend whose master key is `master` (slot ignored).
    pub fn group(&self, master: &ServiceKey) -> Option<&Group> {
        self.groups.get(&group_of(master))
    }

    /// Every entry, frontend by frontend, each master before its slots.
    pub fn iter(&self) -> impl Iterator<Item = (ServiceKey, &ServiceValue)> {
        self.groups.iter().flat_map(|(master, group)| {
            group.iter().map(move |(slot, value)| {
                (
                    ServiceKey {
                        backend_slot: slot,
                        ..*master
                    },
                    value,
                )
            })
        })
    }

    pub fn keys(&self) -> impl Iterator<Item = ServiceKey> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &ServiceValue> {
        self.iter().map(|(_, v)| v)
    }

    /// Every frontend's master key (slot 0) and entries.
    pub fn groups(&self) -> impl Iterator<Item = (&ServiceKey, &Group)> {
        self.groups.iter()
    }
}

impl Extend<(ServiceKey, ServiceValue)> for ServiceEntries {
    fn extend<I: IntoIterator<Item = (ServiceKey, ServiceValue)>>(&mut self, entries: I) {
        for (key, value) in entries {
            self.insert(key, value);
        }
    }
}

impl FromIterator<(ServiceKey, ServiceValue)> for ServiceEntries {
    fn from_iter<I: IntoIterator<Item = (ServiceKey, ServiceValue)>>(entries: I) -> Self {
        let mut all = ServiceEntries::default();
        all.extend(entries);
        all
    }
}

impl std::ops::Index<&ServiceKey> for ServiceEntries {
    type Output = ServiceValue;
    fn index(&self, key: &ServiceKey) -> &ServiceValue {
        self.get(key).expect("no entry for this key")
    }
}

/// `LB_BACKENDS` entries in one vector sorted by id. A B-tree entry per backend
/// was 49 MB at 100k Services x 10 endpoints (heaptrack; nodes about half full);
/// here an entry is 28 bytes. New ids count up (see `reconcile::IdAllocator`), so
/// inserts append; a removed entry stays as a tombstone until tombstones are half
/// the vector, or until an append finds the vector full with more than a
/// sixteenth of it tombstones, so neither costs a move of the rest each time.
#[derive(Clone, Debug, Default)]
pub struct BackendEntries {
    entries: Vec<(u32, Option<Backend>)>,
    live: usize,
}

impl BackendEntries {
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Room for `additional` more entries at once, and an eighth more: a start
    /// knows how many it writes, and growing by an eighth at a time would copy
    /// the vector over and over, each copy a second vector for a moment (28 MB at
    /// 100k x 10); the eighth is for the ids changes append later, until
    /// tombstones can be reused in place (see `insert`). Room never written is
    /// never touched, so reserving more than is used costs no memory that is
    /// resident.
    pub fn reserve(&mut self, additional: usize) {
        self.entries.reserve_exact(additional + additional / 8);
    }

    fn position(&self, id: u32) -> Result<usize, usize> {
        // Appends are the common case: look at the end before searching.
        match self.entries.last() {
            Some((last, _)) if *last < id => Err(self.entries.len()),
            _ => self.entries.binary_search_by_key(&id, |(i, _)| *i),
        }
    }

    pub fn get(&self, id: &u32) -> Option<&Backend> {
        let at = self.position(*id).ok()?;
        self.entries[at].1.as_ref()
    }

    pub fn contains_key(&self, id: &u32) -> bool {
        self.get(id).is_some()
    }

    /// Inserts or replaces the entry of `id`; returns the value replaced.
    pub fn insert(&mut self, id: u32, backend: Backend) -> Option<Backend> {
        match self.position(id) {
            Ok(at) => {
                let before = self.entries[at].1.replace(backend);
                if before.is_none() {
                    self.live += 1;
                }
                before
            }
            Err(mut at) => {
                if self.entries.len() == self.entries.capacity() {
                    let dead = self.entries.len() - self.live;
                    if dead > self.entries.len() / 16 {
                        // The tombstones' room first, in place: growing copies
                        // the whole vector, the old one alive meanwhile. Under
                        // churn every replaced backend leaves a tombstone behind
                        // an appended id, and the copies were the peak RSS at
                        // 100k Services (issue 22's bench: +14 MiB after churn).
                        self.entries.retain(|(_, b)| b.is_some());
                        at = self.position(id).expect_err("the id has no entry");
                    } else {
                        // Grow by an eighth: amortized appends, at most 12.5%
                        // unused (doubling would leave up to half).
                        self.entries.reserve_exact(self.entries.len() / 8 + 64);
                    }
                }
                self.entries.insert(at, (id, Some(backend)));
                self.live += 1;
                None
            }
        }
    }

    /// Removes the entry of `id`; returns its value.
    pub fn remove(&mut self, id: &u32) -> Option<Backend> {
        let at = self.position(*id).ok()?;
        let removed = self.entries[at].1.take()?;
        self.live -= 1;
        let dead = self.entries.len() - self.live;
        if dead > 64 && dead > self.live {
            self.entries.retain(|(_, b)| b.is_some());
            self.entries.shrink_to(self.live + self.live / 8);
        }
        Some(removed)
    }

    /// Every entry in id order.
    pub fn iter(&self) -> impl Iterator<Item = (&u32, &Backend)> {
        self.entries
            .iter()
            .filter_map(|(id, b)| Some((id, b.as_ref()?)))
    }

    pub fn keys(&self) -> impl Iterator<Item = &u32> {
        self.iter().map(|(id, _)| id)
    }

    pub fn values(&self) -> impl Iterator<Item = &Backend> {
        self.iter().map(|(_, b)| b)
    }
}

impl PartialEq for BackendEntries {
    fn eq(&self, other: &Self) -> bool {
        self.live == other.live && self.iter().eq(other.iter())
    }
}

impl Eq for BackendEntries {}

impl Extend<(u32, Backend)> for BackendEntries {
    /// Entries in any order (a map read in hash order): appended, then sorted once,
    /// the last value of an id kept.
    fn extend<I: IntoIterator<Item = (u32, Backend)>>(&mut self, entries: I) {
        let sorted_before = self.entries.len();
        self.entries
            .extend(entries.into_iter().map(|(id, b)| (id, Some(b))));
        if self.entries.len() == sorted_before {
            return;
        }
        self.entries.sort_by_key(|(id, _)| *id);
        self.entries.dedup_by(|later, earlier| {
            if later.0 != earlier.0 {
                return false;
            }
            if later.1.is_some() {
                earlier.1 = later.1;
            }
            true
        });
        self.live = self.entries.iter().filter(|(_, b)| b.is_some()).count();
    }
}

impl FromIterator<(u32, Backend)> for BackendEntries {
    fn from_iter<I: IntoIterator<Item = (u32, Backend)>>(entries: I) -> Self {
        let mut all = BackendEntries::default();
        all.extend(entries);
        all
    }
}

impl<'a> IntoIterator for &'a BackendEntries {
    type Item = (&'a u32, &'a Backend);
    type IntoIter = Box<dyn Iterator<Item = (&'a u32, &'a Backend)> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(address: u8, slot: u16, proto: u8, pad: u8) -> ServiceKey {
        ServiceKey {
            address: std::net::IpAddr::from([10, 0, 0, address]).into(),
            port: 80,
            backend_slot: slot,
            proto,
            scope: 0,
            _pad: [pad, 0],
        }
    }

    fn backend(port: u16) -> Backend {
        Backend {
            port,
            ..Backend::default()
        }
    }

    /// Churn at scale: each change replaces backends by new, higher ids. Once the
    /// start's room is used, appends reuse the tombstones' room in place instead
    /// of copying the vector into a bigger one.
    #[test]
    fn churn_reuses_tombstones_instead_of_growing() {
        let mut vector = BackendEntries::default();
        vector.reserve(1000);
        for id in 0..1000 {
            vector.insert(id, backend(id as u16));
        }
        let room = vector.entries.capacity();
        assert!(room >= 1125, "the start reserves an eighth more: {room}");
        let mut next = 1000;
        for round in 0..100u32 {
            for k in 0..10 {
                assert_eq!(
                    vector.remove(&(round * 10 + k)),
                    Some(backend((round * 10 + k) as u16))
                );
                assert_eq!(vector.insert(next, backend(next as u16)), None);
                next += 1;
            }
            assert_eq!(vector.len(), 1000);
        }
        assert_eq!(
            vector.entries.capacity(),
            room,
            "the vector was copied to grow"
        );
        let ids: Vec<u32> = vector.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, (1000..2000).collect::<Vec<_>>());
    }

    fn value(n: u32) -> ServiceValue {
        ServiceValue {
            backend_id: n,
            ..ServiceValue::default()
        }
    }

    proptest! {
        /// Grouped, the entries behave as one ordered map of every key: same
        /// lookups, same replaced and removed values, same entries and count.
        #[test]
        fn behaves_as_a_map_of_every_key(
            ops in proptest::collection::vec(
                (any::<bool>(), 0u8..3, 0u16..5, prop_oneof![Just(6u8), Just(17u8), Just(132u8)], 0u8..2, any::<u32>()),
                0..200,
            )
        ) {
            let mut grouped = ServiceEntries::default();
            let mut plain: BTreeMap<ServiceKey, ServiceValue> = BTreeMap::new();
            for (put, address, slot, proto, pad, n) in ops {
                let k = key(address, slot, proto, pad);
                if put {
                    prop_assert_eq!(grouped.insert(k, value(n)), plain.insert(k, value(n)));
                } else {
                    prop_assert_eq!(grouped.remove(&k), plain.remove(&k));
                }
                prop_assert_eq!(grouped.get(&k), plain.get(&k));
                prop_assert_eq!(grouped.len(), plain.len());
            }
            let mut listed: Vec<_> = grouped.iter().map(|(k, v)| (k, *v)).collect();
            listed.sort_by_key(|(k, _)| *k);
            prop_assert_eq!(listed, plain.into_iter().collect::<Vec<_>>());
            let rebuilt: ServiceEntries = grouped.iter().map(|(k, v)| (k, *v)).collect();
            prop_assert_eq!(rebuilt, grouped);
        }

        /// The backend vector behaves as an ordered map of ids, through appends,
        /// inserts below the top, removals (and the compaction they trigger) and
        /// unordered bulk reads.
        #[test]
        fn backends_behave_as_a_map(
            ops in proptest::collection::vec((0u8..3, 0u32..400, any::<u16>()), 0..600),
            bulk in proptest::collection::vec((0u32..400, any::<u16>()), 0..50),
        ) {
            let mut vector = BackendEntries::default();
            let mut plain: BTreeMap<u32, Backend> = BTreeMap::new();
            for (op, id, port) in ops {
                let b = backend(port);
                match op {
                    0 => prop_assert_eq!(vector.insert(id, b), plain.insert(id, b)),
                    // Mostly appends, as the allocator hands ids out.
                    1 => {
                        let top = plain.keys().next_back().map_or(0, |t| t + 1);
                        prop_assert_eq!(vector.insert(top, b), plain.insert(top, b));
                    }
                    _ => prop_assert_eq!(vector.remove(&id), plain.remove(&id)),
                }
                prop_assert_eq!(vector.get(&id), plain.get(&id));
                prop_assert_eq!(vector.len(), plain.len());
            }
            let bulk: Vec<(u32, Backend)> = bulk.into_iter().map(|(id, p)| (id, backend(p))).collect();
            vector.extend(bulk.iter().copied());
            plain.extend(bulk.iter().copied());
            prop_assert_eq!(vector.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
                            plain.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>());
            prop_assert_eq!(vector.len(), plain.len());
        }
    }
}
