//! The one place where the model (`Frontend`, `BackendAddr`, `FrontendSpec`, source
//! ranges) meets the map layout of `lb_common`: encode/decode pairs, the map
//! operations and snapshots the reconciler plans over, and the byte order of every
//! address and port.
//!
//! `lb_common`'s `#[repr(C)]` types keep plain `u32`/`u16` fields because the kernel
//! side shares them; on this side every such field goes through [`Be32`]/[`Be16`], so a
//! value in network order and one in host order are different types rather than a
//! comment apart. Addresses of both families are `lb_common::IpAddrBe` (16 bytes,
//! IPv4 stored IPv4-mapped), converted to and from `std::net::IpAddr` by lb-common.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use ipnet::IpNet;
use lb_common::{
    Backend, IpAddrBe, ServiceKey, ServiceValue, SourceRangeKey, BACKEND_FLAG_LOCAL,
    SOURCE_RANGE_PREFIX_BASE, SVC_FLAG_AFFINITY, SVC_FLAG_CLUSTER_IP, SVC_FLAG_EXTERNAL_SCOPE,
    SVC_FLAG_SOURCE_RANGES,
};

use crate::model::{BackendAddr, Frontend, FrontendSpec, Protocol, Scope};

/// A 32-bit value in network byte order, as map fields hold addresses.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Be32(u32);

impl Be32 {
    pub const fn from_host(value: u32) -> Self {
        Be32(value.to_be())
    }

    pub const fn to_host(self) -> u32 {
        u32::from_be(self.0)
    }

    /// A map field as stored (already network order).
    pub const fn from_map(raw: u32) -> Self {
        Be32(raw)
    }

    /// The value to store in a map field.
    pub const fn to_map(self) -> u32 {
        self.0
    }
}

impl From<Ipv4Addr> for Be32 {
    fn from(ip: Ipv4Addr) -> Self {
        Be32::from_host(u32::from(ip))
    }
}

impl From<Be32> for Ipv4Addr {
    fn from(value: Be32) -> Self {
        Ipv4Addr::from(value.to_host())
    }
}

/// A 16-bit value in network byte order, as map fields hold ports.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Be16(u16);

impl Be16 {
    pub const fn from_host(value: u16) -> Self {
        Be16(value.to_be())
    }

    pub const fn to_host(self) -> u16 {
        u16::from_be(self.0)
    }

    /// A map field as stored (already network order).
    pub const fn from_map(raw: u16) -> Self {
        Be16(raw)
    }

    /// The value to store in a map field.
    pub const fn to_map(self) -> u16 {
        self.0
    }
}

// The map numbers of the model's enums.
impl Protocol {
    /// IANA number, as the kernel reports it.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => lb_common::IPPROTO_TCP,
            Protocol::Udp => lb_common::IPPROTO_UDP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            lb_common::IPPROTO_TCP => Some(Protocol::Tcp),
            lb_common::IPPROTO_UDP => Some(Protocol::Udp),
            _ => None,
        }
    }
}

impl Scope {
    /// `ServiceKey::scope` value.
    pub fn number(self) -> u8 {
        match self {
            Scope::Internal => lb_common::SCOPE_INTERNAL,
            Scope::External => lb_common::SCOPE_EXTERNAL,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            lb_common::SCOPE_INTERNAL => Some(Scope::Internal),
            lb_common::SCOPE_EXTERNAL => Some(Scope::External),
            _ => None,
        }
    }
}

/// The map fields of an address and port (network order) as a socket address;
/// IPv4-mapped addresses come back as IPv4, so they print `10.96.0.10:80` and IPv6
/// ones `[fd00::1]:80`.
pub fn socket_addr(address: IpAddrBe, port: u16) -> SocketAddr {
    SocketAddr::new(address.into(), Be16::from_map(port).to_host())
}

