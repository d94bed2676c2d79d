//! What an (apiVersion, kind) pair is to lb, written once. Three readers decide it
//! (the block fast path, the JSON fast path, the general path that words errors);
//! if each kept its own table, a manifest could load one way as block YAML and
//! another way as JSON or flow YAML, and the fast paths would stop being mere
//! shortcuts of the general one.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy as NetworkPolicyApi;

use crate::model::policy::{NetworkPolicy, PolicyNamespace, PolicyPod};
use crate::source::{policy, ObjectError, Objects};

/// A kind lb proxies (or, for Node, reads the zone and addresses of).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ours {
    Service,
    EndpointSlice,
    Node,
    NetworkPolicy,
    Pod,
    Namespace,
}

impl Ours {
    pub(super) const fn kind(self) -> &'static str {
        match self {
            Ours::Service => "Service",
            Ours::EndpointSlice => "EndpointSlice",
            Ours::Node => "Node",
            Ours::NetworkPolicy => "NetworkPolicy",
            Ours::Pod => "Pod",
            Ours::Namespace => "Namespace",
        }
    }

    /// The one apiVersion lb reads the kind at; any other is reported, naming this
    /// one as the fix.
    pub(super) const fn api_version(self) -> &'static str {
        match self {
            Ours::Service | Ours::Node | Ours::Pod | Ours::Namespace => "v1",
            Ours::EndpointSlice => "discovery.k8s.io/v1",
            Ours::NetworkPolicy => "networking.k8s.io/v1",
        }
    }
}

/// What a document, or an item of a list, is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Ours(Ours),
    /// One of ours at an apiVersion lb does not read: an error, not a silent skip,
    /// since the user meant it to be proxied.
    OtherVersion(Ours),
    /// A list, whatever its apiVersion. Typed lists from the API (`ServiceList`,
    /// `EndpointSliceList`) leave kind and apiVersion out of their items: those are
    /// then `item`'s. A list inside a list is not read (the API server never
    /// writes one), so a reader given an item takes this as [`Kind::Other`].
    List {
        item: Option<Ours>,
    },
    /// No kind at all: reported, as the API server would refuse it.
    Missing,
    /// Not ours to proxy: passed over.
    Other,
}

/// The table. `None` is a field that is absent (or, for the general path, not a
/// string); an empty string is a kind lb does not know.
pub(super) fn classify(api_version: Option<&str>, kind: Option<&str>) -> Kind {
    let ours = match kind {
        None => return Kind::Missing,
        Some("Service") => Ours::Service,
        Some("EndpointSlice") => Ours::EndpointSlice,
        Some("Node") => Ours::Node,
        Some("NetworkPolicy") => Ours::NetworkPolicy,
        Some("Pod") => Ours::Pod,
        Some("Namespace") => Ours::Namespace,
        Some("List") => return Kind::List { item: None },
        Some("ServiceList") => {
            return Kind::List {
                item: Some(Ours::Service),
            }
        }
        Some("EndpointSliceList") => {
            return Kind::List {
                item: Some(Ours::EndpointSlice),
            }
        }
        Some("NetworkPolicyList") => {
            return Kind::List {
                item: Some(Ours::NetworkPolicy),
            }
        }
        Some("PodList") => {
            return Kind::List {
                item: Some(Ours::Pod),
            }
        }
        Some("NamespaceList") => {
            return Kind::List {
                item: Some(Ours::Namespace),
            }
        }
        Some(_) => return Kind::Other,
    };
    if api_version == Some(ours.api_version()) {
        Kind::Ours(ours)
    } else {
        Kind::OtherVersion(ours)
    }
}

/// No name: the API server refuses such an object, and a Service or slice without
/// one cannot be told apart from others in messages or matched to its slices.
pub(super) fn unnamed(meta: &crate::source::lean::Meta) -> bool {
    meta.name.as_deref().is_none_or(str::is_empty)
}

/// A NetworkPolicy, Pod or Namespace, read into the policy model.
pub(super) enum PolicyObject {
    Policy(Arc<NetworkPolicy>),
    Pod(Arc<PolicyPod>),
    Namespace(Arc<PolicyNamespace>),
}

