//! NetworkPolicy's maps and the one rule that reads them (issue 27; the design is
//! `NETPOL-DESIGN.md` in the project notes).
//!
//! Enforcement is on the host side of every local pod's veth: packets from a pod are
//! judged by the pod's egress policy, packets to it by its ingress policy. The agent
//! compiles the policy objects into five maps:
//!
//! - `LB_POLICY_ENDPOINTS` (HASH): a local pod's address -> [`PolicyEndpoint`] (its
//!   endpoint id and which directions any policy enforces on it);
//! - `LB_POLICY_IDENTITY` (HASH): any pod's address in the cluster, and this node's
//!   own addresses -> identity (`u32`);
//! - `LB_POLICY_CIDRS` (LPM trie of [`PolicyCidrKey`]): address -> CIDR class id, a
//!   partition of the address space by every `ipBlock` of every policy;
//! - `LB_POLICY` (LPM trie of [`PolicyKey`]) -> [`PolicyAllow`]: the allows, keyed by
//!   (endpoint, peer, direction, protocol, port) so that the prefix length wildcards
//!   the port, then the protocol;
//! - `LB_POLICY_CT` (LRU HASH of [`PolicyCtKey`]) -> [`PolicyCtValue`]: the flows an
//!   allow opened, whose packets of both directions then pass.
//!
//! [`verdict`] is the rule over the first four, written once for the kernel programs
//! (map-backed [`PolicyLookup`]) and the agent's tests (in-memory), so both agree.
//!
//! LPM trie keys here are the *data part* only, as for `SourceRangeKey` and
//! `MasqCidrKey`: the kernel (and aya's `lpm_trie::Key<K>` on both sides) prepends the
//! `u32` prefix length, counted in bits from the first byte of the data.

use crate::IpAddrBe;

/// Map names, as the kernel object defines them and as they are pinned.
pub mod map_names {
    /// Local pod address -> [`super::PolicyEndpoint`] (HASH).
    pub const ENDPOINTS: &str = "LB_POLICY_ENDPOINTS";
    /// Any pod's (or this node's) address -> identity `u32` (HASH).
    pub const IDENTITY: &str = "LB_POLICY_IDENTITY";
    /// [`super::PolicyCidrKey`] -> CIDR class id `u32` (LPM trie).
    pub const CIDRS: &str = "LB_POLICY_CIDRS";
    /// [`super::PolicyKey`] -> [`super::PolicyAllow`] (LPM trie).
    pub const POLICY: &str = "LB_POLICY";
    /// [`super::PolicyCtKey`] -> [`super::PolicyCtValue`] (LRU HASH).
    pub const CT: &str = "LB_POLICY_CT";
    /// Endpoint id -> [`super::PolicyCounters`] (PERCPU ARRAY).
    pub const DROPS: &str = "LB_POLICY_DROPS";
}

/// `PolicyEndpoint::flags`: at least one policy selects the pod for ingress.
pub const POLICY_ENFORCE_INGRESS: u32 = 1 << 0;
/// `PolicyEndpoint::flags`: at least one policy selects the pod for egress.
pub const POLICY_ENFORCE_EGRESS: u32 = 1 << 1;

/// `PolicyKey::direction`: traffic to the local pod (its ingress policy).
pub const POLICY_DIR_INGRESS: u8 = 1;
/// `PolicyKey::direction`: traffic from the local pod (its egress policy).
pub const POLICY_DIR_EGRESS: u8 = 2;

/// `PolicyKey::peer` of a rule that admits every peer (a rule without `from`/`to`).
/// Never an address's identity.
pub const POLICY_PEER_ANY: u32 = 0;
/// Identity of an address that is no pod and no address of this node.
pub const POLICY_ID_WORLD: u32 = 1;
/// Identity of this node's own addresses: ingress from them is always allowed
/// (kubelet probes), as Calico and Cilium do by default.
pub const POLICY_ID_HOST: u32 = 2;
/// The first pod identity; the ids below are reserved.
pub const POLICY_ID_FIRST_POD: u32 = 256;
/// Set in every CIDR class id, so a class never equals an identity in `PolicyKey::peer`.
pub const POLICY_CIDR_CLASS: u32 = 1 << 31;

