//! Map keys and values shared by the kernel programs (`lb-ebpf`) and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding so that the layout is the same on
//! both sides and in the BTF that `bpftool map dump` uses to print field names.
//! Addresses and ports are kept in network byte order, as `struct bpf_sock_addr` hands
//! them to the socket hooks, so the fast path never swaps bytes.
//!
//! Both families share every map: an address is 16 bytes ([`IpAddrBe`]), an IPv4
//! address stored IPv4-mapped (`::ffff:a.b.c.d`). That is also how an AF_INET6 socket
//! spells an IPv4 peer, so `connect6` to `::ffff:10.96.0.10` finds the IPv4 Service
//! with no extra lookup, and one agent-side codec serves both families.
//!
//! The service table follows Cilium's slot layout: for one frontend (VIP, port,
//! protocol) slot 0 is the *master* entry that holds the number of backends, and slots
//! `1..=count` name one backend each. The agent writes the backends and slots before the
//! master that counts them, so a reader never sees a count larger than the slots present.
#![no_std]

pub mod maglev;
pub mod policy;

pub use policy::{
    PolicyAllow, PolicyCidrKey, PolicyCounters, PolicyCtKey, PolicyCtValue, PolicyEndpoint,
    PolicyKey, PolicyLookup,
};

/// Bumped whenever a map's key or value layout changes. Maps are pinned under
/// `<pin-dir>/v<PIN_LAYOUT_VERSION>/` so an agent never reuses a map with another layout.
pub const PIN_LAYOUT_VERSION: u32 = 6;

/// Map names, as the kernel object defines them and as they are pinned.
pub mod map_names {
    pub const SERVICES: &str = "LB_SERVICES";
    pub const BACKENDS: &str = "LB_BACKENDS";
    pub const SOCK_REVNAT: &str = "LB_SOCK_REVNAT";
    pub const AFFINITY: &str = "LB_AFFINITY";
    pub const STATS: &str = "LB_STATS";
    pub const CT: &str = "LB_CT";
    pub const SVC_STATS: &str = "LB_SVC_STATS";
    pub const ATTACHMENTS: &str = "LB_ATTACHMENTS";
    pub const SOURCE_RANGES: &str = "LB_SOURCE_RANGES";
    pub const FRAG: &str = "LB_FRAG";
    /// The devices `lb_xdp` may redirect to (a DEVMAP_HASH keyed by ifindex; see
    /// [`crate::XDP_DEVMAP_MAX`]).
    pub const XDP_DEVMAP: &str = "LB_XDP_DEVMAP";
    /// The Maglev tables of the frontends flagged `SVC_FLAG_MAGLEV` (an ARRAY of
    /// [`crate::MaglevSlots`]).
    pub const MAGLEV: &str = "LB_MAGLEV";
    /// Egress masquerading's translations (a HASH of [`crate::CtKey`] ->
    /// [`crate::CtValue`], both directions of each flow).
    pub const MASQ: &str = "LB_MASQ";
    /// Egress masquerading's address sets: this node's pod CIDRs and the exempt
    /// destinations (an LPM trie of [`crate::MasqCidrKey`]).
    pub const MASQ_CIDRS: &str = "LB_MASQ_CIDRS";
    /// Every map the agent pins.
    pub const ALL: [&str; 14] = [
        SERVICES,
        BACKENDS,
        SOCK_REVNAT,
        AFFINITY,
        STATS,
        CT,
        SVC_STATS,
        ATTACHMENTS,
        SOURCE_RANGES,
        FRAG,
        XDP_DEVMAP,
        MAGLEV,
        MASQ,
        MASQ_CIDRS,
    ];
}

/// Program names in the kernel object (the Rust function names).
pub mod program_names {
    pub const CONNECT4: &str = "lb_connect4";
    pub const SENDMSG4: &str = "lb_sendmsg4";
    pub const RECVMSG4: &str = "lb_recvmsg4";
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    pub const CONNECT6: &str = "lb_connect6";
    pub const SENDMSG6: &str = "lb_sendmsg6";
    pub const RECVMSG6: &str = "lb_recvmsg6";
    pub const GETPEERNAME6: &str = "lb_getpeername6";
    /// The cgroup socket hooks.
    pub const ALL: [&str; 8] = [
        CONNECT4,
        SENDMSG4,
        RECVMSG4,
        GETPEERNAME4,
        CONNECT6,
        SENDMSG6,
        RECVMSG6,
        GETPEERNAME6,
    ];
    /// TC ingress on node-facing devices.
    pub const TC_EXTERNAL: &str = "lb_tc_external";
    /// TC ingress on pod-facing devices.
    pub const TC_INTERNAL: &str = "lb_tc_internal";
    /// XDP on node-facing devices (section `xdp.frags`: loaded with
    /// `BPF_F_XDP_HAS_FRAGS`, so it also runs on multi-buffer frames).
    pub const XDP: &str = "lb_xdp";
    /// Passes every frame: for the far end of a veth that `lb_xdp` sends into (not
    /// attached by the agent).
    pub const XDP_PASS: &str = "lb_xdp_pass";
    /// The benchmark's packet generator, run through BPF_PROG_TEST_RUN's
    /// live-frames mode (not attached by the agent).
    pub const XDP_GEN: &str = "lb_xdp_gen";
    /// Drops every frame: the benchmark's sink (not attached by the agent).
    pub const XDP_DROP: &str = "lb_xdp_drop";
    /// TC egress on node-facing devices with `--masquerade bpf`: local pods' traffic
    /// to destinations outside the cluster leaves with the node's address.
    pub const TC_EGRESS: &str = "lb_tc_egress";
}

/// The benchmark generator's frame (`lb_xdp_gen`): Ethernet, a 20-byte IPv4 header
/// and a 20-byte TCP header, no payload. The generator rewrites every byte of it
/// from its `LB_GEN_FRAME` template on each send.
pub const GEN_FRAME_LEN: usize = 54;
/// `LB_GEN_FRAME`'s length in 16-bit words, the unit the generator copies in.
pub const GEN_FRAME_WORDS: usize = GEN_FRAME_LEN / 2;

/// IANA protocol numbers as `bpf_sock_addr.protocol` reports them.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
/// ICMP and ICMPv6: masqueraded echo flows (the identifier as the port).
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_ICMPV6: u8 = 58;

