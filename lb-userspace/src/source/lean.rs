//! What the API source keeps of each object: only the fields the desired state, the
//! zone and the metrics read. Objects are trimmed as they arrive, before the
//! reflector caches them, so memory follows what the datapath needs rather than
//! what the API server sends (annotations written by other tools, owner references,
//! selectors, a Node's image list and conditions, endpoints' target references).

use k8s_openapi::api::core::v1::{Node, NodeStatus, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::LABEL_ZONE;
use crate::ops::LAST_CHANGE_TRIGGER_TIME;

/// Drops what this agent never reads.
pub trait Lean {
    fn lean(&mut self);
}

/// Name, namespace and resource version stay (the reflector keys and resumes by
/// them); of labels and annotations, only the ones named.
fn lean_meta(meta: &mut ObjectMeta, labels: &[&str], annotations: &[&str]) {
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.generate_name = None;
    for (map, keep) in [
        (&mut meta.labels, labels),
        (&mut meta.annotations, annotations),
    ] {
        if let Some(entries) = map.as_mut() {
            entries.retain(|k, _| keep.contains(&k.as_str()));
        }
        if map.as_ref().is_some_and(|m| m.is_empty()) {
            *map = None;
        }
    }
}

impl Lean for Service {
    fn lean(&mut self) {
        // The list selector already excludes the labels the rules look at.
        lean_meta(&mut self.metadata, &[], &[]);
        if let Some(spec) = self.spec.as_mut() {
            spec.selector = None;
        }
        if let Some(status) = self.status.as_mut() {
            status.conditions = None;
            for ingress in status
                .load_balancer
                .iter_mut()
                .flat_map(|lb| lb.ingress.iter_mut().flatten())
            {
                ingress.hostname = None;
                ingress.ports = None;
            }
        }
    }
}

impl Lean for EndpointSlice {
    fn lean(&mut self) {
        lean_meta(
            &mut self.metadata,
            &["kubernetes.io/service-name"],
            &[LAST_CHANGE_TRIGGER_TIME],
        );
        for endpoint in self.endpoints.iter_mut().flatten() {
            endpoint.target_ref = None;
            endpoint.deprecated_topology = None;
            endpoint.hostname = None;
            endpoint.zone = None;
            // Only the first address has a defined meaning (kube-proxy reads no other).
            endpoint.addresses.truncate(1);
        }
    }
}

impl Lean for Node {
    fn lean(&mut self) {
        lean_meta(&mut self.metadata, &[LABEL_ZONE], &[]);
        self.spec = None;
        self.status = self.status.take().map(|status| NodeStatus {
            addresses: status.addresses,
            ..NodeStatus::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{build_desired, SourceOptions};

    /// The objects a real API server sends carry much this agent never reads:
    /// trimmed, they give the same service table, and the bulky parts are gone.
    #[test]
    fn trimmed_objects_give_the_same_table() {
        let service: Service = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "default", "resourceVersion": "7",
                "labels": {"app": "web"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(4096)},
                "managedFields": [{"manager": "kubectl"}],
                "ownerReferences": [{"apiVersion": "v1", "kind": "X", "name": "o", "uid": "u"}],
            },
            "spec": {
                "type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
                "ipFamilies": ["IPv4", "IPv6"], "selector": {"app": "web"},
                "ports": [{"port": 80, "targetPort": 8080, "nodePort": 30080}],
            },
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.1", "hostname": "lb.example"}]}},
        }))
        .unwrap();
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web-1", "namespace": "default",
                "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "x"},
                "annotations": {LAST_CHANGE_TRIGGER_TIME: "2026-11-24T00:00:00Z", "other": "y"},
            },
            "addressType": "IPv4",
            "ports": [{"port": 8080}],
            "endpoints": [{
                "addresses": ["10.0.0.1", "10.0.0.2"], "nodeName": "node-a", "zone": "a",
                "hostname": "web-0",
                "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "default"},
                "conditions": {"ready": true},
            }],
        }))
        .unwrap();
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a", "labels": {LABEL_ZONE: "a", "kubernetes.io/os": "linux"}},
            "spec": {"podCIDR": "10.244.1.0/24"},
            "status": {
                "addresses": [{"type": "InternalIP", "address": "192.168.50.2"}],
                "images": [{"names": ["registry/image:tag"], "sizeBytes": 1}],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }))
        .unwrap();
        let opts = SourceOptions {
            node_name: "node-a".into(),
            node_ips: vec!["192.168.50.2".parse().unwrap()],
            ..SourceOptions::default()
        };
        let before = build_desired(
            std::slice::from_ref(&service),
            std::slice::from_ref(&slice),
            &opts,
        );
        let (mut s, mut e, mut n) = (service, slice, node);
        s.lean();
        e.lean();
        n.lean();
        assert_eq!(
            build_desired(std::slice::from_ref(&s), std::slice::from_ref(&e), &opts),
            before
        );

        assert!(s.metadata.annotations.is_none() && s.metadata.labels.is_none());
        assert!(s.metadata.managed_fields.is_none() && s.metadata.owner_references.is_none());
        assert_eq!(s.metadata.resource_version.as_deref(), Some("7"));
        assert!(s.spec.as_ref().unwrap().selector.is_none());
        let annotations = e.metadata.annotations.as_ref().unwrap();
        assert_eq!(
            annotations.keys().collect::<Vec<_>>(),
            [LAST_CHANGE_TRIGGER_TIME]
        );
        assert!(e.endpoints.as_ref().unwrap()[0].target_ref.is_none());
        let labels = n.metadata.labels.as_ref().unwrap();
        assert_eq!(labels.keys().collect::<Vec<_>>(), [LABEL_ZONE]);
        let status = n.status.as_ref().unwrap();
        assert!(status.images.is_none() && status.conditions.is_none());
        assert_eq!(status.addresses.as_ref().unwrap().len(), 1);
        assert!(n.spec.is_none());
    }
}
