//! The compiled maps against the API's semantics: hand-written cases (each checked
//! against the expected answer and the direct evaluator), then property tests
//! (compiled == evaluated for random objects and packets; incremental == full
//! recompile after random changes), then a measurement at 10k pods.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use lb_common::policy::{
    verdict, PolicyAllow, PolicyKey, Verdict, IPPROTO_SCTP, POLICY_DIR_EGRESS, POLICY_DIR_INGRESS,
    POLICY_ID_HOST,
};
use lb_common::{IpAddrBe, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP};

use super::*;
use crate::model::policy::{
    IpBlock, Labels, NamedPort, NetworkPolicy, Peer, PolicyNamespace, PolicyPod, PolicyPort,
    PolicyProtocol, PolicyRule, PortRef, Requirement, Selector, SelectorOp, Text,
};

const NODE: &str = "node-1";
const NODE_IP: &str = "192.168.0.1";
const TCP: u8 = IPPROTO_TCP;
const UDP: u8 = IPPROTO_UDP;
const IN: u8 = POLICY_DIR_INGRESS;
const OUT: u8 = POLICY_DIR_EGRESS;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn pod(ns: &str, name: &str, addr: &str, labels: &[(&str, &str)]) -> PolicyPod {
    PolicyPod {
        namespace: ns.into(),
        name: name.into(),
        ips: addr.split(',').filter(|s| !s.is_empty()).map(ip).collect(),
        labels: Labels::new(labels.iter().copied()),
        named_ports: Arc::from(Vec::new()),
        host_network: false,
        node_name: NODE.into(),
    }
}

fn with_ports(mut p: PolicyPod, ports: &[(&str, PolicyProtocol, u16)]) -> PolicyPod {
    let mut list: Vec<NamedPort> = ports
        .iter()
        .map(|(n, proto, port)| NamedPort {
            name: (*n).into(),
            protocol: *proto,
            port: *port,
        })
        .collect();
    list.sort();
    p.named_ports = Arc::from(list);
    p
}

fn on(mut p: PolicyPod, node: &str) -> PolicyPod {
    p.node_name = node.into();
    p
}

/// A policy from its YAML spec, through the same decoder the sources use.
fn policy(ns: &str, name: &str, spec: &str) -> NetworkPolicy {
    let yaml = format!("metadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}");
    let api: k8s_openapi::api::networking::v1::NetworkPolicy =
        serde_norway::from_str(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
    crate::source::policy::network_policy(&api).unwrap_or_else(|e| panic!("{yaml}: {e}"))
}

fn namespace(name: &str, labels: &[(&str, &str)]) -> PolicyNamespace {
    PolicyNamespace::new(name, Labels::new(labels.iter().copied()))
}

#[derive(Clone, Debug, Default)]
struct World {
    namespaces: Vec<Arc<PolicyNamespace>>,
    pods: Vec<Arc<PolicyPod>>,
    policies: Vec<Arc<NetworkPolicy>>,
    node_addrs: Vec<IpAddr>,
}

impl World {
    fn new() -> Self {
        World {
            node_addrs: vec![ip(NODE_IP)],
            ..Default::default()
        }
    }
    fn ns(mut self, ns: PolicyNamespace) -> Self {
        self.namespaces.push(Arc::new(ns));
        self
    }
    fn pod(mut self, p: PolicyPod) -> Self {
        self.pods.push(Arc::new(p));
        self
    }
    fn policy(mut self, p: NetworkPolicy) -> Self {
        self.policies.push(Arc::new(p));
        self
    }
    fn objects(&self) -> PolicyObjects<'_> {
        PolicyObjects {
            namespaces: &self.namespaces,
            pods: &self.pods,
            policies: &self.policies,
            node_addrs: &self.node_addrs,
        }
    }
    fn compile(&self) -> PolicyCompiler {
        PolicyCompiler::full(
            NODE,
            self.node_addrs.iter().copied(),
            self.namespaces.iter().cloned(),
            self.pods.iter().cloned(),
            self.policies.iter().cloned(),
        )
    }
}

/// One direction judged by the compiled maps, checked against the evaluator.
fn judged(
    world: &World,
    maps: &PolicyMaps,
    pod: &str,
    dir: u8,
    peer: &str,
    proto: u8,
    port: u16,
) -> bool {
    let v = verdict(
        maps,
        &IpAddrBe::from(ip(pod)),
        dir,
        &IpAddrBe::from(ip(peer)),
        proto,
        port.to_be_bytes(),
    );
    let reference = evaluate_direction(&world.objects(), ip(pod), dir, ip(peer), proto, port);
    assert_eq!(
        v.is_allowed(),
        reference,
        "maps {v:?} vs evaluator for pod {pod} dir {dir} peer {peer} proto {proto} port {port}"
    );
    v.is_allowed()
}

/// Asserts a table of (pod, direction, peer, proto, port, allowed).
fn check(world: &World, cases: &[(&str, u8, &str, u8, u16, bool)]) {
    let maps = world.compile().maps();
    for &(pod, dir, peer, proto, port, want) in cases {
        assert_eq!(
            judged(world, &maps, pod, dir, peer, proto, port),
            want,
            "pod {pod} dir {dir} peer {peer} proto {proto} port {port}"
        );
    }
}

const A: &str = "10.0.0.1";
const B: &str = "10.0.0.2";
const C: &str = "10.0.1.3";
const OUTSIDE: &str = "8.8.8.8";

fn base() -> World {
    World::new()
        .ns(namespace("x", &[("team", "a")]))
        .ns(namespace("y", &[("team", "b")]))
        .pod(pod("x", "a", A, &[("app", "db")]))
        .pod(pod("x", "b", B, &[("app", "api")]))
        .pod(pod("y", "c", C, &[("app", "api")]))
}