impl PolicyObject {
    pub(super) fn add_to(self, objects: &mut Objects) {
        match self {
            PolicyObject::Policy(p) => objects.network_policies.push(p),
            PolicyObject::Pod(p) => objects.pods.push(p),
            PolicyObject::Namespace(n) => objects.namespaces.push(n),
        }
    }

    /// From the API type `ours` names, already read; `None` for another kind.
    pub(super) fn from_api(api: ApiObject) -> Result<Self, Box<ObjectError>> {
        Ok(match api {
            ApiObject::Policy(p) => PolicyObject::Policy(Arc::new(policy::network_policy(&p)?)),
            ApiObject::Pod(p) => PolicyObject::Pod(Arc::new(policy::pod(&p)?)),
            ApiObject::Namespace(n) => PolicyObject::Namespace(Arc::new(policy::namespace(&n)?)),
        })
    }
}

/// The API types of the policy kinds.
pub(super) enum ApiObject {
    Policy(Box<NetworkPolicyApi>),
    Pod(Box<Pod>),
    Namespace(Box<Namespace>),
}

impl ApiObject {
    /// Reads the API type of `ours` (one of the policy kinds) from `d`.
    pub(super) fn read<'de, D: serde::Deserializer<'de>>(
        ours: Ours,
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        use serde::Deserialize;
        Ok(Some(match ours {
            Ours::NetworkPolicy => ApiObject::Policy(Box::new(NetworkPolicyApi::deserialize(d)?)),
            Ours::Pod => ApiObject::Pod(Box::new(Pod::deserialize(d)?)),
            Ours::Namespace => ApiObject::Namespace(Box::new(Namespace::deserialize(d)?)),
            Ours::Service | Ours::EndpointSlice | Ours::Node => return Ok(None),
        }))
    }
}

/// Why a policy kind did not load: it does not fit its schema, or it does not make
/// sense (named by [`policy`]'s decoders).
pub(super) enum PolicyObjectError {
    Schema(serde_json::Error),
    Invalid(Box<ObjectError>),
}

/// A policy kind from a generic value (the general and JSON paths).
pub(super) fn policy_object(
    ours: Ours,
    value: serde_json::Value,
) -> Result<PolicyObject, PolicyObjectError> {
    match ApiObject::read(ours, value) {
        Ok(Some(api)) => PolicyObject::from_api(api).map_err(PolicyObjectError::Invalid),
        Ok(None) => unreachable!("only called for the policy kinds"),
        Err(e) => Err(PolicyObjectError::Schema(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table() {
        use Ours::*;
        let cases = [
            ((Some("v1"), Some("Service")), Kind::Ours(Service)),
            ((Some("v1"), Some("Node")), Kind::Ours(Node)),
            (
                (Some("discovery.k8s.io/v1"), Some("EndpointSlice")),
                Kind::Ours(EndpointSlice),
            ),
            ((Some("v2"), Some("Service")), Kind::OtherVersion(Service)),
            ((None, Some("Node")), Kind::OtherVersion(Node)),
            (
                (Some("discovery.k8s.io/v1beta1"), Some("EndpointSlice")),
                Kind::OtherVersion(EndpointSlice),
            ),
            ((Some("v1"), Some("List")), Kind::List { item: None }),
            (
                (None, Some("ServiceList")),
                Kind::List {
                    item: Some(Service),
                },
            ),
            (
                (Some("v1"), Some("EndpointSliceList")),
                Kind::List {
                    item: Some(EndpointSlice),
                },
            ),
            ((Some("v1"), None), Kind::Missing),
            ((Some("v1"), Some("")), Kind::Other),
            ((Some("v1"), Some("ConfigMap")), Kind::Other),
            // Kinds are case-sensitive, as the API server's are.
            ((Some("v1"), Some("service")), Kind::Other),
        ];
        for ((api_version, kind), want) in cases {
            assert_eq!(
                classify(api_version, kind),
                want,
                "{api_version:?} {kind:?}"
            );
        }
        assert_eq!(
            (
                Service.api_version(),
                EndpointSlice.api_version(),
                Node.api_version()
            ),
            ("v1", "discovery.k8s.io/v1", "v1")
        );
    }
}
