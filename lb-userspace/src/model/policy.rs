//! What NetworkPolicy enforcement reads of the cluster: `networking.k8s.io/v1`
//! NetworkPolicies, Pods and Namespaces, reduced to the fields policy needs and with
//! the API's defaults already applied (implied `policyTypes`, protocol TCP, the
//! `kubernetes.io/metadata.name` namespace label), whichever source they came from.
//! Strings that repeat (namespaces, label keys and values, port names) are interned.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use internment::ArcIntern;

/// A string shared by every object that holds the same value.
pub type Text = ArcIntern<str>;

/// The namespace label the API server sets on every Namespace to its own name (since
/// Kubernetes 1.21), which namespaceSelectors commonly use.
pub const LABEL_NAMESPACE_NAME: &str = "kubernetes.io/metadata.name";

/// A label set: pairs sorted by key, keys unique; cheap to clone and to hash.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Arc<[(Text, Text)]>);

impl Labels {
    /// From any pairs; a repeated key keeps its last value.
    pub fn new<K: AsRef<str>, V: AsRef<str>>(pairs: impl IntoIterator<Item = (K, V)>) -> Self {
        let mut map = std::collections::BTreeMap::new();
        for (k, v) in pairs {
            map.insert(Text::from(k.as_ref()), Text::from(v.as_ref()));
        }
        Labels(map.into_iter().collect())
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i: usize| &*self.0[i].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The same set with `key` set to `value`.
    pub fn with(&self, key: &str, value: &str) -> Self {
        Labels::new(self.iter().chain([(key, value)]))
    }
}

/// The protocols a NetworkPolicy port can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyProtocol {
    Tcp,
    Udp,
    Sctp,
}

impl PolicyProtocol {
    /// The API's spelling (`TCP`, `UDP`, `SCTP`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "TCP" => Some(PolicyProtocol::Tcp),
            "UDP" => Some(PolicyProtocol::Udp),
            "SCTP" => Some(PolicyProtocol::Sctp),
            _ => None,
        }
    }

    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            PolicyProtocol::Tcp => lb_common::IPPROTO_TCP,
            PolicyProtocol::Udp => lb_common::IPPROTO_UDP,
            PolicyProtocol::Sctp => lb_common::policy::IPPROTO_SCTP,
        }
    }
}

impl fmt::Display for PolicyProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PolicyProtocol::Tcp => "TCP",
            PolicyProtocol::Udp => "UDP",
            PolicyProtocol::Sctp => "SCTP",
        })
    }
}

/// A `matchExpressions` operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SelectorOp {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One `matchExpressions` requirement (`values` empty for Exists/DoesNotExist).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    pub key: Text,
    pub op: SelectorOp,
    pub values: Vec<Text>,
}

impl Requirement {
    pub fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        let listed = || value.is_some_and(|v| self.values.iter().any(|w| **w == *v));
        match self.op {
            SelectorOp::In => listed(),
            SelectorOp::NotIn => !listed(),
            SelectorOp::Exists => value.is_some(),
            SelectorOp::DoesNotExist => value.is_none(),
        }
    }
}

/// A label selector: `matchLabels` (as `In` of one value) and `matchExpressions`,
/// all of which must hold. An empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Selector {
    pub requirements: Vec<Requirement>,
}

impl Selector {
    /// The selector that matches every label set.
    pub fn everything() -> Self {
        Selector::default()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }
}

/// An address range of 128 bits (IPv4 as IPv4-mapped, its prefix length plus 96), the
/// form the policy maps hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Prefix {
    /// The address bits, host bits zero.
    pub bits: u128,
    /// Prefix length, 0..=128.
    pub len: u8,
}

impl Prefix {
    /// From an `ipnet` network (host bits cleared).
    pub fn from_net(net: &ipnet::IpNet) -> Self {
        let (addr, len) = match net {
            ipnet::IpNet::V4(n) => (
                u128::from(n.network().to_ipv6_mapped()),
                n.prefix_len() + 96,
            ),
            ipnet::IpNet::V6(n) => (u128::from(n.network()), n.prefix_len()),
        };
        Prefix::new(addr, len)
    }

