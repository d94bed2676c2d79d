//! NetworkPolicies, Pods and Namespaces, from the API's types (the API server's
//! watch, or a manifest file read into them) into the policy model
//! ([`crate::model::policy`]), with the API's defaults applied and its validation
//! repeated: the file source has no API server to refuse a malformed object, and an
//! object this cannot read is reported naming it and left out.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1 as net;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::model::policy::{
    IpBlock, Labels, NamedPort, NetworkPolicy, Peer, PolicyNamespace, PolicyPod, PolicyPort,
    PolicyProtocol, PolicyRule, PortRef, Requirement, Selector, SelectorOp, Text,
};
use crate::source::{ObjectError, Problem};

/// The namespace of an object that names none (as `kubectl apply` assumes).
const DEFAULT_NAMESPACE: &str = "default";

/// A field's problem, before it is tied to its object.
struct Bad {
    field: String,
    message: String,
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> Bad {
    Bad {
        field: field.into(),
        message: message.into(),
    }
}

fn labels_of(map: Option<&BTreeMap<String, String>>) -> Labels {
    map.map(|m| Labels::new(m.iter())).unwrap_or_default()
}

fn name_and_namespace(
    kind: &str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<(String, String), Box<ObjectError>> {
    let namespace = meta
        .namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_NAMESPACE)
        .to_owned();
    match meta.name.as_deref().filter(|n| !n.is_empty()) {
        Some(name) => Ok((namespace, name.to_owned())),
        None => Err(Box::new(ObjectError::new(
            kind,
            &namespace,
            "",
            Problem::MissingName,
        ))),
    }
}

/// A NetworkPolicy, or why it cannot be enforced.
pub fn network_policy(policy: &net::NetworkPolicy) -> Result<NetworkPolicy, Box<ObjectError>> {
    let (namespace, name) = name_and_namespace("NetworkPolicy", &policy.metadata)?;
    decode_policy(&namespace, &name, policy).map_err(|Bad { field, message }| {
        Box::new(ObjectError::new(
            "NetworkPolicy",
            &namespace,
            &name,
            Problem::InvalidNetworkPolicy { field, message },
        ))
    })
}

fn decode_policy(
    namespace: &str,
    name: &str,
    policy: &net::NetworkPolicy,
) -> Result<NetworkPolicy, Bad> {
    let spec = policy.spec.clone().unwrap_or_default();
    let pod_selector = match &spec.pod_selector {
        Some(s) => selector(s, "spec.podSelector")?,
        None => Selector::everything(),
    };
    let mut ingress_on = false;
    let mut egress_on = false;
    match spec.policy_types.as_deref() {
        Some(types) if !types.is_empty() => {
            for (i, t) in types.iter().enumerate() {
                match t.as_str() {
                    "Ingress" => ingress_on = true,
                    "Egress" => egress_on = true,
                    other => {
                        return Err(bad(
                            format!("spec.policyTypes[{i}]"),
                            format!("{other:?} is neither Ingress nor Egress"),
                        ))
                    }
                }
            }
        }
        // The API server's default: Ingress always, Egress when there are egress rules.
        _ => {
            ingress_on = true;
            egress_on = spec.egress.as_ref().is_some_and(|e| !e.is_empty());
        }
    }
    let mut ingress = Vec::new();
    for (i, rule) in spec.ingress.iter().flatten().enumerate() {
        let field = format!("spec.ingress[{i}]");
        ingress.push(decode_rule(
            &field,
            "from",
            rule.from.as_deref(),
            rule.ports.as_deref(),
        )?);
    }
    let mut egress = Vec::new();
    for (i, rule) in spec.egress.iter().flatten().enumerate() {
        let field = format!("spec.egress[{i}]");
        egress.push(decode_rule(
            &field,
            "to",
            rule.to.as_deref(),
            rule.ports.as_deref(),
        )?);
    }
    Ok(NetworkPolicy {
        namespace: Text::from(namespace),
        name: Text::from(name),
        pod_selector,
        ingress: ingress_on.then_some(ingress),
        egress: egress_on.then_some(egress),
    })
}

fn decode_rule(
    field: &str,
    peers_name: &str,
    peers: Option<&[net::NetworkPolicyPeer]>,
    ports: Option<&[net::NetworkPolicyPort]>,
) -> Result<PolicyRule, Bad> {
    let mut rule = PolicyRule::default();
    for (i, peer) in peers.unwrap_or_default().iter().enumerate() {
        rule.peers
            .push(decode_peer(&format!("{field}.{peers_name}[{i}]"), peer)?);
    }
    for (i, port) in ports.unwrap_or_default().iter().enumerate() {
        rule.ports
            .push(decode_port(&format!("{field}.ports[{i}]"), port)?);
    }
    Ok(rule)
}

fn decode_peer(field: &str, peer: &net::NetworkPolicyPeer) -> Result<Peer, Bad> {
    let selectors = peer.pod_selector.is_some() || peer.namespace_selector.is_some();
    match (&peer.ip_block, selectors) {
        (Some(_), true) => Err(bad(
            field,
            "ipBlock cannot be combined with podSelector or namespaceSelector; split them \
             into two peers",
        )),
        (None, false) => Err(bad(
            field,
            "names no peer; set podSelector, namespaceSelector or ipBlock",
        )),
        (Some(block), false) => Ok(Peer::Block(ip_block(&format!("{field}.ipBlock"), block)?)),
        (None, true) => Ok(Peer::Pods {
            namespaces: peer
                .namespace_selector
                .as_ref()
                .map(|s| selector(s, &format!("{field}.namespaceSelector")))
                .transpose()?,
            pods: peer
                .pod_selector
                .as_ref()
                .map(|s| selector(s, &format!("{field}.podSelector")))
                .transpose()?,
        }),
    }
}

fn ip_block(field: &str, block: &net::IPBlock) -> Result<IpBlock, Bad> {
    let cidr: ipnet::IpNet = block.cidr.trim().parse().map_err(|_| {
        bad(
            format!("{field}.cidr"),
            format!("{:?} is not a CIDR (e.g. 10.0.0.0/8)", block.cidr),
        )
    })?;
    let cidr = cidr.trunc();
    let mut except = Vec::new();
    for (i, e) in block.except.iter().flatten().enumerate() {
        let f = format!("{field}.except[{i}]");
        let net: ipnet::IpNet = e
            .trim()
            .parse()
            .map_err(|_| bad(&f, format!("{e:?} is not a CIDR")))?;
        let net = net.trunc();
        if !cidr.contains(&net) || net.prefix_len() <= cidr.prefix_len() {
            return Err(bad(
                f,
                format!("{net} is not strictly inside the block's cidr {cidr}"),
            ));
        }
        except.push(net);
    }
    except.sort();
    except.dedup();
    Ok(IpBlock { cidr, except })
}

fn protocol(field: &str, value: Option<&str>) -> Result<PolicyProtocol, Bad> {
    match value {
        None => Ok(PolicyProtocol::Tcp),
        Some(p) => PolicyProtocol::parse(p)
            .ok_or_else(|| bad(field, format!("protocol {p:?} is not TCP, UDP or SCTP"))),
    }
}

fn port_number(field: &str, n: i32) -> Result<u16, Bad> {
    u16::try_from(n)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| bad(field, format!("port {n} is out of range (1-65535)")))
}

