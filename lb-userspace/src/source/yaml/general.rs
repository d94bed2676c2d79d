//! The general path: any YAML (flow style, anchors, tags, quoting the block reader
//! does not take) or JSON document, read into a generic value by a full parser and
//! then into typed objects. Slower than the fast paths, but it is the one that
//! words every problem (the parser's message with the file's line numbers, a
//! missing kind or name, another apiVersion, a schema error) and says where it is,
//! so the fast paths can simply give up on anything that is not a clean load.

use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use lb_yaml::Document;
use serde_json::Value;

use super::kinds::{classify, unnamed, Kind, Ours};
use crate::source::lean::{EndpointSlice, Service};
use crate::source::{Capped, Location, ObjectError, Objects, Problem};

/// One YAML document of `file` that the block reader did not take.
pub(super) fn take_yaml_document(file: &Path, doc: &Document, objects: &mut Objects) {
    let location = Location {
        file: file.to_owned(),
        document: doc.index,
        line: doc.line,
        item: None,
    };
    match serde_norway::from_str::<StrictValue>(&doc.text) {
        Ok(StrictValue(value)) => take_document(value, &location, objects),
        Err(_) => {
            // Parse again with the document at its place in the file so the
            // error's line numbers are the file's; only on the rare error path.
            let padded = "\n".repeat(doc.text_line - 1) + &doc.text;
            let message = match serde_norway::from_str::<StrictValue>(&padded) {
                Err(e) => e.to_string(),
                Ok(_) => "unreadable document".to_owned(),
            };
            objects.errors.push(ObjectError {
                location: Some(location),
                ..ObjectError::new("", "", "", Problem::InvalidYaml { message })
            });
        }
    }
}

/// serde_json's `Value`, except that a mapping repeating a key is an error:
/// serde_json keeps the last value silently, while kubectl and the API server refuse
/// such an object (and the block reader gives up on it, leaving it to this path).
struct StrictValue(Value);

impl<'de> serde::Deserialize<'de> for StrictValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    /// As serde_json does: a float JSON cannot hold (NaN, infinity) is null.
    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        serde::Deserialize::deserialize(d).map(|StrictValue(v)| v)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate key {:?} in a mapping; remove one of them (kubectl and the \
                     API server refuse it)",
                    Capped(&key)
                )));
            }
            let StrictValue(value) = map.next_value()?;
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }
}

fn str_field<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get(field).and_then(Value::as_str)
}

fn meta_field<'a>(value: &'a Value, field: &str) -> &'a str {
    value
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn kind_of(value: &Value) -> Kind {
    classify(str_field(value, "apiVersion"), str_field(value, "kind"))
}

/// One document, read into a generic value (from YAML or JSON).
pub(super) fn take_document(value: Value, location: &Location, objects: &mut Objects) {
    if value.is_null() {
        return; // an empty document, e.g. a trailing `---`
    }
    let Kind::List { item } = kind_of(&value) else {
        return take_object(value, location, objects);
    };
    let Value::Object(mut list) = value else {
        unreachable!("has a kind, so it is a mapping")
    };
    let items = match list.remove("items") {
        None | Some(Value::Null) => return,
        Some(Value::Array(items)) => items,
        Some(_) => {
            let kind = list.get("kind").and_then(Value::as_str).unwrap_or("");
            objects.errors.push(ObjectError {
                location: Some(location.clone()),
                ..ObjectError::new(kind, "", "", Problem::ItemsNotAList)
            });
            return;
        }
    };
    for (i, mut value) in items.into_iter().enumerate() {
        if let (Some(default), Value::Object(fields)) = (item, &mut value) {
            fields
                .entry("kind")
                .or_insert_with(|| Value::String(default.kind().to_owned()));
            fields
                .entry("apiVersion")
                .or_insert_with(|| Value::String(default.api_version().to_owned()));
        }
        let location = Location {
            item: Some(i),
            ..location.clone()
        };
        take_object(value, &location, objects);
    }
}

/// One object (a document, or an item of a list): loaded, passed over, or reported.
fn take_object(value: Value, location: &Location, objects: &mut Objects) {
    let namespace = meta_field(&value, "namespace").to_owned();
    let name = meta_field(&value, "name").to_owned();
    let error = |kind: &str, problem: Problem| ObjectError {
        location: Some(location.clone()),
        ..ObjectError::new(kind, &namespace, &name, problem)
    };
    if !value.is_object() {
        objects.errors.push(error("", Problem::NotAnObject));
        return;
    }
    let ours = match kind_of(&value) {
        Kind::Ours(ours) => ours,
        Kind::OtherVersion(ours) => {
            let problem = Problem::UnsupportedApiVersion {
                kind: ours.kind().to_owned(),
                found: str_field(&value, "apiVersion").unwrap_or("").to_owned(),
                expected: ours.api_version(),
            };
            objects.errors.push(error(ours.kind(), problem));
            return;
        }
        Kind::Missing => {
            objects.errors.push(error("", Problem::MissingKind));
            return;
        }
        // Not ours to proxy; nor is a list inside a list.
        Kind::List { .. } | Kind::Other => return,
    };
    let kind = ours.kind();
    let schema = |e: serde_json::Error| Problem::Schema {
        kind,
        message: e.to_string(),
    };
    match ours {
        Ours::Service => match serde_json::from_value::<Service>(value) {
            Ok(svc) if unnamed(&svc.metadata) => {
                objects.errors.push(error(kind, Problem::MissingName))
            }
            Ok(svc) => objects.services.push(Arc::new(svc)),
            Err(e) => objects.errors.push(error(kind, schema(e))),
        },
        Ours::EndpointSlice => match serde_json::from_value::<EndpointSlice>(value) {
            Ok(slice) if unnamed(&slice.metadata) => {
                objects.errors.push(error(kind, Problem::MissingName))
            }
            Ok(slice) => objects.slices.push(Arc::new(slice)),
            Err(e) => objects.errors.push(error(kind, schema(e))),
        },
        Ours::Node => match serde_json::from_value::<Node>(value) {
            Ok(node) => objects.nodes.push(Arc::new(node)),
            Err(e) => objects.errors.push(error(kind, schema(e))),
        },
        Ours::NetworkPolicy | Ours::Pod | Ours::Namespace => {
            match super::kinds::policy_object(ours, value) {
                Ok(object) => object.add_to(objects),
                Err(super::kinds::PolicyObjectError::Schema(e)) => {
                    objects.errors.push(error(kind, schema(e)))
                }
                Err(super::kinds::PolicyObjectError::Invalid(e)) => {
                    objects.errors.push(ObjectError {
                        location: Some(location.clone()),
                        ..*e
                    })
                }
            }
        }
    }
}
