//! The fast path for block-style YAML, what `kubectl get -o yaml` writes: the
//! block reader hands each mapping over typed by its (apiVersion, kind), so a
//! Service is built straight from the text, without libyaml or a generic value in
//! between. This is where a 10k-Service file spends its time; it only ever takes
//! clean loads, and leaves everything else (and the wording of every error) to the
//! general path.

use std::borrow::Cow;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use lb_yaml::block as block_yaml;
use serde::de::{self, DeserializeSeed, IgnoredAny, VariantAccess};

use super::kinds::{classify, unnamed, ApiObject, Kind, Ours, PolicyObject};
use crate::source::lean::{EndpointSlice, Service};
use crate::source::Objects;

/// A document (or an item of a list) read by the block YAML reader, typed by its
/// `apiVersion` and `kind` before its fields are read. Only clean loads: anything
/// the general path would report (a missing kind, another version of a kind we
/// proxy, a missing name, a schema error) fails the whole document, which then
/// takes that path.
pub(super) enum Manifest {
    Service(Arc<Service>),
    Slice(Arc<EndpointSlice>),
    Node(Arc<Node>),
    Policy(PolicyObject),
    List(Vec<Manifest>),
    /// Not ours to proxy, read through only to check it is well-formed.
    Other,
}

impl Manifest {
    pub(super) fn add_to(self, objects: &mut Objects) {
        match self {
            Manifest::Service(service) => objects.services.push(service),
            Manifest::Slice(slice) => objects.slices.push(slice),
            Manifest::Node(node) => objects.nodes.push(node),
            Manifest::Policy(object) => object.add_to(objects),
            Manifest::List(items) => items.into_iter().for_each(|i| i.add_to(objects)),
            Manifest::Other => {}
        }
    }
}

impl<'de> serde::Deserialize<'de> for Manifest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Place::Document.deserialize(d)
    }
}

/// Where a mapping is read: a whole document, or an item of a list whose items
/// default to the list's item kind ([`Kind::List`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Document,
    Item { default: Option<Ours> },
}

impl<'de> DeserializeSeed<'de> for Place {
    type Value = Manifest;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Manifest, D::Error> {
        d.deserialize_enum(block_yaml::KIND_TAGGED, &[], self)
    }
}

impl<'de> de::Visitor<'de> for Place {
    type Value = Manifest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Manifest, A::Error> {
        let ((api_version, kind), object): ((Cow<str>, Cow<str>), _) = data.variant()?;
        let not_clean = || de::Error::custom("left to the general path");
        // The reader gives an absent field as "", so an item's explicit empty kind
        // takes the default too; the general path would pass that item over.
        let (api_version, kind) = match self {
            Place::Item {
                default: Some(default),
            } => (
                or(api_version, default.api_version()),
                or(kind, default.kind()),
            ),
            _ => (api_version, kind),
        };
        let kind = Some(kind.as_ref()).filter(|k| !k.is_empty());
        Ok(match classify(Some(&api_version), kind) {
            Kind::Ours(Ours::Service) => {
                let service: Service = object.newtype_variant()?;
                if unnamed(&service.metadata) {
                    return Err(not_clean());
                }
                Manifest::Service(Arc::new(service))
            }
            Kind::Ours(Ours::EndpointSlice) => {
                let slice: EndpointSlice = object.newtype_variant()?;
                if unnamed(&slice.metadata) {
                    return Err(not_clean());
                }
                Manifest::Slice(Arc::new(slice))
            }
            Kind::Ours(Ours::Node) => Manifest::Node(Arc::new(object.newtype_variant()?)),
            Kind::Ours(ours @ (Ours::NetworkPolicy | Ours::Pod | Ours::Namespace)) => {
                let api = object.newtype_variant_seed(ReadApi(ours))?;
                // A policy object that makes no sense is reported by the general path.
                Manifest::Policy(PolicyObject::from_api(api).map_err(|_| not_clean())?)
            }
            Kind::OtherVersion(_) | Kind::Missing => return Err(not_clean()),
            Kind::List { item } if self == Place::Document => {
                object.newtype_variant_seed(List { item })?
            }
            Kind::List { .. } | Kind::Other => {
                object.newtype_variant::<IgnoredAny>()?;
                Manifest::Other
            }
        })
    }
}

fn or<'a>(value: Cow<'a, str>, default: &'static str) -> Cow<'a, str> {
    match value.is_empty() {
        true => Cow::Borrowed(default),
        false => value,
    }
}

/// A list's mapping: only `items` is read, each item as [`Place::Item`].
struct List {
    item: Option<Ours>,
}

/// The keys of a list that matter.
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum ListField {
    Items,
    #[serde(other)]
    Other,
}

impl<'de> DeserializeSeed<'de> for List {
    type Value = Manifest;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Manifest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> de::Visitor<'de> for List {
    type Value = Manifest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of Kubernetes objects")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Manifest, A::Error> {
        let mut items = None;
        while let Some(field) = map.next_key()? {
            match field {
                ListField::Items if items.is_some() => {
                    return Err(de::Error::duplicate_field("items"))
                }
                ListField::Items => items = Some(map.next_value_seed(Items(self.item))?),
                ListField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Manifest::List(items.unwrap_or_default()))
    }
}

/// `items:` of a list: null (or absent) is no items.
struct Items(Option<Ours>);

impl<'de> DeserializeSeed<'de> for Items {
    type Value = Vec<Manifest>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<Manifest>, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> de::Visitor<'de> for Items {
    type Value = Vec<Manifest>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sequence of Kubernetes objects")
    }

    fn visit_none<E>(self) -> Result<Vec<Manifest>, E> {
        Ok(Vec::new())
    }

    fn visit_unit<E>(self) -> Result<Vec<Manifest>, E> {
        Ok(Vec::new())
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<Manifest>, D::Error> {
        d.deserialize_seq(self)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Manifest>, A::Error> {
        let place = Place::Item { default: self.0 };
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(place)? {
            items.push(item);
        }
        Ok(items)
    }
}

/// Reads the API type of a policy kind.
struct ReadApi(Ours);

impl<'de> DeserializeSeed<'de> for ReadApi {
    type Value = ApiObject;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<ApiObject, D::Error> {
        ApiObject::read(self.0, d)?.ok_or_else(|| de::Error::custom("not a policy kind"))
    }
}