/// `ServiceValue::flags`: the Service has `sessionAffinity: ClientIP`.
pub const SVC_FLAG_AFFINITY: u16 = 1 << 0;
/// `ServiceValue::flags` (internal master): external traffic must use the
/// `SCOPE_EXTERNAL` entry of the same frontend.
pub const SVC_FLAG_EXTERNAL_SCOPE: u16 = 1 << 1;
/// `ServiceValue::flags`: the frontend is a Service's cluster IP, so kube-proxy's
/// cluster-IP masquerade rules decide a new per-packet flow's SNAT (see
/// [`MasqSettings`]); NodePorts, load-balancer IPs and externalIPs have it clear.
pub const SVC_FLAG_CLUSTER_IP: u16 = 1 << 2;
/// `ServiceValue::flags` (internal master of a LoadBalancer ingress IP): the Service
/// has `spec.loadBalancerSourceRanges`; the per-packet path admits new flows only
/// from sources `LB_SOURCE_RANGES` holds for this frontend's `rev_nat_id` (none: no
/// source is admitted), as kube-proxy's firewall chains do.
pub const SVC_FLAG_SOURCE_RANGES: u16 = 1 << 3;
/// `ServiceValue::flags`: new flows of the per-packet path (TC and XDP, never the
/// socket hooks) pick their slot from this frontend's Maglev table in `LB_MAGLEV`
/// (see [`ServiceValue::maglev`]) rather than at random.
pub const SVC_FLAG_MAGLEV: u16 = 1 << 4;
/// `ServiceValue::flags` of a Maglev master: bits 8..12 hold the table's size as an
/// index into [`maglev::TABLE_SIZES`] (the ladder has 10 rungs; 4 bits hold 16).
const SVC_MAGLEV_RUNG_SHIFT: u16 = 8;
const SVC_MAGLEV_RUNG_MASK: u16 = 0xf;

/// `Backend::flags`: the endpoint runs on this node, so per-packet NAT needs no SNAT
/// to bring its replies back through us.
pub const BACKEND_FLAG_LOCAL: u8 = 1 << 0;

/// Default capacities; the agent may size maps differently at load time.
/// Slot entries: one per frontend plus one per backend of it.
pub const DEFAULT_SERVICES_MAX: u32 = 1 << 21;
pub const DEFAULT_BACKENDS_MAX: u32 = 1 << 21;
pub const DEFAULT_SOCK_REVNAT_MAX: u32 = 262_144;
pub const DEFAULT_AFFINITY_MAX: u32 = 65_536;
pub const DEFAULT_CT_MAX: u32 = 262_144;
/// `LB_SOURCE_RANGES` entries: one per (LoadBalancer frontend, source range).
pub const DEFAULT_SOURCE_RANGES_MAX: u32 = 65_536;
/// `LB_FRAG` entries: fragmented datagrams of translated flows in flight at once.
pub const DEFAULT_FRAG_MAX: u32 = 8_192;
/// How long a first fragment's translation applies to later fragments: Linux's
/// default `ipfrag_time`, after which the receiver has given up on the datagram.
pub const FRAG_TIMEOUT_NS: u64 = 30_000_000_000;

/// An IP address as every map holds it: 16 bytes in network byte order (the word
/// array only gives it the 4-byte alignment `bpf_sock_addr.user_ip6` and IPv6 headers
/// have). An IPv4 address is stored IPv4-mapped, `::ffff:a.b.c.d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct IpAddrBe {
    /// The address bytes, network byte order, as four native-endian words.
    pub words: [u32; 4],
}
const _: () = assert!(core::mem::size_of::<IpAddrBe>() == 16);

/// Word 2 of an IPv4-mapped address: the bytes `00 00 ff ff`.
const V4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

impl IpAddrBe {
    /// The IPv4-mapped form of an IPv4 address given in network byte order (as
    /// `user_ip4` and IPv4 headers carry it).
    #[inline(always)]
    pub const fn from_v4(be: u32) -> Self {
        IpAddrBe {
            words: [0, 0, V4_MAPPED_WORD, be],
        }
    }

    /// An IPv6 address given as its four network-order words.
    #[inline(always)]
    pub const fn from_v6(words: [u32; 4]) -> Self {
        IpAddrBe { words }
    }

    /// Whether this is an IPv4 address (IPv4-mapped).
    #[inline(always)]
    pub const fn is_v4(&self) -> bool {
        self.words[0] == 0 && self.words[1] == 0 && self.words[2] == V4_MAPPED_WORD
    }

    /// The IPv4 address in network byte order; meaningful only when `is_v4()`.
    #[inline(always)]
    pub const fn v4(&self) -> u32 {
        self.words[3]
    }
}

impl From<core::net::IpAddr> for IpAddrBe {
    fn from(ip: core::net::IpAddr) -> Self {
        let octets = match ip {
            core::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            core::net::IpAddr::V6(v6) => v6.octets(),
        };
        let word =
            |i: usize| u32::from_ne_bytes([octets[i], octets[i + 1], octets[i + 2], octets[i + 3]]);
        IpAddrBe {
            words: [word(0), word(4), word(8), word(12)],
        }
    }
}

/// IPv4-mapped addresses come back as IPv4.
impl From<IpAddrBe> for core::net::IpAddr {
    fn from(ip: IpAddrBe) -> Self {
        let mut octets = [0u8; 16];
        for (i, word) in ip.words.iter().enumerate() {
            octets[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
        }
        core::net::Ipv6Addr::from(octets).to_canonical()
    }
}

/// Key of `LB_SERVICES`: one frontend and one of its slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceKey {
    /// Virtual IP address (IPv4-mapped for IPv4).
    pub address: IpAddrBe,
    /// Service port, network byte order.
    pub port: u16,
    /// 0 for the master entry, `1..=count` for backend slots (host byte order).
    pub backend_slot: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// `SCOPE_INTERNAL` or `SCOPE_EXTERNAL`.
    pub scope: u8,
    /// Explicit padding; always zero so that hash lookups match.
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 24);

/// `ServiceKey::scope`: the entry every frontend has, used by the socket hooks and by
/// traffic from inside the cluster.
pub const SCOPE_INTERNAL: u8 = 0;
/// `ServiceKey::scope`: a second entry for traffic from outside the cluster, present
/// only when it must see other backends (`externalTrafficPolicy: Local`); the master
/// of the internal entry then carries `SVC_FLAG_EXTERNAL_SCOPE`.
pub const SCOPE_EXTERNAL: u8 = 1;