    pub fn new(bits: u128, len: u8) -> Self {
        let len = len.min(128);
        Prefix {
            bits: bits & Self::mask(len),
            len,
        }
    }

    fn mask(len: u8) -> u128 {
        match len {
            0 => 0,
            n => u128::MAX << (128 - u32::from(n)),
        }
    }

    /// The 128-bit form of an address (IPv4-mapped for IPv4).
    pub fn addr_bits(ip: IpAddr) -> u128 {
        match ip {
            IpAddr::V4(v4) => u128::from(v4.to_ipv6_mapped()),
            IpAddr::V6(v6) => u128::from(v6),
        }
    }

    pub fn contains_addr(&self, ip: IpAddr) -> bool {
        Self::addr_bits(ip) & Self::mask(self.len) == self.bits
    }

    /// Whether every address of `other` is in `self`.
    pub fn contains(&self, other: &Prefix) -> bool {
        other.len >= self.len && other.bits & Self::mask(self.len) == self.bits
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v6 = std::net::Ipv6Addr::from(self.bits);
        match v6.to_ipv4_mapped() {
            Some(v4) if self.len >= 96 => write!(f, "{v4}/{}", self.len - 96),
            _ => write!(f, "{v6}/{}", self.len),
        }
    }
}

/// An `ipBlock`: `cidr` minus every `except` (each inside `cidr`, of its family).
/// Networks are kept with their host bits cleared.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpBlock {
    pub cidr: ipnet::IpNet,
    /// Sorted, deduplicated.
    pub except: Vec<ipnet::IpNet>,
}

impl IpBlock {
    /// As the API means it: an IPv6 block never holds an IPv4 address, whatever its
    /// prefix (`::/0` included).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidr.contains(&ip) && !self.except.iter().any(|e| e.contains(&ip))
    }
}

/// One `from`/`to` entry of a rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// Pods: `namespaces` `None` is the policy's own namespace; `pods` `None` is
    /// every pod of the selected namespaces.
    Pods {
        namespaces: Option<Selector>,
        pods: Option<Selector>,
    },
    /// Addresses (of pods or not).
    Block(IpBlock),
}

/// `port` of a policy port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PortRef {
    Number(u16),
    /// A container port name, resolved on the destination pod.
    Name(Text),
}

/// One entry of a rule's `ports`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PolicyPort {
    pub protocol: PolicyProtocol,
    /// `None`: every port of `protocol`.
    pub port: Option<PortRef>,
    /// `endPort`: with a numeric `port`, the range `port..=end_port`.
    pub end_port: Option<u16>,
}

/// One ingress or egress rule. Empty `peers`: every peer; empty `ports`: every
/// protocol and port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyRule {
    pub peers: Vec<Peer>,
    pub ports: Vec<PolicyPort>,
}

/// A NetworkPolicy. `ingress`/`egress` are the rules of the directions it enforces
/// (`policyTypes`, or the implied ones), empty when it enforces that direction with no
/// rule (deny all); `None` when it does not enforce that direction.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NetworkPolicy {
    pub namespace: Text,
    pub name: Text,
    /// Pods of `namespace` the policy applies to.
    pub pod_selector: Selector,
    pub ingress: Option<Vec<PolicyRule>>,
    pub egress: Option<Vec<PolicyRule>>,
}

/// A container port that has a name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NamedPort {
    pub name: Text,
    pub protocol: PolicyProtocol,
    pub port: u16,
}

/// A Pod as policy sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PolicyPod {
    pub namespace: Text,
    pub name: Text,
    /// `status.podIPs` (empty before the pod has one, and once it has terminated).
    pub ips: Vec<IpAddr>,
    pub labels: Labels,
    /// Named container ports, sorted.
    pub named_ports: Arc<[NamedPort]>,
    /// `spec.hostNetwork`: not subject to policy and never a pod peer.
    pub host_network: bool,
    /// `spec.nodeName` (empty before scheduling).
    pub node_name: Text,
}

impl PolicyPod {
    /// The port numbers the pod names `name` for `protocol`.
    pub fn resolve<'a>(
        &'a self,
        name: &'a str,
        protocol: PolicyProtocol,
    ) -> impl Iterator<Item = u16> + 'a {
        resolve_named(&self.named_ports, name, protocol)
    }
}

