//! The XDP front door on node-facing devices: NodePort, LoadBalancer IPs and
//! externalIPs (the external scope) served before the kernel builds an skb. Known
//! flows (either direction) and new ones go through the flow logic and maps TC
//! uses (`flow.rs`, `ct.rs`), so TC can take over a flow XDP started and the
//! reverse. A packet whose new source is this node's (SNAT, or a reply now from
//! the frontend) is sent on here: back out of its device (`XDP_TX`) or to another
//! XDP device (`XDP_REDIRECT`), with the next hop's addresses from the FIB and the
//! TTL decremented. Any other translated packet (a local backend) goes to the stack
//! marked (`mark.rs`), so TC does not look it up again.
//!
//! Whatever XDP is not sure of it passes to TC untouched, and it decides so before
//! it rewrites or records anything: fragments, IPv4 options, IPv6 extension
//! headers, ICMP errors, malformed headers, a frontend without a backend (TC
//! answers), a TTL about to expire, a next hop without a neighbour entry or behind
//! a device outside `LB_XDP_DEVMAP`. Each is counted (`lb_common::stat::XDP_*`).
//! Only the frame's first buffer is read or written: a multi-buffer (jumbo) frame's
//! payload is never touched, as incremental checksums do not need it.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_SRC,
    },
    programs::XdpContext,
};
use lb_common::{stat, IpAddrBe, SCOPE_EXTERNAL};

use crate::{
    access::Packet,
    ct, dsr, fib,
    flow::{self, Refusal},
    maps::LB_XDP_DEVMAP,
    mark,
    nat::{self, Tuple},
    packet::{self, Flow, Parsed},
    stats,
    verdict::{XDP_DROP, XDP_PASS, XDP_TX},
};

/// Where a packet this program sends on goes: the egress device, and the frame's
/// new Ethernet addresses (destination, then source) as they lie in the frame.
struct NextHop {
    ifindex: u32,
    eth: [u8; 12],
}

#[inline(always)]
pub fn handle(ctx: &XdpContext) -> u32 {
    let flow = match packet::parse(ctx) {
        Parsed::Flow(flow) => flow,
        // An outer header: perhaps a DSR packet for a pod here, which TC takes.
        Parsed::Ignored | Parsed::Encapsulated => return XDP_PASS,
        Parsed::IcmpError(_) | Parsed::Icmp6Error => return pass(stat::XDP_PASS_ICMP_ERROR),
        Parsed::Fragment(_) => return pass(stat::XDP_PASS_FRAGMENT),
        Parsed::Malformed => return pass(stat::XDP_PASS_MALFORMED),
        Parsed::Unhandled => return pass(stat::XDP_PASS_IPV6_EXT),
    };
    if let Some(reason) = left_to_tc(&flow) {
        return pass(reason);
    }
    // A hit refreshes the entry's time and state bits: what TC does again, to the
    // same values, should the packet still go there.
    if let Some(known) = ct::follow(&flow) {
        if known.is_dsr() {
            return dsr_verdict(ctx, dsr::xdp::known(ctx, &flow, &known));
        }
        return known_flow(ctx, &flow, &known.to);
    }
    new_flow(ctx, &flow)
}

/// TC's alone, however it parsed: a first fragment (its datagram's later
/// fragments need TC's `LB_FRAG` entry), and TCP/UDP behind IPv4 options or IPv6
/// extension headers.
#[inline(always)]
fn left_to_tc(flow: &Flow) -> Option<u32> {
    if flow.first_fragment_id.is_some() {
        return Some(stat::XDP_PASS_FRAGMENT);
    }
    if !flow.has_plain_ip_header() {
        return Some(if flow.v6 {
            stat::XDP_PASS_IPV6_EXT
        } else {
            stat::XDP_PASS_IP_OPTIONS
        });
    }
    None
}

#[inline(always)]
fn known_flow(ctx: &XdpContext, flow: &Flow, to: &Tuple) -> u32 {
    // As in TC: a new source is one of this node's addresses, which the stack's
    // routing input would refuse, so the packet is sent on here.
    let hop = if to.saddr != flow.saddr {
        match next_hop(ctx, flow, &to.saddr, &to.daddr) {
            Ok(hop) => Some(hop),
            Err(reason) => return pass(reason),
        }
    } else {
        None
    };
    send(ctx, flow, to, hop)
}

#[inline(always)]
fn new_flow(ctx: &XdpContext, flow: &Flow) -> u32 {
    let chosen = match flow::choose(flow, SCOPE_EXTERNAL) {
        Ok(chosen) => chosen,
        Err(Refusal::NotFrontend) => return XDP_PASS,
        // Counted as TC counts it (`flow::choose`), and as XDP's verdict.
        Err(Refusal::SourceRange) => return drop(stat::XDP_DROP_SOURCE_RANGE),
        Err(Refusal::NoEndpoint { .. } | Refusal::SlotMiss) => {
            return pass(stat::XDP_PASS_NO_BACKEND)
        }
    };
    // kube-proxy's cluster-IP masquerade rules are TC's alone (`flow::snat_source`):
    // a cluster IP is the cluster's, and traffic from outside to it is rare.
    if chosen.master.is_cluster_ip() {
        return XDP_PASS;
    }
    if dsr::wanted(flow, &chosen) {
        return dsr_verdict(ctx, dsr::xdp::new_flow(ctx, flow, &chosen));
    }
    // Where the packet goes is settled before any entry is written: a flow XDP
    // cannot send on is TC's from its first packet.
    let (node, hop) = if chosen.backend.is_local() {
        (None, None)
    } else {
        match remote(ctx, flow, &chosen.backend.address) {
            Ok(remote) => remote,
            Err(reason) => return pass(reason),
        }
    };
    let Ok(forward) = flow::commit(flow, &chosen, node, 0) else {
        return drop(stat::XDP_DROP_CONNTRACK);
    };
    stats::bump(stat::XDP_NEW_FLOW);
    send(ctx, flow, &forward, hop)
}

