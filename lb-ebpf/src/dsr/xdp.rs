//! DSR at XDP, on the entry node: a new or known DSR flow's packet is DNATed, given
//! what DSR carries and sent from the driver, as the SNAT path's are. Whatever is
//! not plain sailing (a next hop without a neighbour entry or outside
//! `LB_XDP_DEVMAP`, a route whose MTU the packet would no longer fit, no gateway
//! naming the backend's node) goes to TC untouched, which decides; arrivals on the
//! backend's node are TC's alone (IPv4 options, extension headers and outer
//! headers pass XDP untouched).

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    programs::XdpContext,
};
use lb_common::{stat, IpAddrBe};

use super::{wire, Scratch};
use crate::{
    access::Packet,
    ct::Known,
    fib,
    flow::{self, Chosen},
    maps::LB_XDP_DEVMAP,
    nat::{self, Tuple},
    packet::Flow,
    stats,
};

/// What `xdp_lb` does with a DSR frame (the counters of a pass or drop are its).
pub enum Outcome {
    /// Ready: send it out of this device.
    Transmit(u32),
    /// Untouched: to TC, counted under this reason.
    Pass(u32),
    /// Half-written or without state: dropped, counted under this reason.
    Drop(u32),
}

/// The egress device of a DSR frame of `flow` to `backend`, its route (and outer
/// header) in `s`, with what DSR adds counted against the route's MTU; `Err`
/// holds the counter of the reason it is left to TC.
#[inline(always)]
fn hop(
    ctx: &XdpContext,
    flow: &Flow,
    backend: &IpAddrBe,
    ipip: bool,
    carry: bool,
    s: &mut Scratch,
) -> Result<u32, u32> {
    if !fib::hops_left(ctx, flow.v6) {
        return Err(stat::XDP_PASS_TTL);
    }
    let len = flow
        .ip_len
        .saturating_add(wire::overhead(flow.v6, carry, ipip));
    let rc = super::lookup(ctx, flow, backend, ipip, len, s).ok_or(stat::XDP_PASS_FIB)?;
    if rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        return Err(stat::XDP_PASS_NO_NEIGH);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        return Err(stat::XDP_PASS_FIB);
    }
    let ifindex = s.route.ifindex;
    if ifindex != ctx.ingress_device() && LB_XDP_DEVMAP.get_ifindex(ifindex).is_none() {
        return Err(stat::XDP_PASS_NO_DEVMAP);
    }
    Ok(ifindex)
}

/// A new flow with a remote backend in a DSR mode that takes its protocol
/// ([`super::wanted`]); the frame is plain (no options, no fragment: `xdp_lb`
/// leaves those to TC).
#[inline(always)]
pub fn new_flow(ctx: &XdpContext, flow: &Flow, chosen: &Chosen) -> Outcome {
    let Some(s) = super::scratch() else {
        return Outcome::Pass(stat::XDP_PASS_FIB);
    };
    let ipip = super::config().is_ipip();
    let carry = super::carries_frontend(flow);
    let ifindex = match hop(ctx, flow, &chosen.backend.address, ipip, carry, s) {
        Ok(ifindex) => ifindex,
        Err(reason) => return Outcome::Pass(reason),
    };
    let Ok(forward) = flow::commit(flow, chosen, None, super::entry_bits(ipip)) else {
        return Outcome::Drop(stat::XDP_DROP_CONNTRACK);
    };
    stats::bump(stat::XDP_NEW_FLOW);
    send(ctx, flow, &forward, ifindex, carry, ipip, s)
}

/// A known DSR flow's packet: its forward entry's packets are sent as the first
/// was; a pod's reply (its reply entry, on the backend's node) is TC's, which
/// clamps and counts it.
#[inline(always)]
pub fn known(ctx: &XdpContext, flow: &Flow, known: &Known) -> Outcome {
    if known.reply {
        return Outcome::Pass(stat::XDP_PASS_DSR_REPLY);
    }
    let Some(s) = super::scratch() else {
        return Outcome::Pass(stat::XDP_PASS_FIB);
    };
    let carry = super::carries_frontend(flow);
    let ipip = known.is_dsr_ipip();
    match hop(ctx, flow, &known.to.daddr, ipip, carry, s) {
        Ok(ifindex) => send(ctx, flow, &known.to, ifindex, carry, ipip, s),
        Err(reason) => Outcome::Pass(reason),
    }
}

/// DNATs the frame, one hop older, adds what DSR carries and addresses it to the
/// next hop `s.route` names, for `xdp_lb` to send out of `ifindex`.
#[inline(always)]
fn send(
    ctx: &XdpContext,
    flow: &Flow,
    to: &Tuple,
    ifindex: u32,
    carry: bool,
    ipip: bool,
    s: &Scratch,
) -> Outcome {
    if nat::rewrite(ctx, flow, to).is_err() || fib::decrement_hops(ctx, flow.v6).is_none() {
        // Half-rewritten: its checksums no longer hold.
        return Outcome::Drop(stat::XDP_DROP_FAILED);
    }
    match wire::add(ctx, flow, carry, super::outer(s, ipip)) {
        Ok(true) => stats::bump(stat::DSR_ENCAPSULATED),
        Ok(false) => {}
        Err(()) => return Outcome::Drop(stat::XDP_DROP_FAILED),
    }
    if ctx.write(0, &s.route.dmac).is_err() || ctx.write(6, &s.route.smac).is_err() {
        return Outcome::Drop(stat::XDP_DROP_FAILED);
    }
    Outcome::Transmit(ifindex)
}
