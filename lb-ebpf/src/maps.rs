//! The maps, BTF-typed so `bpftool map dump` prints field names. Sizes here are
//! defaults; the agent sets the real `max_entries` at load time.

use aya_ebpf::{
    btf_maps::{Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap},
    macros::btf_map,
};
use lb_common::{
    policy::{
        DEFAULT_POLICY_CIDRS_MAX, DEFAULT_POLICY_CT_MAX, DEFAULT_POLICY_ENDPOINTS_MAX,
        DEFAULT_POLICY_IDENTITY_MAX, DEFAULT_POLICY_MAX, POLICY_DROPS_MAX,
    },
    IpAddrBe, PolicyAllow, PolicyCidrKey, PolicyCounters, PolicyCtKey, PolicyCtValue,
    PolicyEndpoint, PolicyKey,
};
use lb_common::{
    AffinityKey, AffinityValue, Attachment, Backend, CtKey, CtValue, FragKey, FragValue,
    MaglevSlots, MasqCidrKey, QuarantineKey, QuarantineValue, ServiceKey, ServiceValue,
    SockRevNatKey, SockRevNatValue, SourceRangeKey, SvcStats, DEFAULT_AFFINITY_MAX,
    DEFAULT_BACKENDS_MAX, DEFAULT_CT_MAX, DEFAULT_FRAG_MAX, DEFAULT_MAGLEV_SLOTS, DEFAULT_MASQ_MAX,
    DEFAULT_QUARANTINE_MAX, DEFAULT_SERVICES_MAX, DEFAULT_SOCK_REVNAT_MAX,
    DEFAULT_SOURCE_RANGES_MAX, MAGLEV_SLOTS_PER_ENTRY, MASQ_CIDRS_MAX, XDP_DEVMAP_MAX,
};

