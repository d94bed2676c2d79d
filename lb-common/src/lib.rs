//! Map keys and values shared by the kernel programs (`lb-ebpf`) and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding so that the layout is the same on
//! both sides and in the BTF that `bpftool map dump` uses to print field names.
//! Addresses and ports are kept in network byte order, as `struct bpf_sock_addr` hands
//! them to the socket hooks, so the fast path never swaps bytes.
//!
//! The service table follows Cilium's slot layout: for one frontend (VIP, port,
//! protocol) slot 0 is the *master* entry that holds the number of backends, and slots
//! `1..=count` name one backend each. The agent writes the backends and slots before the
//! master that counts them, so a reader never sees a count larger than the slots present.
#![no_std]

/// Bumped whenever a map's key or value layout changes. Maps are pinned under
/// `<pin-dir>/v<PIN_LAYOUT_VERSION>/` so an agent never reuses a map with another layout.
pub const PIN_LAYOUT_VERSION: u32 = 1;

/// Map names, as the kernel object defines them and as they are pinned.
pub mod map_names {
    pub const SERVICES: &str = "LB_SERVICES";
    pub const BACKENDS: &str = "LB_BACKENDS";
    pub const SOCK_REVNAT: &str = "LB_SOCK_REVNAT";
    pub const AFFINITY: &str = "LB_AFFINITY";
    pub const STATS: &str = "LB_STATS";
    /// Every map the agent pins, in the order `lb cleanup` removes them.
    pub const ALL: [&str; 5] = [SERVICES, BACKENDS, SOCK_REVNAT, AFFINITY, STATS];
}

/// Program names in the kernel object (the Rust function names).
pub mod program_names {
    pub const CONNECT4: &str = "lb_connect4";
    pub const SENDMSG4: &str = "lb_sendmsg4";
    pub const RECVMSG4: &str = "lb_recvmsg4";
    pub const GETPEERNAME4: &str = "lb_getpeername4";
    pub const ALL: [&str; 4] = [CONNECT4, SENDMSG4, RECVMSG4, GETPEERNAME4];
}

/// IANA protocol numbers as `bpf_sock_addr.protocol` reports them.
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// `ServiceValue::flags`: the Service has `sessionAffinity: ClientIP`.
pub const SVC_FLAG_AFFINITY: u16 = 1 << 0;

/// Default capacities; the agent may size maps differently at load time.
pub const DEFAULT_SERVICES_MAX: u32 = 65_536;
pub const DEFAULT_BACKENDS_MAX: u32 = 65_536;
pub const DEFAULT_SOCK_REVNAT_MAX: u32 = 262_144;
pub const DEFAULT_AFFINITY_MAX: u32 = 65_536;

/// Key of `LB_SERVICES`: one frontend and one of its slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceKey {
    /// Virtual IPv4 address, network byte order.
    pub address: u32,
    /// Service port, network byte order.
    pub port: u16,
    /// 0 for the master entry, `1..=count` for backend slots (host byte order).
    pub backend_slot: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Explicit padding; always zero so that hash lookups match.
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 12);

/// Value of `LB_SERVICES`. Master entries use `count`, `rev_nat_id`, `flags` and
/// `affinity_timeout_sec`; slot entries use `backend_id` (and repeat `rev_nat_id`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct ServiceValue {
    /// Slot entries: key of the backend in `LB_BACKENDS`. Master: 0.
    pub backend_id: u32,
    /// Master: number of backend slots; 0 means "no usable endpoints", which the
    /// hooks answer with ECONNREFUSED like kube-proxy's REJECT rule.
    pub count: u16,
    /// Non-zero id of this frontend; keys affinity entries.
    pub rev_nat_id: u16,
    /// `SVC_FLAG_*` bits.
    pub flags: u16,
    /// Explicit padding.
    pub _pad: u16,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds` when `SVC_FLAG_AFFINITY` is set.
    pub affinity_timeout_sec: u32,
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 16);

/// Value of `LB_BACKENDS`, keyed by a `u32` backend id. A backend id names one
/// endpoint *of one frontend*; ids are not shared between Services, so removing an
/// endpoint from a Service removes its id and any affinity entry that still names it
/// stops matching.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct Backend {
    /// Pod IPv4 address, network byte order.
    pub address: u32,
    /// Target port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP` or `IPPROTO_UDP`.
    pub proto: u8,
    /// Reserved for backend state bits; zero today.
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 8);

/// Key of `LB_SOCK_REVNAT` (LRU): which backend one socket was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatKey {
    /// `bpf_get_socket_cookie` of the client socket.
    pub cookie: u64,
    /// Backend IPv4 address, network byte order.
    pub address: u32,
    /// Backend port, network byte order.
    pub port: u16,
    /// Explicit padding.
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<SockRevNatKey>() == 16);

/// Value of `LB_SOCK_REVNAT`: the frontend the socket asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct SockRevNatValue {
    /// Virtual IPv4 address, network byte order.
    pub address: u32,
    /// Service port, network byte order.
    pub port: u16,
    /// `rev_nat_id` of the frontend at the time of the translation.
    pub rev_nat_id: u16,
}
const _: () = assert!(core::mem::size_of::<SockRevNatValue>() == 8);

/// Key of `LB_AFFINITY` (LRU). The client is identified by its network namespace
/// cookie: before `connect` a socket has no source address yet, and two pods on one
/// node are two namespaces, hence two clients.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct AffinityKey {
    /// `bpf_get_netns_cookie` of the client socket.
    pub netns_cookie: u64,
    /// Frontend the affinity belongs to.
    pub rev_nat_id: u16,
    /// Explicit padding.
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 16);

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
    /// Number of counters.
    pub const COUNT: u32 = 6;
    /// Human names, indexed like the constants.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "no_backend",
        "slot_miss",
        "revnat_update_failed",
        "affinity_update_failed",
        "reverse_translated",
    ];
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are #[repr(C)] with explicit padding and only integer fields.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for SockRevNatKey {}
    unsafe impl aya::Pod for SockRevNatValue {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
}
