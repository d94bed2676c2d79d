//! The API source's cache of one kind: objects by namespace and name, spread over a
//! fixed number of shards, each published as one part of [`Objects`]. A watch
//! event changes one object, so it rebuilds one shard's part; the consumer skips
//! every other part by its allocation. A change then costs its shard (about 1/256
//! of the objects), where a snapshot of the whole cache would cost every object.

use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashTable;

use k8s_openapi::api::core::v1::Node;

use super::lean::{EndpointSlice, Service};

/// Shards per kind: at 100k Services and 100k slices, a change rebuilds a part of
/// about 400 objects of each kind.
pub const SHARDS: usize = 256;

/// What the cache reads of an object: where it goes and whether it changed.
pub trait Cached {
    fn namespace(&self) -> Option<&str>;
    fn name(&self) -> Option<&str>;
    fn resource_version(&self) -> Option<&str>;
}

macro_rules! cached {
    ($type:ty) => {
        impl Cached for $type {
            fn namespace(&self) -> Option<&str> {
                self.metadata.namespace.as_deref()
            }
            fn name(&self) -> Option<&str> {
                self.metadata.name.as_deref()
            }
            fn resource_version(&self) -> Option<&str> {
                self.metadata.resource_version.as_deref()
            }
        }
    };
}

cached!(Service);
cached!(EndpointSlice);
cached!(Node);

/// The hash of an object's namespace and name: it picks the shard (bits 32 to 39,
/// which the shard's own table uses for neither its bucket nor its tag) and the
/// place in the shard's table.
fn hash_name(namespace: &str, name: &str) -> u64 {
    let mut hasher = rustc_hash::FxHasher::default();
    namespace.hash(&mut hasher);
    name.hash(&mut hasher);
    hasher.finish()
}

fn hash_of<K: Cached>(object: &K) -> u64 {
    hash_name(
        object.namespace().unwrap_or_default(),
        object.name().unwrap_or_default(),
    )
}

fn shard_of(hash: u64) -> usize {
    ((hash >> 32) % SHARDS as u64) as usize
}

fn same_name<K: Cached>(a: &K, b: &K) -> bool {
    a.name() == b.name() && a.namespace().unwrap_or_default() == b.namespace().unwrap_or_default()
}