#[test]
fn no_policy_is_open_and_every_pod_has_an_identity() {
    let w = base();
    let c = w.compile();
    let maps = c.maps();
    assert_eq!(maps.endpoints.len(), 3);
    assert!(maps.endpoints.values().all(|e| e.flags == 0));
    assert_eq!(maps.identities.len(), 4, "three pods and the node");
    assert_eq!(
        maps.identities[&IpAddrBe::from(ip(NODE_IP))],
        POLICY_ID_HOST
    );
    assert!(maps.policy.is_empty() && maps.cidrs.is_empty());
    check(
        &w,
        &[(A, IN, C, TCP, 80, true), (A, OUT, OUTSIDE, UDP, 53, true)],
    );
}

#[test]
fn empty_rule_list_denies_and_policy_types_decide_the_directions() {
    let w = base().policy(policy("x", "deny", "  podSelector: {}"));
    check(
        &w,
        &[
            (A, IN, B, TCP, 80, false),
            (A, IN, C, UDP, 53, false),
            (A, IN, OUTSIDE, IPPROTO_ICMP, 0, false),
            // Ingress only: egress stays open; namespace y is not selected.
            (A, OUT, C, TCP, 80, true),
            (C, IN, A, TCP, 80, true),
            // The node (kubelet probes) may always reach its pods.
            (A, IN, NODE_IP, TCP, 8080, true),
        ],
    );
    let w = base().policy(policy(
        "x",
        "deny-out",
        "  podSelector: {}\n  policyTypes: [Egress]",
    ));
    check(
        &w,
        &[
            (A, IN, B, TCP, 80, true),
            (A, OUT, B, TCP, 80, false),
            (A, OUT, NODE_IP, TCP, 10250, false),
        ],
    );
    // Egress rules imply Egress (and Ingress with none: deny).
    let w = base().policy(policy(
        "x",
        "implied",
        "  podSelector: {matchLabels: {app: db}}\n  egress: [{to: [{podSelector: {}}]}]",
    ));
    check(
        &w,
        &[
            (A, OUT, B, TCP, 80, true),
            (A, OUT, C, TCP, 80, false),
            (A, IN, B, TCP, 80, false),
            (B, IN, C, TCP, 80, true),
        ],
    );
}

#[test]
fn pod_and_namespace_selectors() {
    // podSelector alone: this namespace only.
    let w = base().policy(policy(
        "x",
        "p",
        "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: api}}}]}]",
    ));
    check(&w, &[(A, IN, B, TCP, 80, true), (A, IN, C, TCP, 80, false)]);
    // namespaceSelector alone: every pod of those namespaces.
    let w = base().policy(policy(
        "x",
        "p",
        "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {team: b}}}]}]",
    ));
    check(&w, &[(A, IN, B, TCP, 80, false), (A, IN, C, TCP, 80, true)]);
    // Both in one peer: AND.
    let w = base().pod(pod("y", "d", "10.0.1.4", &[("app", "web")])).policy(policy(
        "x",
        "p",
        "  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - from:\n    - namespaceSelector: {matchLabels: {team: b}}\n      podSelector: {matchLabels: {app: api}}",
    ));
    check(
        &w,
        &[
            (A, IN, C, TCP, 80, true),
            (A, IN, "10.0.1.4", TCP, 80, false),
            (A, IN, B, TCP, 80, false),
        ],
    );
    // Two peers: OR.
    let w = base().pod(pod("y", "d", "10.0.1.4", &[("app", "web")])).policy(policy(
        "x",
        "p",
        "  podSelector: {matchLabels: {app: db}}\n  ingress:\n  - from:\n    - namespaceSelector: {matchLabels: {team: b}}\n    - podSelector: {matchLabels: {app: api}}",
    ));
    check(
        &w,
        &[
            (A, IN, C, TCP, 80, true),
            (A, IN, "10.0.1.4", TCP, 80, true),
            (A, IN, B, TCP, 80, true),
        ],
    );
    // The name label every namespace carries; an empty namespaceSelector is all.
    let w = base().policy(policy(
        "x",
        "p",
        "  podSelector: {}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: y}}}]}]",
    ));
    check(&w, &[(A, IN, C, TCP, 80, true), (A, IN, B, TCP, 80, false)]);
    let w = base().policy(policy(
        "x",
        "p",
        "  podSelector: {}\n  ingress: [{from: [{namespaceSelector: {}}]}]",
    ));
    check(
        &w,
        &[
            (A, IN, C, TCP, 80, true),
            (A, IN, B, TCP, 80, true),
            (A, IN, OUTSIDE, TCP, 80, false),
        ],
    );
}

#[test]
fn match_expressions() {
    let w = base()
        .pod(pod(
            "x",
            "e",
            "10.0.0.5",
            &[("app", "cache"), ("tier", "back")],
        ))
        .pod(pod("x", "f", "10.0.0.6", &[]))
        .policy(policy(
            "x",
            "p",
            r#"  podSelector:
    matchExpressions: [{key: app, operator: In, values: [db]}]
  ingress:
  - from:
    - podSelector:
        matchExpressions:
        - {key: app, operator: NotIn, values: [api]}
        - {key: tier, operator: DoesNotExist}
  - from:
    - podSelector:
        matchExpressions: [{key: tier, operator: Exists}]
    ports: [{port: 6379}]"#,
        ));
    check(
        &w,
        &[
            // f has no app label: NotIn holds, no tier.
            (A, IN, "10.0.0.6", TCP, 80, true),
            (A, IN, B, TCP, 80, false),
            // e has a tier: only the second rule, port 6379.
            (A, IN, "10.0.0.5", TCP, 80, false),
            (A, IN, "10.0.0.5", TCP, 6379, true),
            // The policy selects only app=db.
            (B, IN, C, TCP, 80, true),
        ],
    );
}

