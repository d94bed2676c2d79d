//! Small strings that repeat across objects (node names, protocols, Service types
//! and policies, address types), held once and shared. A hundred thousand
//! endpoints naming a few hundred nodes hold a few hundred strings, not a hundred
//! thousand: a shared string is 16 bytes where a `String` is 24 plus its own
//! allocation.

use internment::ArcIntern;
use serde::de::Visitor;
use serde::{Deserialize, Deserializer};

/// A shared string: one allocation per distinct value, freed with its last user
/// (internment's table; a node gone or a hostile value is not kept for ever).
pub type Shared = ArcIntern<str>;

/// The shared copy of `s`.
pub fn intern(s: &str) -> Shared {
    Shared::from(s)
}

/// Reads a string straight into the table (no `String` on the way).
struct SharedVisitor;

impl<'de> Visitor<'de> for SharedVisitor {
    type Value = Shared;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E>(self, s: &str) -> Result<Shared, E> {
        Ok(intern(s))
    }
}

/// `deserialize_with` for a required string kept shared.
pub fn required<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Shared, D::Error> {
    deserializer.deserialize_str(SharedVisitor)
}

/// `deserialize_with` for an optional string kept shared.
pub fn option<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Shared>, D::Error> {
    struct OptionVisitor;
    impl<'de> Visitor<'de> for OptionVisitor {
        type Value = Option<Shared>;
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
pub fn list<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<Shared>>, D::Error> {
    #[derive(Deserialize)]
    struct Item(#[serde(deserialize_with = "required")] Shared);
    let list = Option::<Vec<Item>>::deserialize(deserializer)?;
    Ok(list.map(|l| l.into_iter().map(|Item(s)| s).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_strings_share_one_allocation() {
        let a = intern("intern-test-node-a");
        let b = intern(&String::from("intern-test-node-a"));
        assert!(std::ptr::eq::<str>(&*a, &*b));
        assert_eq!(&*a, "intern-test-node-a");
        assert!(!std::ptr::eq::<str>(&*a, &*intern("intern-test-node-b")));
    }
}
