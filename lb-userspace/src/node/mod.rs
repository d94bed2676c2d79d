//! The node's network as the per-packet path sees it, and the two decisions drawn
//! from it: on which addresses NodePorts are served (kube-proxy's
//! `--nodeport-addresses`), and which program each device gets. Pure: the netlink
//! watcher ([`crate::node::netlink`]) fills a [`NodeNet`], the agent acts on the answers.
//!
//! Why devices are told apart by their kind and addresses, not their names: a pod's
//! host-side device is a veth (or netkit) pair end the CNI created, and it holds
//! none of the node's addresses; the replies of local backends enter the node
//! there. Everything else is where the node itself is reached: a device holding a
//! node address (`eth0`, a CNI bridge such as `cni0`, the veth uplink of a node
//! that is itself a container), and physical NICs, bond and bridge ports, VLANs and
//! tunnels even without an address of their own, so traffic from outside the node
//! arriving on a bond slave is still seen as external. That holds for bridge and
//! routed (Calico-style) CNIs alike and needs no name pattern.

pub mod host;
pub mod netlink;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

/// One device of the node's network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub name: String,
    /// `IFF_LOOPBACK`: never attached to; local traffic is the socket hooks' job.
    pub loopback: bool,
    /// A veth or netkit pair end: what CNIs give a pod on the host side.
    pub pair: bool,
    /// The link kind of a virtual device (`veth`, `bridge`, `vxlan`, ...); `None`
    /// for a physical one. Said when a device refuses native XDP.
    pub kind: Option<String>,
    /// Addresses of both families with their prefix length.
    pub addresses: Vec<IpNet>,
}

/// The devices by ifindex.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeNet {
    pub links: BTreeMap<u32, Link>,
}

impl NodeNet {
    /// Every address of a non-loopback device that a client elsewhere can reach,
    /// sorted (IPv4 first) and without repeats. IPv6 link-local addresses are left
    /// out: every device has one, and they mean nothing beyond their link.
    pub fn addresses(&self) -> Vec<IpAddr> {
        let mut all: Vec<IpAddr> = self
            .links
            .values()
            .filter(|l| !l.loopback)
            .flat_map(|l| l.addresses.iter().map(|a| a.addr()))
            .filter(is_node_address)
            .collect();
        all.sort();
        all.dedup();
        all
    }
}

/// kube-proxy's `--nodeport-addresses`: which node addresses serve NodePorts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Unset: every address of the node.
    #[default]
    All,
    /// `primary`: the node's primary address(es) only.
    Primary,
    /// The node's addresses inside any of these ranges.
    Cidrs(Vec<IpNet>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "--nodeport-addresses: {value:?} is neither `primary` nor a CIDR such as \
     192.168.0.0/16 or fd00::/64 (give a comma-separated list of CIDRs, or `primary`)"
)]
pub struct NodePortAddressesError {
    pub value: String,
}

impl std::str::FromStr for NodePortAddresses {
    type Err = NodePortAddressesError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self::All);
        }
        if text == "primary" {
            return Ok(Self::Primary);
        }
        text.split(',')
            .map(|part| {
                let part = part.trim();
                part.parse::<IpNet>()
                    .map(|net| net.trunc())
                    .map_err(|_| NodePortAddressesError { value: part.into() })
            })
            .collect::<Result<_, _>>()
            .map(Self::Cidrs)
    }
}

/// Where NodePorts are served. `explicit` (`--node-ip`) wins when no selection was
/// asked for, as before this existed; `primary` is the node's primary address of
/// each family (`--node-ip`, else the Node object's, else the first address found).
pub fn nodeport_addresses(
    net: &NodeNet,
    selection: &NodePortAddresses,
    explicit: &[IpAddr],
    from_node_object: &[IpAddr],
) -> Vec<IpAddr> {
    match selection {
        NodePortAddresses::All if !explicit.is_empty() => explicit.to_vec(),
        NodePortAddresses::All => net.addresses(),
        NodePortAddresses::Primary => primary(net, explicit, from_node_object),
        NodePortAddresses::Cidrs(ranges) => {
            // Loopback addresses count here when a range names them, as in kube-proxy.
            let mut found: Vec<IpAddr> = net
                .links
                .values()
                .flat_map(|l| l.addresses.iter().map(|a| a.addr()))
                .filter(|a| ranges.iter().any(|r| r.contains(a)))
                .collect();
            found.sort();
            found.dedup();
            found
        }
    }
}