/// An IANA service name, as the API validates a named port: 1 to 15 lowercase
/// letters, digits and inner single hyphens, with at least one letter.
pub fn is_port_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

fn decode_port(field: &str, port: &net::NetworkPolicyPort) -> Result<PolicyPort, Bad> {
    let protocol = protocol(&format!("{field}.protocol"), port.protocol.as_deref())?;
    let number_field = format!("{field}.port");
    let port_ref = match &port.port {
        None => None,
        Some(IntOrString::Int(n)) => Some(PortRef::Number(port_number(&number_field, *n)?)),
        Some(IntOrString::String(s)) if is_port_name(s) => {
            Some(PortRef::Name(Text::from(s.as_str())))
        }
        Some(IntOrString::String(s)) => {
            return Err(bad(
                number_field,
                format!(
                    "{s:?} is neither a port number nor a port name (lowercase letters, \
                     digits and hyphens, at most 15)"
                ),
            ))
        }
    };
    let end_port = match (port.end_port, &port_ref) {
        (None, _) => None,
        (Some(end), Some(PortRef::Number(start))) => {
            let end = port_number(&format!("{field}.endPort"), end)?;
            if end < *start {
                return Err(bad(
                    format!("{field}.endPort"),
                    format!("{end} is below port {start}"),
                ));
            }
            Some(end)
        }
        (Some(_), _) => {
            return Err(bad(
                format!("{field}.endPort"),
                "needs a numeric port to start the range",
            ))
        }
    };
    Ok(PolicyPort {
        protocol,
        port: port_ref,
        end_port,
    })
}

