//! What the agent reads from this node's Node object (from the API server, or among
//! the manifest files): its addresses, where `--node-ip` does not say, and its zone.

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::AgentConfig;
use crate::node::{self, NodeNet};
use crate::source::labels::LABEL_ZONE;

/// Where NodePorts are served now: kube-proxy's `--nodeport-addresses` over the
/// node's addresses, `--node-ip`, and the Node object's (for `primary`).
pub(super) fn served_addresses(
    net: &NodeNet,
    config: &AgentConfig,
    nodes: &[Arc<Node>],
) -> Vec<IpAddr> {
    let from_node = node_addresses(nodes, &config.node_name);
    node::nodeport_addresses(
        net,
        &config.nodeport_addresses,
        &config.node_ips,
        &from_node,
    )
}

/// This node's InternalIP/ExternalIP addresses (both families) from its Node
/// object: its primary addresses when `--node-ip` does not say.
fn node_addresses(nodes: &[Arc<Node>], node_name: &str) -> Vec<IpAddr> {
    nodes
        .iter()
        .filter(|n| n.metadata.name.as_deref() == Some(node_name))
        .filter_map(|n| n.status.as_ref()?.addresses.as_ref())
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// This node's `topology.kubernetes.io/zone` label from its Node object.
pub(super) fn node_zone(nodes: &[Arc<Node>], node_name: &str) -> Option<String> {
    nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(node_name))?
        .metadata
        .labels
        .as_ref()?
        .get(LABEL_ZONE)
        .filter(|zone| !zone.is_empty())
        .cloned()
}