/// Bits of a [`PolicyKey`]: a lookup's prefix length, and an entry for one port.
pub const POLICY_PREFIX_FULL: u32 = 96;
/// Prefix length of an entry for every port of one protocol (endpoint, peer,
/// direction and protocol matched).
pub const POLICY_PREFIX_ANY_PORT: u32 = 80;
/// Prefix length of an entry for every protocol and port (a rule without `ports`).
pub const POLICY_PREFIX_ANY_PROTO: u32 = 72;
/// Bits of a [`PolicyCidrKey`]: a lookup's prefix length.
pub const POLICY_CIDR_PREFIX_FULL: u32 = 128;
/// Prefix length of an IPv4 `a.b.c.d/n` in `LB_POLICY_CIDRS` is this plus `n`
/// (stored IPv4-mapped, `::ffff:a.b.c.d`).
pub const POLICY_CIDR_V4_PREFIX_BASE: u32 = 96;

/// Default capacity of `LB_POLICY_ENDPOINTS`: local pod addresses.
pub const DEFAULT_POLICY_ENDPOINTS_MAX: u32 = 4_096;
/// Capacity of `LB_POLICY_DROPS`, and so the bound on endpoint ids (`1..` this).
pub const POLICY_DROPS_MAX: u32 = DEFAULT_POLICY_ENDPOINTS_MAX;
/// Default capacity of `LB_POLICY_IDENTITY`: pod addresses of the whole cluster plus
/// this node's addresses.
pub const DEFAULT_POLICY_IDENTITY_MAX: u32 = 262_144;
/// Default capacity of `LB_POLICY_CIDRS`: distinct `ipBlock` prefixes (cidrs and
/// excepts) of all policies.
pub const DEFAULT_POLICY_CIDRS_MAX: u32 = 65_536;
/// Default capacity of `LB_POLICY`: allow entries of all local pods (an LPM trie is
/// not preallocated: memory follows the entries).
pub const DEFAULT_POLICY_MAX: u32 = 1 << 20;
/// Default capacity of `LB_POLICY_CT`: flows an allow opened.
pub const DEFAULT_POLICY_CT_MAX: u32 = 262_144;

/// Value of `LB_POLICY_ENDPOINTS` (keyed by each address of a local pod that is not
/// host-network).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyEndpoint {
    /// The pod's endpoint id, `1..POLICY_DROPS_MAX`, host byte order: the
    /// `PolicyKey::endpoint` of its allows and its index in `LB_POLICY_DROPS`.
    pub id: u32,
    /// `POLICY_ENFORCE_*` bits, host byte order; read through the predicates.
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyEndpoint>() == 8);

impl PolicyEndpoint {
    /// A policy selects the pod for ingress (`POLICY_ENFORCE_INGRESS`).
    #[inline(always)]
    pub const fn enforces_ingress(&self) -> bool {
        self.flags & POLICY_ENFORCE_INGRESS != 0
    }

    /// A policy selects the pod for egress (`POLICY_ENFORCE_EGRESS`).
    #[inline(always)]
    pub const fn enforces_egress(&self) -> bool {
        self.flags & POLICY_ENFORCE_EGRESS != 0
    }

    /// Whether `direction` (`POLICY_DIR_*`) is enforced; an unknown direction is not.
    #[inline(always)]
    pub const fn enforces(&self, direction: u8) -> bool {
        match direction {
            POLICY_DIR_INGRESS => self.enforces_ingress(),
            POLICY_DIR_EGRESS => self.enforces_egress(),
            _ => false,
        }
    }
}

