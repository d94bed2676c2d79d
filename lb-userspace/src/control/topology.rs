//! Topology-aware routing as kube-proxy does it (`CategorizeEndpoints`): traffic that
//! may go to any endpoint of the cluster keeps to the endpoints hinted for this node,
//! or for this node's zone, when the hints allow it.
//!
//! Only the hints count. The Service's `spec.trafficDistribution`
//! (`PreferSameZone`, its older name `PreferClose`, `PreferSameNode`) and the
//! `service.kubernetes.io/topology-mode: Auto` annotation are read by the
//! EndpointSlice controller, which writes `hints.forZones` / `hints.forNodes` only
//! when they ask for it and the endpoints are spread well enough; current
//! kube-proxy reads nothing but the hints, so a Service whose slices carry hints is
//! routed by them whatever its spec says, and one whose slices carry none is not.

use std::net::IpAddr;

use super::options::SourceOptions;

/// One endpoint of one slice, with its conditions resolved as kube-proxy does:
/// what the endpoint rules, topology's among them, decide on.
pub(super) struct EndpointInfo {
    pub(super) ip: IpAddr,
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    pub(super) local: bool,
    pub(super) hints: Hints,
}

/// `hints` of one endpoint.
#[derive(Clone, Debug, Default)]
pub(super) struct Hints {
    /// `hints.forZones[].name`.
    pub zones: Vec<crate::source::intern::Shared>,
    /// `hints.forNodes[].name`.
    pub nodes: Vec<crate::source::intern::Shared>,
}

impl Hints {
    pub(super) fn read(hints: Option<&crate::source::lean::EndpointHints>) -> Self {
        let Some(hints) = hints else {
            return Hints::default();
        };
        Hints {
            zones: hints
                .for_zones
                .iter()
                .flatten()
                .map(|z| z.name.clone())
                .collect(),
            nodes: hints
                .for_nodes
                .iter()
                .flatten()
                .map(|n| n.name.clone())
                .collect(),
        }
    }
}

/// Which endpoints cluster-wide traffic from this node may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Every endpoint: no hints, or none that suit this node.
    Any,
    /// Endpoints hinted for this node's zone.
    SameZone,
    /// Endpoints hinted for this node.
    SameNode,
}

impl Mode {
    pub(super) fn admits(self, endpoint: &EndpointInfo, opts: &SourceOptions) -> bool {
        let has = |names: &[crate::source::intern::Shared], wanted: &str| {
            names.iter().any(|n| **n == *wanted)
        };
        match self {
            Mode::Any => true,
            Mode::SameZone => has(&endpoint.hints.zones, &opts.zone),
            Mode::SameNode => has(&endpoint.hints.nodes, &opts.node_name),
        }
    }
}

/// kube-proxy's choice: hints are used only when every ready endpoint has them (a
/// partly hinted slice is being rewritten by the controller) and at least one is for
/// this node (node hints first) or its zone; otherwise every endpoint is used, so a
/// zone without endpoints is never left without service. Endpoints that are not
/// ready have no say.
pub(super) fn mode<'a>(
    endpoints: impl IntoIterator<Item = &'a EndpointInfo>,
    opts: &SourceOptions,
) -> Mode {
    let mut any_ready = false;
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for endpoint in endpoints.into_iter().filter(|e| e.ready) {
        any_ready = true;
        let hints = &endpoint.hints;
        if hints.nodes.is_empty() {
            all_node_hints = false;
        } else if !opts.node_name.is_empty() && hints.nodes.iter().any(|n| **n == *opts.node_name) {
            for_node = true;
        }
        if hints.zones.is_empty() {
            all_zone_hints = false;
        } else if !opts.zone.is_empty() && hints.zones.iter().any(|z| **z == *opts.zone) {
            for_zone = true;
        }
    }
    if !any_ready {
        Mode::Any
    } else if all_node_hints && for_node {
        Mode::SameNode
    } else if all_zone_hints && for_zone {
        Mode::SameZone
    } else {
        Mode::Any
    }
}

