//! `lb policy POD`: a pod's NetworkPolicies (the agent's answer,
//! `control::policy::view`) beside what the pinned maps say: its drops, and the
//! verdict the kernel programs' own rule gives a new flow to or from a peer.

use std::net::IpAddr;

use lb_common::policy::{PolicyLookup, Verdict, POLICY_DIR_EGRESS, POLICY_DIR_INGRESS};
use lb_common::{IpAddrBe, PolicyCounters};
use serde::{Deserialize, Serialize};

use crate::control::policy::view::{direction_name, PodPolicies, RuleName};
use crate::model::policy::PolicyProtocol;

/// A connection to judge: to the pod from `peer` (`ingress`), or from the pod to
/// `peer`, to port `port` (the pod's for ingress, the peer's for egress).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub ingress: bool,
    pub peer: IpAddr,
    pub protocol: PolicyProtocol,
    pub port: u16,
}

/// `TCP`, `UDP` or `SCTP` in any case, as NetworkPolicy names them.
pub fn protocol(name: &str) -> Option<PolicyProtocol> {
    PolicyProtocol::parse(&name.to_ascii_uppercase())
}

/// What `lb policy POD` prints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodReport {
    pub pod: PodPolicies,
    /// Packets dropped by policy, summed over the pod's addresses' endpoint.
    pub ingress_drops: u64,
    pub egress_drops: u64,
    pub verdict: Option<PeerVerdict>,
}

/// The verdict for one [`Probe`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerVerdict {
    /// `ingress` or `egress`.
    pub direction: String,
    /// The pod's address of the peer's family that was judged.
    pub pod_address: IpAddr,
    pub peer: IpAddr,
    pub protocol: String,
    pub port: u16,
    pub allowed: bool,
    /// `open` (no policy isolates the pod in this direction), `node` (ingress
    /// from this node, always allowed), `rule` (an allow matched) or `denied`.
    pub reason: String,
    /// The rule whose allow matched.
    pub rule: Option<RuleName>,
}

/// Why a [`Probe`] cannot be judged.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "pod {namespace}/{name} runs on node {node:?}, not on this one: its policies are \
         enforced there (ask that node's agent)"
    )]
    NotLocal {
        namespace: String,
        name: String,
        node: String,
    },
    #[error("pod {namespace}/{name} has no {family} address to judge {peer} against")]
    NoAddress {
        namespace: String,
        name: String,
        family: &'static str,
        peer: IpAddr,
    },
}

/// The verdict the datapath gives `probe` for `pod`, read through `maps` (the
/// pinned maps, or any [`PolicyLookup`]).
pub fn judge<L: PolicyLookup>(
    maps: &L,
    pod: &PodPolicies,
    probe: Probe,
) -> Result<PeerVerdict, ProbeError> {
    if !pod.local {
        return Err(ProbeError::NotLocal {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            node: pod.node.clone(),
        });
    }
    let address = pod
        .addresses
        .iter()
        .copied()
        .find(|a| a.is_ipv4() == probe.peer.is_ipv4())
        .ok_or_else(|| ProbeError::NoAddress {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            family: if probe.peer.is_ipv4() { "IPv4" } else { "IPv6" },
            peer: probe.peer,
        })?;
    let direction = if probe.ingress {
        POLICY_DIR_INGRESS
    } else {
        POLICY_DIR_EGRESS
    };
    let verdict = lb_common::policy::verdict(
        maps,
        &IpAddrBe::from(address),
        direction,
        &IpAddrBe::from(probe.peer),
        probe.protocol.number(),
        probe.port.to_be_bytes(),
    );
    let (reason, rule) = match verdict {
        Verdict::Open => ("open", None),
        Verdict::Host => ("node", None),
        Verdict::Allowed { rule } => ("rule", pod.rules.iter().find(|r| r.id == rule).cloned()),
        Verdict::Denied { .. } => ("denied", None),
    };
    Ok(PeerVerdict {
        direction: direction_name(direction).to_owned(),
        pod_address: address,
        peer: probe.peer,
        protocol: probe.protocol.to_string(),
        port: probe.port,
        allowed: verdict.is_allowed(),
        reason: reason.to_owned(),
        rule,
    })
}

impl PodReport {
    pub fn new(pod: PodPolicies, drops: PolicyCounters, verdict: Option<PeerVerdict>) -> Self {
        PodReport {
            pod,
            ingress_drops: drops.ingress_drops,
            egress_drops: drops.egress_drops,
            verdict,
        }
    }

