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
/// Service path, each a subprogram called from here. The verifier adds up the
/// frames of a chain of calls (512 bytes in all): with the Service path (DSR
/// included) inlined here, any subprogram it called would push the chain past
/// that; side by side, each has the 512 bytes to itself.
/// The entry itself must keep no stack (not even a counter's key): the kernel
/// rounds each frame up to 16 bytes, and the Service path's takes 512 so rounded.
#[inline(always)]
pub fn handle_external(ctx: &TcContext) -> i32 {
    if let Some(verdict) = masq::ingress(ctx) {
        return verdict;
    }
    external(ctx.skb.skb)
}

#[inline(never)]
fn external(skb: *mut __sk_buff) -> i32 {
    handle(&TcContext::new(skb), SCOPE_EXTERNAL)
}

/// The Service path of both scopes (`lb_tc_internal` inlines it).
#[inline(always)]
pub fn handle(ctx: &TcContext, scope: u8) -> i32 {
    // XDP runs on node-facing devices only, before us: what it translated and
    // handed to the stack is done.
    if scope == SCOPE_EXTERNAL && mark::is_marked(ctx) {
        stats::bump(stat::TC_XDP_MARKED);
        return TC_ACT_OK;
    }
    let flow = match packet::parse(ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Ignored => return TC_ACT_OK,
        Parsed::Encapsulated => {
            if scope == SCOPE_EXTERNAL {
                if let Some(verdict) = dsr::tc::arrive(ctx, true) {
                    return verdict;
                }
            }
            return TC_ACT_OK;
        }
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
    // A DSR packet from an entry node, for a pod here: its option is one.
    if scope == SCOPE_EXTERNAL && !flow.has_plain_ip_header() {
        if let Some(verdict) = dsr::tc::arrive(ctx, false) {
            return verdict;
        }
    }
    frag::forget(&flow);
    if let Some(known) = ct::follow(&flow) {
        stats::bump(stat::TC_CT_HIT);
        if known.is_dsr() {
            if !known.reply {
                return dsr::tc::forward(ctx, &flow, &known);
            }
            dsr::tc::reply(ctx, &flow, &known);
        }
        return apply(ctx, &flow, &known.to);
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
