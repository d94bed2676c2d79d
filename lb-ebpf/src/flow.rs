//! The flow logic both per-packet programs share: which frontend and backend a new
//! flow gets, and the conntrack entries that carry it. TC and XDP call the same
//! functions on the same maps, so a flow one of them created is continued by the
//! other (after XDP is attached or detached) with entries neither can tell apart.
//!
//! A new flow goes through two steps, so that XDP can decide whether it will send
//! the packet itself before anything is written: [`choose`] reads (frontend,
//! source ranges, backend), [`commit`] writes (the reply entry that claims the
//! SNAT port, then the forward entry). What a program does with the packet between
//! and after them is its own.

use aya_ebpf::helpers::generated::bpf_get_prandom_u32;
use lb_common::{
    stat, Backend, CtValue, IpAddrBe, ServiceKey, ServiceValue, AFFINITY_CLIENT_IP, CT_DIR_FORWARD,
    CT_DIR_REPLY, SCOPE_EXTERNAL, SCOPE_INTERNAL,
};

use crate::{
    access::Packet, ct, fib, maglev, masq, nat::Tuple, packet::Flow, select, source_ranges, stats,
};

/// Source ports for SNAT when the client's own port is taken on the backend side.
const SNAT_PORT_MIN: u32 = 32_768;
const SNAT_PORT_SPAN: u32 = 28_232;
const SNAT_RETRIES: u32 = 8;

/// This node's address for SNAT towards remote backends when `--node-ip` names
/// one; set by the agent at load time. 0: the address the node's routing picks
/// towards the backend (see [`snat_source`]).
#[unsafe(no_mangle)]
static LB_NODE_IPV4: u32 = 0;

/// `LB_NODE_IPV4`'s IPv6 twin (`--node-ip` of that family); all zero: unset.
#[unsafe(no_mangle)]
static LB_NODE_IPV6: IpAddrBe = IpAddrBe { words: [0; 4] };

/// `--node-ip` of the flow's family, when given.
#[inline(always)]
pub fn node_ip(v6: bool) -> Option<IpAddrBe> {
    if v6 {
        // SAFETY: a read-only global the loader patches; volatile so the compiler
        // does not fold the zero it sees at build time.
        let ip = unsafe { core::ptr::read_volatile(&LB_NODE_IPV6) };
        return (ip != IpAddrBe::default()).then_some(ip);
    }
    // SAFETY: as above.
    let ip = unsafe { core::ptr::read_volatile(&LB_NODE_IPV4) };
    (ip != 0).then_some(IpAddrBe::from_v4(ip))
}

/// What [`choose`] picked for a new flow; nothing is written yet.
#[derive(Clone, Copy)]
pub struct Chosen {
    /// The frontend's master entry, its scope resolved.
    pub master: ServiceValue,
    pub backend_id: u32,
    pub backend: Backend,
}

/// Why a new flow gets no backend from [`choose`].
#[derive(Clone, Copy)]
pub enum Refusal {
    /// Not addressed to a frontend (of this scope): not ours.
    NotFrontend,
    /// The source is outside the frontend's `loadBalancerSourceRanges`: drop.
    /// Already counted (globally and for the frontend).
    SourceRange,
    /// The frontend has no usable endpoint (`count == 0`). `external`: under the
    /// external scope (`externalTrafficPolicy: Local`), which drops instead of
    /// rejecting. Not counted: the program that answers counts.
    NoEndpoint { rev_nat_id: u32, external: bool },
    /// The master promised slots that stayed missing (`SLOT_MISS` counted).
    SlotMiss,
}

/// The frontend a new flow is addressed to, its scope resolved, and a backend for
/// it: the client's under ClientIP affinity (remembered), else the one the
/// frontend's Maglev table gives the flow, else a random one.
#[inline(always)]
pub fn choose(flow: &Flow, scope: u8) -> Result<Chosen, Refusal> {
    let mut key = ServiceKey {
        address: flow.daddr,
        port: flow.dport,
        backend_slot: 0,
        proto: flow.proto,
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    };
    let Some(mut master) = select::frontend(&key) else {
        return Err(Refusal::NotFrontend);
    };
    // Before the scope switch: the ranges hang off the internal master, and apply to
    // every client of a LoadBalancer IP, from outside or from pods, as in kube-proxy.
    if !source_ranges::admits(&master, flow.saddr) {
        stats::bump(stat::TC_SOURCE_RANGE_DROP);
        stats::source_range_drop(master.rev_nat_id);
        return Err(Refusal::SourceRange);
    }
    if scope == SCOPE_EXTERNAL && master.is_external_scope() {
        key.scope = SCOPE_EXTERNAL;
        let Some(external) = select::frontend(&key) else {
            return Err(Refusal::NotFrontend);
        };
        master = external;
    }
    if master.count == 0 {
        return Err(Refusal::NoEndpoint {
            rev_nat_id: master.rev_nat_id,
            external: key.scope == SCOPE_EXTERNAL,
        });
    }
    let client = || (AFFINITY_CLIENT_IP, flow.saddr);
    let choice = select::Choice {
        // SAFETY: a plain helper without arguments.
        entropy: unsafe { bpf_get_prandom_u32() },
        // Hashed only for a Maglev frontend: a random one has no use for it.
        flow_hash: master
            .maglev()
            .map(|_| maglev::flow_hash(&flow.saddr, flow.sport, flow.dport, flow.proto)),
    };
    let Some((backend_id, backend)) = select::backend(&key, &master, client, choice) else {
        return Err(Refusal::SlotMiss);
    };
    Ok(Chosen {
        master,
        backend_id,
        backend,
    })
}