    /// The human form.
    pub fn render_text(&self) -> String {
        let p = &self.pod;
        let addresses: Vec<String> = p.addresses.iter().map(|a| a.to_string()).collect();
        let mut out = format!(
            "pod {}/{} on node {} ({}), addresses: {}\n",
            p.namespace,
            p.name,
            if p.node.is_empty() { "?" } else { &p.node },
            if p.local { "this node" } else { "another node" },
            if addresses.is_empty() {
                "none".to_owned()
            } else {
                addresses.join(", ")
            },
        );
        if p.host_network {
            out += "host network: NetworkPolicy does not apply to it\n";
        }
        for (ingress, drops) in [(true, self.ingress_drops), (false, self.egress_drops)] {
            let name = if ingress { "ingress" } else { "egress" };
            let by: Vec<String> = p
                .policies
                .iter()
                .filter(|q| if ingress { q.ingress } else { q.egress })
                .map(|q| format!("{}/{}", q.namespace, q.name))
                .collect();
            if by.is_empty() {
                out += &format!("{name}: open (no policy selects it for {name})\n");
            } else {
                out += &format!(
                    "{name}: isolated by {}; {drops} packets dropped\n",
                    by.join(", ")
                );
            }
        }
        if let Some(v) = &self.verdict {
            let (from, to) = if v.direction == "ingress" {
                (v.peer.to_string(), format!("{}", v.pod_address))
            } else {
                (v.pod_address.to_string(), v.peer.to_string())
            };
            let why = match v.reason.as_str() {
                "open" => format!("allowed: no policy selects the pod for {}", v.direction),
                "node" => "allowed: from this node (kubelet probes are never blocked)".to_owned(),
                "rule" => match &v.rule {
                    Some(rule) => format!("allowed by {}", rule.describe()),
                    None => "allowed by a rule the agent no longer names".to_owned(),
                },
                _ => format!(
                    "denied: no rule of the policies isolating the pod for {} admits it",
                    v.direction
                ),
            };
            out += &format!(
                "{} {from} -> {to} {}/{}: {why}\n",
                v.direction, v.protocol, v.port
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::policy::view::SelectingPolicy;
    use lb_common::IPPROTO_TCP;

    /// Maps holding one enforced endpoint (id 4, ingress) at 10.244.1.11, peer
    /// 10.244.2.12 as identity 300 with TCP/80 allowed by rule 9.
    struct OneAllow;

    impl PolicyLookup for OneAllow {
        fn endpoint(&self, addr: &IpAddrBe) -> Option<lb_common::PolicyEndpoint> {
            (*addr == IpAddrBe::from("10.244.1.11".parse::<IpAddr>().unwrap())).then_some(
                lb_common::PolicyEndpoint {
                    id: 4,
                    flags: lb_common::policy::POLICY_ENFORCE_INGRESS,
                },
            )
        }
        fn identity(&self, addr: &IpAddrBe) -> Option<u32> {
            (*addr == IpAddrBe::from("10.244.2.12".parse::<IpAddr>().unwrap())).then_some(300)
        }
        fn cidr_class(&self, _: &IpAddrBe) -> Option<u32> {
            None
        }
        fn allow(&self, key: &lb_common::PolicyKey) -> Option<lb_common::PolicyAllow> {
            (key.endpoint == 4
                && key.peer == 300
                && key.proto == IPPROTO_TCP
                && key.port_be == 80u16.to_be_bytes())
            .then_some(lb_common::PolicyAllow { rule: 9, _pad: 0 })
        }
    }

    fn pod() -> PodPolicies {
        PodPolicies {
            namespace: "x".into(),
            name: "a".into(),
            node: "node1".into(),
            local: true,
            host_network: false,
            addresses: vec![
                "10.244.1.11".parse().unwrap(),
                "fd00:244:1::11".parse().unwrap(),
            ],
            endpoint: Some(4),
            policies: vec![SelectingPolicy {
                namespace: "x".into(),
                name: "allow-b".into(),
                ingress: true,
                egress: false,
            }],
            rules: vec![RuleName {
                id: 9,
                namespace: "x".into(),
                policy: "allow-b".into(),
                direction: "ingress".into(),
                index: 0,
            }],
        }
    }

    fn probe(ingress: bool, peer: &str, port: u16) -> Probe {
        Probe {
            ingress,
            peer: peer.parse().unwrap(),
            protocol: PolicyProtocol::Tcp,
            port,
        }
    }

    #[test]
    fn the_rule_that_allowed_is_named_and_a_miss_is_denied() {
        let v = judge(&OneAllow, &pod(), probe(true, "10.244.2.12", 80)).unwrap();
        assert!(v.allowed && v.reason == "rule");
        assert_eq!(v.rule.unwrap().describe(), "x/allow-b spec.ingress[0]");
        let v = judge(&OneAllow, &pod(), probe(true, "10.244.2.12", 81)).unwrap();
        assert!(!v.allowed && v.reason == "denied" && v.rule.is_none());
        // Egress is not isolated.
        let v = judge(&OneAllow, &pod(), probe(false, "10.244.2.12", 81)).unwrap();
        assert!(v.allowed && v.reason == "open");
        let report = PodReport::new(pod(), PolicyCounters::default(), Some(v));
        let text = report.render_text();
        assert!(text.contains("ingress: isolated by x/allow-b"), "{text}");
        assert!(text.contains("egress: open"), "{text}");
    }

    #[test]
    fn a_peer_of_a_family_the_pod_lacks_or_a_pod_elsewhere_is_an_error() {
        let mut only_v4 = pod();
        only_v4.addresses.truncate(1);
        let e = judge(&OneAllow, &only_v4, probe(true, "fd00::1", 80)).unwrap_err();
        assert!(e.to_string().contains("no IPv6 address"), "{e}");
        let mut elsewhere = pod();
        elsewhere.local = false;
        let e = judge(&OneAllow, &elsewhere, probe(true, "10.244.2.12", 80)).unwrap_err();
        assert!(e.to_string().contains("enforced there"), "{e}");
    }

    #[test]
    fn protocols_are_named_as_network_policy_names_them() {
        let number = |name| protocol(name).map(PolicyProtocol::number);
        assert_eq!(number("tcp"), Some(IPPROTO_TCP));
        assert_eq!(number("SCTP"), Some(lb_common::policy::IPPROTO_SCTP));
        assert_eq!(number("icmp"), None);
    }
}