/// The first address of each family, from the first source that has one of it.
fn primary(net: &NodeNet, explicit: &[IpAddr], from_node_object: &[IpAddr]) -> Vec<IpAddr> {
    let found = net.addresses();
    [false, true]
        .into_iter()
        .filter_map(|v6| {
            [explicit, from_node_object, &found]
                .into_iter()
                .find_map(|list| list.iter().find(|a| a.is_ipv6() == v6))
                .copied()
        })
        .collect()
}

/// An address NodePorts can be served on: not loopback, not IPv6 link-local.
pub fn is_node_address(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_loopback(),
        IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unicast_link_local(),
    }
}

/// Which program a device gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// `lb_tc_external`: traffic from outside the node (external scope).
    NodeFacing,
    /// `lb_tc_internal`: pods, and the replies of local backends.
    PodFacing,
}

/// Why a device got its program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// From the device's addresses.
    Auto,
    /// Named by `--iface` / `--pod-iface`.
    Flag,
}

/// What the per-packet path should be attached to, by ifindex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub name: String,
    pub role: Role,
    pub reason: Reason,
}

/// `--iface` / `--pod-iface`: names whose role is fixed by the operator.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub node_facing: Vec<String>,
    pub pod_facing: Vec<String>,
    /// `--tc-attach off`: no device gets a program, whatever the flags say.
    pub off: bool,
}

/// The first device a flag names that this namespace does not have, with its flag.
pub fn missing_override<'a>(
    net: &NodeNet,
    overrides: &'a Overrides,
) -> Option<(&'static str, &'a str)> {
    if overrides.off {
        return None;
    }
    let present = |name: &str| net.links.values().any(|l| l.name == name);
    let flagged = overrides
        .node_facing
        .iter()
        .map(|n| ("--iface", n))
        .chain(overrides.pod_facing.iter().map(|n| ("--pod-iface", n)));
    flagged
        .into_iter()
        .find(|(_, name)| !present(name))
        .map(|(flag, name)| (flag, name.as_str()))
}