/// The numbers named `name` for `protocol` among `ports`.
pub fn resolve_named<'a>(
    ports: &'a [NamedPort],
    name: &'a str,
    protocol: PolicyProtocol,
) -> impl Iterator<Item = u16> + 'a {
    ports
        .iter()
        .filter(move |p| &*p.name == name && p.protocol == protocol)
        .map(|p| p.port)
}

/// A Namespace's labels (with `kubernetes.io/metadata.name` always set to its name).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PolicyNamespace {
    pub name: Text,
    pub labels: Labels,
}

impl PolicyNamespace {
    /// A namespace with `labels`, plus the name label the API server sets.
    pub fn new(name: &str, labels: Labels) -> Self {
        PolicyNamespace {
            name: Text::from(name),
            labels: labels.with(LABEL_NAMESPACE_NAME, name),
        }
    }

    /// The labels of a namespace no Namespace object was seen for: only the name label
    /// (the manifest source may carry pods without their Namespace).
    pub fn implied(name: &str) -> Self {
        PolicyNamespace::new(name, Labels::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        Labels::new(pairs.iter().copied())
    }

    fn req(key: &str, op: SelectorOp, values: &[&str]) -> Requirement {
        Requirement {
            key: key.into(),
            op,
            values: values.iter().map(|v| Text::from(*v)).collect(),
        }
    }

    #[test]
    fn selector_operators() {
        let l = labels(&[("app", "db"), ("tier", "back")]);
        let cases = [
            (req("app", SelectorOp::In, &["db", "web"]), true),
            (req("app", SelectorOp::In, &["web"]), false),
            (req("missing", SelectorOp::In, &["x"]), false),
            (req("app", SelectorOp::NotIn, &["web"]), true),
            (req("app", SelectorOp::NotIn, &["db"]), false),
            // NotIn holds for a label that is not there at all.
            (req("missing", SelectorOp::NotIn, &["x"]), true),
            (req("tier", SelectorOp::Exists, &[]), true),
            (req("missing", SelectorOp::Exists, &[]), false),
            (req("missing", SelectorOp::DoesNotExist, &[]), true),
            (req("tier", SelectorOp::DoesNotExist, &[]), false),
        ];
        for (r, want) in cases {
            assert_eq!(r.matches(&l), want, "{r:?}");
        }
        assert!(Selector::everything().matches(&l));
        assert!(Selector::everything().matches(&Labels::default()));
        let both = Selector {
            requirements: vec![
                req("app", SelectorOp::In, &["db"]),
                req("tier", SelectorOp::In, &["front"]),
            ],
        };
        assert!(!both.matches(&l), "every requirement must hold");
    }

    #[test]
    fn labels_sorted_and_last_wins() {
        let l = Labels::new([("b", "1"), ("a", "2"), ("b", "3")]);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![("a", "2"), ("b", "3")]);
        assert_eq!(l.get("b"), Some("3"));
        assert_eq!(l.get("c"), None);
        let ns = PolicyNamespace::new("prod", labels(&[(LABEL_NAMESPACE_NAME, "lie")]));
        assert_eq!(ns.labels.get(LABEL_NAMESPACE_NAME), Some("prod"));
    }

    #[test]
    fn prefixes() {
        let net: ipnet::IpNet = "10.1.2.3/8".parse().unwrap();
        let p = Prefix::from_net(&net);
        assert_eq!(p.to_string(), "10.0.0.0/8");
        assert!(p.contains_addr("10.9.9.9".parse().unwrap()));
        assert!(!p.contains_addr("11.0.0.1".parse().unwrap()));
        assert!(!p.contains_addr("::a09:909".parse().unwrap()));
        let all4 = Prefix::from_net(&"0.0.0.0/0".parse().unwrap());
        assert!(all4.contains(&p));
        assert!(!all4.contains_addr("2001:db8::1".parse().unwrap()));
        let all6 = Prefix::from_net(&"::/0".parse().unwrap());
        assert!(all6.contains_addr("10.0.0.1".parse().unwrap()));
        assert_eq!(
            Prefix::from_net(&"2001:db8::1/32".parse().unwrap()).to_string(),
            "2001:db8::/32"
        );
    }
}