#[test]
fn ip_blocks_with_excepts_both_families() {
    let w = base()
        .pod(pod("x", "v6", "10.0.0.9,fd00::9", &[("app", "v6")]))
        .policy(policy(
            "x",
            "p",
            r#"  podSelector: {}
  policyTypes: [Ingress, Egress]
  ingress:
  - from:
    - ipBlock: {cidr: 10.0.0.0/16, except: [10.0.1.0/24]}
  egress:
  - to:
    - ipBlock: {cidr: 0.0.0.0/0, except: [10.0.0.0/8]}
    ports: [{protocol: UDP, port: 53}]
  - to:
    - ipBlock: {cidr: "::/0"}"#,
        ));
    check(
        &w,
        &[
            // A pod address inside the block is matched by it.
            (A, IN, B, TCP, 80, true),
            // The except: a pod of y in 10.0.1.0/24.
            (A, IN, C, TCP, 80, false),
            (A, IN, "10.0.200.1", TCP, 80, true),
            (A, IN, "10.1.0.1", TCP, 80, false),
            (A, OUT, OUTSIDE, UDP, 53, true),
            (A, OUT, OUTSIDE, TCP, 53, false),
            (A, OUT, "10.9.9.9", UDP, 53, false),
            // ::/0 holds every IPv6 address but no IPv4 one.
            ("fd00::9", OUT, "2001:db8::1", TCP, 443, true),
            (A, OUT, "1.1.1.1", TCP, 443, false),
        ],
    );
}

#[test]
fn ports_protocols_and_ranges() {
    let w = base().policy(policy(
        "x",
        "p",
        r#"  podSelector: {matchLabels: {app: db}}
  ingress:
  - ports:
    - port: 80
    - {protocol: UDP, port: 1000, endPort: 2000}
    - {protocol: SCTP}"#,
    ));
    check(
        &w,
        &[
            (A, IN, C, TCP, 80, true),
            (A, IN, C, TCP, 81, false),
            (A, IN, C, UDP, 80, false),
            (A, IN, C, UDP, 999, false),
            (A, IN, C, UDP, 1000, true),
            (A, IN, C, UDP, 1500, true),
            (A, IN, C, UDP, 2000, true),
            (A, IN, C, UDP, 2001, false),
            (A, IN, C, IPPROTO_SCTP, 7, true),
            (A, IN, C, IPPROTO_ICMP, 0, false),
            // Without peers the rule holds for every peer, outside ones too.
            (A, IN, OUTSIDE, TCP, 80, true),
        ],
    );
    // endPort is not ignored (Cilium 28684): the range's entries are prefixes.
    let maps = w.compile().maps();
    let udp_entries = maps.policy.keys().filter(|k| k.data.proto == UDP).count();
    assert_eq!(udp_entries, super::ports::split_range(1000, 2000).len());
}

#[test]
fn named_ports_resolve_on_the_destination_pod() {
    let tcp = PolicyProtocol::Tcp;
    let w = World::new()
        .pod(with_ports(pod("x", "srv1", A, &[("app", "srv")]), &[("http", tcp, 8080)]))
        .pod(with_ports(pod("x", "srv2", B, &[("app", "srv")]), &[("http", tcp, 9090)]))
        .pod(on(pod("x", "client", "10.0.0.3", &[("app", "client")]), "node-2"))
        .pod(pod("x", "local-client", "10.0.0.4", &[("app", "client")]))
        .policy(policy(
            "x",
            "in",
            "  podSelector: {matchLabels: {app: srv}}\n  ingress: [{ports: [{port: http}]}]",
        ))
        .policy(policy(
            "x",
            "out",
            "  podSelector: {matchLabels: {app: client}}\n  egress: [{to: [{podSelector: {matchLabels: {app: srv}}}], ports: [{port: http}]}]",
        ));
    check(
        &w,
        &[
            // Ingress: each server's own number.
            (A, IN, "10.0.0.3", TCP, 8080, true),
            (A, IN, "10.0.0.3", TCP, 9090, false),
            (B, IN, "10.0.0.3", TCP, 9090, true),
            (B, IN, "10.0.0.3", TCP, 8080, false),
            (A, IN, "10.0.0.3", UDP, 8080, false),
            // Egress: per destination pod, though both servers have the same labels.
            ("10.0.0.4", OUT, A, TCP, 8080, true),
            ("10.0.0.4", OUT, A, TCP, 9090, false),
            ("10.0.0.4", OUT, B, TCP, 9090, true),
            ("10.0.0.4", OUT, B, TCP, 8080, false),
        ],
    );
    let c = w.compile();
    let ids: std::collections::BTreeSet<u32> = [A, B]
        .iter()
        .map(|a| c.maps().identities[&IpAddrBe::from(ip(a))])
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "a named port's number is part of the identity"
    );
}

#[test]
fn egress_named_port_without_peers_and_toward_blocks() {
    let tcp = PolicyProtocol::Tcp;
    let w = World::new()
        .pod(with_ports(pod("x", "srv", A, &[]), &[("http", tcp, 8080)]))
        .pod(pod("x", "client", B, &[("app", "client")]))
        .policy(policy(
            "x",
            "out",
            r#"  podSelector: {matchLabels: {app: client}}
  egress:
  - ports: [{port: http}, {port: 53, protocol: UDP}]
  - to: [{ipBlock: {cidr: 10.0.0.0/8}}]
    ports: [{port: http}]"#,
        ));
    check(
        &w,
        &[
            (B, OUT, A, TCP, 8080, true),
            (B, OUT, A, TCP, 80, false),
            (B, OUT, OUTSIDE, UDP, 53, true),
            (B, OUT, OUTSIDE, TCP, 8080, false),
            (B, OUT, "10.5.5.5", TCP, 8080, false),
        ],
    );
}

