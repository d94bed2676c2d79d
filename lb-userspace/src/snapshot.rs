//! The kernel's service table as the agent holds it: what it read from the pinned
//! maps, or what it wrote to them (its copy, kept between changes).

use std::collections::BTreeMap;

use lb_common::{Backend, ServiceKey, ServiceValue};

use crate::codec::MapOp;

/// The kernel's service table as read from the pinned maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapSnapshot {
    /// Every `LB_SERVICES` entry (masters and slots).
    pub services: ServiceEntries,
    /// Every `LB_BACKENDS` entry.
    pub backends: BTreeMap<u32, Backend>,
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
    }
}