/// The source of a new flow that leaves with the node's address: `--node-ip` when
/// given, else whatever address the node's routing would use to reach the backend,
/// so no address has to be configured. `None` keeps the client's address: when
/// [`wants_snat`] says so, and when no source is known (a kernel before 6.7
/// without `--node-ip`, or no route to the backend).
#[inline(always)]
pub fn snat_source<P: Packet>(
    ctx: &P,
    flow: &Flow,
    chosen: &Chosen,
    scope: u8,
) -> Option<IpAddrBe> {
    if !wants_snat(flow, chosen, scope) {
        return None;
    }
    let backend = &chosen.backend.address;
    node_ip(flow.v6).or_else(|| fib::source_towards(ctx, &flow.saddr, backend, flow.v6))
}

/// kube-proxy's masquerade rules for a new per-packet flow.
/// - A NodePort, load-balancer IP or externalIP: SNAT towards a remote backend,
///   which would otherwise answer the client directly; a local backend's replies
///   pass through this node anyway, so it sees the client (what
///   `externalTrafficPolicy: Local` promises; kube-proxy masquerades there too).
/// - A cluster IP: SNAT with `--masquerade-all`; from a source outside the
///   cluster's pod CIDRs (kube-proxy's `! -s clusterCIDR` rule; while none is
///   known, a flow that entered on a node-facing device, `scope`); and back to the
///   client itself (hairpin: its reply would never leave its namespace). Otherwise
///   a pod keeps its address, towards a remote backend too: the backend sees which
///   pod called, and the reply, routed to the pod's node, is reverse-translated
///   where it enters.
#[inline(always)]
fn wants_snat(flow: &Flow, chosen: &Chosen, scope: u8) -> bool {
    if !chosen.master.is_cluster_ip() {
        return !chosen.backend.is_local();
    }
    if masq::masquerade_all() || chosen.backend.address == flow.saddr {
        return true;
    }
    let inside = masq::in_cluster(&flow.saddr).unwrap_or(scope == SCOPE_INTERNAL);
    !inside
}

/// Writes the conntrack entries of a chosen flow and returns the tuple its packets
/// leave with: `node` (from [`snat_source`]) becomes their source when given;
/// `dsr` (`CT_DSR*` bits, 0 but for a DSR flow) marks the forward entry. The
/// flow is counted for its frontend; `Err` (counted: `TC_CT_FULL` or
/// `TC_SNAT_EXHAUSTED`) means the packet must be dropped.
#[inline(always)]
pub fn commit(flow: &Flow, chosen: &Chosen, node: Option<IpAddrBe>, dsr: u8) -> Result<Tuple, ()> {
    // What the backend's replies will come back to us as, and what they must become.
    let original_reply = reply_tuple(&Tuple {
        saddr: flow.saddr,
        daddr: flow.daddr,
        sport: flow.sport,
        dport: flow.dport,
    });
    let rev_nat_id = chosen.master.rev_nat_id;
    let reply_entry = ct::entry(
        &original_reply,
        chosen.backend_id,
        rev_nat_id,
        0,
        CT_DIR_REPLY,
    );
    let mut forward = Tuple {
        saddr: flow.saddr,
        daddr: chosen.backend.address,
        sport: flow.sport,
        dport: chosen.backend.port,
    };
    claim_reply(flow, &mut forward, &reply_entry, node)?;
    let mut forward_entry = ct::entry(
        &forward,
        chosen.backend_id,
        rev_nat_id,
        ct::state_of(flow),
        CT_DIR_FORWARD,
    );
    forward_entry.dsr = dsr;
    if ct::put(&ct::key_of(flow), &forward_entry).is_err() {
        stats::bump(stat::TC_CT_FULL);
        return Err(());
    }
    stats::service(rev_nat_id, false);
    Ok(forward)
}

/// Records where the backend's replies come back, so they are reverse-translated.
/// Without `node` the client's address is kept. With it, a remote backend would
/// answer the client directly, bypassing our reverse NAT: `node` becomes the
/// source, keeping the client's port when it is free on the backend side, else a
/// random one; the NOEXIST insert is the claim.
#[inline(always)]
fn claim_reply(
    flow: &Flow,
    forward: &mut Tuple,
    reply: &CtValue,
    node: Option<IpAddrBe>,
) -> Result<(), ()> {
    let Some(node) = node else {
        let reply_key = ct::key_of_tuple(&reply_tuple(forward), flow.proto);
        return ct::put(&reply_key, reply).map_err(|_| {
            stats::bump(stat::TC_CT_FULL);
        });
    };
    forward.saddr = node;
    let mut port = flow.sport;
    for attempt in 0..SNAT_RETRIES {
        if attempt > 0 {
            // SAFETY: a plain helper without arguments.
            let r = unsafe { bpf_get_prandom_u32() };
            port = ((SNAT_PORT_MIN + r % SNAT_PORT_SPAN) as u16).to_be();
        }
        forward.sport = port;
        let reply_key = ct::key_of_tuple(&reply_tuple(forward), flow.proto);
        // A port egress masquerading holds with the same peer is not free either.
        if masq::holds(&reply_key) {
            continue;
        }
        if ct::claim(&reply_key, reply).is_ok() {
            return Ok(());
        }
    }
    stats::bump(stat::TC_SNAT_EXHAUSTED);
    Err(())
}

/// The tuple of a packet answering one sent with `t`.
#[inline(always)]
fn reply_tuple(t: &Tuple) -> Tuple {
    Tuple {
        saddr: t.daddr,
        daddr: t.saddr,
        sport: t.dport,
        dport: t.sport,
    }
}