/// Data part of an `LB_POLICY_CIDRS` key (LPM trie; the kernel prepends the `u32`
/// prefix length). An IPv6 `addr/n` has prefix length `n`, an IPv4 `a.b.c.d/n`
/// `POLICY_CIDR_V4_PREFIX_BASE + n`; a lookup uses `POLICY_CIDR_PREFIX_FULL`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyCidrKey {
    /// The range's address (a lookup: the peer's), network byte order, IPv4-mapped
    /// for IPv4, so the trie's most-significant-bit-first match is a prefix match.
    pub address: IpAddrBe,
}
const _: () = assert!(core::mem::size_of::<PolicyCidrKey>() == 16);

/// Data part of an `LB_POLICY` key (LPM trie; the kernel prepends the `u32` prefix
/// length). The fields are in the order the prefix length cuts them: an entry with
/// prefix `POLICY_PREFIX_ANY_PROTO` (72) matches every protocol and port,
/// `POLICY_PREFIX_ANY_PORT` (80) every port of `proto`, `POLICY_PREFIX_FULL` (96)
/// one port, and `80 + k` the ports sharing the first `k` bits of `port_be` (an
/// `endPort` range is split into such prefixes). A lookup uses 96.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyKey {
    /// The local pod's endpoint id (`PolicyEndpoint::id`), host byte order (always
    /// matched whole, so its byte order does not matter to the trie).
    pub endpoint: u32,
    /// The peer: a pod identity (`>= POLICY_ID_FIRST_POD`), a CIDR class id (with
    /// `POLICY_CIDR_CLASS`) or `POLICY_PEER_ANY`; host byte order, matched whole.
    pub peer: u32,
    /// `POLICY_DIR_INGRESS` or `POLICY_DIR_EGRESS`.
    pub direction: u8,
    /// IP protocol (`IPPROTO_TCP`, `IPPROTO_UDP`, `IPPROTO_SCTP`, ...).
    pub proto: u8,
    /// Destination port, network byte order: the local pod's port for ingress, the
    /// peer's for egress (after Service translation: the backend's).
    pub port_be: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<PolicyKey>() == 12);
const _: () = assert!(core::mem::size_of::<PolicyKey>() as u32 * 8 == POLICY_PREFIX_FULL);

/// Value of `LB_POLICY`: only allows are stored; no entry means deny when the
/// direction is enforced.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyAllow {
    /// The agent's id of the (policy, direction, rule) that allowed it, host byte
    /// order: for `lb policy` and the connection's conntrack entry.
    pub rule: u32,
    /// Explicit padding.
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyAllow>() == 8);

/// `IPPROTO_SCTP`: NetworkPolicy's third port protocol.
pub const IPPROTO_SCTP: u8 = 132;

/// Key of `LB_POLICY_CT` (LRU): one allowed flow, seen from the local pod's side, so
/// that its packets of both directions find the same entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyCtKey {
    /// The local pod's address, network byte order (IPv4-mapped for IPv4).
    pub pod: IpAddrBe,
    /// The peer's address, network byte order (after Service translation).
    pub peer: IpAddrBe,
    /// The local pod's port, network byte order.
    pub pod_port_be: [u8; 2],
    /// The peer's port, network byte order.
    pub peer_port_be: [u8; 2],
    /// IP protocol.
    pub proto: u8,
    /// Explicit padding; always zero so that hash lookups match.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<PolicyCtKey>() == 40);

/// Value of `LB_POLICY_CT`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyCtValue {
    /// The direction (`POLICY_DIR_*`) whose allow opened the flow.
    pub opened: u8,
    /// Explicit padding.
    pub _pad: [u8; 3],
    /// `PolicyAllow::rule` of the allow that opened it (0: not enforced or the host).
    pub rule: u32,
}
const _: () = assert!(core::mem::size_of::<PolicyCtValue>() == 8);

