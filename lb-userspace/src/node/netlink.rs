//! Follows the devices and addresses (both families) of the agent's network namespace through
//! rtnetlink: one dump at start, then the kernel's link and address notifications,
//! so a device or address that appears or goes is seen at once, without polling.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::AsyncSocket as _;
use rtnetlink::MulticastGroup;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::node::{Link, NodeNet};

/// Room for bursts of notifications (hundreds of pods starting at once); past it
/// the kernel drops notifications, and a full dump puts the view right again.
const RECEIVE_BUFFER: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("cannot open a netlink socket to follow the node's devices: {0}")]
    Socket(#[source] std::io::Error),
    #[error("cannot list the node's {what} over netlink: {source}")]
    Dump {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
}

/// What the watcher knows; published as a [`NodeNet`].
#[derive(Default)]
struct View {
    /// ifindex -> the device as its last notification described it (no addresses).
    links: BTreeMap<u32, Link>,
    addresses: BTreeMap<u32, BTreeSet<IpNet>>,
}

impl View {
    fn node_net(&self) -> NodeNet {
        let links = self
            .links
            .iter()
            .map(|(&index, link)| {
                let addresses = self
                    .addresses
                    .get(&index)
                    .map(|set| set.iter().copied().collect())
                    .unwrap_or_default();
                (
                    index,
                    Link {
                        addresses,
                        ..link.clone()
                    },
                )
            })
            .collect();
        NodeNet { links }
    }

    fn new_link(&mut self, message: &LinkMessage) {
        let name = message.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        });
        let Some(name) = name else { return };
        let loopback = message.header.flags.contains(LinkFlags::Loopback);
        let kind = message.attributes.iter().find_map(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                LinkInfo::Kind(kind) => Some(kind),
                _ => None,
            }),
            _ => None,
        });
        let pair = matches!(kind, Some(InfoKind::Veth | InfoKind::Netkit));
        let link = Link {
            name,
            loopback,
            pair,
            kind: kind.map(|k| k.to_string()),
            addresses: Vec::new(),
        };
        self.links.insert(message.header.index, link);
    }

    fn del_link(&mut self, message: &LinkMessage) {
        self.links.remove(&message.header.index);
        self.addresses.remove(&message.header.index);
    }

    /// The address of an address message (either family): `IFA_LOCAL` (the node's
    /// side of a point-to-point link), else `IFA_ADDRESS`.
    fn address_of(message: &AddressMessage) -> Option<IpNet> {
        let mut found: Option<IpAddr> = None;
        for attribute in &message.attributes {
            match attribute {
                AddressAttribute::Local(a) => found = Some(*a),
                AddressAttribute::Address(a) if found.is_none() => found = Some(*a),
                _ => {}
            }
        }
        IpNet::new(found?, message.header.prefix_len).ok()
    }

    fn new_address(&mut self, message: &AddressMessage) {
        if let Some(net) = Self::address_of(message) {
            self.addresses
                .entry(message.header.index)
                .or_default()
                .insert(net);
        }
    }

    fn del_address(&mut self, message: &AddressMessage) {
        if let Some(net) = Self::address_of(message) {
            if let Some(set) = self.addresses.get_mut(&message.header.index) {
                set.remove(&net);
            }
        }
    }

    /// Applies a notification; true when it changed the view.
    fn apply(&mut self, message: &RouteNetlinkMessage) -> bool {
        let before = (self.links.clone(), self.addresses.clone());
        match message {
            // A bridge speaks for its ports in AF_BRIDGE link messages (a port's
            // STP state, e.g. forwarding once the forward delay has passed; a port
            // leaving the bridge is an AF_BRIDGE RTM_DELLINK). They carry no link
            // kind, so taken as the device's own they would turn a pod's veth
            // into an unknown device, or delete it.
            RouteNetlinkMessage::NewLink(m) | RouteNetlinkMessage::DelLink(m)
                if m.header.interface_family == AddressFamily::Bridge =>
            {
                return false
            }
            RouteNetlinkMessage::NewLink(m) => self.new_link(m),
            RouteNetlinkMessage::DelLink(m) => self.del_link(m),
            RouteNetlinkMessage::NewAddress(m) => self.new_address(m),
            RouteNetlinkMessage::DelAddress(m) => self.del_address(m),
            _ => return false,
        }
        before != (self.links.clone(), self.addresses.clone())
    }
}

