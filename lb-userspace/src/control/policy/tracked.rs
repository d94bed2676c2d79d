//! A map's desired content, and what changed in it since it was last asked.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use super::MapDiff;

/// A map's content and the entries changed since the last [`Tracked::take`], with
/// their value before the first change.
pub(super) struct Tracked<K, V> {
    cur: BTreeMap<K, V>,
    touched: HashMap<K, Option<V>>,
}

impl<K, V> Default for Tracked<K, V> {
    fn default() -> Self {
        Tracked {
            cur: BTreeMap::new(),
            touched: HashMap::new(),
        }
    }
}

impl<K: Ord + Hash + Copy, V: Copy + PartialEq> Tracked<K, V> {
    pub fn current(&self) -> &BTreeMap<K, V> {
        &self.cur
    }

    pub fn set(&mut self, key: K, value: Option<V>) {
        let old = match value {
            Some(v) => self.cur.insert(key, v),
            None => self.cur.remove(&key),
        };
        self.touched.entry(key).or_insert(old);
    }

    pub fn take(&mut self) -> MapDiff<K, V> {
        let mut diff = MapDiff::default();
        for (key, old) in self.touched.drain() {
            match (old, self.cur.get(&key)) {
                (None, Some(v)) => diff.inserts.push((key, *v)),
                (Some(o), Some(v)) if o != *v => diff.updates.push((key, *v)),
                (Some(_), None) => diff.deletes.push(key),
                _ => {}
            }
        }
        diff.inserts.sort_by_key(|a| a.0);
        diff.updates.sort_by_key(|a| a.0);
        diff.deletes.sort();
        diff
    }
}