#[test]
fn policies_add_up_and_empty_from_means_everyone() {
    let w = base()
        .policy(policy(
            "x",
            "one",
            "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: api}}}], ports: [{port: 5432}]}]",
        ))
        .policy(policy(
            "x",
            "two",
            "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {team: b}}}], ports: [{port: 80}]}]",
        ))
        .policy(policy("x", "three", "  podSelector: {}\n  ingress: [{from: [], ports: [{port: 9100}]}]"));
    check(
        &w,
        &[
            (A, IN, B, TCP, 5432, true),
            (A, IN, B, TCP, 80, false),
            (A, IN, C, TCP, 80, true),
            (A, IN, C, TCP, 5432, false),
            (A, IN, OUTSIDE, TCP, 9100, true),
            (B, IN, OUTSIDE, TCP, 9100, true),
            (B, IN, A, TCP, 80, false),
        ],
    );
    // A key two rules give names the first rule by (namespace, policy, direction, index).
    let w = base()
        .policy(policy("x", "b", "  podSelector: {}\n  ingress: [{}]"))
        .policy(policy("x", "a", "  podSelector: {}\n  ingress: [{}]"));
    let c = w.compile();
    for allow in c.maps().policy.values() {
        assert_eq!(&*c.rule(allow.rule).unwrap().policy, "a");
    }
}

#[test]
fn host_network_pods_and_other_nodes() {
    let mut host = pod("x", "h", NODE_IP, &[("app", "api")]);
    host.host_network = true;
    let w = base()
        .pod(host)
        .pod(on(
            pod("x", "remote", "10.0.9.9", &[("app", "db")]),
            "node-2",
        ))
        .policy(policy(
            "x",
            "deny",
            "  podSelector: {}\n  policyTypes: [Ingress, Egress]",
        ));
    let c = w.compile();
    let maps = c.maps();
    // Local pods only; the host-network pod has no endpoint and no identity.
    assert_eq!(maps.endpoints.len(), 3);
    assert!(!maps.endpoints.contains_key(&IpAddrBe::from(ip("10.0.9.9"))));
    assert_eq!(
        maps.identities[&IpAddrBe::from(ip(NODE_IP))],
        POLICY_ID_HOST
    );
    assert!(maps
        .identities
        .contains_key(&IpAddrBe::from(ip("10.0.9.9"))));
    let v = verdict(
        &maps,
        &IpAddrBe::from(ip("10.0.9.9")),
        IN,
        &IpAddrBe::from(ip(A)),
        TCP,
        80u16.to_be_bytes(),
    );
    assert_eq!(v, Verdict::Open, "another node's pod is enforced there");
    check(
        &w,
        &[
            (A, IN, NODE_IP, TCP, 80, true),
            (A, OUT, NODE_IP, TCP, 80, false),
        ],
    );
}

#[test]
fn changes_touch_only_what_they_affect() {
    let w = base().policy(policy(
        "x",
        "p",
        "  podSelector: {matchLabels: {app: db}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: api}}}]}]",
    ));
    let mut c = w.compile();
    // A new pod with an existing identity: one identity entry, nothing else.
    let ops = c.apply(PolicyChange::UpsertPod(Arc::new(pod(
        "x",
        "b2",
        "10.0.0.22",
        &[("app", "api")],
    ))));
    assert_eq!(ops.identities.inserts.len(), 1);
    assert_eq!((ops.policy.len(), ops.cidrs.len()), (0, 0));
    assert_eq!(ops.endpoints.inserts.len(), 1, "a local pod: its endpoint");
    // The same on another node: the identity only.
    let ops = c.apply(PolicyChange::UpsertPod(Arc::new(on(
        pod("x", "b3", "10.0.0.23", &[("app", "api")]),
        "node-2",
    ))));
    assert_eq!(ops.len(), 1);
    // A pod relabelled into the selector: it gets the policy's flag.
    let ops = c.apply(PolicyChange::UpsertPod(Arc::new(pod(
        "x",
        "b",
        B,
        &[("app", "db")],
    ))));
    assert_eq!(ops.endpoints.updates.len(), 1);
    assert!(ops.endpoints.updates[0].1.enforces_ingress());
    // Namespace labels change identities, not the selection of x's pods.
    let ops = c.apply(PolicyChange::UpsertNamespace(Arc::new(namespace(
        "y",
        &[("team", "c")],
    ))));
    assert_eq!(ops.identities.updates.len(), 1, "{ops:?}");
    // Deleting the policy opens the pods again and removes its entries.
    let ops = c.apply(PolicyChange::DeletePolicy {
        namespace: "x".into(),
        name: "p".into(),
    });
    assert!(ops.policy.inserts.is_empty() && !ops.policy.deletes.is_empty());
    assert!(c.maps().policy.is_empty());
    assert!(c.maps().endpoints.values().all(|e| e.flags == 0));
    // Removing everything leaves empty maps but the node's address.
    let mut names: Vec<(Text, Text)> = c
        .maps()
        .endpoints
        .keys()
        .map(|_| ("".into(), "".into()))
        .collect();
    names.clear();
    for p in ["a", "b", "b2"] {
        c.apply(PolicyChange::DeletePod {
            namespace: "x".into(),
            name: p.into(),
        });
    }
    for (ns, p) in [("x", "b3"), ("y", "c")] {
        c.apply(PolicyChange::DeletePod {
            namespace: ns.into(),
            name: p.into(),
        });
    }
    let maps = c.maps();
    assert!(maps.endpoints.is_empty());
    assert_eq!(maps.identities.len(), 1);
}

