//! The fixture's network namespace, set up so that the programs' route lookups
//! answer as on a node: an uplink holding the node's addresses, gateways towards
//! the clients and the other node's pods (their neighbour entries fixed), a gateway
//! whose neighbour is never resolved, and a second device to redirect from.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The uplink (`lbx0`): the node's addresses, the next hops below behind it.
pub const UPLINK: &str = "lbx0";
pub const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];
/// A second node-facing device (`lby0`), where a packet for the uplink comes in.
pub const SIDE: &str = "lby0";
/// The gateway towards the clients (203.0.113.0/24, 198.51.100.0/24,
/// 2001:db8:71::/64).
pub const CLIENT_GW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
/// The other node, next hop for its pods (10.244.2.0/24, fd00:244:2::/64).
pub const PEER_NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x03];

pub const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);
pub const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 2);

/// The devices' indexes in the fixture's namespace.
pub struct Net {
    pub uplink: u32,
    pub side: u32,
}

/// Runs `ip` in the calling thread's network namespace (a forked child keeps it).
fn ip(args: &str) {
    let status = std::process::Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .expect("run ip");
    assert!(status.success(), "ip {args}");
}

/// Writes a sysctl of the thread's network namespace.
fn sysctl(path: &str, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{path}: {e}"));
}

fn ifindex(name: &str) -> u32 {
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name; the call reads it only.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(index, 0, "no device {name:?}");
    index
}

/// Sets the MTU of `dev` and its veth peer.
pub fn set_mtu(dev: &str, mtu: u32) {
    let peer = if dev == UPLINK { "lbx1" } else { "lby1" };
    for d in [dev, peer] {
        ip(&format!("link set {d} mtu {mtu}"));
    }
}

/// Builds the devices, addresses, routes and neighbours (the namespace is the
/// fixture's, and goes with it).
pub fn setup() -> Net {
    ip("link set lo up");
    ip(&format!(
        "link add {UPLINK} address 02:00:00:00:00:aa type veth peer name lbx1"
    ));
    ip(&format!(
        "link add {SIDE} address 02:00:00:00:00:bb type veth peer name lby1"
    ));
    for dev in [UPLINK, "lbx1", SIDE, "lby1"] {
        ip(&format!("link set {dev} up"));
    }
    // A router forwards: the lookups (input lookups, as forwarding does) honour it.
    sysctl("/proc/sys/net/ipv4/ip_forward", "1");
    sysctl("/proc/sys/net/ipv6/conf/all/forwarding", "1");
    ip(&format!("addr add {NODE}/24 dev {UPLINK}"));
    ip(&format!("addr add 192.168.60.2/24 dev {SIDE}"));
    ip(&format!("-6 addr add {NODE6}/64 dev {UPLINK} nodad"));
    ip(&format!("-6 addr add 2001:db8:60::2/64 dev {SIDE} nodad"));

    // The other node's pods, and a gateway that never answers ARP / ND.
    ip("route add 10.244.2.0/24 via 192.168.50.3");
    ip(&format!(
        "neigh add 192.168.50.3 lladdr 02:00:00:00:00:03 dev {UPLINK} nud permanent"
    ));
    ip("route add 10.244.3.0/24 via 192.168.50.4");
    ip("-6 route add fd00:244:2::/64 via 2001:db8:50::3");
    ip(&format!(
        "-6 neigh add 2001:db8:50::3 lladdr 02:00:00:00:00:03 dev {UPLINK} nud permanent"
    ));
    ip("-6 route add fd00:244:3::/64 via 2001:db8:50::4");
    // The clients.
    ip("route add 203.0.113.0/24 via 192.168.50.1");
    ip("route add 198.51.100.0/24 via 192.168.50.1");
    ip(&format!(
        "neigh add 192.168.50.1 lladdr 02:00:00:00:00:01 dev {UPLINK} nud permanent"
    ));
    ip("-6 route add 2001:db8:71::/64 via 2001:db8:50::1");
    ip(&format!(
        "-6 neigh add 2001:db8:50::1 lladdr 02:00:00:00:00:01 dev {UPLINK} nud permanent"
    ));
    Net {
        uplink: ifindex(UPLINK),
        side: ifindex(SIDE),
    }
}