fn selector(s: &LabelSelector, field: &str) -> Result<Selector, Bad> {
    let mut requirements = Vec::new();
    for (k, v) in s.match_labels.iter().flatten() {
        requirements.push(Requirement {
            key: Text::from(k.as_str()),
            op: SelectorOp::In,
            values: vec![Text::from(v.as_str())],
        });
    }
    for (i, e) in s.match_expressions.iter().flatten().enumerate() {
        let f = format!("{field}.matchExpressions[{i}]");
        let op = match e.operator.as_str() {
            "In" => SelectorOp::In,
            "NotIn" => SelectorOp::NotIn,
            "Exists" => SelectorOp::Exists,
            "DoesNotExist" => SelectorOp::DoesNotExist,
            other => {
                return Err(bad(
                    f,
                    format!("operator {other:?} is not In, NotIn, Exists or DoesNotExist"),
                ))
            }
        };
        let values: Vec<Text> = e
            .values
            .iter()
            .flatten()
            .map(|v| Text::from(v.as_str()))
            .collect();
        match op {
            SelectorOp::In | SelectorOp::NotIn if values.is_empty() => {
                return Err(bad(f, format!("{:?} needs values", e.operator)))
            }
            SelectorOp::Exists | SelectorOp::DoesNotExist if !values.is_empty() => {
                return Err(bad(f, format!("{:?} takes no values", e.operator)))
            }
            _ => {}
        }
        requirements.push(Requirement {
            key: Text::from(e.key.as_str()),
            op,
            values,
        });
    }
    Ok(Selector { requirements })
}

/// A Pod, or why it cannot be judged.
pub fn pod(pod: &Pod) -> Result<PolicyPod, Box<ObjectError>> {
    let (namespace, name) = name_and_namespace("Pod", &pod.metadata)?;
    decode_pod(&namespace, &name, pod).map_err(|Bad { field, message }| {
        Box::new(ObjectError::new(
            "Pod",
            &namespace,
            &name,
            Problem::InvalidPod { field, message },
        ))
    })
}

fn decode_pod(namespace: &str, name: &str, pod: &Pod) -> Result<PolicyPod, Bad> {
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let mut ips: Vec<IpAddr> = Vec::new();
    let mut add_ip = |field: String, value: &str| -> Result<(), Bad> {
        let ip: IpAddr = value
            .trim()
            .parse()
            .map_err(|_| bad(field, format!("{value:?} is not an IP address")))?;
        if !ips.contains(&ip) {
            ips.push(ip);
        }
        Ok(())
    };
    if let Some(status) = status {
        match status.pod_ips.as_deref() {
            Some(list) if !list.is_empty() => {
                for (i, p) in list.iter().enumerate() {
                    add_ip(format!("status.podIPs[{i}].ip"), &p.ip)?;
                }
            }
            _ => {
                if let Some(ip) = status.pod_ip.as_deref().filter(|s| !s.is_empty()) {
                    add_ip("status.podIP".to_owned(), ip)?;
                }
            }
        }
    }
    // A finished pod's address may already belong to another pod.
    let terminated = matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if terminated {
        ips.clear();
    }
    let mut named_ports = Vec::new();
    for (c, container) in spec.iter().flat_map(|s| s.containers.iter()).enumerate() {
        for (i, port) in container.ports.iter().flatten().enumerate() {
            let Some(port_name) = port.name.as_deref().filter(|n| !n.is_empty()) else {
                continue;
            };
            let field = format!("spec.containers[{c}].ports[{i}]");
            named_ports.push(NamedPort {
                name: Text::from(port_name),
                protocol: protocol(&format!("{field}.protocol"), port.protocol.as_deref())?,
                port: port_number(&format!("{field}.containerPort"), port.container_port)?,
            });
        }
    }
    named_ports.sort();
    named_ports.dedup();
    Ok(PolicyPod {
        namespace: Text::from(namespace),
        name: Text::from(name),
        ips,
        labels: labels_of(pod.metadata.labels.as_ref()),
        named_ports: Arc::from(named_ports),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        node_name: Text::from(spec.and_then(|s| s.node_name.as_deref()).unwrap_or("")),
    })
}