/// Value of `LB_SERVICES`. Master entries use `count`, `rev_nat_id`, `flags` and
/// `affinity_timeout_sec`, and a Maglev master also `backend_id`; slot entries use
/// `backend_id` (and repeat `rev_nat_id`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceValue {
    /// Slot entries: key of the backend in `LB_BACKENDS`. Master: 0, or with
    /// `SVC_FLAG_MAGLEV` the first slot of its Maglev table in `LB_MAGLEV` (a
    /// multiple of [`MAGLEV_SLOTS_PER_ENTRY`]; see [`ServiceValue::maglev`]).
    pub backend_id: u32,
    /// Master: number of backend slots; 0 means "no usable endpoints", which the
    /// hooks answer with ECONNREFUSED like kube-proxy's REJECT rule.
    pub count: u16,
    /// `SVC_FLAG_*` bits.
    pub flags: u16,
    /// Non-zero id of this frontend; keys affinity entries and per-Service counters.
    /// 32 bits: a 16-bit id (Cilium's rev-NAT index) caps a node at 65535 Service ports.
    pub rev_nat_id: u32,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds` when `SVC_FLAG_AFFINITY` is set.
    pub affinity_timeout_sec: u32,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);

/// The `SVC_FLAG_*` bits, read by name (as Cilium's `lb*_svc_is_*` helpers do).
impl ServiceValue {
    /// `sessionAffinity: ClientIP`.
    #[inline(always)]
    pub const fn is_affinity(&self) -> bool {
        self.flags & SVC_FLAG_AFFINITY != 0
    }

    /// Internal master whose external traffic must use the external entry
    /// (`externalTrafficPolicy: Local`).
    #[inline(always)]
    pub const fn is_external_scope(&self) -> bool {
        self.flags & SVC_FLAG_EXTERNAL_SCOPE != 0
    }

    /// A Service's cluster IP (not a NodePort, load-balancer IP or externalIP).
    #[inline(always)]
    pub const fn is_cluster_ip(&self) -> bool {
        self.flags & SVC_FLAG_CLUSTER_IP != 0
    }

    /// New flows must come from `loadBalancerSourceRanges`.
    #[inline(always)]
    pub const fn has_source_ranges(&self) -> bool {
        self.flags & SVC_FLAG_SOURCE_RANGES != 0
    }

    /// A Maglev master's table: its first slot in `LB_MAGLEV` and its size (a prime
    /// of [`maglev::TABLE_SIZES`]); its slot `s` holds the position (0-based) of the
    /// backend in slot `position + 1`. `None` without `SVC_FLAG_MAGLEV`, or with a
    /// size index past the ladder (written by no agent).
    #[inline(always)]
    pub const fn maglev(&self) -> Option<(u32, u32)> {
        if self.flags & SVC_FLAG_MAGLEV == 0 {
            return None;
        }
        let rung = ((self.flags >> SVC_MAGLEV_RUNG_SHIFT) & SVC_MAGLEV_RUNG_MASK) as usize;
        if rung >= maglev::TABLE_SIZES.len() {
            return None;
        }
        Some((self.backend_id, maglev::TABLE_SIZES[rung]))
    }
}

/// The `ServiceValue::flags` bits of a Maglev master whose table has
/// `maglev::TABLE_SIZES[rung]` slots (`SVC_FLAG_MAGLEV` and the size index); `None`
/// for a rung past the ladder.
pub const fn maglev_flags(rung: usize) -> Option<u16> {
    if rung >= maglev::TABLE_SIZES.len() {
        return None;
    }
    Some(SVC_FLAG_MAGLEV | ((rung as u16 & SVC_MAGLEV_RUNG_MASK) << SVC_MAGLEV_RUNG_SHIFT))
}

/// Value of `LB_MAGLEV`, an ARRAY holding every Maglev table of the node: four
/// consecutive slots, 8 bytes with nothing wasted (an array entry takes its value
/// size rounded up to 8). Slot `s` of the arena is `positions[s % 4]` of entry
/// `s / 4`; a table is a run of slots starting at a multiple of four, so its slot
/// `t` is arena slot `first + t`.
///
/// Entry 0 is not part of any table: its four lanes hold the seed the tables were
/// built with (lane `i` = bits `16 i .. 16 i + 16`), which the agent reads on start
/// to know whether it may keep them; no program reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MaglevSlots {
    /// Four table slots: each the position (0-based, host byte order) of a backend
    /// among the frontend's slots, in (address, port) order.
    pub positions: [u16; 4],
}
const _: () = assert!(core::mem::size_of::<MaglevSlots>() == 8);

/// Table slots per `LB_MAGLEV` entry.
pub const MAGLEV_SLOTS_PER_ENTRY: u32 = 4;
/// The first arena slot a table may start at: entry 0 is the seed header.
pub const MAGLEV_FIRST_TABLE_SLOT: u32 = MAGLEV_SLOTS_PER_ENTRY;
/// Default capacity of `LB_MAGLEV` in slots (`--maglev-table-slots`): 2^21 slots,
/// 4 MiB of kernel memory, allocated whole when the map is created. Room for 2048
/// tables of 6 to 10 backends (1024 slots each) or 8192 of 1 or 2 (252 slots).
pub const DEFAULT_MAGLEV_SLOTS: u32 = 1 << 21;

/// Value of `LB_BACKENDS`, keyed by a `u32` backend id. A backend id names one
/// endpoint *of one frontend*; ids are not shared between Services, so removing an
/// endpoint from a Service removes its id and any affinity entry that still names it
/// stops matching.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend {
    /// Pod IP address (IPv4-mapped for IPv4; always the frontend's family).
    pub address: IpAddrBe,
    /// Target port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// `BACKEND_FLAG_*` bits.
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 20);

impl Backend {
    /// The endpoint runs on this node (`BACKEND_FLAG_LOCAL`).
    #[inline(always)]
    pub const fn is_local(&self) -> bool {
        self.flags & BACKEND_FLAG_LOCAL != 0
    }
}

/// Key of `LB_SOCK_REVNAT` (LRU): which backend one socket was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatKey {
    /// `bpf_get_socket_cookie` of the client socket.
    pub cookie: u64,
    /// Backend IP address, as the socket sees it (IPv4-mapped for IPv4, also on an
    /// AF_INET6 socket).
    pub address: IpAddrBe,
    /// Backend port, network byte order.
    pub port: u16,
    /// Explicit padding.
    pub _pad: u16,
    /// Explicit padding up to the 8-byte alignment of `cookie`.
    pub _pad2: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevNatKey>() == 32);

/// Value of `LB_SOCK_REVNAT`: the frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatValue {
    /// Virtual IP address (IPv4-mapped for IPv4).
    pub address: IpAddrBe,
    /// Service port, network byte order.
    pub port: u16,
    /// Explicit padding.
    pub _pad: u16,
    /// `rev_nat_id` of the frontend at the time of the translation.
    pub rev_nat_id: u32,
}
const _: () = assert!(core::mem::size_of::<SockRevNatValue>() == 24);

/// Key of `LB_AFFINITY` (LRU). The client is identified by its network namespace
/// cookie: before `connect` a socket has no source address yet, and two pods on one
/// node are two namespaces, hence two clients.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey {
    /// The client: `bpf_get_netns_cookie` of the socket for the socket hooks, or
    /// `AFFINITY_CLIENT_IP` for the per-packet path, whose client is `client_ip`
    /// (netns cookies are small counters and never set the top bit).
    pub client: u64,
    /// The per-packet path's client: the packet's source address. Zero for sockets.
    pub client_ip: IpAddrBe,
    /// Frontend the affinity belongs to.
    pub rev_nat_id: u32,
    /// Explicit padding.
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 32);

/// `AffinityKey::client` of per-packet clients, which `client_ip` names.
pub const AFFINITY_CLIENT_IP: u64 = 1 << 63;

/// Value of `LB_AFFINITY`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityValue {
    /// `bpf_ktime_get_ns` when the client last used the backend.
    pub last_used_ns: u64,
    /// Backend id in `LB_BACKENDS`.
    pub backend_id: u32,
    /// Explicit padding.
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

/// Key of `LB_CT` (LRU): one direction of one flow, exactly as its packets carry it.
/// Each translated flow has two entries: the client's original tuple (`CT_DIR_FORWARD`)
/// and the tuple the backend's replies carry (`CT_DIR_REPLY`). Both say what to rewrite
/// the tuple to, so either direction is one lookup and one rewrite.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtKey {
    /// Source IP address (IPv4-mapped for IPv4).
    pub src_addr: IpAddrBe,
    /// Destination IP address (IPv4-mapped for IPv4).
    pub dst_addr: IpAddrBe,
    /// Source port, network byte order.
    pub src_port: u16,
    /// Destination port, network byte order.
    pub dst_port: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Explicit padding. The direction is not part of the key: a packet's tuple says
    /// which entry it belongs to, so every packet costs one lookup.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<CtKey>() == 40);

pub const CT_DIR_FORWARD: u8 = 0;
pub const CT_DIR_REPLY: u8 = 1;

/// Value of `LB_CT`: the tuple the packet leaves with, and the flow's state.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct CtValue {
    /// `bpf_ktime_get_ns` of the last packet in this direction.
    pub last_seen_ns: u64,
    /// Rewritten source address (IPv4-mapped for IPv4).
    pub nat_src_addr: IpAddrBe,
    /// Rewritten destination address (IPv4-mapped for IPv4).
    pub nat_dst_addr: IpAddrBe,
    /// Rewritten source port, network byte order.
    pub nat_src_port: u16,
    /// Rewritten destination port, network byte order.
    pub nat_dst_port: u16,
    /// Backend of the flow (for `lb conntrack` and affinity).
    pub backend_id: u32,
    /// Frontend the flow was addressed to.
    pub rev_nat_id: u32,
    /// `CT_STATE_*` bits seen so far in this direction.
    pub state: u8,
    /// `CT_DIR_FORWARD` or `CT_DIR_REPLY`.
    pub dir: u8,
    /// `CT_DSR_*` bits: the flow goes by direct server return (see the DSR section
    /// below); 0 for every other flow.
    pub dsr: u8,
    /// Explicit padding up to the 8-byte alignment of `last_seen_ns`.
    pub _pad2: u8,
}
const _: () = assert!(core::mem::size_of::<CtValue>() == 56);

/// `CtValue::state` bits; the agent's garbage collector derives timeouts from them.
pub const CT_STATE_SYN: u8 = 1 << 0;
pub const CT_STATE_ESTABLISHED: u8 = 1 << 1;
pub const CT_STATE_FIN: u8 = 1 << 2;
pub const CT_STATE_RST: u8 = 1 << 3;

/// Key of `LB_FRAG` (LRU): one datagram, as RFC 791 / RFC 8200 identify its
/// fragments, exactly as its fragments carry it (before any translation).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragKey {
    /// Source IP address (IPv4-mapped for IPv4).
    pub src_addr: IpAddrBe,
    /// Destination IP address (IPv4-mapped for IPv4).
    pub dst_addr: IpAddrBe,
    /// The identification: IPv4's 16-bit field (zero-extended) or the IPv6
    /// Fragment header's 32-bit one, network byte order as the packet carries it.
    pub id: u32,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Explicit padding; always zero so that hash lookups match.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<FragKey>() == 40);

/// Value of `LB_FRAG`: the addresses the datagram's first fragment was rewritten to,
/// which its later fragments (no L4 header, so no ports to match) get as well.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct FragValue {
    /// `bpf_ktime_get_ns` when the first fragment passed; the entry is ignored after
    /// `FRAG_TIMEOUT_NS` (the IP id may be reused by then).
    pub created_ns: u64,
    /// Rewritten source address (IPv4-mapped for IPv4).
    pub nat_src_addr: IpAddrBe,
    /// Rewritten destination address (IPv4-mapped for IPv4).
    pub nat_dst_addr: IpAddrBe,
}
const _: () = assert!(core::mem::size_of::<FragValue>() == 40);

/// Value of the per-CPU `LB_SVC_STATS` hash, keyed by a frontend's `rev_nat_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SvcStats {
    /// Connections (socket connects, UDP sockets, per-packet flows) sent to a backend.
    pub connections: u64,
    /// Connections refused or dropped for want of a usable backend.
    pub no_backend: u64,
    /// New flows dropped because their source is outside the Service's
    /// `loadBalancerSourceRanges` (`SVC_FLAG_SOURCE_RANGES`).
    pub source_range_drops: u64,
}
const _: () = assert!(core::mem::size_of::<SvcStats>() == 24);