// ---- canonical form: ids replaced by what they stand for ----

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum CanonPeer {
    Reserved(u32),
    Identity(String),
    Class(Vec<String>),
}

fn canon_peer(c: &PolicyCompiler, id: u32) -> CanonPeer {
    if let Some(desc) = c.identity(id) {
        return CanonPeer::Identity(format!("{desc:?}"));
    }
    if let Some(blocks) = c.class_blocks(id) {
        return CanonPeer::Class(blocks);
    }
    CanonPeer::Reserved(id)
}

type Canon = (
    BTreeMap<IpAddrBe, (String, String, u32)>,
    BTreeMap<IpAddrBe, CanonPeer>,
    BTreeMap<(u32, IpAddrBe), Vec<String>>,
    BTreeMap<(u32, String, CanonPeer, u8, u8, [u8; 2]), String>,
);

fn canon(c: &PolicyCompiler, maps: &PolicyMaps) -> Canon {
    let ep = |id: u32| {
        let (ns, name) = c.endpoint_pod(id).expect("endpoint of a local pod");
        format!("{ns}/{name}")
    };
    let endpoints = maps
        .endpoints
        .iter()
        .map(|(k, v)| {
            let (ns, name) = c.endpoint_pod(v.id).unwrap();
            (*k, (ns.to_owned(), name.to_owned(), v.flags))
        })
        .collect();
    let identities = maps
        .identities
        .iter()
        .map(|(k, v)| (*k, canon_peer(c, *v)))
        .collect();
    let cidrs = maps
        .cidrs
        .iter()
        .map(|(k, v)| ((k.prefix_len, k.data.address), c.class_blocks(*v).unwrap()))
        .collect();
    let policy = maps
        .policy
        .iter()
        .map(|(k, v): (&Lpm<PolicyKey>, &PolicyAllow)| {
            let d = k.data;
            (
                (
                    k.prefix_len,
                    ep(d.endpoint),
                    canon_peer(c, d.peer),
                    d.direction,
                    d.proto,
                    d.port_be,
                ),
                format!("{:?}", c.rule(v.rule).unwrap()),
            )
        })
        .collect();
    (endpoints, identities, cidrs, policy)
}

// ---- random worlds ----

mod random {
    use proptest::prelude::*;

    use super::*;

    pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
    const KEYS: [&str; 2] = ["app", "tier"];
    const VALUES: [&str; 3] = ["a", "b", "c"];
    /// Pod addresses: 10.0.0.0/28 and fd00::/124, so blocks and excepts hit them.
    pub fn pod_ip(i: u8, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(std::net::Ipv6Addr::new(
                0xfd00,
                0,
                0,
                0,
                0,
                0,
                0,
                u16::from(i),
            ))
        } else {
            IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, i))
        }
    }
    pub const PORTS: [u16; 5] = [53, 80, 81, 443, 8080];

    fn labels() -> impl Strategy<Value = Labels> {
        proptest::collection::vec((0..KEYS.len(), 0..VALUES.len()), 0..3)
            .prop_map(|pairs| Labels::new(pairs.into_iter().map(|(k, v)| (KEYS[k], VALUES[v]))))
    }

    fn protocol() -> impl Strategy<Value = PolicyProtocol> {
        prop_oneof![
            4 => Just(PolicyProtocol::Tcp),
            2 => Just(PolicyProtocol::Udp),
            1 => Just(PolicyProtocol::Sctp),
        ]
    }

    fn named_ports() -> impl Strategy<Value = Vec<NamedPort>> {
        proptest::collection::vec(
            (
                prop_oneof![Just("http"), Just("dns")],
                protocol(),
                0..PORTS.len(),
            ),
            0..3,
        )
        .prop_map(|list| {
            let mut out: Vec<NamedPort> = list
                .into_iter()
                .map(|(n, protocol, p)| NamedPort {
                    name: n.into(),
                    protocol,
                    port: PORTS[p],
                })
                .collect();
            out.sort();
            out.dedup_by(|a, b| a.name == b.name && a.protocol == b.protocol);
            out
        })
    }

    pub fn pod_strategy(index: u8) -> impl Strategy<Value = PolicyPod> {
        (
            0..NAMESPACES.len(),
            labels(),
            named_ports(),
            prop_oneof![4 => Just(false), 1 => Just(true)],
            prop_oneof![3 => Just(NODE), 1 => Just("node-2")],
            prop_oneof![3 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)],
        )
            .prop_map(move |(ns, labels, ports, host, node, family)| {
                let ips = match family {
                    0 => vec![pod_ip(index, false)],
                    1 => vec![pod_ip(index, true)],
                    _ => vec![pod_ip(index, false), pod_ip(index, true)],
                };
                PolicyPod {
                    namespace: NAMESPACES[ns].into(),
                    name: format!("p{index}").into(),
                    ips,
                    labels,
                    named_ports: Arc::from(ports),
                    host_network: host,
                    node_name: node.into(),
                }
            })
    }

    fn requirement() -> impl Strategy<Value = Requirement> {
        (
            0..KEYS.len(),
            prop_oneof![
                Just(SelectorOp::In),
                Just(SelectorOp::NotIn),
                Just(SelectorOp::Exists),
                Just(SelectorOp::DoesNotExist)
            ],
            proptest::collection::btree_set(0..VALUES.len(), 1..3),
        )
            .prop_map(|(k, op, values)| Requirement {
                key: KEYS[k].into(),
                op,
                values: match op {
                    SelectorOp::In | SelectorOp::NotIn => {
                        values.into_iter().map(|v| Text::from(VALUES[v])).collect()
                    }
                    _ => Vec::new(),
                },
            })
    }

    fn selector() -> impl Strategy<Value = Selector> {
        proptest::collection::vec(requirement(), 0..3)
            .prop_map(|requirements| Selector { requirements })
    }

    fn ns_selector() -> impl Strategy<Value = Selector> {
        prop_oneof![
            selector(),
            (0..NAMESPACES.len()).prop_map(|i| Selector {
                requirements: vec![Requirement {
                    key: crate::model::policy::LABEL_NAMESPACE_NAME.into(),
                    op: SelectorOp::In,
                    values: vec![NAMESPACES[i].into()],
                }],
            }),
        ]
    }

    fn block() -> impl Strategy<Value = IpBlock> {
        let cidrs = [
            ("10.0.0.0/28", vec!["10.0.0.0/30", "10.0.0.8/29"]),
            ("10.0.0.0/29", vec!["10.0.0.4/31"]),
            ("10.0.0.0/8", vec!["10.0.0.0/29"]),
            ("0.0.0.0/0", vec!["10.0.0.0/8"]),
            ("fd00::/124", vec!["fd00::/126"]),
            ("::/0", vec!["fd00::8/125"]),
            ("8.8.8.0/24", vec![]),
        ];
        (0..cidrs.len(), proptest::bits::u8::masked(0b11)).prop_map(move |(i, mask)| {
            let (cidr, excepts) = &cidrs[i];
            IpBlock {
                cidr: cidr.parse().unwrap(),
                except: excepts
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| mask & (1 << j) != 0)
                    .map(|(_, e)| e.parse().unwrap())
                    .collect(),
            }
        })
    }

    fn peer() -> impl Strategy<Value = Peer> {
        prop_oneof![
            2 => (proptest::option::of(ns_selector()), proptest::option::of(selector()))
                .prop_filter("a peer names something", |(n, p)| n.is_some() || p.is_some())
                .prop_map(|(namespaces, pods)| Peer::Pods { namespaces, pods }),
            1 => block().prop_map(Peer::Block),
        ]
    }

    fn port() -> impl Strategy<Value = PolicyPort> {
        (
            protocol(),
            prop_oneof![
                1 => Just(None),
                3 => (0..PORTS.len()).prop_map(|i| Some(PortRef::Number(PORTS[i]))),
                2 => prop_oneof![Just("http"), Just("dns")].prop_map(|n| Some(PortRef::Name(n.into()))),
            ],
            proptest::option::of(0..PORTS.len()),
        )
            .prop_map(|(protocol, port, end)| {
                let end_port = match (&port, end) {
                    (Some(PortRef::Number(p)), Some(e)) if PORTS[e] >= *p => Some(PORTS[e]),
                    _ => None,
                };
                PolicyPort {
                    protocol,
                    port,
                    end_port,
                }
            })
    }

    fn rule() -> impl Strategy<Value = PolicyRule> {
        (
            proptest::collection::vec(peer(), 0..3),
            proptest::collection::vec(port(), 0..3),
        )
            .prop_map(|(peers, ports)| PolicyRule { peers, ports })
    }

    pub fn policy_strategy(index: u8) -> impl Strategy<Value = NetworkPolicy> {
        (
            0..NAMESPACES.len(),
            selector(),
            proptest::option::of(proptest::collection::vec(rule(), 0..3)),
            proptest::option::of(proptest::collection::vec(rule(), 0..3)),
        )
            .prop_map(move |(ns, pod_selector, ingress, egress)| NetworkPolicy {
                namespace: NAMESPACES[ns].into(),
                name: format!("np{index}").into(),
                pod_selector,
                ingress,
                egress,
            })
    }

    pub fn namespace_strategy(i: usize) -> impl Strategy<Value = PolicyNamespace> {
        labels().prop_map(move |l| PolicyNamespace::new(NAMESPACES[i], l))
    }

    pub fn world() -> impl Strategy<Value = World> {
        (
            proptest::collection::vec(proptest::option::of(namespace_strategy(0)), 0..1),
            namespace_strategy(1),
            (0u8..8).prop_flat_map(|n| (0..n).map(pod_strategy).collect::<Vec<_>>()),
            (0u8..5).prop_flat_map(|n| (0..n).map(policy_strategy).collect::<Vec<_>>()),
        )
            .prop_map(|(x, y, pods, policies)| {
                let mut w = World::new();
                w.node_addrs.push(ip("fd00::ff"));
                for ns in x.into_iter().flatten() {
                    w.namespaces.push(Arc::new(ns));
                }
                w.namespaces.push(Arc::new(y));
                w.pods = pods.into_iter().map(Arc::new).collect();
                w.policies = policies.into_iter().map(Arc::new).collect();
                w
            })
    }

    /// Peers a packet may come from or go to: pods, the node, outsiders.
    pub fn addresses() -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = (0..8)
            .flat_map(|i| [pod_ip(i, false), pod_ip(i, true)])
            .collect();
        out.extend(
            [
                NODE_IP,
                "fd00::ff",
                "8.8.8.8",
                "10.0.0.200",
                "10.1.0.1",
                "fd00::1:1",
                "2001:db8::1",
            ]
            .iter()
            .map(|s| ip(s)),
        );
        out
    }

    #[derive(Clone, Debug)]
    pub enum Step {
        Pod(PolicyPod),
        DeletePod(u8),
        Policy(NetworkPolicy),
        DeletePolicy(u8),
        Namespace(PolicyNamespace),
        DeleteNamespace(usize),
        NodeAddrs(bool),
    }

    pub fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..8).prop_flat_map(pod_strategy).prop_map(Step::Pod),
            2 => (0u8..8).prop_map(Step::DeletePod),
            4 => (0u8..5).prop_flat_map(policy_strategy).prop_map(Step::Policy),
            2 => (0u8..5).prop_map(Step::DeletePolicy),
            1 => (0..NAMESPACES.len()).prop_flat_map(namespace_strategy).prop_map(Step::Namespace),
            1 => (0..NAMESPACES.len()).prop_map(Step::DeleteNamespace),
            1 => proptest::bool::ANY.prop_map(Step::NodeAddrs),
        ]
    }
}