/// Value of `LB_POLICY_DROPS` (PERCPU ARRAY indexed by endpoint id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicyCounters {
    /// Packets to the pod its ingress policy dropped.
    pub ingress_drops: u64,
    /// Packets from the pod its egress policy dropped.
    pub egress_drops: u64,
}
const _: () = assert!(core::mem::size_of::<PolicyCounters>() == 16);

/// Whether the programs enforce NetworkPolicy (`--network-policy`): a read-only
/// global of the kernel object set at load time, as `--node-ip` is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct PolicySettings {
    /// 1: on; 0: off (no program reads or writes the policy maps).
    pub enabled: u32,
}
const _: () = assert!(core::mem::size_of::<PolicySettings>() == 4);

impl PolicySettings {
    /// `--network-policy on`.
    #[inline(always)]
    pub const fn is_enabled(&self) -> bool {
        self.enabled != 0
    }
}

/// The four lookups [`verdict`] needs. The kernel programs implement it over the maps,
/// the agent's tests over in-memory tables; the LPM lookups take the full key (prefix
/// `POLICY_PREFIX_FULL` / `POLICY_CIDR_PREFIX_FULL`) and return the longest match.
pub trait PolicyLookup {
    /// `LB_POLICY_ENDPOINTS[addr]`.
    fn endpoint(&self, addr: &IpAddrBe) -> Option<PolicyEndpoint>;
    /// `LB_POLICY_IDENTITY[addr]`.
    fn identity(&self, addr: &IpAddrBe) -> Option<u32>;
    /// `LB_POLICY_CIDRS` longest match of `addr`.
    fn cidr_class(&self, addr: &IpAddrBe) -> Option<u32>;
    /// `LB_POLICY` longest match of `key`.
    fn allow(&self, key: &PolicyKey) -> Option<PolicyAllow>;
}

/// What [`verdict`] decided, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No policy selects the pod for this direction (or the address is no local pod).
    Open,
    /// Ingress from this node's own addresses: always allowed.
    Host,
    /// An allow matched: `PolicyAllow::rule` of the first lookup that hit.
    Allowed {
        /// The rule id of the matching allow.
        rule: u32,
    },
    /// Enforced and no allow matched: drop, counted on `endpoint`.
    Denied {
        /// The local pod's endpoint id (index in `LB_POLICY_DROPS`).
        endpoint: u32,
    },
}

impl Verdict {
    /// Whether the packet passes.
    #[inline(always)]
    pub const fn is_allowed(&self) -> bool {
        !matches!(self, Verdict::Denied { .. })
    }
}

/// The verdict for one packet of a new flow: `pod` is the local pod's address,
/// `direction` whose policy applies (`POLICY_DIR_INGRESS`: the packet goes to the
/// pod), `peer` the other end's address, `proto` the IP protocol and `port_be` the
/// destination port (network byte order: the pod's for ingress, the peer's for
/// egress; 0 for protocols without ports).
///
/// Allowed when the direction is not enforced on the pod, when it is ingress from
/// this node (identity `POLICY_ID_HOST`), or when `LB_POLICY` holds an allow for the
/// peer's identity (`POLICY_ID_WORLD` if none), for its CIDR class (if any), or for
/// `POLICY_PEER_ANY`. Straight-line: at most two hash and four LPM lookups.
#[inline(always)]
pub fn verdict<L: PolicyLookup>(
    maps: &L,
    pod: &IpAddrBe,
    direction: u8,
    peer: &IpAddrBe,
    proto: u8,
    port_be: [u8; 2],
) -> Verdict {
    verdict_of(maps, maps.endpoint(pod), direction, peer, proto, port_be)
}

