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

use super::unnamed;
use crate::source::lean::{EndpointSlice, Service};
use crate::source::Objects;

/// A document (or an item of a list) read by the block YAML reader, typed by its
/// `apiVersion` and `kind` before its fields are read. Only clean loads: anything
/// the general path would report (a missing kind, another version of a kind we
/// proxy, a schema error) fails the whole document, which then takes that path.
pub(super) enum Manifest {
    Service(Arc<Service>),
    Slice(Arc<EndpointSlice>),
    Node(Arc<Node>),
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
            Manifest::List(items) => items.into_iter().for_each(|i| i.add_to(objects)),
            Manifest::Other => {}
        }
    }
}

/// `items` of a list; typed lists from the API leave kind and apiVersion out of
/// their items, so those are read as the list's item type.
#[derive(serde::Deserialize)]
struct Items<T> {
    #[serde(default = "Option::default")]
    items: Option<Vec<T>>,
}

impl<T> Items<T> {
    fn into_manifests(self, wrap: impl Fn(T) -> Manifest) -> Manifest {
        Manifest::List(self.items.into_iter().flatten().map(wrap).collect())
    }
}

/// A list's item: an object of any kind, but not another list.
struct ListItem(Manifest);

impl<'de> serde::Deserialize<'de> for Manifest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_enum(
            block_yaml::KIND_TAGGED,
            &[],
            ManifestVisitor { lists: true },
        )
    }
}

impl<'de> serde::Deserialize<'de> for ListItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_enum(
            block_yaml::KIND_TAGGED,
            &[],
            ManifestVisitor { lists: false },
        )
        .map(ListItem)
    }
}

struct ManifestVisitor {
    /// Whether a list is read as one; items that are lists are not ours to proxy,
    /// as on the general path.
    lists: bool,
}

impl<'de> serde::de::Visitor<'de> for ManifestVisitor {
    type Value = Manifest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<Manifest, A::Error> {
        use serde::de::{Error, IgnoredAny, VariantAccess};
        let ((api_version, kind), object): ((Cow<str>, Cow<str>), _) = data.variant()?;
        let not_clean = || A::Error::custom("left to the general path");
        Ok(match (api_version.as_ref(), kind.as_ref()) {
            ("v1", "Service") => {
                let service: Service = object.newtype_variant()?;
                if unnamed(&service.metadata) {
                    return Err(not_clean());
                }
                Manifest::Service(Arc::new(service))
            }
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                let slice: EndpointSlice = object.newtype_variant()?;
                if unnamed(&slice.metadata) {
                    return Err(not_clean());
                }
                Manifest::Slice(Arc::new(slice))
            }
            ("v1", "Node") => Manifest::Node(Arc::new(object.newtype_variant()?)),
            (_, "Service" | "EndpointSlice" | "Node" | "") => return Err(not_clean()),
            (_, "List") if self.lists => {
                let list: Items<ListItem> = object.newtype_variant()?;
                list.into_manifests(|item| item.0)
            }
            (_, "ServiceList") if self.lists => {
                let list: Items<Service> = object.newtype_variant()?;
                if list.items.iter().flatten().any(|s| unnamed(&s.metadata)) {
                    return Err(not_clean());
                }
                list.into_manifests(|s| Manifest::Service(Arc::new(s)))
            }
            (_, "EndpointSliceList") if self.lists => {
                let list: Items<EndpointSlice> = object.newtype_variant()?;
                if list.items.iter().flatten().any(|s| unnamed(&s.metadata)) {
                    return Err(not_clean());
                }
                list.into_manifests(|s| Manifest::Slice(Arc::new(s)))
            }
            _ => {
                object.newtype_variant::<IgnoredAny>()?;
                Manifest::Other
            }
        })
    }
}