/// Applies a step to the objects and returns the change the compiler gets.
fn apply_step(world: &mut World, step: &random::Step) -> Option<Vec<PolicyChange>> {
    use random::Step;
    fn find<T>(list: &[Arc<T>], f: impl Fn(&T) -> bool) -> Option<usize> {
        list.iter().position(|x| f(x))
    }
    Some(vec![match step.clone() {
        Step::Pod(p) => {
            // Names are unique across namespaces here: a pod "moving" is a delete
            // and an upsert.
            let mut changes = Vec::new();
            if let Some(at) = find(&world.pods, |q| q.name == p.name) {
                let old = world.pods.remove(at);
                if old.namespace != p.namespace {
                    changes.push(PolicyChange::DeletePod {
                        namespace: old.namespace.clone(),
                        name: old.name.clone(),
                    });
                }
            }
            world.pods.push(Arc::new(p.clone()));
            changes.push(PolicyChange::UpsertPod(Arc::new(p)));
            return Some(changes);
        }
        Step::DeletePod(i) => {
            let name = format!("p{i}");
            let at = find(&world.pods, |p| *p.name == *name)?;
            let p = world.pods.remove(at);
            PolicyChange::DeletePod {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
            }
        }
        Step::Policy(p) => {
            let mut changes = Vec::new();
            if let Some(at) = find(&world.policies, |q| q.name == p.name) {
                let old = world.policies.remove(at);
                if old.namespace != p.namespace {
                    changes.push(PolicyChange::DeletePolicy {
                        namespace: old.namespace.clone(),
                        name: old.name.clone(),
                    });
                }
            }
            world.policies.push(Arc::new(p.clone()));
            changes.push(PolicyChange::UpsertPolicy(Arc::new(p)));
            return Some(changes);
        }
        Step::DeletePolicy(i) => {
            let name = format!("np{i}");
            let at = find(&world.policies, |p| *p.name == *name)?;
            let p = world.policies.remove(at);
            PolicyChange::DeletePolicy {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
            }
        }
        Step::Namespace(ns) => {
            world.namespaces.retain(|n| n.name != ns.name);
            world.namespaces.push(Arc::new(ns.clone()));
            PolicyChange::UpsertNamespace(Arc::new(ns))
        }
        Step::DeleteNamespace(i) => {
            let name = random::NAMESPACES[i];
            world.namespaces.retain(|n| &*n.name != name);
            PolicyChange::DeleteNamespace { name: name.into() }
        }
        Step::NodeAddrs(_) => return None,
    }])
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

    /// The shared verdict over the compiled maps (LPM tries simulated as the kernel
    /// matches them) equals the evaluator over the objects, for every local pod
    /// address, direction, peer, protocol and port.
    #[test]
    fn compiled_maps_agree_with_the_objects(world in random::world()) {
        let maps = world.compile().maps();
        let objects = world.objects();
        let locals: Vec<IpAddr> = world
            .pods
            .iter()
            .filter(|p| &*p.node_name == NODE && !p.host_network)
            .flat_map(|p| p.ips.clone())
            .collect();
        let protos = [TCP, UDP, IPPROTO_SCTP, IPPROTO_ICMP];
        for pod in &locals {
            for peer in random::addresses() {
                for dir in [IN, OUT] {
                    for proto in protos {
                        for port in random::PORTS.iter().copied().chain([0, 60000]) {
                            let v = verdict(
                                &maps,
                                &IpAddrBe::from(*pod),
                                dir,
                                &IpAddrBe::from(peer),
                                proto,
                                port.to_be_bytes(),
                            );
                            let want = evaluate_direction(&objects, *pod, dir, peer, proto, port);
                            proptest::prop_assert_eq!(
                                v.is_allowed(), want,
                                "pod {} dir {} peer {} proto {} port {}: {:?}",
                                pod, dir, peer, proto, port, v
                            );
                        }
                    }
                }
            }
        }
    }

    /// Random changes applied one at a time give the maps a full compile of the
    /// final objects gives (ids aside), and the operations each change returned,
    /// applied in turn, give the same maps.
    #[test]
    fn incremental_equals_full(
        start in random::world(),
        steps in proptest::collection::vec(random::step(), 1..25),
    ) {
        let mut world = start.clone();
        let mut c = start.compile();
        let mut written = c.maps();
        for step in &steps {
            let ops = match step {
                random::Step::NodeAddrs(extra) => {
                    world.node_addrs = vec![ip(NODE_IP)];
                    if *extra {
                        world.node_addrs.push(random::pod_ip(3, false));
                    }
                    c.set_node_addresses(world.node_addrs.clone())
                }
                _ => match apply_step(&mut world, step) {
                    Some(changes) => c.apply_all(changes),
                    None => continue,
                },
            };
            ops.apply_to(&mut written);
            proptest::prop_assert_eq!(&written, &c.maps(), "ops after {:?}", step);
        }
        let full = world.compile();
        proptest::prop_assert_eq!(canon(&c, &c.maps()), canon(&full, &full.maps()));
    }
}

