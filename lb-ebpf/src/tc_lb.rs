//! The per-packet path at TC ingress: DNAT (and SNAT for remote backends) of the
//! first packet of a flow to a frontend, conntrack for the rest, reverse NAT for the
//! replies. On node-facing devices with the external scope, on pod-facing ones
//! with the internal scope, so a reply is translated where it enters the node. The
//! flow logic is `flow.rs`, shared with XDP; what is TC's own is here: fragments,
//! ICMP errors, the rejects, and routing with `bpf_redirect_neigh`.

use aya_ebpf::{bindings::__sk_buff, programs::TcContext};
use lb_common::{stat, IPPROTO_TCP, SCOPE_EXTERNAL};

use crate::{
    ct, dsr, fib,
    flow::{self, Refusal},
    frag, icmp, icmp6, mark, masq,
    nat::{self, Tuple},
    packet::{self, Flow, Parsed},
    reject, stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};

/// `lb_tc_external`: replies to pods' masqueraded flows (`masq`), then the
/// Service path ([`handle`]), each a subprogram called from here.
#[inline(always)]
pub fn handle_external(ctx: &TcContext) -> i32 {
    if let Some(verdict) = masq::ingress(ctx) {
        return verdict;
    }
    handle::<SCOPE_EXTERNAL>(ctx)
}

/// The Service path of a scope: its known flows, then its new flows, each a
/// subprogram called from the entry. The verifier adds up the frames of a chain
/// of calls (512 bytes in all), so nothing of the Service path may call a
/// subprogram; side by side, each has the 512 bytes to itself. New flows
/// (choice, quarantine, DSR, the conntrack entries) take the most, so they get a
/// frame of their own and parse the packet again: a second parse costs a new
/// flow's first packet, never a known flow's.
/// The entry itself must keep no stack (not even a counter's key): the kernel
/// rounds each frame up to 16 bytes, and a subprogram's may take 512 so rounded.
#[inline(always)]
pub fn handle<const SCOPE: u8>(ctx: &TcContext) -> i32 {
    let verdict = known_flows::<SCOPE>(ctx.skb.skb);
    if verdict != NEW_FLOW {
        return verdict;
    }
    new_flows::<SCOPE>(ctx.skb.skb)
}

/// [`known_flows`]' answer for a packet that starts a flow: no TC verdict is
/// negative but `TC_ACT_UNSPEC` (-1).
const NEW_FLOW: i32 = i32::MIN;

#[inline(never)]
fn known_flows<const SCOPE: u8>(skb: *mut __sk_buff) -> i32 {
    known(&TcContext::new(skb), SCOPE).unwrap_or(NEW_FLOW)
}

#[inline(never)]
fn new_flows<const SCOPE: u8>(skb: *mut __sk_buff) -> i32 {
    let ctx = TcContext::new(skb);
    match packet::parse(&ctx) {
        Parsed::Flow(flow) => new_flow(&ctx, &flow, SCOPE),
        // It parsed as a flow a moment ago: nothing changed the packet since.
        _ => TC_ACT_OK,
    }
}

/// The verdict for everything but the first packet of a new flow (`Err`).
#[inline(always)]
fn known(ctx: &TcContext, scope: u8) -> Result<i32, ()> {
    // XDP runs on node-facing devices only, before us: what it translated and
    // handed to the stack is done.
    if scope == SCOPE_EXTERNAL && mark::is_marked(ctx) {
        stats::bump(stat::TC_XDP_MARKED);
        return Ok(TC_ACT_OK);
    }
    let flow = match packet::parse(ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Ignored => return Ok(TC_ACT_OK),
        Parsed::Encapsulated => {
            if scope == SCOPE_EXTERNAL {
                if let Some(verdict) = dsr::tc::arrive(ctx, true) {
                    return Ok(verdict);
                }
            }
            return Ok(TC_ACT_OK);
        }
        Parsed::IcmpError(error) => return Ok(icmp::handle(ctx, &error)),
        Parsed::Icmp6Error => return Ok(icmp6::handle(ctx)),
        Parsed::Fragment(fragment) => return Ok(frag::follow(ctx, &fragment)),
        Parsed::Malformed => {
            stats::bump(stat::TC_MALFORMED);
            return Ok(TC_ACT_OK);
        }
        Parsed::Unhandled => {
            stats::bump(stat::TC_IPV6_EXT_UNHANDLED);
            return Ok(TC_ACT_OK);
        }
    };
    // A DSR packet from an entry node, for a pod here: its option is one.
    if scope == SCOPE_EXTERNAL && !flow.has_plain_ip_header() {
        if let Some(verdict) = dsr::tc::arrive(ctx, false) {
            return Ok(verdict);
        }
    }
    frag::forget(&flow);
    if let Some(known) = ct::follow(&flow) {
        stats::bump(stat::TC_CT_HIT);
        if known.is_dsr() {
            if !known.reply {
                return Ok(dsr::tc::forward(ctx, &flow, &known));
            }
            dsr::tc::reply(ctx, &flow, &known);
        }
        return Ok(apply(ctx, &flow, &known.to));
    }
    Err(())
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
    let chosen = match flow::choose(flow, scope) {
        Ok(chosen) => chosen,
        Err(refusal) => return refused(ctx, flow, refusal),
    };
    if scope == SCOPE_EXTERNAL && dsr::wanted(flow, &chosen) {
        if let dsr::tc::Decision::Sent(verdict) = dsr::tc::new_flow(ctx, flow, &chosen) {
            return verdict;
        }
    }
    let node = flow::snat_source(ctx, flow, &chosen, scope);
    let Ok(forward) = flow::commit(flow, &chosen, node, 0) else {
        return TC_ACT_SHOT;
    };
    stats::bump(stat::TC_NEW_FLOW);
    apply(ctx, flow, &forward)
}

/// The verdict for a new flow that gets no backend: passed on when it is not
/// ours, dropped outside the source ranges, and for want of an endpoint dropped
/// (`externalTrafficPolicy: Local` without a local endpoint, as kube-proxy does, so
/// the load balancer's health checks fail over to another node) or rejected: a RST
/// for TCP, a port unreachable for UDP (kube-proxy's REJECT).
#[inline(always)]
fn refused(ctx: &TcContext, flow: &Flow, refusal: Refusal) -> i32 {
    match refusal {
        Refusal::NotFrontend => TC_ACT_OK,
        Refusal::SourceRange => TC_ACT_SHOT,
        Refusal::SlotMiss => {
            stats::bump(stat::TC_NO_BACKEND);
            TC_ACT_SHOT
        }
        Refusal::NoEndpoint {
            rev_nat_id,
            external,
        } => {
            stats::bump(stat::TC_NO_BACKEND);
            stats::service(rev_nat_id, true);
            if external {
                return TC_ACT_SHOT;
            }
            let answered = match (flow.proto == IPPROTO_TCP, flow.v6) {
                (true, true) => reject::tcp_reset6(ctx, flow),
                (true, false) => reject::tcp_reset(ctx, flow),
                (false, true) => reject::udp_unreachable6(ctx, flow),
                (false, false) => reject::udp_unreachable(ctx, flow),
            };
            answered.unwrap_or(TC_ACT_SHOT)
        }
    }
}