/// Data part of an `LB_SOURCE_RANGES` key (an LPM trie: the kernel prepends a
/// `u32` prefix length, host byte order, counted in bits from the start of this
/// struct). An entry for an IPv6 source range `addr/n` of a frontend has prefix length
/// `SOURCE_RANGE_PREFIX_BASE + n`, so `rev_nat_id` always matches whole and the
/// address by its first `n` bits; an IPv4 range `a.b.c.d/n` is stored IPv4-mapped
/// with `n + 96`. A lookup uses the full 160 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SourceRangeKey {
    /// `rev_nat_id` of the frontend's internal master, host byte order (always
    /// matched whole, so its byte order does not matter to the trie).
    pub rev_nat_id: u32,
    /// Range address (a lookup: the packet's source), network byte order, so the
    /// trie's most-significant-bit-first matching is a prefix match.
    pub address: IpAddrBe,
}
const _: () = assert!(core::mem::size_of::<SourceRangeKey>() == 20);

/// Bits of `SourceRangeKey::rev_nat_id`, before the address in the prefix length.
pub const SOURCE_RANGE_PREFIX_BASE: u32 = 32;

/// Data part of an `LB_MASQ_CIDRS` key (an LPM trie; the kernel prepends a `u32`
/// prefix length, host byte order, counted in bits from the start of this struct).
/// An entry for `addr/n` of set `kind` has prefix length `MASQ_CIDR_PREFIX_BASE +
/// n` (an IPv4 `a.b.c.d/n` stored IPv4-mapped with `n + 96`), so the set always
/// matches whole; a lookup uses the full 160 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MasqCidrKey {
    /// `MASQ_CIDR_*`: which set the entry belongs to, host byte order (matched
    /// whole, so its byte order does not matter to the trie).
    pub kind: u32,
    /// The range's address (a lookup: the packet's), network byte order, so the
    /// trie's most-significant-bit-first matching is a prefix match.
    pub address: IpAddrBe,
}
const _: () = assert!(core::mem::size_of::<MasqCidrKey>() == 20);

