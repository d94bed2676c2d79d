//! Small strings that repeat across objects (node names, protocols, Service types
//! and policies, address types), held once and shared. A hundred thousand
//! endpoints naming a few hundred nodes hold a few hundred strings, not a hundred
//! thousand: an `Arc<str>` is 16 bytes where a `String` is 24 plus its own
//! allocation.

use std::sync::{Arc, Mutex};

use rustc_hash::FxHashSet;
use serde::de::Visitor;
use serde::{Deserialize, Deserializer};

/// Strings held by the table alone are dropped when it has grown to this many,
/// or twice as many as were held at the last drop: a name no object uses any more
/// (a node gone, a hostile value) is not kept for ever, and dropping costs O(1)
/// per string added.
const FLOOR: usize = 1024;

struct Table {
    strings: FxHashSet<Arc<str>>,
    limit: usize,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// The shared copy of `s`.
pub fn intern(s: &str) -> Arc<str> {
    let mut guard = TABLE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let table = guard.get_or_insert_with(|| Table {
        strings: FxHashSet::default(),
        limit: FLOOR,
    });
    if let Some(held) = table.strings.get(s) {
        return held.clone();
    }
    if table.strings.len() >= table.limit {
        table.strings.retain(|held| Arc::strong_count(held) > 1);
        table.limit = FLOOR.max(2 * table.strings.len());
    }
    let shared: Arc<str> = Arc::from(s);
    table.strings.insert(shared.clone());
    shared
}

/// Reads a string straight into the table (no `String` on the way).
struct SharedVisitor;

impl<'de> Visitor<'de> for SharedVisitor {
    type Value = Arc<str>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E>(self, s: &str) -> Result<Arc<str>, E> {
        Ok(intern(s))
    }
}

/// `deserialize_with` for a required string kept shared.
pub fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Arc<str>, D::Error> {
    deserializer.deserialize_str(SharedVisitor)
}

/// `deserialize_with` for an optional string kept shared.
pub fn option<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Arc<str>>, D::Error> {
    struct OptionVisitor;
    impl<'de> Visitor<'de> for OptionVisitor {
        type Value = Option<Arc<str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            required(d).map(Some)
        }
    }
    deserializer.deserialize_option(OptionVisitor)
}

/// `deserialize_with` for an optional list of strings kept shared.
pub fn list<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<Arc<str>>>, D::Error> {
    #[derive(Deserialize)]
    struct Shared(#[serde(deserialize_with = "required")] Arc<str>);
    let list = Option::<Vec<Shared>>::deserialize(deserializer)?;
    Ok(list.map(|l| l.into_iter().map(|Shared(s)| s).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_allocation() {
        let a = intern("intern-test-node-a");
        let b = intern(&String::from("intern-test-node-a"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "intern-test-node-a");
        assert!(!Arc::ptr_eq(&a, &intern("intern-test-node-b")));
    }

    /// Strings no one holds any more are dropped as the table grows, and the ones
    /// held stay shared.
    #[test]
    fn unused_strings_are_dropped() {
        let kept = intern("intern-test-kept");
        for i in 0..4 * FLOOR {
            intern(&format!("intern-test-gone-{i}"));
        }
        let guard = TABLE.lock().unwrap();
        let table = guard.as_ref().unwrap();
        assert!(
            table.strings.len() <= 2 * FLOOR + 64,
            "{}",
            table.strings.len()
        );
        assert!(table.strings.contains("intern-test-kept"));
        drop(guard);
        assert!(Arc::ptr_eq(&kept, &intern("intern-test-kept")));
    }
}