/// Most backends one frontend can have: slot numbers are `u16` and slot 0 is the master.
pub const MAX_BACKENDS_PER_FRONTEND: usize = u16::MAX as usize - 1;
/// Largest `rev_nat_id`; 0 is reserved for "none". Ids are 32-bit in the maps; this
/// leaves room far beyond any service map while keeping counts in a `u32`.
pub const MAX_REV_NAT_ID: u32 = u32::MAX - 1;

/// `max_entries` of the maps the plan writes to, and what the Maglev tables in
/// them are built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub services: u32,
    pub backends: u32,
    /// Largest frontend id (`rev_nat_id`) to hand out; 0 is reserved.
    pub frontend_ids: u32,
    /// Slots of `LB_MAGLEV` (its entries times four), the header's included.
    pub maglev_slots: u32,
    /// `--maglev-seed`, which the tables are built with (and the kernel hashes
    /// flows with).
    pub maglev_seed: u64,
}

/// A frontend as the map spells it, so that entries with a protocol or scope the
/// model does not know can still be grouped and removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FrontendKey {
    pub address: IpAddrBe,
    pub port: Be16,
    pub proto: u8,
    pub scope: u8,
}

impl FrontendKey {
    pub fn of(frontend: &Frontend) -> Self {
        FrontendKey {
            address: frontend.ip.into(),
            port: Be16::from_host(frontend.port),
            proto: frontend.protocol.number(),
            scope: frontend.scope.number(),
        }
    }

    /// The frontend part of a service key (any slot).
    pub fn of_key(key: &ServiceKey) -> Self {
        FrontendKey {
            address: key.address,
            port: Be16::from_map(key.port),
            proto: key.proto,
            scope: key.scope,
        }
    }

    /// The `LB_SERVICES` key of one slot (0 = master).
    pub fn slot(self, slot: u16) -> ServiceKey {
        ServiceKey {
            address: self.address,
            port: self.port.to_map(),
            backend_slot: slot,
            proto: self.proto,
            scope: self.scope,
            _pad: [0; 2],
        }
    }

    /// `None` for a protocol or scope the model does not know.
    pub fn frontend(self) -> Option<Frontend> {
        Some(Frontend {
            ip: self.address.into(),
            port: self.port.to_host(),
            protocol: Protocol::from_number(self.proto)?,
            scope: Scope::from_number(self.scope)?,
        })
    }
}

/// The `LB_SERVICES` key of one slot (0 = master) of a frontend.
pub fn service_key(frontend: &Frontend, slot: u16) -> ServiceKey {
    FrontendKey::of(frontend).slot(slot)
}

/// The frontend a service entry belongs to. Entries with a protocol the hooks never
/// look up, or with padding set, can never match a lookup: `None`.
pub fn frontend_of(key: &ServiceKey) -> Option<Frontend> {
    if key._pad != [0; 2] {
        return None;
    }
    FrontendKey::of_key(key).frontend()
}

/// The `LB_BACKENDS` value of one backend of a frontend speaking `protocol`.
pub fn backend_value(backend: &BackendAddr, protocol: Protocol) -> Backend {
    Backend {
        address: backend.ip.into(),
        port: Be16::from_host(backend.port).to_map(),
        proto: protocol.number(),
        flags: if backend.local { BACKEND_FLAG_LOCAL } else { 0 },
    }
}

/// The endpoint an `LB_BACKENDS` value names (its protocol is the frontend's).
pub fn backend_addr(backend: &Backend) -> BackendAddr {
    BackendAddr {
        ip: backend.address.into(),
        port: Be16::from_map(backend.port).to_host(),
        local: backend.flags & BACKEND_FLAG_LOCAL != 0,
    }
}

