//! The per-packet path: DNAT (and SNAT for remote backends) of the first packet of a
//! flow to a frontend, conntrack for the rest, reverse NAT for the replies. Attached
//! at TC ingress: on node-facing devices with the external scope, on pod-facing ones
//! with the internal scope, so a reply is translated where it enters the node. One
//! flow logic serves both families; parsing, rewriting, routing and rejects differ.

use aya_ebpf::{helpers::generated::bpf_get_prandom_u32, programs::TcContext};
use lb_common::{
    stat, Backend, CtValue, IpAddrBe, ServiceKey, ServiceValue, AFFINITY_CLIENT_IP, CT_DIR_FORWARD,
    CT_DIR_REPLY, IPPROTO_TCP, SCOPE_EXTERNAL, SCOPE_INTERNAL,
};

use crate::{
    ct, fib, frag, icmp, icmp6,
    nat::{self, Tuple},
    packet::{self, Flow, Parsed},
    reject, select, source_ranges, stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
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
fn node_ip(v6: bool) -> Option<IpAddrBe> {
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

#[inline(always)]
pub fn handle(ctx: &TcContext, scope: u8) -> i32 {
    let flow = match packet::parse(ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Ignored => return TC_ACT_OK,
        Parsed::IcmpError(error) => return icmp::handle(ctx, &error),
        Parsed::Icmp6Error => return icmp6::handle(ctx),
        Parsed::Fragment(fragment) => return frag::follow(ctx, &fragment),
        Parsed::Malformed => {
            stats::bump(stat::TC_MALFORMED);
            return TC_ACT_OK;
        }
        Parsed::Unhandled => {
            stats::bump(stat::TC_IPV6_EXT_UNHANDLED);
            return TC_ACT_OK;
        }
    };
    frag::forget(&flow);
    if let Some(to) = ct::follow(&flow) {
        stats::bump(stat::TC_CT_HIT);
        return apply(ctx, &flow, &to);
    }
    new_flow(ctx, &flow, scope)
}

#[inline(always)]
fn apply(ctx: &TcContext, flow: &Flow, to: &Tuple) -> i32 {
    if nat::rewrite(ctx, flow, to).is_err() {
        // A half-rewritten packet would carry a wrong checksum: drop it.
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    frag::remember(flow, to);
    // A new source (SNAT, or a reply now from the frontend) may be an address of this
    // node, which routing input refuses: forward it ourselves.
    if to.saddr != flow.saddr {
        if let Some(verdict) = fib::redirect(ctx, &to.saddr, &to.daddr, flow.v6) {
            return verdict;
        }
    }
    TC_ACT_OK
}

#[inline(always)]
fn new_flow(ctx: &TcContext, flow: &Flow, scope: u8) -> i32 {
    let (key, master) = match lookup(ctx, flow, scope) {
        Ok(frontend) => frontend,
        Err(verdict) => return verdict,
    };
    let (backend_id, backend) = match pick(flow, &key, &master) {
        Ok(picked) => picked,
        Err(verdict) => return verdict,
    };
    // What the backend's replies will come back to us as, and what they must become.
    let original_reply = reply_tuple(&Tuple {
        saddr: flow.saddr,
        daddr: flow.daddr,
        sport: flow.sport,
        dport: flow.dport,
    });
    let reply_entry = ct::entry(
        &original_reply,
        backend_id,
        master.rev_nat_id,
        0,
        CT_DIR_REPLY,
    );
    let mut forward = Tuple {
        saddr: flow.saddr,
        daddr: backend.address,
        sport: flow.sport,
        dport: backend.port,
    };
    let node = if backend.is_local() {
        None
    } else {
        snat_source(ctx, flow, &backend.address)
    };
    if let Err(verdict) = claim_reply(flow, &mut forward, &reply_entry, node) {
        return verdict;
    }
    let forward_entry = ct::entry(
        &forward,
        backend_id,
        master.rev_nat_id,
        ct::state_of(flow),
        CT_DIR_FORWARD,
    );
    if ct::put(&ct::key_of(flow), &forward_entry).is_err() {
        stats::bump(stat::TC_CT_FULL);
        return TC_ACT_SHOT;
    }
    stats::bump(stat::TC_NEW_FLOW);
    stats::service(master.rev_nat_id, false);
    apply(ctx, flow, &forward)
}

/// The frontend a new flow is addressed to, its scope resolved: `Err` holds the
/// verdict for a flow that goes no further (not a frontend: passed on; outside
/// the source ranges: dropped; no usable endpoint: dropped or reset).
#[inline(always)]
fn lookup(ctx: &TcContext, flow: &Flow, scope: u8) -> Result<(ServiceKey, ServiceValue), i32> {
    let mut key = ServiceKey {
        address: flow.daddr,
        port: flow.dport,
        backend_slot: 0,
        proto: flow.proto,
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    };
    let Some(mut master) = select::frontend(&key) else {
        return Err(TC_ACT_OK);
    };
    // Before the scope switch: the ranges hang off the internal master, and apply to
    // every client of a LoadBalancer IP, from outside or from pods, as in kube-proxy.
    if !source_ranges::admits(&master, flow.saddr) {
        stats::bump(stat::TC_SOURCE_RANGE_DROP);
        stats::source_range_drop(master.rev_nat_id);
        return Err(TC_ACT_SHOT);
    }
    if scope == SCOPE_EXTERNAL && master.is_external_scope() {
        key.scope = SCOPE_EXTERNAL;
        let Some(external) = select::frontend(&key) else {
            return Err(TC_ACT_OK);
        };
        master = external;
    }
    if master.count == 0 {
        stats::bump(stat::TC_NO_BACKEND);
        stats::service(master.rev_nat_id, true);
        // externalTrafficPolicy: Local without a local endpoint drops, as kube-proxy
        // does, so the load balancer's health checks fail over to another node.
        // A Service without any endpoint rejects: a RST for TCP, a port
        // unreachable for UDP (kube-proxy's REJECT).
        if key.scope == SCOPE_EXTERNAL {
            return Err(TC_ACT_SHOT);
        }
        let answered = match (flow.proto == IPPROTO_TCP, flow.v6) {
            (true, true) => reject::tcp_reset6(ctx, flow),
            (true, false) => reject::tcp_reset(ctx, flow),
            (false, true) => reject::udp_unreachable6(ctx, flow),
            (false, false) => reject::udp_unreachable(ctx, flow),
        };
        return Err(answered.unwrap_or(TC_ACT_SHOT));
    }
    Ok((key, master))
}

/// The backend of a new flow (random, or the client's under ClientIP affinity).
#[inline(always)]
fn pick(flow: &Flow, key: &ServiceKey, master: &ServiceValue) -> Result<(u32, Backend), i32> {
    let client = || (AFFINITY_CLIENT_IP, flow.saddr);
    // SAFETY: a plain helper without arguments.
    let entropy = unsafe { bpf_get_prandom_u32() };
    select::backend(key, master, client, entropy).ok_or_else(|| {
        stats::bump(stat::TC_NO_BACKEND);
        TC_ACT_SHOT
    })
}

/// Records where the backend's replies come back, so they are reverse-translated.
/// A local backend's replies pass through this node anyway: the client's address
/// is kept (what externalTrafficPolicy: Local promises). A remote backend would
/// answer the client directly, bypassing our reverse NAT: `node` becomes the
/// source, keeping the client's port when it is free on the backend side, else a
/// random one; the NOEXIST insert is the claim. `Err` holds the verdict.
#[inline(always)]
fn claim_reply(
    flow: &Flow,
    forward: &mut Tuple,
    reply: &CtValue,
    node: Option<IpAddrBe>,
) -> Result<(), i32> {
    let Some(node) = node else {
        let reply_key = ct::key_of_tuple(&reply_tuple(forward), flow.proto);
        return ct::put(&reply_key, reply).map_err(|_| {
            stats::bump(stat::TC_CT_FULL);
            TC_ACT_SHOT
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
        if ct::claim(&reply_key, reply).is_ok() {
            return Ok(());
        }
    }
    stats::bump(stat::TC_SNAT_EXHAUSTED);
    Err(TC_ACT_SHOT)
}

/// The source of a flow SNATed towards a remote backend: `--node-ip` when given,
/// else whatever address the node's routing would use to reach the backend, so no
/// address has to be configured. `None` (keep the client's address) only when
/// neither is known: a kernel before 6.7 without `--node-ip`, or no route to the
/// backend.
#[inline(always)]
fn snat_source(ctx: &TcContext, flow: &Flow, backend: &IpAddrBe) -> Option<IpAddrBe> {
    node_ip(flow.v6).or_else(|| fib::source_towards(ctx, &flow.saddr, backend, flow.v6))
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