/// A new flow to a remote backend: its SNAT source and its next hop, from one
/// route lookup made as forwarding makes it, from the client's address (the
/// source is the route's, as MASQUERADE picks it after that lookup), unless
/// `--node-ip` names the source. A new flow pays for LRU conntrack writes already
/// (about 60% of XDP's time for a SYN flood, perf): a second lookup for the
/// source was 6% more. `Err` holds the counter of why it is left to TC.
#[inline(always)]
fn remote(
    ctx: &XdpContext,
    flow: &Flow,
    backend: &IpAddrBe,
) -> Result<(Option<IpAddrBe>, Option<NextHop>), u32> {
    if !fib::hops_left(ctx, flow.v6) {
        return Err(stat::XDP_PASS_TTL);
    }
    let (rc, route) = fib::route(
        ctx,
        &flow.saddr,
        backend,
        flow.v6,
        flow.ip_len,
        BPF_FIB_LOOKUP_SRC,
    );
    let hop = checked_hop(ctx, rc, &route)?;
    let node = flow::node_ip(flow.v6).or_else(|| fib::source_of(&route, flow.v6));
    match node {
        // A source the node would not change (none known, or the client's own):
        // the stack forwards it, translated.
        None => Ok((None, None)),
        Some(node) if node == flow.saddr => Ok((Some(node), None)),
        Some(node) => Ok((Some(node), Some(hop))),
    }
}

/// The next hop of a packet that will leave from `saddr` to `daddr`, as
/// forwarding would find it from the device it came in on; `Err` holds the counter
/// of the reason it is left to TC.
#[inline(always)]
fn next_hop(
    ctx: &XdpContext,
    flow: &Flow,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
) -> Result<NextHop, u32> {
    if !fib::hops_left(ctx, flow.v6) {
        return Err(stat::XDP_PASS_TTL);
    }
    let (rc, route) = fib::route(ctx, saddr, daddr, flow.v6, flow.ip_len, 0);
    checked_hop(ctx, rc, &route)
}

/// The next hop a route lookup answered, if XDP can send there.
#[inline(always)]
fn checked_hop(ctx: &XdpContext, rc: i64, route: &bpf_fib_lookup) -> Result<NextHop, u32> {
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        return Err(stat::XDP_PASS_NO_NEIGH);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return Err(stat::XDP_PASS_FIB);
    }
    if route.ifindex != ctx.ingress_device() && LB_XDP_DEVMAP.get_ifindex(route.ifindex).is_none() {
        return Err(stat::XDP_PASS_NO_DEVMAP);
    }
    let mut eth = [0u8; 12];
    eth[..6].copy_from_slice(&route.dmac);
    eth[6..].copy_from_slice(&route.smac);
    Ok(NextHop {
        ifindex: route.ifindex,
        eth,
    })
}

/// Rewrites the packet to `to` and sends it: to the stack, marked, without a next
/// hop; else out of the next hop's device, addressed to it, one hop older.
#[inline(always)]
fn send(ctx: &XdpContext, flow: &Flow, to: &Tuple, hop: Option<NextHop>) -> u32 {
    let Some(hop) = hop else {
        // Marked first: moving the metadata start leaves the frame as it is.
        mark::mark(ctx);
        if nat::rewrite(ctx, flow, to).is_err() {
            return drop(stat::XDP_DROP_FAILED);
        }
        stats::bump(stat::XDP_PASS_LOCAL);
        return XDP_PASS;
    };
    if nat::rewrite(ctx, flow, to).is_err()
        || fib::decrement_hops(ctx, flow.v6).is_none()
        || ctx.write(0, &hop.eth).is_err()
    {
        // Half-rewritten: its checksums no longer hold.
        return drop(stat::XDP_DROP_FAILED);
    }
    transmit(ctx, hop.ifindex)
}

/// The verdict for a frame of a DSR flow (`dsr::xdp`).
#[inline(always)]
fn dsr_verdict(ctx: &XdpContext, outcome: dsr::xdp::Outcome) -> u32 {
    match outcome {
        dsr::xdp::Outcome::Transmit(ifindex) => transmit(ctx, ifindex),
        dsr::xdp::Outcome::Pass(reason) => pass(reason),
        dsr::xdp::Outcome::Drop(reason) => drop(reason),
    }
}

/// Sends a frame addressed to its next hop out of `ifindex`: back out of the
/// device it came in on (`XDP_TX`), else redirected there.
#[inline(always)]
fn transmit(ctx: &XdpContext, ifindex: u32) -> u32 {
    if ifindex == ctx.ingress_device() {
        stats::bump(stat::XDP_TX);
        return XDP_TX;
    }
    // The device was in the map a moment ago; should it have left since, the frame
    // is dropped (the fallback verdict), not passed rewritten.
    match LB_XDP_DEVMAP.redirect(ifindex, XDP_DROP as u64) {
        Ok(verdict) => {
            stats::bump(stat::XDP_REDIRECT);
            verdict
        }
        Err(_) => drop(stat::XDP_DROP_FAILED),
    }
}

/// Leaves the packet, untouched, to the stack and TC, counting why.
#[inline(always)]
fn pass(reason: u32) -> u32 {
    stats::bump(reason);
    XDP_PASS
}

#[inline(always)]
fn drop(reason: u32) -> u32 {
    stats::bump(reason);
    XDP_DROP
}