/// [`verdict`] for a caller that has already read the pod's endpoint entry
/// (`endpoint`: `LB_POLICY_ENDPOINTS[pod]`), so the kernel programs do not look
/// it up twice for one packet.
#[inline(always)]
pub fn verdict_of<L: PolicyLookup>(
    maps: &L,
    endpoint: Option<PolicyEndpoint>,
    direction: u8,
    peer: &IpAddrBe,
    proto: u8,
    port_be: [u8; 2],
) -> Verdict {
    let endpoint = match endpoint {
        Some(endpoint) if endpoint.enforces(direction) => endpoint,
        _ => return Verdict::Open,
    };
    let identity = match maps.identity(peer) {
        Some(identity) => identity,
        None => POLICY_ID_WORLD,
    };
    if direction == POLICY_DIR_INGRESS && identity == POLICY_ID_HOST {
        return Verdict::Host;
    }
    let mut key = PolicyKey {
        endpoint: endpoint.id,
        peer: identity,
        direction,
        proto,
        port_be,
    };
    if let Some(allow) = maps.allow(&key) {
        return Verdict::Allowed { rule: allow.rule };
    }
    if let Some(class) = maps.cidr_class(peer) {
        key.peer = class;
        if let Some(allow) = maps.allow(&key) {
            return Verdict::Allowed { rule: allow.rule };
        }
    }
    key.peer = POLICY_PEER_ANY;
    if let Some(allow) = maps.allow(&key) {
        return Verdict::Allowed { rule: allow.rule };
    }
    Verdict::Denied {
        endpoint: endpoint.id,
    }
}