/// Lists the devices and addresses, then follows them until the receiver is
/// dropped. The subscription comes before the dump, so a change made while the
/// dump runs is not lost: it is applied after it.
pub async fn watch() -> Result<watch::Receiver<NodeNet>, NetlinkError> {
    let (mut connection, handle, mut notifications) = rtnetlink::new_multicast_connection(&[
        MulticastGroup::Link,
        MulticastGroup::Ipv4Ifaddr,
        MulticastGroup::Ipv6Ifaddr,
    ])
    .map_err(NetlinkError::Socket)?;
    if let Err(e) = connection
        .socket_mut()
        .socket_mut()
        .set_rx_buf_sz(RECEIVE_BUFFER)
    {
        debug!("netlink receive buffer left at its default: {e}");
    }
    tokio::spawn(connection);
    let mut view = View::default();
    let dump_error = |what| move |source| NetlinkError::Dump { what, source };
    let mut links = handle.link().get().execute();
    while let Some(link) = links.try_next().await.map_err(dump_error("devices"))? {
        view.new_link(&link);
    }
    let mut addresses = handle.address().get().execute();
    while let Some(address) = addresses
        .try_next()
        .await
        .map_err(dump_error("addresses"))?
    {
        view.new_address(&address);
    }
    let (sender, receiver) = watch::channel(view.node_net());
    tokio::spawn(async move {
        while let Some((message, _)) = notifications.next().await {
            let NetlinkPayload::InnerMessage(message) = message.payload else {
                continue;
            };
            if view.apply(&message) && sender.send(view.node_net()).is_err() {
                return;
            }
        }
        warn!("netlink notifications ended: devices and addresses are no longer followed");
        drop(handle);
    });
    Ok(receiver)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::address::AddressHeader;
    use netlink_packet_route::link::LinkHeader;

    fn link(index: u32, name: &str) -> LinkMessage {
        let mut message = LinkMessage::default();
        message.header = LinkHeader {
            index,
            ..LinkHeader::default()
        };
        message.attributes.push(LinkAttribute::IfName(name.into()));
        message
    }

    fn address(index: u32, ip: &str, prefix: u8) -> AddressMessage {
        let mut message = AddressMessage::default();
        message.header = AddressHeader {
            index,
            prefix_len: prefix,
            ..AddressHeader::default()
        };
        message
            .attributes
            .push(AddressAttribute::Local(ip.parse().unwrap()));
        message
    }

    /// The bridge's messages about its port (no link kind) leave the veth as it was.
    #[test]
    fn bridge_port_messages_do_not_replace_the_device() {
        let mut view = View::default();
        let mut veth = link(4, "vpod");
        veth.attributes
            .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
                InfoKind::Veth,
            )]));
        assert!(view.apply(&RouteNetlinkMessage::NewLink(veth)));
        let mut port = link(4, "vpod");
        port.header.interface_family = AddressFamily::Bridge;
        assert!(!view.apply(&RouteNetlinkMessage::NewLink(port.clone())));
        assert!(!view.apply(&RouteNetlinkMessage::DelLink(port)));
        let net = view.node_net();
        assert!(net.links[&4].pair, "{:?}", net.links[&4]);
    }

    #[test]
    fn notifications_add_rename_and_remove_devices_and_addresses() {
        let mut view = View::default();
        assert!(view.apply(&RouteNetlinkMessage::NewLink(link(4, "vpod"))));
        assert!(!view.apply(&RouteNetlinkMessage::NewLink(link(4, "vpod"))));
        assert!(view.apply(&RouteNetlinkMessage::NewAddress(address(4, "10.0.0.1", 24))));
        let net = view.node_net();
        assert_eq!(net.links[&4].name, "vpod");
        assert_eq!(
            net.links[&4].addresses,
            vec!["10.0.0.1/24".parse().unwrap()]
        );
        assert!(view.apply(&RouteNetlinkMessage::DelAddress(address(4, "10.0.0.1", 24))));
        assert!(view.node_net().links[&4].addresses.is_empty());
        // Deleted and re-created under the same name: a new ifindex.
        assert!(view.apply(&RouteNetlinkMessage::DelLink(link(4, "vpod"))));
        assert!(view.apply(&RouteNetlinkMessage::NewLink(link(5, "vpod"))));
        let net = view.node_net();
        assert_eq!(net.links.keys().copied().collect::<Vec<_>>(), vec![5]);
    }
}