/// Every device but loopback gets a program: by the flags when they name it, else
/// pod-facing when it is a veth/netkit end without a node address (an IPv6
/// link-local one every veth gets does not count), node-facing otherwise.
pub fn attachments(net: &NodeNet, overrides: &Overrides) -> BTreeMap<u32, Attachment> {
    if overrides.off {
        return BTreeMap::new();
    }
    net.links
        .iter()
        .filter(|(_, link)| !link.loopback)
        .map(|(&index, link)| {
            let named = |names: &[String]| names.contains(&link.name);
            let (role, reason) = if named(&overrides.node_facing) {
                (Role::NodeFacing, Reason::Flag)
            } else if named(&overrides.pod_facing) {
                (Role::PodFacing, Reason::Flag)
            } else if link.pair && !link.addresses.iter().any(|a| is_node_address(&a.addr())) {
                (Role::PodFacing, Reason::Auto)
            } else {
                (Role::NodeFacing, Reason::Auto)
            };
            let attachment = Attachment {
                name: link.name.clone(),
                role,
                reason,
            };
            (index, attachment)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str, addresses: &[&str]) -> Link {
        Link {
            kind: None,
            name: name.into(),
            loopback: name == "lo",
            pair: name.starts_with("veth") || name.starts_with("cali") || name == "eth0",
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    /// A flannel-style node that is itself a container (its uplink a veth with the
    /// node address), a CNI bridge with the pod gateway, two pod veths, and a
    /// bonded NIC without an address of its own.
    fn node() -> NodeNet {
        let links = [
            (1, link("lo", &["127.0.0.1/8"])),
            (2, link("eth0", &["192.168.50.1/24"])),
            (3, link("cni0", &["10.244.1.1/24"])),
            (5, link("ens4", &[])),
            (7, link("veth1a2b", &[])),
            (9, link("cali12345", &[])),
        ];
        NodeNet {
            links: links.into_iter().collect(),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn pod_veths_face_pods_everything_else_faces_the_node() {
        let plan = attachments(&node(), &Overrides::default());
        let roles: Vec<(u32, &str, Role, Reason)> = plan
            .iter()
            .map(|(i, a)| (*i, a.name.as_str(), a.role, a.reason))
            .collect();
        assert_eq!(
            roles,
            vec![
                (2, "eth0", Role::NodeFacing, Reason::Auto),
                (3, "cni0", Role::NodeFacing, Reason::Auto),
                (5, "ens4", Role::NodeFacing, Reason::Auto),
                (7, "veth1a2b", Role::PodFacing, Reason::Auto),
                (9, "cali12345", Role::PodFacing, Reason::Auto),
            ]
        );
    }

    #[test]
    fn flags_fix_a_role_and_say_so() {
        let overrides = Overrides {
            node_facing: vec!["cali12345".into()],
            pod_facing: vec!["cni0".into()],
            off: false,
        };
        let plan = attachments(&node(), &overrides);
        assert_eq!(plan[&9].role, Role::NodeFacing);
        assert_eq!(plan[&9].reason, Reason::Flag);
        assert_eq!(plan[&3].role, Role::PodFacing);
        assert_eq!(plan[&3].reason, Reason::Flag);
        assert_eq!(plan[&2].reason, Reason::Auto);
        let off = Overrides {
            off: true,
            ..overrides
        };
        assert!(attachments(&node(), &off).is_empty());
    }

    #[test]
    fn a_flag_naming_no_device_is_found() {
        let mut overrides = Overrides {
            node_facing: vec!["eth0".into()],
            pod_facing: vec!["vethX".into()],
            off: false,
        };
        assert_eq!(
            missing_override(&node(), &overrides),
            Some(("--pod-iface", "vethX"))
        );
        overrides.pod_facing.clear();
        assert_eq!(missing_override(&node(), &overrides), None);
    }

    #[test]
    fn nodeport_addresses_follow_kube_proxy() {
        let net = node();
        let all = nodeport_addresses(&net, &NodePortAddresses::All, &[], &[]);
        assert_eq!(all, vec![ip("10.244.1.1"), ip("192.168.50.1")]);
        // --node-ip alone keeps its old meaning: exactly those.
        let explicit = [ip("192.168.50.1")];
        assert_eq!(
            nodeport_addresses(&net, &NodePortAddresses::All, &explicit, &[]),
            explicit.to_vec()
        );
        let cidrs: NodePortAddresses = "192.168.0.0/16, 127.0.0.0/8".parse().unwrap();
        assert_eq!(
            nodeport_addresses(&net, &cidrs, &[], &[]),
            vec![ip("127.0.0.1"), ip("192.168.50.1")]
        );
        let primary = NodePortAddresses::Primary;
        assert_eq!(
            nodeport_addresses(&net, &primary, &[], &[ip("192.168.50.1")]),
            vec![ip("192.168.50.1")]
        );
        assert_eq!(
            nodeport_addresses(&net, &primary, &explicit, &[ip("10.0.0.9")]),
            explicit.to_vec()
        );
        assert_eq!(
            nodeport_addresses(&net, &primary, &[], &[]),
            vec![ip("10.244.1.1")]
        );
    }

    #[test]
    fn nodeport_address_selections_parse() {
        assert_eq!("".parse(), Ok(NodePortAddresses::All));
        assert_eq!("primary".parse(), Ok(NodePortAddresses::Primary));
        assert_eq!(
            "10.1.2.3/8".parse(),
            Ok(NodePortAddresses::Cidrs(vec!["10.0.0.0/8"
                .parse()
                .unwrap()]))
        );
        let err = "10.0.0.0/8,eth0".parse::<NodePortAddresses>().unwrap_err();
        assert_eq!(err.value, "eth0");
        assert!(err.to_string().contains("`primary`"), "{err}");
    }
}