/// Both hold a version, and it is the same: the object did not change.
fn same_version<K: Cached>(a: &K, b: &K) -> bool {
    match (a.resource_version(), b.resource_version()) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

fn empty_tables<K>() -> Vec<HashTable<Arc<K>>> {
    (0..SHARDS).map(|_| HashTable::new()).collect()
}

/// Puts `object` in `table`, in place of the one of its name if any.
fn put<K: Cached>(table: &mut HashTable<Arc<K>>, hash: u64, object: Arc<K>) {
    match table.find_mut(hash, |held| same_name(held.as_ref(), object.as_ref())) {
        Some(held) => *held = object,
        None => {
            table.insert_unique(hash, object, |o| hash_of(o.as_ref()));
        }
    }
}

/// One kind's objects, in shards, with the shards changed since they were last taken.
/// Each shard is a table of the objects themselves, found by their own namespace
/// and name: a key held beside each object (two `String`s in a B-tree) cost about
/// 150 bytes per object, 30 MB at 100k Services and 100k slices.
#[derive(Debug)]
pub struct ShardedStore<K> {
    shards: Vec<HashTable<Arc<K>>>,
    dirty: BTreeSet<usize>,
    /// The objects of a relist under way, by shard, each allocated once where it
    /// will be kept. (One map of whole objects was rehashed, object bytes and all,
    /// as 100k of them arrived: 9% of a 100k start, mostly page faults.)
    relist: Option<Vec<HashTable<Arc<K>>>>,
}

impl<K: Cached> Default for ShardedStore<K> {
    fn default() -> Self {
        ShardedStore {
            shards: empty_tables(),
            dirty: BTreeSet::new(),
            relist: None,
        }
    }
}

impl<K: Cached> ShardedStore<K> {
    /// An object added or changed (a watch event). False when the same version is
    /// held already.
    pub fn apply(&mut self, object: K) -> bool {
        let hash = hash_of(&object);
        let shard = shard_of(hash);
        let table = &mut self.shards[shard];
        if table
            .find(hash, |held| same_name(held.as_ref(), &object))
            .is_some_and(|held| same_version(held.as_ref(), &object))
        {
            return false;
        }
        put(table, hash, Arc::new(object));
        self.dirty.insert(shard);
        true
    }

    /// An object deleted. False when it was not held.
    pub fn delete(&mut self, object: &K) -> bool {
        let hash = hash_of(object);
        let shard = shard_of(hash);
        let Ok(held) = self.shards[shard].find_entry(hash, |held| same_name(held.as_ref(), object))
        else {
            return false;
        };
        held.remove();
        self.dirty.insert(shard);
        true
    }

    /// A (re)list begins: what it returns will replace the cache when it is done.
    /// Until then the cache stays as it was.
    pub fn relist_begin(&mut self) {
        self.relist = Some(empty_tables());
    }

    pub fn relist_item(&mut self, object: K) {
        let hash = hash_of(&object);
        let tables = self.relist.get_or_insert_with(empty_tables);
        put(&mut tables[shard_of(hash)], hash, Arc::new(object));
    }

    /// The relist replaces the cache: objects it did not return are deleted, those
    /// of a new version replaced; those of the same version stay as they were (the
    /// same allocation). False when nothing changed.
    pub fn relist_done(&mut self) -> bool {
        let tables = self.relist.take().unwrap_or_else(empty_tables);
        let mut changed = false;
        for (index, (shard, mut listed)) in self.shards.iter_mut().zip(tables).enumerate() {
            let before = shard.len();
            shard.retain(|held| {
                listed
                    .find(hash_of(held.as_ref()), |fresh| {
                        same_name(fresh.as_ref(), held.as_ref())
                    })
                    .is_some_and(|fresh| same_version(held.as_ref(), fresh.as_ref()))
            });
            let mut touched = shard.len() != before;
            for held in shard.iter() {
                if let Ok(fresh) = listed.find_entry(hash_of(held.as_ref()), |fresh| {
                    same_name(fresh.as_ref(), held.as_ref())
                }) {
                    fresh.remove();
                }
            }
            // What remains is new, or of a new version.
            touched |= !listed.is_empty();
            for fresh in listed.drain() {
                shard.insert_unique(hash_of(fresh.as_ref()), fresh, |o| hash_of(o.as_ref()));
            }
            if touched {
                self.dirty.insert(index);
                changed = true;
            }
        }
        changed
    }

    /// Shards changed since the last call.
    pub fn take_dirty(&mut self) -> BTreeSet<usize> {
        std::mem::take(&mut self.dirty)
    }

    /// One shard's objects, in no particular order (the index orders them by name).
    pub fn shard(&self, index: usize) -> impl Iterator<Item = &Arc<K>> {
        self.shards[index].iter()
    }

    /// Every object, in shard order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<K>> {
        self.shards.iter().flat_map(|s| s.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::super::lean::Meta;
    use super::*;

    fn svc(name: &str, version: &str) -> Service {
        Service {
            metadata: Meta {
                namespace: Some("default".into()),
                name: Some(name.into()),
                resource_version: Some(version.into()),
                ..Meta::default()
            },
            ..Service::default()
        }
    }

    fn names(store: &ShardedStore<Service>) -> BTreeSet<String> {
        store
            .all()
            .map(|s| {
                format!(
                    "{}@{}",
                    s.metadata.name.as_deref().unwrap(),
                    s.metadata.resource_version.as_deref().unwrap()
                )
            })
            .collect()
    }

    fn shard_of_name(name: &str) -> usize {
        shard_of(hash_name("default", name))
    }

    #[test]
    fn a_change_dirties_only_its_shard() {
        let mut store = ShardedStore::default();
        for i in 0..1000 {
            assert!(store.apply(svc(&format!("s{i}"), "1")));
        }
        assert!(store.take_dirty().len() > SHARDS / 2);
        assert!(store.apply(svc("s7", "2")));
        assert_eq!(store.take_dirty(), [shard_of_name("s7")].into());
        // The same version again (a resumed watch repeating itself): no change.
        assert!(!store.apply(svc("s7", "2")));
        assert!(store.delete(&svc("s8", "1")));
        assert!(!store.delete(&svc("s8", "1")));
        assert_eq!(store.take_dirty(), [shard_of_name("s8")].into());
        assert_eq!(store.all().count(), 999);
    }

    #[test]
    fn a_relist_replaces_the_cache_and_keeps_unchanged_objects() {
        let mut store = ShardedStore::default();
        for name in ["a", "b", "c"] {
            store.apply(svc(name, "1"));
        }
        store.take_dirty();
        let b = store
            .all()
            .find(|s| s.metadata.name.as_deref() == Some("b"))
            .unwrap()
            .clone();

        // Nothing new: nothing changes, no shard is dirty.
        store.relist_begin();
        for name in ["a", "b", "c"] {
            store.relist_item(svc(name, "1"));
        }
        assert!(!store.relist_done());
        assert!(store.take_dirty().is_empty());

        // During the relist the cache is unchanged; after it, a is gone, c changed,
        // d came, and b is the same allocation.
        store.relist_begin();
        store.relist_item(svc("b", "1"));
        store.relist_item(svc("c", "5"));
        store.relist_item(svc("d", "6"));
        assert_eq!(
            names(&store),
            ["a@1", "b@1", "c@1"].map(String::from).into()
        );
        assert!(store.relist_done());
        assert_eq!(
            names(&store),
            ["b@1", "c@5", "d@6"].map(String::from).into()
        );
        let dirty = store.take_dirty();
        let expected: BTreeSet<usize> = ["a", "c", "d"].iter().map(|n| shard_of_name(n)).collect();
        assert_eq!(dirty, expected);
        let b_now = store
            .all()
            .find(|s| s.metadata.name.as_deref() == Some("b"))
            .unwrap();
        assert!(Arc::ptr_eq(&b, b_now));
    }
}