/// kube-proxy's `TestCategorizeEndpoints` table (pkg/proxy/topology_test.go),
/// every case with hints or traffic policies, plus the node-hint cases of
/// `topologyModeFromHints`, checked on the desired table: "cluster" endpoints are
/// those of the NodePort's internal entry, "local" those of the external entry
/// (`externalTrafficPolicy: Local`) or of the cluster IP
/// (`internalTrafficPolicy: Local`).
#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::control::{build_desired, NodePortRange, SourceOptions};
    use crate::model::{Frontend, Protocol, Scope};
    use crate::source::yaml::parse_str;

    /// One endpoint: its address's last octet (10.1.2.N, and fd00:1:2::N in the
    /// IPv6 slice), and what the slice says.
    #[derive(Clone, Copy, Default)]
    struct Ep {
        n: u8,
        zones: &'static [&'static str],
        nodes: &'static [&'static str],
        /// Not ready; `serving_terminating` says whether it still serves.
        unready: bool,
        serving_terminating: bool,
        local: bool,
    }

    fn ep(n: u8, zones: &'static [&'static str]) -> Ep {
        Ep {
            n,
            zones,
            ..Ep::default()
        }
    }

    impl Ep {
        fn local(self) -> Self {
            Ep {
                local: true,
                ..self
            }
        }
        fn unready(self) -> Self {
            Ep {
                unready: true,
                ..self
            }
        }
        fn terminating(self) -> Self {
            Ep {
                unready: true,
                serving_terminating: true,
                ..self
            }
        }
        fn nodes(self, nodes: &'static [&'static str]) -> Self {
            Ep { nodes, ..self }
        }

        fn yaml(&self, v6: bool) -> String {
            let names = |list: &[&str]| {
                list.iter()
                    .map(|z| format!("{{name: {z}}}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let conditions = if self.serving_terminating {
                "{ready: false, serving: true, terminating: true}"
            } else if self.unready {
                "{ready: false}"
            } else {
                "{ready: true}"
            };
            let address = if v6 {
                format!("\"fd00:1:2::{}\"", self.n)
            } else {
                format!("10.1.2.{}", self.n)
            };
            format!(
                "- addresses: [{address}]\n  nodeName: {}\n  conditions: {conditions}\n  \
                 hints: {{forZones: [{}], forNodes: [{}]}}\n",
                if self.local { "node-a" } else { "node-x" },
                names(self.zones),
                names(self.nodes),
            )
        }
    }

    #[derive(Clone, Copy, Default)]
    struct Policy {
        itp_local: bool,
        etp_local: bool,
    }

    const CLUSTER: Policy = Policy {
        itp_local: false,
        etp_local: false,
    };

    /// (cluster endpoints, local endpoints when a policy is Local) as last octets,
    /// for node-a in `zone`. Every case runs for both families at once: a
    /// dual-stack Service whose IPv4 and IPv6 slices list the same endpoints must
    /// categorize them alike in each family.
    fn categorize(zone: &str, policy: Policy, endpoints: &[Ep]) -> (Vec<u8>, Option<Vec<u8>>) {
        let v4 = categorize_family(zone, policy, endpoints, endpoints, false);
        let v6 = categorize_family(zone, policy, endpoints, endpoints, true);
        assert_eq!(v4, v6, "IPv4 and IPv6 categorized alike");
        v4
    }

    /// `categorize` for one family of a dual-stack Service whose IPv4 slice lists
    /// `v4_endpoints` and whose IPv6 slice lists `v6_endpoints`.
    fn categorize_family(
        zone: &str,
        policy: Policy,
        v4_endpoints: &[Ep],
        v6_endpoints: &[Ep],
        v6: bool,
    ) -> (Vec<u8>, Option<Vec<u8>>) {
        let policy_yaml = format!(
            "  internalTrafficPolicy: {}\n  externalTrafficPolicy: {}\n",
            if policy.itp_local { "Local" } else { "Cluster" },
            if policy.etp_local { "Local" } else { "Cluster" },
        );
        let slice = |name: &str, family: &str, endpoints: &[Ep]| {
            format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\n\
                 addressType: {family}\nports: [{{port: 80}}]\nendpoints:\n{}",
                endpoints
                    .iter()
                    .map(|e| e.yaml(family == "IPv6"))
                    .collect::<String>()
            )
        };
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\n\
             spec:\n  type: NodePort\n  clusterIPs: [10.96.0.10, \"fd00::10\"]\n{policy_yaml}  \
             ports: [{{port: 80, nodePort: 30080}}]\n{}{}",
            slice("web-4", "IPv4", v4_endpoints),
            slice("web-6", "IPv6", v6_endpoints),
        );
        let objects = parse_str(Path::new("t.yaml"), &yaml);
        assert!(objects.errors.is_empty(), "{:?}", objects.errors);
        let opts = SourceOptions {
            node_name: "node-a".to_owned(),
            node_ips: vec![
                "192.168.50.2".parse().unwrap(),
                "2001:db8:50::2".parse().unwrap(),
            ],
            node_port_range: NodePortRange::default(),
            zone: zone.to_owned(),
            ..SourceOptions::default()
        };
        let (desired, errors) = build_desired(&objects.services, &objects.slices, &opts);
        assert!(errors.is_empty(), "{errors:?}");
        let octets = |f: Frontend| -> Vec<u8> {
            desired.frontends[&f]
                .backends
                .iter()
                .map(|b| match b.ip {
                    std::net::IpAddr::V4(ip) => {
                        assert!(!v6, "{ip} behind an IPv6 frontend");
                        ip.octets()[3]
                    }
                    std::net::IpAddr::V6(ip) => {
                        assert!(v6, "{ip} behind an IPv4 frontend");
                        ip.octets()[15]
                    }
                })
                .collect()
        };
        let (node_ip, vip) = if v6 {
            ("2001:db8:50::2", "fd00::10")
        } else {
            ("192.168.50.2", "10.96.0.10")
        };
        let node_port = Frontend::internal(node_ip.parse().unwrap(), 30080, Protocol::Tcp);
        let cluster_ip = Frontend::internal(vip.parse().unwrap(), 80, Protocol::Tcp);
        let local = if policy.etp_local {
            let local = octets(node_port.with_scope(Scope::External));
            if policy.itp_local {
                assert_eq!(octets(cluster_ip), local, "both policies Local");
            }
            Some(local)
        } else if policy.itp_local {
            Some(octets(cluster_ip))
        } else {
            assert_eq!(
                octets(cluster_ip),
                octets(node_port),
                "cluster IP and NodePort"
            );
            None
        };
        (octets(node_port), local)
    }

    /// kube-proxy's proxiers categorize each family on its own: hints missing in
    /// the IPv6 slice turn topology off for IPv6 only.
    #[test]
    fn each_family_is_categorized_on_its_own() {
        let hinted = [ep(3, A), ep(4, B)];
        let unhinted = [ep(3, NONE), ep(4, NONE)];
        let v4 = categorize_family("zone-a", CLUSTER, &hinted, &unhinted, false);
        let v6 = categorize_family("zone-a", CLUSTER, &hinted, &unhinted, true);
        assert_eq!(v4.0, [3]);
        assert_eq!(v6.0, [3, 4]);
    }

    fn cluster_only(zone: &str, endpoints: &[Ep]) -> Vec<u8> {
        categorize(zone, CLUSTER, endpoints).0
    }

    const A: &[&str] = &["zone-a"];
    const B: &[&str] = &["zone-b"];
    const C: &[&str] = &["zone-c"];
    const NONE: &[&str] = &[];

    #[test]
    fn all_endpoints_hinted_and_some_for_this_zone_keeps_to_the_zone() {
        // The Service says nothing of trafficDistribution: the hints alone decide.
        let eps = [ep(3, A), ep(4, B), ep(5, C), ep(6, A)];
        assert_eq!(cluster_only("zone-a", &eps), [3, 6]);
    }

    #[test]
    fn local_policies_ignore_topology_for_local_endpoints() {
        let eps = [ep(3, A).local(), ep(4, B).local(), ep(5, C), ep(6, A)];
        for policy in [
            Policy {
                etp_local: true,
                itp_local: false,
            },
            Policy {
                etp_local: false,
                itp_local: true,
            },
        ] {
            let (cluster, local) = categorize("zone-a", policy, &eps);
            assert_eq!(cluster, [3, 6]);
            assert_eq!(local.unwrap(), [3, 4]);
        }
        // Without hints, as before topology: terminating local endpoints serve Local
        // traffic while ready remote ones serve the cluster.
        let eps = [
            ep(0, NONE),
            ep(1, NONE).unready().local(),
            ep(2, NONE).terminating().local(),
            ep(3, NONE).terminating(),
        ];
        let etp = Policy {
            etp_local: true,
            itp_local: false,
        };
        let (cluster, local) = categorize("zone-a", etp, &eps);
        assert_eq!(cluster, [0]);
        assert_eq!(local.unwrap(), [2]);
        // Both policies Local and every endpoint remote: Local traffic has none.
        let both = Policy {
            etp_local: true,
            itp_local: true,
        };
        let (cluster, local) = categorize("zone-a", both, &[ep(0, NONE), ep(1, NONE)]);
        assert_eq!(cluster, [0, 1]);
        assert!(local.unwrap().is_empty());
        let (cluster, local) = categorize(
            "zone-a",
            both,
            &[ep(0, NONE).terminating(), ep(1, NONE).terminating()],
        );
        assert_eq!(cluster, [0, 1]);
        assert!(local.unwrap().is_empty());
    }

    #[test]
    fn no_zone_or_another_zone_uses_every_endpoint() {
        // Empty node labels, an empty zone label, and a zone no endpoint is for.
        assert_eq!(cluster_only("", &[ep(3, A)]), [3]);
        assert_eq!(cluster_only("zone-b", &[ep(3, A)]), [3]);
        assert_eq!(cluster_only("zone-b", &[ep(3, A), ep(4, C)]), [3, 4]);
        // The same endpoints seen from a zone they are hinted for.
        assert_eq!(cluster_only("zone-c", &[ep(3, A), ep(4, C)]), [4]);
    }

    #[test]
    fn unready_endpoints_have_no_say() {
        let eps = [ep(3, A), ep(4, B), ep(5, C), ep(6, A).unready()];
        assert_eq!(cluster_only("zone-a", &eps), [3]);
        // Only unready endpoints in this zone: no filtering.
        let eps = [ep(3, A).unready(), ep(4, B), ep(5, C), ep(6, A).unready()];
        assert_eq!(cluster_only("zone-a", &eps), [4, 5]);
        // An unready endpoint without hints does not stop the others' hints.
        let eps = [ep(3, A), ep(4, B), ep(5, NONE).unready()];
        assert_eq!(cluster_only("zone-a", &eps), [3]);
    }

    #[test]
    fn one_endpoint_without_hints_turns_them_all_off() {
        let eps = [ep(3, A), ep(4, B), ep(5, NONE), ep(6, A)];
        assert_eq!(cluster_only("zone-a", &eps), [3, 4, 5, 6]);
        let eps = [ep(3, A), ep(4, B), ep(5, B), ep(6, A)];
        assert_eq!(cluster_only("zone-a", &eps), [3, 6]);
    }

    #[test]
    fn an_endpoint_hinted_for_several_zones_serves_each() {
        let eps = [
            ep(3, &["zone-a", "zone-b", "zone-c"]),
            ep(4, &["zone-b", "zone-c"]),
            ep(5, &["zone-b", "zone-d"]),
            ep(6, C),
        ];
        assert_eq!(cluster_only("zone-c", &eps), [3, 4, 6]);
    }

    #[test]
    fn conflicting_topology_and_locality() {
        let eps = [ep(0, A).local(), ep(1, B).local(), ep(2, A), ep(3, B)];
        let etp = Policy {
            etp_local: true,
            itp_local: false,
        };
        let (cluster, local) = categorize("zone-a", etp, &eps);
        assert_eq!(cluster, [0, 2]);
        assert_eq!(local.unwrap(), [0, 1]);
    }

    #[test]
    fn nothing_ready_falls_back_to_terminating_endpoints_anywhere() {
        // Hints are not consulted for the fallback.
        let eps = [
            ep(3, A).terminating(),
            ep(4, B).terminating(),
            ep(5, B).unready(),
        ];
        assert_eq!(cluster_only("zone-a", &eps), [3, 4]);
        // Ready endpoints again: the zone's one, and the terminating ones left alone.
        let eps = [
            ep(3, A).terminating(),
            ep(4, B).terminating(),
            ep(6, A),
            ep(7, B),
        ];
        assert_eq!(cluster_only("zone-a", &eps), [6]);
    }

    #[test]
    fn node_hints_come_before_zone_hints() {
        let eps = [
            ep(3, A).nodes(&["node-a"]),
            ep(4, A).nodes(&["node-b"]),
            ep(5, B).nodes(&["node-c"]),
        ];
        assert_eq!(cluster_only("zone-a", &eps), [3]);
        // No endpoint for this node: the zone hints decide.
        let eps = [
            ep(3, A).nodes(&["node-b"]),
            ep(4, A).nodes(&["node-b"]),
            ep(5, B).nodes(&["node-c"]),
        ];
        assert_eq!(cluster_only("zone-a", &eps), [3, 4]);
        // One ready endpoint without a node hint: the zone hints decide.
        let eps = [
            ep(3, A).nodes(&["node-a"]),
            ep(4, A),
            ep(5, B).nodes(&["node-c"]),
        ];
        assert_eq!(cluster_only("zone-a", &eps), [3, 4]);
        // Node hints without zone hints work without a zone.
        let eps = [
            ep(3, NONE).nodes(&["node-a"]),
            ep(4, NONE).nodes(&["node-b"]),
        ];
        assert_eq!(cluster_only("", &eps), [3]);
    }
}