/// `MasqCidrKey::kind`: this node's pod CIDRs; only packets from them are
/// masqueraded.
pub const MASQ_CIDR_POD_SOURCE: u32 = 1;
/// `MasqCidrKey::kind`: destinations never masqueraded (ip-masq-agent's
/// `nonMasqueradeCIDRs`, link-local, the cluster's pod CIDRs).
pub const MASQ_CIDR_EXEMPT: u32 = 2;
/// `MasqCidrKey::kind`: the cluster's pod CIDRs (`--cluster-cidr`, every Node's
/// `spec.podCIDRs`), kube-proxy's "local" sources for its cluster-IP masquerade
/// rule, whatever `--masquerade` says. Its ranges hold [`MASQ_CIDR_INSIDE`]; once
/// any is known the set also holds `::/0` with [`MASQ_CIDR_OUTSIDE`], so a lookup
/// tells "outside" (that entry) from "not known" (no entry).
pub const MASQ_CIDR_CLUSTER: u32 = 3;
/// Value of an `LB_MASQ_CIDRS` range: the address lies in it.
pub const MASQ_CIDR_INSIDE: u8 = 1;
/// Value of the cluster set's `::/0`: the address lies in none of its ranges.
pub const MASQ_CIDR_OUTSIDE: u8 = 0;
/// Bits of `MasqCidrKey::kind`, before the address in the prefix length.
pub const MASQ_CIDR_PREFIX_BASE: u32 = 32;
/// `LB_MASQ_CIDRS` entries: a few per pod CIDR and exempt range.
pub const MASQ_CIDRS_MAX: u32 = 4096;
/// Default capacity of `LB_MASQ` (`--masquerade-map-size`): entries, two per
/// masqueraded flow. Not preallocated: memory follows the flows.
pub const DEFAULT_MASQ_MAX: u32 = 131_072;

/// What the per-packet programs are told about masquerading (`--masquerade`,
/// `--masquerade-all`, `--nodeport-range`), a read-only global of the kernel object set at load time.
/// Read through its predicates.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct MasqSettings {
    /// 1: `--masquerade bpf`; 0: off (no program looks at `LB_MASQ`).
    pub enabled: u8,
    /// 1: `--masquerade-all` (kube-proxy's): every new per-packet flow to a
    /// cluster IP leaves with the node's address; 0: only as kube-proxy's
    /// cluster-IP rules say (from outside the cluster, or back to the client).
    pub masquerade_all: u8,
    /// First port of the NodePort range, host byte order: masquerading never
    /// takes a port in it (a new flow from outside to that NodePort would meet
    /// the translation).
    pub nodeport_first_host: u16,
    /// Last port of the NodePort range, host byte order.
    pub nodeport_last_host: u16,
    /// Explicit padding.
    pub _pad2: u16,
}
const _: () = assert!(core::mem::size_of::<MasqSettings>() == 8);

impl MasqSettings {
    /// `--masquerade bpf`.
    #[inline(always)]
    pub const fn is_enabled(&self) -> bool {
        self.enabled != 0
    }

    /// `--masquerade-all`.
    #[inline(always)]
    pub const fn is_masquerade_all(&self) -> bool {
        self.masquerade_all != 0
    }

    /// `port` (host byte order) lies in the NodePort range.
    #[inline(always)]
    pub const fn is_node_port(&self, port: u16) -> bool {
        port >= self.nodeport_first_host && port <= self.nodeport_last_host
    }
}

/// Entries of `LB_XDP_DEVMAP`: the node-facing devices with `lb_xdp` attached, the
/// only ones it redirects to. The key is the ifindex; the value is the kernel's
/// `struct bpf_devmap_val` with `ifindex` equal to the key and no program.
pub const XDP_DEVMAP_MAX: u32 = 1024;

/// The XDP metadata (`bpf_xdp_adjust_meta`) `lb_xdp` puts in front of a packet it
/// translated and hands to the stack (`XDP_PASS`): `lb_tc_external` on the same
/// device finds it at `skb->data_meta` and lets the packet pass without parsing or
/// looking it up again. Only XDP programs write metadata, so a packet from the wire
/// cannot carry it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct XdpMark {
    /// [`XDP_MARK_MAGIC`], native byte order (written and read on the same host).
    pub magic: u32,
}
const _: () = assert!(core::mem::size_of::<XdpMark>() == 4);

/// `XdpMark::magic`: "lb" translated this packet (the bytes `LBX1` as a
/// little-endian word); any other value is not lb's mark.
pub const XDP_MARK_MAGIC: u32 = u32::from_le_bytes(*b"LBX1");

/// Longest interface name the kernel allows, with its NUL (`IFNAMSIZ`).
pub const IFNAMSIZ: usize = 16;