/// The master entry of a frontend with `count` backends. `external_scope`: the
/// frontend also has an external-scope entry that traffic from outside must use
/// instead of this one. `maglev`: the first slot of its Maglev table in
/// `LB_MAGLEV` and its size's index in the ladder (`None`: random).
pub fn master_value(
    spec: &FrontendSpec,
    count: u16,
    rev_nat_id: u32,
    external_scope: bool,
    maglev: Option<(u32, usize)>,
) -> ServiceValue {
    let mut flags = 0;
    if spec.affinity_timeout_sec.is_some() {
        flags |= SVC_FLAG_AFFINITY;
    }
    if external_scope {
        flags |= SVC_FLAG_EXTERNAL_SCOPE;
    }
    if spec.source_ranges.is_some() {
        flags |= SVC_FLAG_SOURCE_RANGES;
    }
    if spec.cluster_ip {
        flags |= SVC_FLAG_CLUSTER_IP;
    }
    let mut backend_id = 0;
    if let Some((first, rung)) = maglev {
        if let Some(bits) = lb_common::maglev_flags(rung) {
            flags |= bits;
            backend_id = first;
        }
    }
    ServiceValue {
        backend_id,
        count,
        flags,
        rev_nat_id,
        affinity_timeout_sec: spec.affinity_timeout_sec.unwrap_or(0),
    }
}

/// `sessionAffinity: ClientIP` timeout a master entry carries, if any.
pub fn affinity_timeout(master: &ServiceValue) -> Option<u32> {
    (master.flags & SVC_FLAG_AFFINITY != 0).then_some(master.affinity_timeout_sec)
}

/// The slot entry naming backend `backend_id` of frontend `rev_nat_id`.
pub fn slot_value(backend_id: u32, rev_nat_id: u32) -> ServiceValue {
    ServiceValue {
        backend_id,
        rev_nat_id,
        ..ServiceValue::default()
    }
}

/// One `LB_SOURCE_RANGES` entry: a frontend id and one of its ranges.
pub type SourceRange = (u32, IpNet);

/// Bits an IPv4 range's prefix is shifted by, stored IPv4-mapped (`::ffff:0:0/96`).
const V4_MAPPED_PREFIX: u8 = 96;

/// The trie key (prefix length, data) of an entry (see [`lb_common::SourceRangeKey`]).
pub fn source_range_key(entry: &SourceRange) -> (u32, SourceRangeKey) {
    let (rev_nat_id, net) = entry;
    let bits = match net {
        IpNet::V4(v4) => V4_MAPPED_PREFIX + v4.prefix_len(),
        IpNet::V6(v6) => v6.prefix_len(),
    };
    (
        SOURCE_RANGE_PREFIX_BASE + u32::from(bits),
        SourceRangeKey {
            rev_nat_id: *rev_nat_id,
            address: net.network().into(),
        },
    )
}

