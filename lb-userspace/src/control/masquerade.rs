//! Which traffic egress masquerading touches, pure: packets from this node's pod
//! CIDRs, to any destination outside the exempt set. The exempt set follows
//! ip-masq-agent: its `nonMasqueradeCIDRs` (by default the private and reserved
//! ranges), link-local unless `masqLinkLocal` / `masqLinkLocalIPv6`, and always the
//! cluster's pod CIDRs, so pod-to-pod traffic keeps its addresses whatever the
//! file says.
//!
//! The pod CIDRs come from the Nodes' `spec.podCIDRs` (the API server's, or Node
//! objects among the manifest files), and `--cluster-cidr` (kube-proxy's flag) when
//! given; this node's own, the sources, from its Node, else `--cluster-cidr`.
//!
//! All of them together are also the cluster set of kube-proxy's cluster-IP
//! masquerade rule (traffic to a cluster IP from outside it gets the node's
//! address), kept with or without egress masquerading.

use std::collections::BTreeSet;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use crate::datapath::masquerade::MasqCidrs;
use crate::source::masq_config::MasqConfig;

/// `--masquerade`: whether lb masquerades pods' egress traffic itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MasqueradeMode {
    /// Not lb's job (the CNI or ip-masq-agent masquerades, or nothing needs to).
    #[default]
    Off,
    /// In BPF, on every node-facing device's egress; the CNI's own masquerade
    /// should be turned off.
    Bpf,
}

/// ip-masq-agent's default `nonMasqueradeCIDRs`: RFC 1918, then the reserved and
/// documentation ranges it also leaves alone (`--nomasq-all-reserved-ranges`).
pub const DEFAULT_NON_MASQUERADE: [&str; 11] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "240.0.0.0/4",
];
/// Link-local ranges, exempt unless the file says to masquerade them.
pub const LINK_LOCAL_V4: &str = "169.254.0.0/16";
pub const LINK_LOCAL_V6: &str = "fe80::/10";

/// The Nodes' pod CIDRs: `spec.podCIDRs`, else `spec.podCIDR`; values that are no
/// CIDR are skipped (the API server validates them).
fn pod_cidrs_of(node: &Node) -> Vec<IpNet> {
    let Some(spec) = &node.spec else {
        return Vec::new();
    };
    let listed = spec.pod_cidrs.as_deref().unwrap_or_default();
    let single = spec.pod_cidr.iter();
    let texts: Vec<&String> = if listed.is_empty() {
        single.collect()
    } else {
        listed.iter().collect()
    };
    texts
        .into_iter()
        .filter_map(|t| t.parse::<IpNet>().ok().map(|n| n.trunc()))
        .collect()
}

