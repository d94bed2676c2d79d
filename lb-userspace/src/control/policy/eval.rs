//! NetworkPolicy judged straight from the objects, with no maps, ids or classes: the
//! reference the compiled maps are tested against (and a way to explain a verdict).
//! Slow on purpose: every call walks every object.

use std::net::IpAddr;
use std::sync::Arc;

use lb_common::policy::{POLICY_DIR_EGRESS, POLICY_DIR_INGRESS};

use crate::model::policy::{
    resolve_named, Labels, NetworkPolicy, Peer, PolicyNamespace, PolicyPod, PolicyPort, PolicyRule,
    PortRef,
};

/// Everything a verdict depends on.
#[derive(Clone, Copy)]
pub struct PolicyObjects<'a> {
    pub namespaces: &'a [Arc<PolicyNamespace>],
    pub pods: &'a [Arc<PolicyPod>],
    pub policies: &'a [Arc<NetworkPolicy>],
    /// The node's own addresses (ingress from them is allowed).
    pub node_addrs: &'a [IpAddr],
}

impl<'a> PolicyObjects<'a> {
    /// The pod an address belongs to (not host-network; the first by namespace and
    /// name if several claim it). A node address is no pod.
    fn pod_at(&self, ip: IpAddr) -> Option<&'a PolicyPod> {
        if self.node_addrs.contains(&ip) {
            return None;
        }
        self.pods
            .iter()
            .filter(|p| !p.host_network && p.ips.contains(&ip))
            .min_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)))
            .map(|p| &**p)
    }

    fn namespace_labels(&self, ns: &str) -> Labels {
        self.namespaces
            .iter()
            .find(|n| &*n.name == ns)
            .map(|n| n.labels.clone())
            .unwrap_or_else(|| PolicyNamespace::implied(ns).labels)
    }
}

/// Whether the packet passes the policy of the pod at `pod_addr` for `direction`
/// (`POLICY_DIR_INGRESS`: from `peer` to the pod, `port` the pod's; egress: from the
/// pod to `peer`, `port` the peer's).
pub fn evaluate_direction(
    objects: &PolicyObjects,
    pod_addr: IpAddr,
    direction: u8,
    peer: IpAddr,
    proto: u8,
    port: u16,
) -> bool {
    let Some(pod) = objects.pod_at(pod_addr) else {
        return true;
    };
    let rules_of = |p: &'_ NetworkPolicy| -> Option<Vec<PolicyRule>> {
        match direction {
            POLICY_DIR_INGRESS => p.ingress.clone(),
            POLICY_DIR_EGRESS => p.egress.clone(),
            _ => None,
        }
    };
    let selecting: Vec<Vec<PolicyRule>> = objects
        .policies
        .iter()
        .filter(|p| p.namespace == pod.namespace && p.pod_selector.matches(&pod.labels))
        .filter_map(|p| rules_of(p).map(|rules| (p, rules)))
        .map(|(_, rules)| rules)
        .collect();
    if selecting.is_empty() {
        return true;
    }
    if direction == POLICY_DIR_INGRESS && objects.node_addrs.contains(&peer) {
        return true;
    }
    let peer_pod = objects.pod_at(peer);
    let policy_ns = &pod.namespace;
    selecting.iter().flatten().any(|rule| {
        // Which pod a named port resolves on for each way the peer can match.
        let named_on = |peer_is_pod: bool| -> Option<&PolicyPod> {
            if direction == POLICY_DIR_INGRESS {
                Some(pod)
            } else if peer_is_pod {
                peer_pod
            } else {
                None
            }
        };
        if rule.peers.is_empty() {
            return ports_match(&rule.ports, proto, port, named_on(true));
        }
        rule.peers.iter().any(|p| match p {
            Peer::Pods { namespaces, pods } => {
                let Some(pp) = peer_pod else {
                    return false;
                };
                let ns_ok = match namespaces {
                    None => pp.namespace == *policy_ns,
                    Some(sel) => sel.matches(&objects.namespace_labels(&pp.namespace)),
                };
                ns_ok
                    && pods.as_ref().is_none_or(|sel| sel.matches(&pp.labels))
                    && ports_match(&rule.ports, proto, port, named_on(true))
            }
            Peer::Block(block) => {
                block.contains(peer) && ports_match(&rule.ports, proto, port, named_on(false))
            }
        })
    })
}

fn ports_match(ports: &[PolicyPort], proto: u8, port: u16, named_on: Option<&PolicyPod>) -> bool {
    if ports.is_empty() {
        return true;
    }
    ports.iter().any(|spec| {
        spec.protocol.number() == proto
            && match (&spec.port, spec.end_port) {
                (None, _) => true,
                (Some(PortRef::Number(n)), None) => port == *n,
                (Some(PortRef::Number(n)), Some(end)) => (*n..=end).contains(&port),
                (Some(PortRef::Name(name)), _) => named_on.is_some_and(|p| {
                    resolve_named(&p.named_ports, name, spec.protocol).any(|n| n == port)
                }),
            }
    })
}

/// Whether a connection from `src` to `dst:port` is allowed by the whole cluster's
/// policy: the source pod's egress and the destination pod's ingress.
pub fn evaluate(objects: &PolicyObjects, src: IpAddr, dst: IpAddr, proto: u8, port: u16) -> bool {
    evaluate_direction(objects, src, POLICY_DIR_EGRESS, dst, proto, port)
        && evaluate_direction(objects, dst, POLICY_DIR_INGRESS, src, proto, port)
}
