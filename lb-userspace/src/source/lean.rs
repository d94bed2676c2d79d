//! Services and EndpointSlices as this agent keeps them: only the fields the desired
//! state, the zone and the metrics read, decoded straight from the API's JSON (or a
//! manifest's YAML) so nothing else is ever allocated. The field names and shapes
//! are k8s-openapi's, so the reading of them (`desired`) is the same code either way.
//!
//! Why not k8s-openapi's own types: at 10k Services × 10 endpoints they made up
//! 115 of the agent's 195 MB heap peak (heaptrack, 2026-11-26). Its `Endpoint` is
//! about 340 bytes before its strings (target reference, hostname, deprecated
//! topology, a vector of addresses), a kept `labels` map costs a 540-byte B-tree
//! node, and a Service's spec carries its selector map. Here an endpoint is its
//! first address, conditions, node and hints; a slice's owner and trigger time are
//! plain fields; labels and annotations other than the ones read are skipped.
//!
//! Nodes are few (this node's one, by field selector), so they stay k8s-openapi's,
//! trimmed by [`trim_node`] as they arrive.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Container, Node, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::intern::{self, Shared};
use super::labels::{
    ANNOTATION_ALGORITHM, LABEL_HEADLESS, LABEL_PROXY_NAME, LABEL_SERVICE_NAME, LABEL_ZONE,
    LAST_CHANGE_TRIGGER_TIME,
};