// ---- scale ----

/// 10k pods (100 on this node) in 100 namespaces, 1k policies; compile time, entry
/// counts, and the cost of single changes. `cargo test -p lb-userspace --lib --release
/// -- --ignored policy_scale --nocapture`.
#[test]
#[ignore]
fn policy_scale() {
    use std::time::Instant;
    let namespaces: Vec<Arc<PolicyNamespace>> = (0..100)
        .map(|i| {
            Arc::new(namespace(
                &format!("ns{i}"),
                &[("team", &format!("t{}", i % 10))],
            ))
        })
        .collect();
    let tcp = PolicyProtocol::Tcp;
    let mut pods = Vec::new();
    for i in 0..10_000u32 {
        let ns = format!("ns{}", i % 100);
        let addr = format!("10.{}.{}.{}", 1 + i / 65536, (i / 256) % 256, i % 256);
        let app = format!("app{}", (i / 100) % 20);
        let mut p = with_ports(
            pod(
                &ns,
                &format!("pod{i}"),
                &addr,
                &[("app", &app), ("rev", &format!("r{}", i % 3))],
            ),
            &[("http", tcp, 8080), ("metrics", tcp, 9100)],
        );
        // One pod in a hundred is local, spread over the namespaces.
        if i % 100 != (i / 100) % 100 {
            p.node_name = format!("node-{}", 2 + i % 99).into();
        }
        pods.push(Arc::new(p));
    }
    let mut policies = Vec::new();
    for i in 0..1000u32 {
        let ns = format!("ns{}", i % 100);
        let spec = match i % 4 {
            0 => format!(
                "  podSelector: {{matchLabels: {{app: app{}}}}}\n  ingress:\n  - from: [{{podSelector: {{matchLabels: {{app: app{}}}}}}}]\n    ports: [{{port: http}}, {{port: 5432}}]",
                i % 20,
                (i + 1) % 20
            ),
            1 => format!(
                "  podSelector: {{matchLabels: {{app: app{}}}}}\n  ingress:\n  - from: [{{namespaceSelector: {{matchLabels: {{team: t{}}}}}}}]\n    ports: [{{port: 8000, endPort: 8100}}]",
                i % 20,
                i % 10
            ),
            2 => format!(
                "  podSelector: {{matchLabels: {{app: app{}}}}}\n  egress:\n  - to: [{{ipBlock: {{cidr: 172.{}.0.0/16, except: [172.{}.1.0/24]}}}}]\n    ports: [{{port: 443}}]\n  - to: [{{namespaceSelector: {{}}, podSelector: {{matchLabels: {{app: app{}}}}}}}]",
                i % 20,
                i % 256,
                i % 256,
                (i + 3) % 20
            ),
            _ => "  podSelector: {}\n  ingress: [{from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: ns0}}}]}]".to_owned(),
        };
        policies.push(Arc::new(policy(&ns, &format!("np{i}"), &spec)));
    }
    let start = Instant::now();
    let mut c = PolicyCompiler::full(
        NODE,
        [ip(NODE_IP)],
        namespaces.iter().cloned(),
        pods.iter().cloned(),
        policies.iter().cloned(),
    );
    let compile = start.elapsed();
    let counts = c.counts();
    println!(
        "full compile: {compile:?}; entries endpoints {} identities {} cidrs {} policy {}; \
         {} distinct identities",
        counts.0,
        counts.1,
        counts.2,
        counts.3,
        c.identity_count()
    );

    fn measure(
        c: &mut PolicyCompiler,
        change: PolicyChange,
        out: &mut (Vec<std::time::Duration>, Vec<usize>),
    ) {
        let start = Instant::now();
        let ops = c.apply(change);
        out.0.push(start.elapsed());
        out.1.push(ops.len());
    }
    // A remote pod with a new label set (a new identity).
    let mut new_identity = Default::default();
    for i in 0..20 {
        let mut p = (*pods[1 + i]).clone();
        p.labels = p.labels.with("rev", &format!("new{i}"));
        measure(
            &mut c,
            PolicyChange::UpsertPod(Arc::new(p)),
            &mut new_identity,
        );
    }
    // A policy edited (its port changes), then restored.
    let mut policy_edit = Default::default();
    for i in 0..20 {
        let mut p = (*policies[i * 4]).clone();
        if let Some(rules) = p.ingress.as_mut() {
            rules[0].ports[1].port = Some(PortRef::Number(5433));
        }
        measure(
            &mut c,
            PolicyChange::UpsertPolicy(Arc::new(p)),
            &mut policy_edit,
        );
        measure(
            &mut c,
            PolicyChange::UpsertPolicy(policies[i * 4].clone()),
            &mut policy_edit,
        );
    }
    // A local pod relabelled.
    let mut local_relabel = Default::default();
    for i in 0..20 {
        let mut p = (*pods[i * 101]).clone();
        p.labels = p.labels.with("app", "app19");
        measure(
            &mut c,
            PolicyChange::UpsertPod(Arc::new(p)),
            &mut local_relabel,
        );
    }
    for (what, (times, sizes)) in [
        ("remote pod, new identity", new_identity),
        ("policy edit", policy_edit),
        ("local pod relabelled", local_relabel),
    ] {
        let mut sorted = times.clone();
        sorted.sort();
        println!(
            "{what}: median {:?} max {:?}; map ops median {} max {}",
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1],
            {
                let mut s = sizes.clone();
                s.sort();
                s[s.len() / 2]
            },
            sizes.iter().max().unwrap()
        );
    }
}