/// A Namespace's labels (plus the name label the API server sets).
pub fn namespace(ns: &Namespace) -> Result<PolicyNamespace, Box<ObjectError>> {
    let name = ns
        .metadata
        .name
        .as_deref()
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Box::new(ObjectError::new("Namespace", "", "", Problem::MissingName)))?;
    Ok(PolicyNamespace::new(
        name,
        labels_of(ns.metadata.labels.as_ref()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy_yaml(yaml: &str) -> net::NetworkPolicy {
        serde_norway::from_str(yaml).unwrap()
    }

    #[test]
    fn implied_policy_types() {
        let p = network_policy(&policy_yaml(
            "metadata: {name: a, namespace: x}\nspec: {podSelector: {}}",
        ))
        .unwrap();
        assert_eq!((p.ingress, p.egress), (Some(vec![]), None));
        let p = network_policy(&policy_yaml(
            "metadata: {name: a, namespace: x}\nspec:\n  podSelector: {}\n  egress: [{}]",
        ))
        .unwrap();
        assert_eq!(p.ingress, Some(vec![]));
        assert_eq!(p.egress, Some(vec![PolicyRule::default()]));
        // egress: [] is no egress section: ingress only.
        let p = network_policy(&policy_yaml(
            "metadata: {name: a}\nspec:\n  podSelector: {}\n  egress: []",
        ))
        .unwrap();
        assert_eq!((&*p.namespace, p.egress), ("default", None));
        let p = network_policy(&policy_yaml(
            "metadata: {name: a}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]\n  ingress: [{}]",
        ))
        .unwrap();
        assert_eq!((p.ingress, p.egress), (None, Some(vec![])));
    }

    #[test]
    fn malformed_policies_name_the_field() {
        let cases = [
            ("policyTypes: [Both]", "spec.policyTypes[0]"),
            ("ingress: [{from: [{}]}]", "spec.ingress[0].from[0]"),
            (
                "ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]}]",
                "spec.ingress[0].from[0]",
            ),
            (
                "egress: [{to: [{ipBlock: {cidr: 10.0.0.0/33}}]}]",
                "spec.egress[0].to[0].ipBlock.cidr",
            ),
            (
                "egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [11.0.0.0/16]}}]}]",
                "spec.egress[0].to[0].ipBlock.except[0]",
            ),
            (
                "egress: [{to: [{ipBlock: {cidr: 10.0.0.0/8, except: [10.0.0.0/8]}}]}]",
                "spec.egress[0].to[0].ipBlock.except[0]",
            ),
            (
                "ingress: [{ports: [{port: 0}]}]",
                "spec.ingress[0].ports[0].port",
            ),
            (
                "ingress: [{ports: [{port: 70000}]}]",
                "spec.ingress[0].ports[0].port",
            ),
            (
                "ingress: [{ports: [{port: Http}]}]",
                "spec.ingress[0].ports[0].port",
            ),
            (
                "ingress: [{ports: [{protocol: ICMP}]}]",
                "spec.ingress[0].ports[0].protocol",
            ),
            (
                "ingress: [{ports: [{port: 90, endPort: 80}]}]",
                "spec.ingress[0].ports[0].endPort",
            ),
            (
                "ingress: [{ports: [{port: http, endPort: 80}]}]",
                "spec.ingress[0].ports[0].endPort",
            ),
            (
                "ingress: [{from: [{podSelector: {matchExpressions: [{key: a, operator: In}]}}]}]",
                "spec.ingress[0].from[0].podSelector.matchExpressions[0]",
            ),
            (
                "podSelector: {matchExpressions: [{key: a, operator: Exists, values: [b]}]}",
                "spec.podSelector.matchExpressions[0]",
            ),
            (
                "podSelector: {matchExpressions: [{key: a, operator: Near}]}",
                "spec.podSelector.matchExpressions[0]",
            ),
        ];
        for (spec, want_field) in cases {
            let yaml = format!("metadata: {{name: p, namespace: ns}}\nspec: {{{spec}}}");
            let err = network_policy(&policy_yaml(&yaml)).expect_err(spec);
            match &err.reason {
                Problem::InvalidNetworkPolicy { field, .. } => {
                    assert_eq!(field, want_field, "{spec}: {err}")
                }
                other => panic!("{spec}: {other:?}"),
            }
            let text = err.to_string();
            assert!(text.starts_with("NetworkPolicy ns/p: "), "{text}");
        }
    }

    #[test]
    fn peers_ports_and_blocks() {
        let p = network_policy(&policy_yaml(
            r#"
metadata: {name: p, namespace: ns}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
  - from:
    - podSelector: {matchLabels: {app: api}}
      namespaceSelector: {matchLabels: {team: a}}
    - namespaceSelector: {}
    - ipBlock: {cidr: 10.1.2.3/16, except: [10.1.9.0/24, 10.1.0.0/24, 10.1.9.0/24]}
    ports:
    - port: 80
    - {protocol: UDP, port: 1000, endPort: 2000}
    - {protocol: SCTP}
    - port: http
"#,
        ))
        .unwrap();
        let rule = &p.ingress.as_ref().unwrap()[0];
        assert!(matches!(
            &rule.peers[0],
            Peer::Pods {
                namespaces: Some(_),
                pods: Some(_)
            }
        ));
        assert!(matches!(
            &rule.peers[1],
            Peer::Pods { namespaces: Some(s), pods: None } if s.requirements.is_empty()
        ));
        let Peer::Block(block) = &rule.peers[2] else {
            panic!()
        };
        assert_eq!(block.cidr.to_string(), "10.1.0.0/16");
        let excepts: Vec<String> = block.except.iter().map(|e| e.to_string()).collect();
        assert_eq!(excepts, ["10.1.0.0/24", "10.1.9.0/24"]);
        assert_eq!(
            rule.ports,
            vec![
                PolicyPort {
                    protocol: PolicyProtocol::Tcp,
                    port: Some(PortRef::Number(80)),
                    end_port: None
                },
                PolicyPort {
                    protocol: PolicyProtocol::Udp,
                    port: Some(PortRef::Number(1000)),
                    end_port: Some(2000)
                },
                PolicyPort {
                    protocol: PolicyProtocol::Sctp,
                    port: None,
                    end_port: None
                },
                PolicyPort {
                    protocol: PolicyProtocol::Tcp,
                    port: Some(PortRef::Name("http".into())),
                    end_port: None
                },
            ]
        );
    }

    #[test]
    fn pods_and_namespaces() {
        let p: Pod = serde_norway::from_str(
            r#"
metadata: {name: a, namespace: x, labels: {app: web}}
spec:
  nodeName: n1
  containers:
  - name: c
    ports:
    - {name: http, containerPort: 8080}
    - {containerPort: 9090}
    - {name: dns, containerPort: 53, protocol: UDP}
status:
  podIP: 10.0.0.1
  podIPs: [{ip: 10.0.0.1}, {ip: "fd00::1"}]
"#,
        )
        .unwrap();
        let pod = super::pod(&p).unwrap();
        assert_eq!(pod.ips.len(), 2);
        assert_eq!(pod.labels.get("app"), Some("web"));
        assert_eq!(&*pod.node_name, "n1");
        assert_eq!(
            pod.resolve("http", PolicyProtocol::Tcp).collect::<Vec<_>>(),
            [8080]
        );
        assert_eq!(pod.resolve("http", PolicyProtocol::Udp).count(), 0);
        assert_eq!(
            pod.resolve("dns", PolicyProtocol::Udp).collect::<Vec<_>>(),
            [53]
        );
        assert!(!pod.host_network);

        let mut done = p.clone();
        done.status.as_mut().unwrap().phase = Some("Succeeded".into());
        assert!(super::pod(&done).unwrap().ips.is_empty());

        let mut broken = p.clone();
        broken.status.as_mut().unwrap().pod_ips = Some(vec![k8s_openapi::api::core::v1::PodIP {
            ip: "10.0.0.300".into(),
        }]);
        let err = super::pod(&broken).unwrap_err();
        assert!(
            err.to_string().starts_with("Pod x/a: status.podIPs[0].ip"),
            "{err}"
        );

        let ns: Namespace =
            serde_norway::from_str("metadata: {name: prod, labels: {team: a}}").unwrap();
        let ns = namespace(&ns).unwrap();
        assert_eq!(ns.labels.get("team"), Some("a"));
        assert_eq!(
            ns.labels.get(crate::model::policy::LABEL_NAMESPACE_NAME),
            Some("prod")
        );
    }

    #[test]
    fn port_names() {
        for ok in ["http", "h2c", "a-b", "web8080"] {
            assert!(is_port_name(ok), "{ok}");
        }
        for no in ["", "80", "HTTP", "-a", "a-", "a--b", "abcdefghijklmnop"] {
            assert!(!is_port_name(no), "{no}");
        }
    }
}