/// Not preallocated: sized for 100k frontends x 10 endpoints, memory follows the
/// entries actually written (the agent is the only writer, so allocation happens
/// outside the packet path; lookups cost the same).
#[btf_map]
pub static LB_SERVICES: HashMap<
    ServiceKey,
    ServiceValue,
    { DEFAULT_SERVICES_MAX as usize },
    { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

#[btf_map]
pub static LB_BACKENDS: HashMap<
    u32,
    Backend,
    { DEFAULT_BACKENDS_MAX as usize },
    { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// LRU: an entry per (socket, backend) must never fail to insert because old
/// sockets filled the map; the oldest are the ones to forget.
#[btf_map]
pub static LB_SOCK_REVNAT: LruHashMap<
    SockRevNatKey,
    SockRevNatValue,
    { DEFAULT_SOCK_REVNAT_MAX as usize },
> = LruHashMap::new();

#[btf_map]
pub static LB_AFFINITY: LruHashMap<AffinityKey, AffinityValue, { DEFAULT_AFFINITY_MAX as usize }> =
    LruHashMap::new();

#[btf_map]
pub static LB_STATS: PerCpuArray<u64, { lb_common::stat::COUNT as usize }> = PerCpuArray::new();

/// LRU: under pressure the oldest flows go, never the packet of a new one.
#[btf_map]
pub static LB_CT: LruHashMap<CtKey, CtValue, { DEFAULT_CT_MAX as usize }> = LruHashMap::new();

/// Per-service counters. Not preallocated: memory follows the Services that saw
/// traffic times the CPUs, not the map size times the CPUs.
#[btf_map]
pub static LB_SVC_STATS: PerCpuHashMap<
    u32,
    SvcStats,
    { DEFAULT_SERVICES_MAX as usize },
    { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// The agent's record of the devices it attached to (see `lb_common::Attachment`);
/// no program reads it.
#[btf_map]
pub static LB_ATTACHMENTS: HashMap<u32, Attachment, { lb_common::ATTACHMENTS_MAX as usize }> =
    HashMap::new();

/// `loadBalancerSourceRanges` of the frontends flagged `SVC_FLAG_SOURCE_RANGES` (see
/// `lb_common::SourceRangeKey`); the value is unused (1).
#[btf_map]
pub static LB_SOURCE_RANGES: LpmTrie<SourceRangeKey, u8, { DEFAULT_SOURCE_RANGES_MAX as usize }> =
    LpmTrie::new();

/// The translation of fragmented datagrams, for their later fragments (see
/// `frag.rs`). LRU: a datagram whose fragments never all came is forgotten first.
#[btf_map]
pub static LB_FRAG: LruHashMap<FragKey, FragValue, { DEFAULT_FRAG_MAX as usize }> =
    LruHashMap::new();

/// The node-facing devices that run `lb_xdp`, keyed by ifindex (see
/// `lb_common::XDP_DEVMAP_MAX`): the agent fills it, and `lb_xdp` redirects only to
/// a device found here (another device may lack the driver support to take an
/// XDP frame, or its peer the program a veth needs to deliver one).
#[btf_map]
pub static LB_XDP_DEVMAP: DevMapHash<{ XDP_DEVMAP_MAX as usize }> = DevMapHash::new();

/// Every Maglev table of the node, four slots an entry (see `lb_common::MaglevSlots`);
/// a Maglev master names its table's first slot and size. An array: one lookup by
/// index, no hashing, and exactly 8 bytes a 4-slot entry; its size is fixed when it
/// is created (`--maglev-table-slots`), so the agent allocates tables inside it.
#[btf_map]
pub static LB_MAGLEV: Array<
    MaglevSlots,
    { (DEFAULT_MAGLEV_SLOTS / MAGLEV_SLOTS_PER_ENTRY) as usize },
> = Array::new();

/// Egress masquerading's translations, both directions of each flow (see
/// `masq.rs`), in conntrack's types. A plain hash, not LRU: an evicted half of a
/// flow would free its port for another pod while the other half still names it
/// (a shared mapping); a full map refuses new flows instead (counted), and the
/// agent's collector expires entries with their flows. Not preallocated: memory
/// follows the flows.
#[btf_map]
pub static LB_MASQ: HashMap<
    CtKey,
    CtValue,
    { DEFAULT_MASQ_MAX as usize },
    { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Egress masquerading's address sets (see `lb_common::MasqCidrKey`): this node's
/// pod CIDRs and the exempt destinations; the value is unused (1).
#[btf_map]
pub static LB_MASQ_CIDRS: LpmTrie<MasqCidrKey, u8, { MASQ_CIDRS_MAX as usize }> = LpmTrie::new();

/// Passive health (see `quarantine.rs`): backends of a frontend that refused a new
/// connection, and until when new connections skip them. LRU: entries are written
/// from the packet path (a refusal), and under pressure the backend that refused
/// longest ago is the one to forget.
#[btf_map]
pub static LB_QUARANTINE: LruHashMap<
    QuarantineKey,
    QuarantineValue,
    { DEFAULT_QUARANTINE_MAX as usize },
> = LruHashMap::new();

/// NetworkPolicy (see `policy.rs` and `lb_common::policy`): local pods' endpoint
/// ids and enforced directions, by address.
#[btf_map]
pub static LB_POLICY_ENDPOINTS: HashMap<
    IpAddrBe,
    PolicyEndpoint,
    { DEFAULT_POLICY_ENDPOINTS_MAX as usize },
> = HashMap::new();

/// NetworkPolicy: every pod's (and this node's) address -> identity.
#[btf_map]
pub static LB_POLICY_IDENTITY: HashMap<IpAddrBe, u32, { DEFAULT_POLICY_IDENTITY_MAX as usize }> =
    HashMap::new();

/// NetworkPolicy: the ipBlocks' partition of the address space into CIDR classes.
#[btf_map]
pub static LB_POLICY_CIDRS: LpmTrie<PolicyCidrKey, u32, { DEFAULT_POLICY_CIDRS_MAX as usize }> =
    LpmTrie::new();

/// NetworkPolicy: the allows, by (endpoint, peer, direction, protocol, port prefix).
#[btf_map]
pub static LB_POLICY: LpmTrie<PolicyKey, PolicyAllow, { DEFAULT_POLICY_MAX as usize }> =
    LpmTrie::new();

/// NetworkPolicy: the flows an allow (or an unenforced direction) admitted, as
/// the pod sees them. LRU: a full table forgets the oldest flow, whose next
/// packet is judged again, rather than refusing a new one.
#[btf_map]
pub static LB_POLICY_CT: LruHashMap<
    PolicyCtKey,
    PolicyCtValue,
    { DEFAULT_POLICY_CT_MAX as usize },
> = LruHashMap::new();

/// NetworkPolicy: drops per local pod (indexed by endpoint id), per CPU.
#[btf_map]
pub static LB_POLICY_DROPS: PerCpuArray<PolicyCounters, { POLICY_DROPS_MAX as usize }> =
    PerCpuArray::new();