impl PolicyKey {
    /// The key's bytes as the trie compares them (most significant bit first).
    #[inline(always)]
    pub const fn to_bytes(&self) -> [u8; 12] {
        let e = self.endpoint.to_ne_bytes();
        let p = self.peer.to_ne_bytes();
        [
            e[0],
            e[1],
            e[2],
            e[3],
            p[0],
            p[1],
            p[2],
            p[3],
            self.direction,
            self.proto,
            self.port_be[0],
            self.port_be[1],
        ]
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    fn v4(a: [u8; 4]) -> IpAddrBe {
        IpAddrBe::from_v4(u32::from_ne_bytes(a))
    }

    fn addr_bytes(a: &IpAddrBe) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, w) in a.words.iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        out
    }

    /// Whether the first `bits` bits of `a` and `b` agree.
    fn prefix_eq(a: &[u8], b: &[u8], bits: u32) -> bool {
        (0..bits as usize).all(|i| {
            let mask = 0x80u8 >> (i % 8);
            a[i / 8] & mask == b[i / 8] & mask
        })
    }

    /// Tables with the kernel's semantics: a hash lookup is exact, an LPM lookup
    /// returns the entry of the longest prefix that matches the key's bits.
    #[derive(Default)]
    struct Tables {
        endpoints: Vec<(IpAddrBe, PolicyEndpoint)>,
        identities: Vec<(IpAddrBe, u32)>,
        cidrs: Vec<(u32, PolicyCidrKey, u32)>,
        allows: Vec<(u32, PolicyKey, PolicyAllow)>,
    }

    impl PolicyLookup for Tables {
        fn endpoint(&self, addr: &IpAddrBe) -> Option<PolicyEndpoint> {
            self.endpoints
                .iter()
                .find(|(a, _)| a == addr)
                .map(|(_, e)| *e)
        }
        fn identity(&self, addr: &IpAddrBe) -> Option<u32> {
            self.identities
                .iter()
                .find(|(a, _)| a == addr)
                .map(|(_, i)| *i)
        }
        fn cidr_class(&self, addr: &IpAddrBe) -> Option<u32> {
            let want = addr_bytes(addr);
            self.cidrs
                .iter()
                .filter(|(len, k, _)| prefix_eq(&addr_bytes(&k.address), &want, *len))
                .max_by_key(|(len, _, _)| *len)
                .map(|(_, _, c)| *c)
        }
        fn allow(&self, key: &PolicyKey) -> Option<PolicyAllow> {
            let want = key.to_bytes();
            self.allows
                .iter()
                .filter(|(len, k, _)| prefix_eq(&k.to_bytes(), &want, *len))
                .max_by_key(|(len, _, _)| *len)
                .map(|(_, _, a)| *a)
        }
    }

    const POD: [u8; 4] = [10, 0, 0, 5];
    const PEER: [u8; 4] = [10, 0, 1, 7];
    const EP: u32 = 3;
    const PEER_ID: u32 = POLICY_ID_FIRST_POD + 4;

    fn tables(flags: u32) -> Tables {
        Tables {
            endpoints: std::vec![(v4(POD), PolicyEndpoint { id: EP, flags })],
            identities: std::vec![(v4(PEER), PEER_ID), (v4([192, 168, 0, 1]), POLICY_ID_HOST)],
            ..Default::default()
        }
    }

    fn key(peer: u32, direction: u8, proto: u8, port: u16) -> PolicyKey {
        PolicyKey {
            endpoint: EP,
            peer,
            direction,
            proto,
            port_be: port.to_be_bytes(),
        }
    }

    fn allow(rule: u32) -> PolicyAllow {
        PolicyAllow { rule, _pad: 0 }
    }

    fn judge(t: &Tables, dir: u8, peer: [u8; 4], proto: u8, port: u16) -> Verdict {
        verdict(t, &v4(POD), dir, &v4(peer), proto, port.to_be_bytes())
    }

    #[test]
    fn unknown_pod_or_unenforced_direction_is_open() {
        let t = tables(POLICY_ENFORCE_INGRESS);
        let other = verdict(
            &t,
            &v4([10, 0, 0, 99]),
            POLICY_DIR_INGRESS,
            &v4(PEER),
            crate::IPPROTO_TCP,
            [0, 80],
        );
        assert_eq!(other, Verdict::Open);
        assert_eq!(
            judge(&t, POLICY_DIR_EGRESS, PEER, crate::IPPROTO_TCP, 80),
            Verdict::Open
        );
        assert_eq!(
            judge(&t, POLICY_DIR_INGRESS, PEER, crate::IPPROTO_TCP, 80),
            Verdict::Denied { endpoint: EP }
        );
        assert!(!Verdict::Denied { endpoint: EP }.is_allowed());
    }

    #[test]
    fn host_is_allowed_in_but_judged_out() {
        let t = tables(POLICY_ENFORCE_INGRESS | POLICY_ENFORCE_EGRESS);
        let host = [192, 168, 0, 1];
        assert_eq!(
            judge(&t, POLICY_DIR_INGRESS, host, crate::IPPROTO_TCP, 80),
            Verdict::Host
        );
        assert_eq!(
            judge(&t, POLICY_DIR_EGRESS, host, crate::IPPROTO_TCP, 80),
            Verdict::Denied { endpoint: EP }
        );
    }

    #[test]
    fn identity_port_prefixes() {
        let mut t = tables(POLICY_ENFORCE_INGRESS);
        let tcp = crate::IPPROTO_TCP;
        t.allows.push((
            POLICY_PREFIX_FULL,
            key(PEER_ID, POLICY_DIR_INGRESS, tcp, 80),
            allow(7),
        ));
        // 1024..=1031: one /13 of the port's 16 bits.
        t.allows.push((
            POLICY_PREFIX_ANY_PORT + 13,
            key(PEER_ID, POLICY_DIR_INGRESS, tcp, 1024),
            allow(8),
        ));
        t.allows.push((
            POLICY_PREFIX_ANY_PORT,
            key(PEER_ID, POLICY_DIR_INGRESS, crate::IPPROTO_UDP, 0),
            allow(9),
        ));
        let d = POLICY_DIR_INGRESS;
        assert_eq!(judge(&t, d, PEER, tcp, 80), Verdict::Allowed { rule: 7 });
        assert!(!judge(&t, d, PEER, tcp, 81).is_allowed());
        assert_eq!(judge(&t, d, PEER, tcp, 1031), Verdict::Allowed { rule: 8 });
        assert!(!judge(&t, d, PEER, tcp, 1032).is_allowed());
        assert!(!judge(&t, d, PEER, tcp, 1023).is_allowed());
        assert_eq!(
            judge(&t, d, PEER, crate::IPPROTO_UDP, 53),
            Verdict::Allowed { rule: 9 }
        );
        assert!(!judge(&t, d, PEER, IPPROTO_SCTP, 80).is_allowed());
        // Same port, another peer or the other direction: no.
        assert!(!judge(&t, d, [10, 0, 1, 8], tcp, 80).is_allowed());
        t.endpoints[0].1.flags |= POLICY_ENFORCE_EGRESS;
        assert!(!judge(&t, POLICY_DIR_EGRESS, PEER, tcp, 80).is_allowed());
    }

    #[test]
    fn any_protocol_rule_and_any_peer() {
        let mut t = tables(POLICY_ENFORCE_EGRESS);
        t.allows.push((
            POLICY_PREFIX_ANY_PROTO,
            key(POLICY_PEER_ANY, POLICY_DIR_EGRESS, 0, 0),
            allow(11),
        ));
        for (proto, port) in [(crate::IPPROTO_TCP, 1), (crate::IPPROTO_ICMP, 0)] {
            assert_eq!(
                judge(&t, POLICY_DIR_EGRESS, [8, 8, 8, 8], proto, port),
                Verdict::Allowed { rule: 11 }
            );
        }
        assert_eq!(
            judge(
                &t,
                POLICY_DIR_EGRESS,
                [192, 168, 0, 1],
                crate::IPPROTO_TCP,
                22
            ),
            Verdict::Allowed { rule: 11 }
        );
    }

    #[test]
    fn cidr_class_is_independent_of_identity() {
        let mut t = tables(POLICY_ENFORCE_INGRESS);
        let class = POLICY_CIDR_CLASS | 5;
        let except = POLICY_CIDR_CLASS | 6;
        // 10.0.0.0/8 is class 5, except 10.0.1.0/24 (class 6, no allow).
        t.cidrs.push((
            POLICY_CIDR_V4_PREFIX_BASE + 8,
            PolicyCidrKey {
                address: v4([10, 0, 0, 0]),
            },
            class,
        ));
        t.cidrs.push((
            POLICY_CIDR_V4_PREFIX_BASE + 24,
            PolicyCidrKey {
                address: v4([10, 0, 1, 0]),
            },
            except,
        ));
        t.allows.push((
            POLICY_PREFIX_ANY_PROTO,
            key(class, POLICY_DIR_INGRESS, 0, 0),
            allow(21),
        ));
        let d = POLICY_DIR_INGRESS;
        // Not a pod: WORLD, then its class.
        assert_eq!(
            judge(&t, d, [10, 9, 9, 9], crate::IPPROTO_TCP, 80),
            Verdict::Allowed { rule: 21 }
        );
        // A pod inside the except: its identity has no allow, nor its class.
        assert!(!judge(&t, d, PEER, crate::IPPROTO_TCP, 80).is_allowed());
        // Outside every block.
        assert!(!judge(&t, d, [11, 0, 0, 1], crate::IPPROTO_TCP, 80).is_allowed());
        // A pod inside the block is matched by the block as well.
        t.identities.push((v4([10, 2, 0, 1]), PEER_ID + 1));
        assert!(judge(&t, d, [10, 2, 0, 1], crate::IPPROTO_TCP, 80).is_allowed());
    }

    #[test]
    fn key_bytes_follow_field_order() {
        let k = PolicyKey {
            endpoint: u32::from_ne_bytes([1, 2, 3, 4]),
            peer: u32::from_ne_bytes([5, 6, 7, 8]),
            direction: 9,
            proto: 10,
            port_be: [11, 12],
        };
        assert_eq!(k.to_bytes(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(
            core::mem::offset_of!(PolicyKey, port_be),
            10,
            "the trie cuts the port last"
        );
    }
}
