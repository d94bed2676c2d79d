//! JSON files (`kubectl get -o json`, or several such outputs appended): read as a
//! stream of values, each loaded straight into typed objects when it loads
//! cleanly, and through the general path otherwise, which words the problem. The
//! typed load avoids a generic value per object, which at 10k Services is most of
//! the work and memory of reading the file.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use serde_json::value::RawValue;
use serde_json::Value;

use super::general::take_document;
use super::kinds::{classify, unnamed, Kind, Ours};
use crate::source::lean::{EndpointSlice, Service};
use crate::source::{Location, ObjectError, Objects, Problem};

/// `kubectl -o json` writes one value; concatenated values (several `kubectl get`
/// appended to one file) are read one after another.
pub(super) fn parse_json(file: &Path, text: &str, objects: &mut Objects) {
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
    let mut index = 0;
    loop {
        let start = stream.byte_offset();
        let next = stream.next();
        let Some(result) = next else { break };
        index += 1;
        // Typed straight from the text when it loads cleanly; otherwise through a
        // generic value, which words the problem.
        let result = match result {
            Ok(raw) if take_json_document(raw.get(), objects) => continue,
            Ok(raw) => serde_json::from_str::<Value>(raw.get()),
            Err(e) => Err(e),
        };
        // Counted only here: counting lines for every value would be quadratic.
        let skipped = text[start..].len() - text[start..].trim_start().len();
        let line = 1 + text[..start + skipped].matches('\n').count();
        let location = Location {
            file: file.to_owned(),
            document: index,
            line,
            item: None,
        };
        match result {
            Ok(value) => take_document(value, &location, objects),
            Err(e) => {
                // The stream cannot find the start of the next value after an error
                // (and a value serde_json cannot hold is as good as unreadable).
                objects.errors.push(ObjectError {
                    location: Some(location),
                    ..ObjectError::new(
                        "",
                        "",
                        "",
                        Problem::InvalidJson {
                            message: e.to_string(),
                        },
                    )
                });
                break;
            }
        }
    }
}

/// The fields that decide what a document is.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "apiVersion")]
    api_version: Option<Cow<'a, str>>,
}

impl Head<'_> {
    fn kind(&self) -> Kind {
        classify(self.api_version.as_deref(), self.kind.as_deref())
    }
}

/// Only of a JSON object: serde would also read a struct from an array.
fn head_of(json: &str) -> Option<Head<'_>> {
    if !json.trim_start().starts_with('{') {
        return None;
    }
    serde_json::from_str(json).ok()
}

#[derive(serde::Deserialize)]
struct ListItems<'a> {
    #[serde(borrow, default)]
    items: Option<Vec<&'a RawValue>>,
}

/// Loads a document given as JSON straight into typed objects, without a generic
/// value in between. Returns false, having added nothing, for anything that is not a
/// clean load (an error, an unexpected shape): the caller then takes the general
/// path, which reports the problem with its location.
fn take_json_document(json: &str, objects: &mut Objects) -> bool {
    let Some(head) = head_of(json) else {
        return false;
    };
    let Kind::List { item } = head.kind() else {
        return take_json_object(json, head, objects);
    };
    let Ok(ListItems { items }) = serde_json::from_str::<ListItems>(json) else {
        return false;
    };
    let mut found = Objects::default();
    for raw in items.unwrap_or_default() {
        let Some(mut head) = head_of(raw.get()) else {
            return false;
        };
        if let Some(default) = item {
            head.kind.get_or_insert(Cow::Borrowed(default.kind()));
            head.api_version
                .get_or_insert(Cow::Borrowed(default.api_version()));
        }
        if !take_json_object(raw.get(), head, &mut found) {
            return false;
        }
    }
    objects.services.extend(found.services);
    objects.slices.extend(found.slices);
    objects.nodes.extend(found.nodes);
    objects.network_policies.extend(found.network_policies);
    objects.pods.extend(found.pods);
    objects.namespaces.extend(found.namespaces);
    true
}

/// One object (a document, or an item of a list); false when it is not a clean load.
fn take_json_object(json: &str, head: Head, objects: &mut Objects) -> bool {
    match head.kind() {
        Kind::Ours(Ours::Service) => match serde_json::from_str::<Service>(json) {
            Ok(service) if !unnamed(&service.metadata) => objects.services.push(Arc::new(service)),
            _ => return false,
        },
        Kind::Ours(Ours::EndpointSlice) => match serde_json::from_str::<EndpointSlice>(json) {
            Ok(slice) if !unnamed(&slice.metadata) => objects.slices.push(Arc::new(slice)),
            _ => return false,
        },
        Kind::Ours(Ours::Node) => match serde_json::from_str::<Node>(json) {
            Ok(node) => objects.nodes.push(Arc::new(node)),
            Err(_) => return false,
        },
        Kind::Ours(ours @ (Ours::NetworkPolicy | Ours::Pod | Ours::Namespace)) => {
            return serde_json::from_str::<serde_json::Value>(json)
                .ok()
                .and_then(|value| super::kinds::policy_object(ours, value).ok())
                .is_some_and(|object| {
                    object.add_to(objects);
                    true
                })
        }
        Kind::OtherVersion(_) | Kind::Missing => return false,
        // Not ours to proxy; nor is a list inside a list.
        Kind::List { .. } | Kind::Other => {}
    }
    true
}