/// Value of `LB_ATTACHMENTS`, keyed by ifindex (`u32`): a device the agent attached
/// a per-packet program to. No program reads it; it is the agent's record for
/// `lb status` (which links, and why) and `lb cleanup` (detach exactly these, never
/// another owner's filter), and it outlives the agent like the attachments do.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Attachment {
    /// Device name when attached, NUL-padded.
    pub name: [u8; IFNAMSIZ],
    /// `ATTACH_ROLE_*`: which program the device got.
    pub role: u8,
    /// `ATTACH_REASON_*`: why the device got it.
    pub reason: u8,
    /// `ATTACH_MODE_*`: how the program is attached.
    pub mode: u8,
    /// `ATTACH_XDP_*`: whether `lb_xdp` runs in front of `lb_tc_external` here.
    pub xdp: u8,
    /// `ATTACH_XDP_REFUSED`: the errno the kernel refused the attachment with
    /// (capped at 255); 0 otherwise.
    pub xdp_errno: u8,
    /// Explicit padding up to the 8-byte alignment of `netns`.
    pub _pad: [u8; 3],
    /// Inode of the agent's network namespace: device names mean something only
    /// there, so `lb cleanup` elsewhere must not act on them.
    pub netns: u64,
}
const _: () = assert!(core::mem::size_of::<Attachment>() == 32);

/// `Attachment::role`: node-facing device, `lb_tc_external`.
pub const ATTACH_ROLE_NODE: u8 = 1;
/// `Attachment::role`: pod-facing device, `lb_tc_internal`.
pub const ATTACH_ROLE_POD: u8 = 2;
/// `Attachment::reason`: chosen by the agent from the device's addresses.
pub const ATTACH_REASON_AUTO: u8 = 1;
/// `Attachment::reason`: named by `--iface` / `--pod-iface`.
pub const ATTACH_REASON_FLAG: u8 = 2;
/// `Attachment::mode`: a TCX bpf_link, pinned under `<pin-dir>/links/`.
pub const ATTACH_MODE_TCX: u8 = 1;
/// `Attachment::mode`: a cls_bpf filter at lb's priority and handle on clsact.
pub const ATTACH_MODE_NETLINK: u8 = 2;

/// `Attachment::xdp`: no XDP on this device (`--xdp off`, or a pod-facing one).
pub const ATTACH_XDP_NONE: u8 = 0;
/// `Attachment::xdp`: `lb_xdp` attached in the driver (native XDP).
pub const ATTACH_XDP_NATIVE: u8 = 1;
/// `Attachment::xdp`: `lb_xdp` attached in the stack (generic XDP, for testing).
pub const ATTACH_XDP_GENERIC: u8 = 2;
/// `Attachment::xdp`: the device refused `lb_xdp` (see `xdp_errno`); it keeps the
/// TC path alone.
pub const ATTACH_XDP_REFUSED: u8 = 3;

/// Most devices the agent records (a node with this many pods is far beyond
/// Kubernetes' 110-pods-per-node default).
pub const ATTACHMENTS_MAX: u32 = 16_384;

// ---- Direct server return (DSR) ------------------------------------------------
//
// In DSR mode the node a client's flow enters (the entry node) sends the flow to a
// backend on another node keeping the client's address, and tells the backend's
// node which frontend the client addressed; that node rewrites the pod's replies to
// come from the frontend and sends them straight to the client. What the programs
// are told (the mode, the dispatch) is a load-time constant, [`DsrConfig`]; what a
// flow became is in its conntrack entries (`CtValue::dsr`).

/// `DsrConfig::mode`: every remote backend is reached with SNAT (the default).
pub const LB_MODE_SNAT: u8 = 0;
/// `DsrConfig::mode`: remote backends of external frontends (NodePort,
/// LoadBalancer IPs, externalIPs) are reached by DSR, TCP and UDP.
pub const LB_MODE_DSR: u8 = 1;
/// `DsrConfig::mode`: DSR for TCP, SNAT for UDP.
pub const LB_MODE_HYBRID: u8 = 2;

/// `DsrConfig::dispatch`: the frontend travels in an IPv4 option (8 bytes) or an
/// IPv6 Destination Options header (24 bytes) of the flow's first packet (a TCP
/// SYN) and of every UDP datagram.
pub const DSR_DISPATCH_OPT: u8 = 0;
/// `DsrConfig::dispatch`: every packet of the flow travels inside an outer IPv4 /
/// IPv6 header (20 / 40 bytes) from the entry node to the backend's node; the
/// packets that carry the frontend carry it as with `DSR_DISPATCH_OPT`, inside.
pub const DSR_DISPATCH_IPIP: u8 = 1;

/// How the per-packet programs reach remote backends: set by the agent at load time
/// (`--lb-mode`, `--dsr-dispatch`) as a read-only global of the kernel object, as
/// `--node-ip` is. Read through its predicates.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct DsrConfig {
    /// `LB_MODE_*`.
    pub mode: u8,
    /// `DSR_DISPATCH_*`.
    pub dispatch: u8,
    /// Explicit padding.
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<DsrConfig>() == 4);

impl DsrConfig {
    /// New flows of protocol `proto` to remote backends of external frontends go
    /// by DSR.
    #[inline(always)]
    pub const fn dsr_for(&self, proto: u8) -> bool {
        match self.mode {
            LB_MODE_DSR => proto == IPPROTO_TCP || proto == IPPROTO_UDP,
            LB_MODE_HYBRID => proto == IPPROTO_TCP,
            _ => false,
        }
    }

    /// DSR packets travel inside an outer IP header (`DSR_DISPATCH_IPIP`).
    #[inline(always)]
    pub const fn is_ipip(&self) -> bool {
        self.dispatch == DSR_DISPATCH_IPIP
    }
}

/// `CtValue::dsr`: the flow goes by DSR. On the entry node it marks the forward
/// entry (its packets leave with the client's address, and with the frontend in
/// an option when they are a TCP SYN or a UDP datagram); on the backend's node the
/// reply entry it created when the flow arrived (the pod's replies leave from the
/// frontend, straight to the client).
pub const CT_DSR: u8 = 1 << 0;
/// `CtValue::dsr`, with `CT_DSR`: the flow's packets travel from the entry node
/// inside an outer IP header (`DSR_DISPATCH_IPIP`). The entry node adds it to every
/// forward packet; the backend's node removes it, and lowers the MSS of the pod's
/// SYN-ACK by its size, as it bounds the segments the client sends.
pub const CT_DSR_IPIP: u8 = 1 << 1;

impl CtValue {
    /// The flow goes by DSR (`CT_DSR`).
    #[inline(always)]
    pub const fn is_dsr(&self) -> bool {
        self.dsr & CT_DSR != 0
    }