/// The sets the programs match, from what is known now; with `mode` off only the
/// cluster set.
pub fn derive(
    mode: MasqueradeMode,
    config: &MasqConfig,
    nodes: &[Arc<Node>],
    node_name: &str,
    cluster_cidrs: &[IpNet],
) -> MasqCidrs {
    let cluster: BTreeSet<IpNet> = nodes
        .iter()
        .flat_map(|n| pod_cidrs_of(n))
        .chain(cluster_cidrs.iter().map(IpNet::trunc))
        .collect();
    if mode == MasqueradeMode::Off {
        return MasqCidrs {
            cluster,
            ..MasqCidrs::default()
        };
    }
    let mut exempt: BTreeSet<IpNet> = match &config.non_masquerade {
        Some(listed) => listed.iter().copied().collect(),
        None => DEFAULT_NON_MASQUERADE
            .iter()
            .map(|c| c.parse().expect("a valid default"))
            .collect(),
    };
    if !config.masq_link_local.unwrap_or(false) {
        exempt.insert(LINK_LOCAL_V4.parse().expect("valid"));
    }
    if !config.masq_link_local_v6.unwrap_or(false) {
        exempt.insert(LINK_LOCAL_V6.parse().expect("valid"));
    }
    exempt.extend(cluster.iter().copied());
    let own: BTreeSet<IpNet> = nodes
        .iter()
        .filter(|n| n.metadata.name.as_deref() == Some(node_name))
        .flat_map(|n| pod_cidrs_of(n))
        .collect();
    let pod_sources = if own.is_empty() {
        cluster_cidrs.iter().map(IpNet::trunc).collect()
    } else {
        own
    };
    MasqCidrs {
        pod_sources,
        exempt,
        cluster,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidrs: &[&str]) -> Arc<Node> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name},
                "spec": {"podCIDR": cidrs.first(), "podCIDRs": cidrs},
            }))
            .unwrap(),
        )
    }

    fn nets(texts: &[&str]) -> BTreeSet<IpNet> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn without_a_file_the_defaults_link_local_and_every_node_s_pods_are_exempt() {
        let nodes = [
            node("node1", &["10.244.1.0/24", "fd00:244:1::/64"]),
            node("node2", &["10.244.2.0/24", "fd00:244:2::/64"]),
        ];
        let sets = derive(
            MasqueradeMode::Bpf,
            &MasqConfig::default(),
            &nodes,
            "node1",
            &[],
        );
        for exempt in DEFAULT_NON_MASQUERADE.iter().chain(&[
            LINK_LOCAL_V4,
            LINK_LOCAL_V6,
            "fd00:244:2::/64",
            "10.244.2.0/24",
        ]) {
            assert!(sets.exempt.contains(&exempt.parse().unwrap()), "{exempt}");
        }
        assert_eq!(
            sets.pod_sources,
            nets(&["10.244.1.0/24", "fd00:244:1::/64"])
        );
    }

    #[test]
    fn the_file_replaces_the_defaults_but_never_the_pod_cidrs() {
        let config = MasqConfig {
            non_masquerade: Some(vec!["172.16.0.0/12".parse().unwrap()]),
            masq_link_local: Some(true),
            masq_link_local_v6: Some(true),
        };
        let sets = derive(
            MasqueradeMode::Bpf,
            &config,
            &[node("node1", &["10.244.1.0/24"])],
            "node1",
            &[],
        );
        assert_eq!(sets.exempt, nets(&["172.16.0.0/12", "10.244.1.0/24"]));
    }

    #[test]
    fn cluster_cidr_is_exempt_and_the_sources_when_this_node_has_no_pod_cidr() {
        let cluster = [
            "10.244.0.0/16".parse().unwrap(),
            "fd00:244::/48".parse().unwrap(),
        ];
        let config = MasqConfig {
            non_masquerade: Some(vec![]),
            ..MasqConfig::default()
        };
        let sets = derive(
            MasqueradeMode::Bpf,
            &config,
            &[node("other", &["10.244.9.0/24"])],
            "node1",
            &cluster,
        );
        assert_eq!(sets.pod_sources, nets(&["10.244.0.0/16", "fd00:244::/48"]));
        assert!(sets.exempt.contains(&"10.244.0.0/16".parse().unwrap()));
        assert!(sets.exempt.contains(&"10.244.9.0/24".parse().unwrap()));
        // Nothing known: nothing is a pod source, so nothing is masqueraded.
        assert!(derive(MasqueradeMode::Bpf, &config, &[], "node1", &[])
            .pod_sources
            .is_empty());
    }

    #[test]
    fn the_single_pod_cidr_field_is_read_when_the_list_is_absent() {
        let node: Arc<Node> = Arc::new(
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "node1"}, "spec": {"podCIDR": "10.244.1.0/24"},
            }))
            .unwrap(),
        );
        let sets = derive(
            MasqueradeMode::Bpf,
            &MasqConfig::default(),
            &[node],
            "node1",
            &[],
        );
        assert_eq!(sets.pod_sources, nets(&["10.244.1.0/24"]));
    }

    #[test]
    fn the_cluster_set_is_every_node_s_pods_and_cluster_cidr_with_masquerading_off_too() {
        let nodes = [
            node("node1", &["10.244.1.0/24"]),
            node("node2", &["10.244.2.0/24", "fd00:244:2::/64"]),
        ];
        let cluster = ["10.96.128.0/20".parse().unwrap()];
        let wanted = nets(&[
            "10.244.1.0/24",
            "10.244.2.0/24",
            "fd00:244:2::/64",
            "10.96.128.0/20",
        ]);
        let config = MasqConfig::default();
        let off = derive(MasqueradeMode::Off, &config, &nodes, "node1", &cluster);
        assert_eq!(off.cluster, wanted);
        // Off: no egress set, so the egress program (not attached) has nothing to match.
        assert!(off.pod_sources.is_empty() && off.exempt.is_empty());
        let on = derive(MasqueradeMode::Bpf, &config, &nodes, "node1", &cluster);
        assert_eq!(on.cluster, wanted);
        assert!(wanted.iter().all(|n| on.exempt.contains(n)));
        assert!(derive(MasqueradeMode::Off, &config, &[], "node1", &[])
            .cluster
            .is_empty());
    }
}