/// The entry a trie key stands for; `None` for a key no agent writes.
pub fn source_range(prefix_len: u32, key: &SourceRangeKey) -> Option<SourceRange> {
    let bits = u8::try_from(prefix_len.checked_sub(SOURCE_RANGE_PREFIX_BASE)?).ok()?;
    let net = match IpAddr::from(key.address) {
        IpAddr::V4(v4) => IpNet::new(v4.into(), bits.checked_sub(V4_MAPPED_PREFIX)?),
        v6 => IpNet::new(v6, bits),
    }
    .ok()?;
    Some((key.rev_nat_id, net))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_fields_hold_addresses_and_ports_in_network_order() {
        // The oracle is the wire layout itself: the first octet first in memory.
        let b = backend_value(
            &BackendAddr {
                ip: Ipv4Addr::new(10, 244, 1, 2).into(),
                port: 8080,
                local: true,
            },
            Protocol::Tcp,
        );
        assert_eq!(bytes(&b.address), v4_mapped([10, 244, 1, 2]));
        assert_eq!(b.port.to_ne_bytes(), 8080u16.to_be_bytes());
        assert_eq!(
            backend_addr(&b),
            BackendAddr {
                ip: Ipv4Addr::new(10, 244, 1, 2).into(),
                port: 8080,
                local: true,
            }
        );

        let web = Frontend::internal(Ipv4Addr::new(10, 96, 0, 10).into(), 443, Protocol::Udp)
            .with_scope(Scope::External);
        let k = service_key(&web, 3);
        assert_eq!(bytes(&k.address), v4_mapped([10, 96, 0, 10]));
        assert_eq!(k.port.to_ne_bytes(), 443u16.to_be_bytes());
        assert_eq!((k.backend_slot, k.scope), (3, lb_common::SCOPE_EXTERNAL));
        assert_eq!(frontend_of(&k), Some(web));
        assert_eq!(frontend_of(&ServiceKey { _pad: [1, 0], ..k }), None);
        assert_eq!(frontend_of(&ServiceKey { proto: 1, ..k }), None);

        assert_eq!(
            socket_addr(k.address, k.port),
            "10.96.0.10:443".parse().unwrap()
        );
        assert_eq!(Be32::from_host(0x0a60_000a).to_host(), 0x0a60_000a);
        assert_eq!(Be16::from_map(k.port).to_host(), 443);
    }

    #[test]
    fn master_flags_round_trip_the_affinity() {
        let spec = |affinity_timeout_sec| FrontendSpec {
            service: "default/web:http".into(),
            backends: Default::default(),
            affinity_timeout_sec,
            source_ranges: None,
            maglev: false,
            cluster_ip: false,
        };
        let m = master_value(&spec(Some(30)), 2, 7, true, None);
        assert_eq!(
            m.flags,
            SVC_FLAG_AFFINITY | SVC_FLAG_EXTERNAL_SCOPE,
            "affinity and external scope, no source ranges"
        );
        assert_eq!(affinity_timeout(&m), Some(30));
        assert_eq!(
            affinity_timeout(&master_value(&spec(None), 2, 7, false, None)),
            None
        );
        let maglev = master_value(&spec(None), 2, 7, false, Some((4096, 2)));
        assert_eq!(maglev.maglev(), Some((4096, 1_021)));
        assert_eq!(maglev.backend_id, 4096);
        assert_eq!(m.maglev(), None);
    }

    #[test]
    fn source_range_keys_round_trip_and_carry_the_prefix_after_the_id() {
        let e: SourceRange = (7, "203.0.113.0/24".parse().unwrap());
        let (prefix_len, k) = source_range_key(&e);
        assert_eq!(prefix_len, 32 + 96 + 24);
        // Network byte order: the first octet is the first byte the trie matches.
        assert_eq!(bytes(&k.address), v4_mapped([203, 0, 113, 0]));
        assert_eq!(source_range(prefix_len, &k), Some(e));
        assert_eq!(source_range(16, &k), None);
        // Shorter than the IPv4-mapped prefix: no IPv4 range.
        assert_eq!(source_range(32 + 90, &k), None);

        let e6: SourceRange = (7, "2001:db8:7::/48".parse().unwrap());
        let (prefix_len, k) = source_range_key(&e6);
        assert_eq!(prefix_len, 32 + 48);
        assert_eq!(&bytes(&k.address)[..6], [0x20, 0x01, 0x0d, 0xb8, 0, 7]);
        assert_eq!(source_range(prefix_len, &k), Some(e6));
    }

    /// The map address as the bytes it holds in memory.
    fn bytes(a: &IpAddrBe) -> Vec<u8> {
        a.words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    fn v4_mapped(v4: [u8; 4]) -> Vec<u8> {
        let mut out = vec![0; 10];
        out.extend([0xff, 0xff]);
        out.extend(v4);
        out
    }

    #[test]
    fn ipv6_addresses_round_trip_and_print_bracketed() {
        let ip: IpAddr = "fd00::1".parse().unwrap();
        let b = backend_value(
            &BackendAddr {
                ip,
                port: 80,
                local: false,
            },
            Protocol::Tcp,
        );
        assert_eq!(bytes(&b.address)[..2], [0xfd, 0]);
        assert!(!b.address.is_v4());
        assert_eq!(backend_addr(&b).ip, ip);
        assert_eq!(socket_addr(b.address, b.port).to_string(), "[fd00::1]:80");
        let v4 = IpAddrBe::from(IpAddr::from(Ipv4Addr::new(10, 96, 0, 10)));
        assert!(v4.is_v4());
        assert_eq!(socket_addr(v4, 80u16.to_be()).to_string(), "10.96.0.10:80");
    }
}