    /// Its packets travel inside an outer IP header (`CT_DSR_IPIP`).
    #[inline(always)]
    pub const fn is_dsr_ipip(&self) -> bool {
        self.dsr & (CT_DSR | CT_DSR_IPIP) == CT_DSR | CT_DSR_IPIP
    }
}

/// Indexes of the per-CPU `LB_STATS` array (u64 counters). Plain constants rather
/// than an enum: the index crosses the kernel boundary as a raw `u32`.
pub mod stat {
    /// connect/sendmsg to a frontend was rewritten to a backend.
    pub const TRANSLATED: u32 = 0;
    /// connect/sendmsg refused because the Service has no usable endpoint.
    pub const NO_BACKEND: u32 = 1;
    /// A slot or backend id the master promised was missing (agent mid-update).
    pub const SLOT_MISS: u32 = 2;
    /// `LB_SOCK_REVNAT` could not take an entry; replies will show the pod address.
    pub const REVNAT_UPDATE_FAILED: u32 = 3;
    /// `LB_AFFINITY` could not take an entry; affinity not remembered.
    pub const AFFINITY_UPDATE_FAILED: u32 = 4;
    /// recvmsg/getpeername answer rewritten back to the frontend.
    pub const REVERSE_TRANSLATED: u32 = 5;
    /// TC: first packet of a flow to a frontend translated, conntrack entries created.
    pub const TC_NEW_FLOW: u32 = 6;
    /// TC: packet of a known flow rewritten (either direction).
    pub const TC_CT_HIT: u32 = 7;
    /// TC: packet to a frontend without usable backend, answered with a reject.
    pub const TC_NO_BACKEND: u32 = 8;
    /// A conntrack entry could not be created (TC or XDP); the packet was dropped.
    pub const TC_CT_FULL: u32 = 9;
    /// No free source port for SNAT to a remote backend (TC or XDP); dropped.
    pub const TC_SNAT_EXHAUSTED: u32 = 10;
    /// TC: headers could not be parsed or rewritten (truncated, bad lengths); passed on.
    pub const TC_MALFORMED: u32 = 11;
    /// TC: a later IP fragment (no L4 header) whose first fragment was not
    /// translated here (another flow, or it has not arrived yet); passed on
    /// untranslated. Later fragments of translated datagrams count as `TC_CT_HIT`.
    pub const TC_FRAGMENT: u32 = 12;
    /// New flow to a LoadBalancer IP from outside its `loadBalancerSourceRanges`;
    /// dropped (by TC, or by XDP, which also counts `XDP_DROP_SOURCE_RANGE`).
    pub const TC_SOURCE_RANGE_DROP: u32 = 13;
    /// TC: an IPv6 packet whose extension headers were not followed to a TCP/UDP
    /// header (ESP, an unknown header, or more than the program walks); passed on
    /// untouched.
    pub const TC_IPV6_EXT_UNHANDLED: u32 = 14;
    /// TC: a packet `lb_xdp` already translated (its `XdpMark` in the metadata),
    /// passed on without a second look.
    pub const TC_XDP_MARKED: u32 = 15;
    /// XDP: first packet of a flow translated, conntrack entries created (as TC's
    /// `TC_NEW_FLOW`; the packet also counts under its verdict below).
    pub const XDP_NEW_FLOW: u32 = 16;
    /// XDP: translated and sent back out of the device it came in on (`XDP_TX`).
    pub const XDP_TX: u32 = 17;
    /// XDP: translated and redirected to another device of `LB_XDP_DEVMAP`.
    pub const XDP_REDIRECT: u32 = 18;
    /// XDP: translated for a destination the stack delivers (a local backend; a
    /// remote one without SNAT), marked (`XdpMark`) and passed (`XDP_PASS`).
    pub const XDP_PASS_LOCAL: u32 = 19;
    /// XDP, passed untouched to TC: an IP fragment (first or later).
    pub const XDP_PASS_FRAGMENT: u32 = 20;
    /// XDP, passed untouched to TC: an IPv4 header with options (IHL > 5).
    pub const XDP_PASS_IP_OPTIONS: u32 = 21;
    /// XDP, passed untouched to TC: IPv6 with extension headers.
    pub const XDP_PASS_IPV6_EXT: u32 = 22;
    /// XDP, passed untouched to TC: an ICMP or ICMPv6 error (TC translates those
    /// of known flows).
    pub const XDP_PASS_ICMP_ERROR: u32 = 23;
    /// XDP, passed untouched to TC: headers that do not add up, or lie past the
    /// frame's first buffer (TC counts the malformed ones as `TC_MALFORMED`).
    pub const XDP_PASS_MALFORMED: u32 = 24;
    /// XDP, passed untouched to TC: a new flow to a frontend without a usable
    /// backend (TC answers it with a RST or an ICMP unreachable).
    pub const XDP_PASS_NO_BACKEND: u32 = 25;
    /// XDP, passed untouched to TC: TTL (hop limit) would expire here.
    pub const XDP_PASS_TTL: u32 = 26;
    /// XDP, passed untouched to TC: the next hop has no neighbour entry yet
    /// (`BPF_FIB_LKUP_RET_NO_NEIGH`); TC resolves it (`bpf_redirect_neigh`).
    pub const XDP_PASS_NO_NEIGH: u32 = 27;
    /// XDP, passed untouched to TC: any other FIB answer than success (no route,
    /// forwarding disabled, MTU exceeded, ...).
    pub const XDP_PASS_FIB: u32 = 28;
    /// XDP, passed untouched to TC: the egress device is another one and not in
    /// `LB_XDP_DEVMAP`.
    pub const XDP_PASS_NO_DEVMAP: u32 = 29;
    /// XDP: new flow from outside `loadBalancerSourceRanges`; dropped (also
    /// counted as `TC_SOURCE_RANGE_DROP` and per frontend).
    pub const XDP_DROP_SOURCE_RANGE: u32 = 30;
    /// XDP: no conntrack entry or SNAT port could be had (`TC_CT_FULL`,
    /// `TC_SNAT_EXHAUSTED` say which); dropped, as TC drops it.
    pub const XDP_DROP_CONNTRACK: u32 = 31;
    /// XDP: a packet being rewritten could not be finished or sent (a failed
    /// write, or its egress device left `LB_XDP_DEVMAP` meanwhile); dropped.
    pub const XDP_DROP_FAILED: u32 = 32;
    /// TC or XDP: a new flow to a Maglev frontend whose table slot could not be
    /// read or named no slot of the frontend (a table mid-rewrite, a damaged
    /// arena); it got a random backend instead.
    pub const MAGLEV_MISS: u32 = 33;
    /// DSR, entry node: a packet of a DSR flow sent to the backend's node with the
    /// DSR option (a TCP SYN, a UDP datagram) or inside an outer header (`ipip`).
    pub const DSR_ENCAPSULATED: u32 = 34;
    /// DSR, backend's node: a packet for a local pod whose DSR option was removed
    /// or whose outer header was (`ipip`).
    pub const DSR_DECAPSULATED: u32 = 35;
    /// DSR, backend's node: a pod's SYN-ACK whose MSS was lowered by the outer
    /// header its flow's packets carry from the entry node (`ipip`).
    pub const DSR_MSS_CLAMPED: u32 = 36;
    /// DSR, entry node: a new UDP flow whose first datagram would not fit the
    /// egress MTU with the DSR overhead; it went by SNAT, as in `snat` mode.
    pub const DSR_UDP_TOO_BIG_SNAT: u32 = 37;
    /// DSR, backend's node: a pod's reply rewritten to come from the frontend and
    /// sent straight to the client.
    pub const DSR_REPLY_REWRITTEN: u32 = 38;
    /// DSR, entry node: a new flow DSR would have carried went by SNAT for another
    /// reason: IPv4 options or IPv6 extension headers already in the packet, a
    /// fragment, no route to the backend, or (`ipip`) a backend not behind a
    /// gateway that names its node.
    pub const DSR_SNAT_FALLBACK: u32 = 39;
    /// DSR, entry node: a later packet of a DSR flow that could not take the
    /// overhead (a fragment, or a UDP datagram that would no longer fit the MTU)
    /// and went to the backend translated but without it.
    pub const DSR_PLAIN: u32 = 40;
    /// XDP, passed untouched to TC: a packet matching the reply entry of a DSR
    /// flow on the backend's node (TC rewrites it, counts it, clamps its MSS).
    pub const XDP_PASS_DSR_REPLY: u32 = 41;
    /// Masquerade, egress: a new flow of a local pod to a destination outside the
    /// exempt set got the node's address and a port (both entries written).
    pub const MASQ_NEW_FLOW: u32 = 42;
    /// Masquerade, egress: a packet of a masqueraded flow left with the node's
    /// address (its first packet included).
    pub const MASQ_EGRESS: u32 = 43;
    /// Masquerade, ingress: a reply to a masqueraded flow was given back its pod's
    /// address and port.
    pub const MASQ_INGRESS: u32 = 44;
    /// Masquerade, ingress: an ICMP or ICMPv6 error about a masqueraded flow was
    /// rewritten for its pod (PMTU discovery through the masquerade).
    pub const MASQ_ICMP_ERROR: u32 = 45;
    /// Masquerade, egress: a new flow of a local pod to an exempt destination
    /// (another pod, a `nonMasqueradeCIDRs` range), passed with the pod's address.
    pub const MASQ_EXEMPT: u32 = 46;
    /// Masquerade, egress: no port was free for a new flow towards its
    /// destination (bounded tries); the packet was dropped. Never a shared port.
    pub const MASQ_PORT_EXHAUSTED: u32 = 47;
    /// Masquerade, egress: `LB_MASQ` refused the entries of a new flow (full,
    /// see `--masquerade-map-size`); the packet was dropped.
    pub const MASQ_MAP_FULL: u32 = 48;
    /// Masquerade, egress: no node address for the flow (no route's source, no
    /// `--node-ip` of the family); passed untranslated.
    pub const MASQ_NO_SOURCE: u32 = 49;
    /// Number of counters.
    pub const COUNT: u32 = 50;
    /// Human names, indexed like the constants.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "no_backend",
        "slot_miss",
        "revnat_update_failed",
        "affinity_update_failed",
        "reverse_translated",
        "tc_new_flow",
        "tc_ct_hit",
        "tc_no_backend",
        "tc_ct_full",
        "tc_snat_exhausted",
        "tc_malformed",
        "tc_fragment",
        "tc_source_range_drop",
        "tc_ipv6_ext_unhandled",
        "tc_xdp_marked",
        "xdp_new_flow",
        "xdp_tx",
        "xdp_redirect",
        "xdp_pass_local",
        "xdp_pass_fragment",
        "xdp_pass_ip_options",
        "xdp_pass_ipv6_ext",
        "xdp_pass_icmp_error",
        "xdp_pass_malformed",
        "xdp_pass_no_backend",
        "xdp_pass_ttl",
        "xdp_pass_no_neigh",
        "xdp_pass_fib",
        "xdp_pass_no_devmap",
        "xdp_drop_source_range",
        "xdp_drop_conntrack",
        "xdp_drop_failed",
        "maglev_miss",
        "dsr_encapsulated",
        "dsr_decapsulated",
        "dsr_mss_clamped",
        "dsr_udp_too_big_snat",
        "dsr_reply_rewritten",
        "dsr_snat_fallback",
        "dsr_plain",
        "xdp_pass_dsr_reply",
        "masq_new_flow",
        "masq_egress",
        "masq_ingress",
        "masq_icmp_error",
        "masq_exempt",
        "masq_port_exhausted",
        "masq_map_full",
        "masq_no_source",
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)] with explicit padding and only integer fields.
    unsafe impl aya::Pod for IpAddrBe {}
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for SockRevNatKey {}
    unsafe impl aya::Pod for SockRevNatValue {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtValue {}
    unsafe impl aya::Pod for SvcStats {}
    unsafe impl aya::Pod for Attachment {}
    unsafe impl aya::Pod for SourceRangeKey {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for FragValue {}
    unsafe impl aya::Pod for XdpMark {}
    unsafe impl aya::Pod for MaglevSlots {}
    unsafe impl aya::Pod for DsrConfig {}
    unsafe impl aya::Pod for MasqCidrKey {}
    unsafe impl aya::Pod for MasqSettings {}
    unsafe impl aya::Pod for PolicyEndpoint {}
    unsafe impl aya::Pod for PolicyCidrKey {}
    unsafe impl aya::Pod for PolicyKey {}
    unsafe impl aya::Pod for PolicyAllow {}
    unsafe impl aya::Pod for PolicyCtKey {}
    unsafe impl aya::Pod for PolicyCtValue {}
    unsafe impl aya::Pod for PolicyCounters {}
}