/// A Service: what kube-proxy's service change tracker reads of it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Service {
    /// Name, namespace, resource version; of the labels only the two that hand the
    /// Service to another proxy or mark it headless, and of the annotations only
    /// `service.lb/algorithm`.
    #[serde(default, deserialize_with = "service_meta")]
    pub metadata: Meta,
    #[serde(default)]
    pub spec: Option<ServiceSpec>,
    #[serde(default)]
    pub status: Option<ServiceStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    #[serde(rename = "type", default, deserialize_with = "intern::option")]
    pub type_: Option<Shared>,
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs", default, deserialize_with = "fitted")]
    pub cluster_ips: Option<Vec<String>>,
    #[serde(default, deserialize_with = "intern::list")]
    pub ip_families: Option<Vec<Shared>>,
    #[serde(default, deserialize_with = "intern::option")]
    pub ip_family_policy: Option<Shared>,
    #[serde(default, deserialize_with = "fitted")]
    pub ports: Option<Vec<ServicePort>>,
    #[serde(rename = "externalIPs", default, deserialize_with = "fitted")]
    pub external_ips: Option<Vec<String>>,
    #[serde(rename = "loadBalancerIP")]
    pub load_balancer_ip: Option<String>,
    #[serde(default, deserialize_with = "fitted")]
    pub load_balancer_source_ranges: Option<Vec<String>>,
    #[serde(default, deserialize_with = "intern::option")]
    pub external_traffic_policy: Option<Shared>,
    #[serde(default, deserialize_with = "intern::option")]
    pub internal_traffic_policy: Option<Shared>,
    pub health_check_node_port: Option<i32>,
    #[serde(default, deserialize_with = "intern::option")]
    pub session_affinity: Option<Shared>,
    pub session_affinity_config: Option<SessionAffinityConfig>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    pub name: Option<String>,
    pub port: i32,
    #[serde(default, deserialize_with = "intern::option")]
    pub protocol: Option<Shared>,
    pub node_port: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct SessionAffinityConfig {
    #[serde(rename = "clientIP")]
    pub client_ip: Option<ClientIPConfig>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientIPConfig {
    pub timeout_seconds: Option<i32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    pub load_balancer: Option<LoadBalancerStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct LoadBalancerStatus {
    #[serde(default, deserialize_with = "fitted")]
    pub ingress: Option<Vec<LoadBalancerIngress>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerIngress {
    pub ip: Option<String>,
    #[serde(default, deserialize_with = "intern::option")]
    pub ip_mode: Option<Shared>,
}

/// An EndpointSlice: its owner, its endpoints and ports.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "SliceIn")]
pub struct EndpointSlice {
    /// Name, namespace, resource version; no labels or annotations (the two read
    /// are the fields below).
    pub metadata: Meta,
    /// The `kubernetes.io/service-name` label: the Service the slice belongs to.
    pub service_name: Option<String>,
    /// The `endpoints.kubernetes.io/last-change-trigger-time` annotation, as
    /// written (RFC 3339), for the network-programming latency.
    pub trigger_time: Option<String>,
    pub address_type: Shared,
    pub endpoints: Option<Vec<Endpoint>>,
    pub ports: Option<Vec<EndpointPort>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceIn {
    #[serde(default)]
    metadata: MetaIn,
    #[serde(deserialize_with = "intern::required")]
    address_type: Shared,
    #[serde(default, deserialize_with = "fitted")]
    endpoints: Option<Vec<Endpoint>>,
    #[serde(default, deserialize_with = "fitted")]
    ports: Option<Vec<EndpointPort>>,
}

impl From<SliceIn> for EndpointSlice {
    fn from(slice: SliceIn) -> Self {
        let mut meta = slice.metadata;
        EndpointSlice {
            service_name: meta.labels.take(LABEL_SERVICE_NAME),
            trigger_time: meta.annotations.take(LAST_CHANGE_TRIGGER_TIME),
            metadata: meta.into_meta(None),
            address_type: slice.address_type,
            endpoints: slice.endpoints,
            ports: slice.ports,
        }
    }
}

/// One endpoint in 48 bytes (a million of them at 100k Services x 10): the parts
/// every endpoint has inline, the rare ones (hints, an address that is not one)
/// behind one pointer.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "EndpointIn")]
pub struct Endpoint {
    /// The first of `addresses` when it is an IP address.
    ip: Option<IpAddr>,
    pub conditions: Option<EndpointConditions>,
    pub node_name: Option<Shared>,
    rare: Option<Box<Rare>>,
}
const _: () = assert!(std::mem::size_of::<Endpoint>() <= 48);

/// What few endpoints carry.
#[derive(Clone, Debug, Default, PartialEq)]
struct Rare {
    hints: Option<EndpointHints>,
    /// The first of `addresses` when it is not an IP address, as written.
    invalid_address: Option<Box<str>>,
}

impl Endpoint {
    /// The first of `addresses` (kube-proxy reads no other): an IP address, or
    /// the text of one that is not; `None` when the list is empty.
    pub fn address(&self) -> Option<EndpointAddress> {
        match (
            self.ip,
            self.rare.as_ref().and_then(|r| r.invalid_address.as_ref()),
        ) {
            (Some(ip), _) => Some(EndpointAddress::Ip(ip)),
            (None, Some(text)) => Some(EndpointAddress::Invalid(text.clone())),
            (None, None) => None,
        }
    }

    pub fn hints(&self) -> Option<&EndpointHints> {
        self.rare.as_ref()?.hints.as_ref()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EndpointIn {
    /// The first address only: the rest have no defined meaning, and are skipped
    /// unread.
    #[serde(rename = "addresses", deserialize_with = "first_address")]
    address: Option<EndpointAddress>,
    conditions: Option<EndpointConditions>,
    hints: Option<EndpointHints>,
    #[serde(default, deserialize_with = "intern::option")]
    node_name: Option<Shared>,
}

impl From<EndpointIn> for Endpoint {
    fn from(endpoint: EndpointIn) -> Self {
        let (ip, invalid_address) = match endpoint.address {
            Some(EndpointAddress::Ip(ip)) => (Some(ip), None),
            Some(EndpointAddress::Invalid(text)) => (None, Some(text)),
            None => (None, None),
        };
        let rare = (endpoint.hints.is_some() || invalid_address.is_some()).then(|| {
            Box::new(Rare {
                hints: endpoint.hints,
                invalid_address,
            })
        });
        Endpoint {
            ip,
            conditions: endpoint.conditions,
            node_name: endpoint.node_name,
            rare,
        }
    }
}

/// An endpoint's address, parsed as it is read (an IP address is 17 bytes, its
/// text 24 plus an allocation); the text is kept only when it is not an address,
/// for the error that names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointAddress {
    Ip(IpAddr),
    Invalid(Box<str>),
}

impl std::fmt::Display for EndpointAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            EndpointAddress::Ip(ip) => ip.fmt(f),
            EndpointAddress::Invalid(text) => f.write_str(text),
        }
    }
}

impl From<&str> for EndpointAddress {
    fn from(text: &str) -> Self {
        match text.parse() {
            Ok(ip) => EndpointAddress::Ip(ip),
            Err(_) => EndpointAddress::Invalid(text.into()),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct EndpointConditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointHints {
    pub for_zones: Option<Vec<ForZone>>,
    pub for_nodes: Option<Vec<ForNode>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ForZone {
    #[serde(deserialize_with = "intern::required")]
    pub name: Shared,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ForNode {
    #[serde(deserialize_with = "intern::required")]
    pub name: Shared,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct EndpointPort {
    pub name: Option<String>,
    pub port: Option<i32>,
    #[serde(default, deserialize_with = "intern::option")]
    pub protocol: Option<Shared>,
}

/// The metadata fields read, with every label and annotation as written; the
/// kinds keep the ones they need and drop the rest.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct MetaIn {
    name: Option<String>,
    namespace: Option<String>,
    resource_version: Option<String>,
    labels: Entries,
    annotations: Entries,
}

impl MetaIn {
    fn into_meta(self, labels: Option<BTreeMap<String, String>>) -> Meta {
        Meta {
            name: self.name.map(String::into_boxed_str),
            namespace: self.namespace.as_deref().map(intern::intern),
            resource_version: self.resource_version.map(String::into_boxed_str),
            labels,
        }
    }
}

/// What this agent keeps of an object's metadata: 72 bytes, where k8s-openapi's
/// `ObjectMeta` is 360 before its strings (at 100k Services and 100k slices, 58 MB
/// of nothing). The field names are `ObjectMeta`'s.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Meta {
    pub name: Option<Box<str>>,
    /// Shared by every object of the namespace.
    pub namespace: Option<Shared>,
    /// What the API source compares to know an object unchanged.
    pub resource_version: Option<Box<str>>,
    /// Of a Service's labels, the two read (another proxy's, headless), and of its
    /// annotations the one read (`service.lb/algorithm`), in one map: their names
    /// cannot collide, and a second map would cost another pointer in every
    /// object for what few Services carry. A slice keeps none.
    pub labels: Option<BTreeMap<String, String>>,
}

impl Meta {
    /// As k8s-openapi spells it, for kube-runtime's watcher (which keys and
    /// resumes by it).
    fn object_meta(&self) -> ObjectMeta {
        ObjectMeta {
            name: self.name.as_deref().map(str::to_owned),
            namespace: self.namespace.as_deref().map(str::to_owned),
            resource_version: self.resource_version.as_deref().map(str::to_owned),
            ..ObjectMeta::default()
        }
    }
}

/// An object as kube-runtime's watcher reads it: its `Resource` contract wants
/// k8s-openapi's `ObjectMeta`, which is built from the object's own [`Meta`] as
/// it is decoded and dropped as the event arrives ([`Wire::into_inner`]).
#[derive(Clone, Debug)]
pub struct Wire<T> {
    metadata: ObjectMeta,
    object: T,
}

impl<T> Wire<T> {
    pub fn into_inner(self) -> T {
        self.object
    }
}

/// The objects a [`Wire`] carries.
pub trait HasMeta {
    fn meta(&self) -> &Meta;
}

impl HasMeta for Service {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl HasMeta for EndpointSlice {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

impl<'de, T: Deserialize<'de> + HasMeta> Deserialize<'de> for Wire<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let object = T::deserialize(deserializer)?;
        Ok(Wire {
            metadata: object.meta().object_meta(),
            object,
        })
    }
}

/// A string map's entries (labels or annotations), as read; `null` reads as none.
#[derive(Default)]
struct Entries(Vec<(String, String)>);

impl Entries {
    fn take(&mut self, key: &str) -> Option<String> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.swap_remove(at).1)
    }
}

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_unit<E>(self) -> Result<Entries, E> {
                Ok(Entries::default())
            }
            fn visit_none<E>(self) -> Result<Entries, E> {
                Ok(Entries::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Entries, D::Error> {
                d.deserialize_map(self)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, String>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_option(EntriesVisitor)
    }
}

fn service_meta<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Meta, D::Error> {
    let mut meta = Option::<MetaIn>::deserialize(deserializer)?.unwrap_or_default();
    let mut labels: BTreeMap<String, String> = [LABEL_PROXY_NAME, LABEL_HEADLESS]
        .into_iter()
        .filter_map(|key| Some((key.to_owned(), meta.labels.take(key)?)))
        .collect();
    if let Some(algorithm) = meta.annotations.take(ANNOTATION_ALGORITHM) {
        labels.insert(ANNOTATION_ALGORITHM.to_owned(), algorithm);
    }
    Ok(meta.into_meta((!labels.is_empty()).then_some(labels)))
}

fn first_address<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<EndpointAddress>, D::Error> {
    struct FirstVisitor;
    impl<'de> Visitor<'de> for FirstVisitor {
        type Value = Option<EndpointAddress>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a list of addresses")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let first = seq.next_element::<std::borrow::Cow<'de, str>>()?;
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(first.map(|text| EndpointAddress::from(&*text)))
        }
    }
    deserializer.deserialize_seq(FirstVisitor)
}

/// A list kept for an object's life, without the growth room reading left (16
/// places for 10 endpoints, 4 for one port).
fn fitted<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<Vec<T>>, D::Error> {
    let mut list = Option::<Vec<T>>::deserialize(deserializer)?;
    if let Some(list) = list.as_mut() {
        list.shrink_to_fit();
    }
    Ok(list)
}

macro_rules! api_resource {
    ($type:ty, $api_version:literal, $group:literal, $kind:literal, $plural:literal) => {
        impl k8s_openapi::Resource for $type {
            const API_VERSION: &'static str = $api_version;
            const GROUP: &'static str = $group;
            const KIND: &'static str = $kind;
            const VERSION: &'static str = "v1";
            const URL_PATH_SEGMENT: &'static str = $plural;
            type Scope = k8s_openapi::NamespaceResourceScope;
        }

        impl k8s_openapi::Metadata for $type {
            type Ty = ObjectMeta;
            fn metadata(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

api_resource!(Wire<Service>, "v1", "", "Service", "services");
api_resource!(
    Wire<EndpointSlice>,
    "discovery.k8s.io/v1",
    "discovery.k8s.io",
    "EndpointSlice",
    "endpointslices"
);

/// Drops what this agent never reads of a Node (decoded whole, as k8s-openapi's):
/// name and resource version stay (the cache keys and resumes by them); of the
/// labels, only the zone; of the spec, the pod CIDRs; of the status, the addresses.
pub fn trim_node(node: &mut Node) {
    let meta = &mut node.metadata;
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.annotations = None;
    if let Some(labels) = meta.labels.as_mut() {
        labels.retain(|k, _| k == LABEL_ZONE);
    }
    // The pod CIDRs: what egress masquerading exempts, and its sources.
    node.spec = node.spec.take().map(|spec| NodeSpec {
        pod_cidr: spec.pod_cidr,
        pod_cidrs: spec.pod_cidrs,
        ..NodeSpec::default()
    });
    node.status = node.status.take().map(|status| NodeStatus {
        addresses: status.addresses,
        ..NodeStatus::default()
    });
}

/// Drops what NetworkPolicy never reads of a Pod as it arrives (10k Pods are
/// held): its labels, node, host networking, named container ports and addresses
/// stay.
pub fn trim_pod(pod: &mut Pod) {
    let meta = &mut pod.metadata;
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.annotations = None;
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        host_network: spec.host_network,
        containers: spec
            .containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                ports: c.ports,
                ..Container::default()
            })
            .collect(),
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|status| PodStatus {
        pod_ip: status.pod_ip,
        pod_ips: status.pod_ips,
        phase: status.phase,
        ..PodStatus::default()
    });
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A Service and its EndpointSlice as a real API server sends them, with much
    /// this agent never reads.
    pub(crate) fn full_api_objects() -> (serde_json::Value, serde_json::Value) {
        let service = serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "default", "resourceVersion": "7",
                "uid": "u-1", "creationTimestamp": "2026-11-24T00:00:00Z",
                "labels": {"app": "web", LABEL_PROXY_NAME: "other"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(4096),
                                ANNOTATION_ALGORITHM: "maglev"},
                "managedFields": [{"manager": "kubectl"}],
                "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "o", "uid": "u"}],
            },
            "spec": {
                "type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
                "ipFamilies": ["IPv4", "IPv6"], "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080, "appProtocol": "http"}],
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "hostname": "lb.example", "ports": [{"port": 80, "protocol": "TCP"}]}]},
                       "conditions": [{"type": "x", "status": "True"}]},
        });
        let slice = serde_json::json!({
            "metadata": {
                "name": "web-1", "namespace": "default", "resourceVersion": "8",
                "labels": {LABEL_SERVICE_NAME: "web", "endpointslice.kubernetes.io/managed-by": "x"},
                "annotations": {LAST_CHANGE_TRIGGER_TIME: "2026-11-24T00:00:00Z", "other": "y"},
                "managedFields": [{"manager": "kube-controller-manager"}],
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}],
            "endpoints": [{
                "addresses": ["10.0.0.1", "10.0.0.2"], "nodeName": "node-a", "zone": "a",
                "hostname": "web-0", "deprecatedTopology": {"a": "b"},
                "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "default"},
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "hints": {"forZones": [{"name": "a"}]},
            }],
        });
        (service, slice)
    }

    /// Objects as a real API server sends them carry much this agent never reads;
    /// decoded, they give the same service table as the same objects written with
    /// only the fields read, and the bulky parts are not kept.
    #[test]
    fn full_objects_decode_to_what_is_read() {
        let (service, slice) = full_api_objects();
        let service: Service = serde_json::from_value(service).unwrap();
        let slice: EndpointSlice = serde_json::from_value(slice).unwrap();

        let thin_service: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default", "resourceVersion": "7",
                         "labels": {LABEL_PROXY_NAME: "other"},
                         "annotations": {ANNOTATION_ALGORITHM: "maglev"}},
            "spec": {
                "type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
                "ipFamilies": ["IPv4", "IPv6"],
                "ports": [{"name": "http", "port": 80, "nodePort": 30080}],
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}},
        }))
        .unwrap();
        assert_eq!(service, thin_service);
        assert_eq!(
            service
                .metadata
                .labels
                .as_ref()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            [LABEL_PROXY_NAME, ANNOTATION_ALGORITHM]
        );
        assert_eq!(service.metadata.resource_version.as_deref(), Some("7"));

        assert_eq!(slice.service_name.as_deref(), Some("web"));
        assert_eq!(slice.trigger_time.as_deref(), Some("2026-11-24T00:00:00Z"));
        assert!(slice.metadata.labels.is_none());
        assert_eq!(slice.metadata.resource_version.as_deref(), Some("8"));
        let endpoint = &slice.endpoints.as_ref().unwrap()[0];
        assert_eq!(
            endpoint.address(),
            Some(EndpointAddress::Ip("10.0.0.1".parse().unwrap()))
        );
        assert!(endpoint.hints().is_some());
        assert_eq!(endpoint.node_name.as_deref(), Some("node-a"));
        // Lists kept without growth room; repeated strings shared.
        let endpoints = slice.endpoints.as_ref().unwrap();
        assert_eq!(endpoints.capacity(), endpoints.len());
        let ports = service.spec.as_ref().unwrap().ports.as_ref().unwrap();
        assert_eq!(ports.capacity(), ports.len());
        let again: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-2"}, "addressType": "IPv4",
            "endpoints": [{"addresses": ["not-an-ip"], "nodeName": "node-a"}],
        }))
        .unwrap();
        let other = &again.endpoints.as_ref().unwrap()[0];
        assert!(std::ptr::eq::<str>(
            &**other.node_name.as_ref().unwrap(),
            &**endpoint.node_name.as_ref().unwrap()
        ));
        assert_eq!(
            other.address(),
            Some(EndpointAddress::Invalid("not-an-ip".into()))
        );
        assert!(other.hints().is_none());
    }

    /// A bad value in a field this agent reads is still an error naming it; `null`
    /// labels and a missing metadata read as none.
    #[test]
    fn read_fields_are_checked_and_nulls_are_none() {
        let bad = serde_json::json!({"metadata": {"name": "s"}, "addressType": "IPv4",
                                     "endpoints": [{"addresses": "10.0.0.1"}]});
        let err = serde_json::from_value::<EndpointSlice>(bad).unwrap_err();
        assert!(err.to_string().contains("a list of addresses"), "{err}");
        let missing = serde_json::json!({"metadata": {"name": "s"}, "endpoints": []});
        let err = serde_json::from_value::<EndpointSlice>(missing).unwrap_err();
        assert!(err.to_string().contains("addressType"), "{err}");

        let nulls: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "s", "labels": null, "annotations": null},
            "addressType": "IPv4",
        }))
        .unwrap();
        assert_eq!(nulls.service_name, None);
        let bare: Service = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(bare, Service::default());
    }

    #[test]
    fn nodes_keep_their_addresses_zone_and_pod_cidrs() {
        let mut node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a", "labels": {LABEL_ZONE: "a", "kubernetes.io/os": "linux"}},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"], "providerID": "x"},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "192.168.50.2"}],
                "images": [{"names": ["registry/image:tag"], "sizeBytes": 1}],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .unwrap();
        trim_node(&mut node);
        let labels = node.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.keys().collect::<Vec<_>>(), [LABEL_ZONE]);
        let status = node.status.as_ref().unwrap();
        assert!(status.images.is_none() && status.conditions.is_none());
        assert_eq!(status.addresses.as_ref().unwrap().len(), 1);
        let spec = node.spec.as_ref().unwrap();
        assert_eq!(spec.pod_cidr.as_deref(), Some("10.244.1.0/24"));
        assert_eq!(spec.pod_cidrs.as_ref().unwrap().len(), 1);
        assert!(spec.provider_id.is_none());
    }
}
