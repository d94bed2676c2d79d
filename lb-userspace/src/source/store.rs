//! The API source's cache of one kind: the objects by namespace and name, as the
//! watchers last reported them. Every change it takes says what it replaced, so the
//! source hands on `previous -> current` per object (see [`super::changes`])
//! without keeping anything else.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashTable;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use super::lean::{EndpointSlice, Service};

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
cached!(Pod);
cached!(Namespace);
cached!(NetworkPolicy);

fn hash_of<K: Cached>(object: &K) -> u64 {
    let mut hasher = rustc_hash::FxHasher::default();
    object.namespace().unwrap_or_default().hash(&mut hasher);
    object.name().unwrap_or_default().hash(&mut hasher);
    hasher.finish()
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

/// One object's change: what was held before, and what is held now.
pub type Replaced<K> = (Option<Arc<K>>, Option<Arc<K>>);

/// One kind's objects. A table of the objects themselves, found by their own
/// namespace and name: a key held beside each object (two `String`s in a B-tree)
/// cost about 150 bytes per object, 30 MB at 100k Services and 100k slices.
#[derive(Debug)]
pub struct Store<K> {
    objects: HashTable<Arc<K>>,
    /// The objects of a relist under way, each allocated once where it will be
    /// kept. (One map of whole objects was rehashed, object bytes and all, as 100k
    /// of them arrived: 9% of a 100k start, mostly page faults.)
    relist: Option<HashTable<Arc<K>>>,
}

impl<K> Default for Store<K> {
    fn default() -> Self {
        Store {
            objects: HashTable::new(),
            relist: None,
        }
    }
}

impl<K: Cached> Store<K> {
    /// An object added or changed (a watch event): what it replaced, and itself.
    /// `None` when the same version is held already.
    pub fn apply(&mut self, object: K) -> Option<Replaced<K>> {
        let hash = hash_of(&object);
        let object = Arc::new(object);
        match self
            .objects
            .find_mut(hash, |held| same_name(held.as_ref(), object.as_ref()))
        {
            Some(held) if same_version(held.as_ref(), object.as_ref()) => None,
            Some(held) => {
                let previous = std::mem::replace(held, object.clone());
                Some((Some(previous), Some(object)))
            }
            None => {
                self.objects
                    .insert_unique(hash, object.clone(), |o| hash_of(o.as_ref()));
                Some((None, Some(object)))
            }
        }
    }

    /// An object deleted: what was held. `None` when it was not held.
    pub fn delete(&mut self, object: &K) -> Option<Replaced<K>> {
        let hash = hash_of(object);
        let held = self
            .objects
            .find_entry(hash, |held| same_name(held.as_ref(), object))
            .ok()?;
        let (previous, _) = held.remove();
        Some((Some(previous), None))
    }

    /// A (re)list begins: what it returns will replace the cache when it is done.
    /// Until then the cache stays as it was.
    pub fn relist_begin(&mut self) {
        self.relist = Some(HashTable::new());
    }

    pub fn relist_item(&mut self, object: K) {
        let hash = hash_of(&object);
        let listed = self.relist.get_or_insert_with(HashTable::new);
        match listed.find_mut(hash, |held| same_name(held.as_ref(), &object)) {
            Some(held) => *held = Arc::new(object),
            None => {
                listed.insert_unique(hash, Arc::new(object), |o| hash_of(o.as_ref()));
            }
        }
    }

    /// The relist replaces the cache: objects it did not return are deleted, those
    /// of a new version replaced; those of the same version stay as they were (the
    /// same allocation). Returns what changed.
    pub fn relist_done(&mut self) -> Vec<Replaced<K>> {
        let mut listed = self.relist.take().unwrap_or_default();
        let mut changed = Vec::new();
        // What is held and listed again at the same version stays; the rest of what
        // is held is gone or replaced.
        self.objects.retain(|held| {
            let hash = hash_of(held.as_ref());
            match listed.find_entry(hash, |fresh| same_name(fresh.as_ref(), held.as_ref())) {
                Ok(fresh) if same_version(held.as_ref(), fresh.get().as_ref()) => {
                    fresh.remove();
                    true
                }
                Ok(fresh) => {
                    let (fresh, _) = fresh.remove();
                    changed.push((Some(held.clone()), Some(fresh)));
                    false
                }
                Err(_) => {
                    changed.push((Some(held.clone()), None));
                    false
                }
            }
        });
        // What remains listed is new; the replacements go in with it.
        for fresh in listed.drain() {
            changed.push((None, Some(fresh)));
        }
        for (_, current) in &changed {
            if let Some(current) = current {
                self.objects
                    .insert_unique(hash_of(current.as_ref()), current.clone(), |o| {
                        hash_of(o.as_ref())
                    });
            }
        }
        changed
    }

    /// Every object, in no particular order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<K>> {
        self.objects.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::super::lean::Meta;
    use super::*;

    fn svc(name: &str, version: &str) -> Service {
        Service {
            metadata: Meta {
                namespace: Some(super::super::intern::intern("default")),
                name: Some(name.into()),
                resource_version: Some(version.into()),
                ..Meta::default()
            },
            ..Service::default()
        }
    }

    fn names(store: &Store<Service>) -> std::collections::BTreeSet<String> {
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

    fn version(object: &Option<Arc<Service>>) -> Option<&str> {
        object.as_ref()?.metadata.resource_version.as_deref()
    }

    #[test]
    fn a_change_says_what_it_replaced() {
        let mut store = Store::default();
        let (before, now) = store.apply(svc("a", "1")).unwrap();
        assert!(before.is_none() && version(&now) == Some("1"));
        let (before, now) = store.apply(svc("a", "2")).unwrap();
        assert_eq!((version(&before), version(&now)), (Some("1"), Some("2")));
        // The same version again (a resumed watch repeating itself): no change.
        assert!(store.apply(svc("a", "2")).is_none());
        let (before, now) = store.delete(&svc("a", "2")).unwrap();
        assert_eq!((version(&before), now.is_none()), (Some("2"), true));
        assert!(store.delete(&svc("a", "2")).is_none());
        assert_eq!(store.all().count(), 0);
    }

    #[test]
    fn a_relist_replaces_the_cache_and_keeps_unchanged_objects() {
        let mut store = Store::default();
        for name in ["a", "b", "c"] {
            store.apply(svc(name, "1"));
        }
        let b = store
            .all()
            .find(|s| s.metadata.name.as_deref() == Some("b"))
            .unwrap()
            .clone();

        // Nothing new: nothing changes.
        store.relist_begin();
        for name in ["a", "b", "c"] {
            store.relist_item(svc(name, "1"));
        }
        assert!(store.relist_done().is_empty());

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
        let mut changed: Vec<(Option<String>, Option<String>)> = store
            .relist_done()
            .iter()
            .map(|(b, n)| {
                (
                    version(b).map(|_| name_of(b)),
                    version(n).map(|_| name_of(n)),
                )
            })
            .collect();
        changed.sort();
        assert_eq!(
            changed,
            [
                (None, Some("d@6".into())),
                (Some("a@1".into()), None),
                (Some("c@1".into()), Some("c@5".into())),
            ]
        );
        assert_eq!(
            names(&store),
            ["b@1", "c@5", "d@6"].map(String::from).into()
        );
        let b_now = store
            .all()
            .find(|s| s.metadata.name.as_deref() == Some("b"))
            .unwrap();
        assert!(Arc::ptr_eq(&b, b_now));
    }

    fn name_of(object: &Option<Arc<Service>>) -> String {
        let s = object.as_ref().unwrap();
        format!(
            "{}@{}",
            s.metadata.name.as_deref().unwrap(),
            s.metadata.resource_version.as_deref().unwrap()
        )
    }
}
