//! DSR at TC: the entry node's sending (a new flow, a known one), the backend's
//! node's arrivals, and the pod's replies there.

use aya_ebpf::{
    bindings::{BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::generated::bpf_redirect_neigh,
    programs::TcContext,
};
use lb_common::{
    stat, CtKey, IpAddrBe, CT_DIR_REPLY, CT_DSR, CT_DSR_IPIP, IPPROTO_TCP, IPPROTO_UDP,
};

use super::{wire, Scratch};
use crate::{
    access::Packet,
    ct::{self, Known},
    fib,
    flow::{self, Chosen},
    frag,
    hdr::{self, ETH_HLEN, ETH_TYPE_IPV6_RAW, IP6_HLEN, IP_HLEN, TCP_HLEN},
    maps::LB_CT,
    nat::{self, Tuple},
    packet::{Flow, TCP_FLAG_SYN},
    stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};

/// What [`new_flow`] did with a new flow.
pub enum Decision {
    /// Sent (or dropped) by DSR: the program's verdict.
    Sent(i32),
    /// Not possible for this flow (counted why): nothing was written, the flow
    /// goes by SNAT.
    Snat,
}

/// Why a DSR packet has no route.
enum Miss {
    /// A UDP datagram that would not fit the route's MTU with DSR's additions.
    TooBig,
    /// No route, or (`ipip`) none naming the backend's node.
    NoRoute,
}

/// The egress device of a DSR packet of `flow` to `backend`, its route (and
/// outer header) in `s`; a missing neighbour is fine, `bpf_redirect_neigh`
/// resolves it.
#[inline(always)]
fn route(
    ctx: &TcContext,
    flow: &Flow,
    backend: &IpAddrBe,
    ipip: bool,
    carry: bool,
    s: &mut Scratch,
) -> Result<u32, Miss> {
    let len = super::checked_len(flow, carry, ipip);
    let rc = super::lookup(ctx, flow, backend, ipip, len, s).ok_or(Miss::NoRoute)?;
    if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64 && flow.proto == IPPROTO_UDP {
        return Err(Miss::TooBig);
    }
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 && rc != BPF_FIB_LKUP_RET_NO_NEIGH as i64 {
        return Err(Miss::NoRoute);
    }
    Ok(s.route.ifindex)
}

/// A new flow `choose` gave a remote backend, under the external scope, in a DSR
/// mode that takes its protocol ([`super::wanted`]).
#[inline(always)]
pub fn new_flow(ctx: &TcContext, flow: &Flow, chosen: &Chosen) -> Decision {
    // The option and the outer header go behind / in front of a plain header, and
    // a datagram's later fragments could not follow it.
    if !flow.has_plain_ip_header() || flow.first_fragment_id.is_some() {
        stats::bump(stat::DSR_SNAT_FALLBACK);
        return Decision::Snat;
    }
    let Some(s) = super::scratch() else {
        return Decision::Snat;
    };
    let ipip = super::config().is_ipip();
    let carry = super::carries_frontend(flow);
    let ifindex = match route(ctx, flow, &chosen.backend.address, ipip, carry, s) {
        Ok(ifindex) => ifindex,
        Err(Miss::TooBig) => {
            stats::bump(stat::DSR_UDP_TOO_BIG_SNAT);
            return Decision::Snat;
        }
        Err(Miss::NoRoute) => {
            stats::bump(stat::DSR_SNAT_FALLBACK);
            return Decision::Snat;
        }
    };
    let Ok(forward) = flow::commit(flow, chosen, None, super::entry_bits(ipip)) else {
        return Decision::Sent(TC_ACT_SHOT);
    };
    stats::bump(stat::TC_NEW_FLOW);
    Decision::Sent(send(
        ctx,
        flow,
        &forward,
        ifindex,
        carry,
        super::outer(s, ipip),
    ))
}

/// A later packet of a DSR flow on the entry node (its forward entry `known`):
/// sent as the first was, the frontend again on a SYN and on every datagram. What
/// cannot take the additions (IP options, a fragment, a datagram that no longer
/// fits) goes translated without them, routed by the stack.
#[inline(always)]
pub fn forward(ctx: &TcContext, flow: &Flow, known: &Known) -> i32 {
    let whole = flow.has_plain_ip_header() && flow.first_fragment_id.is_none();
    let carry = super::carries_frontend(flow);
    let ipip = known.is_dsr_ipip();
    if whole {
        if let Some(s) = super::scratch() {
            if let Ok(ifindex) = route(ctx, flow, &known.to.daddr, ipip, carry, s) {
                return send(ctx, flow, &known.to, ifindex, carry, super::outer(s, ipip));
            }
        }
    }
    stats::bump(stat::DSR_PLAIN);
    if nat::rewrite(ctx, flow, &known.to).is_err() {
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    frag::remember(flow, &known.to);
    TC_ACT_OK
}

/// DNATs the packet, adds what DSR carries and sends it out of `ifindex`, one
/// hop older. A packet whose TTL ends here goes to the stack translated, without
/// the additions, and the stack answers it.
#[inline(always)]
fn send(
    ctx: &TcContext,
    flow: &Flow,
    to: &Tuple,
    ifindex: u32,
    carry: bool,
    outer: Option<(&IpAddrBe, &IpAddrBe)>,
) -> i32 {
    if nat::rewrite(ctx, flow, to).is_err() {
        // A half-rewritten packet would carry a wrong checksum: drop it.
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    if fib::decrement_hops(ctx, flow.v6).is_none() {
        return TC_ACT_OK;
    }
    match wire::add(ctx, flow, carry, outer) {
        Ok(true) => stats::bump(stat::DSR_ENCAPSULATED),
        Ok(false) => {}
        Err(()) => {
            stats::bump(stat::TC_MALFORMED);
            return TC_ACT_SHOT;
        }
    }
    // SAFETY: plain helper; a null next hop lets the kernel resolve the neighbour of
    // the route it looks up for the packet's (new) destination on that device.
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}

/// A packet on a node-facing device that may come from an entry node: carrying
/// our option / Destination Options header (`encapsulated`: inside an outer
/// header to us), or, encapsulated, belonging to a flow that arrived so. The
/// additions are removed, the frontend becomes the flow's reply entry, and the
/// packet goes on to the pod. `None`: not such a packet, left as it was.
///
/// Any such packet is taken, whatever this node's own `--lb-mode`: nodes change
/// mode one at a time, and a pod is addressed either way.
#[inline(always)]
pub fn arrive(ctx: &TcContext, encapsulated: bool) -> Option<i32> {
    let ethertype: u16 = ctx.read(hdr::ETH_TYPE_OFF).ok()?;
    let v6 = ethertype == ETH_TYPE_IPV6_RAW;
    let outer = match (encapsulated, v6) {
        (false, _) => 0,
        (true, false) => IP_HLEN,
        (true, true) => IP6_HLEN,
    };
    let s = super::scratch()?;
    wire::arrival(ctx, ETH_HLEN + outer, v6, &mut s.arrival)?;
    let arrival = &s.arrival;
    // What the pod's replies will carry.
    s.reply_key = CtKey {
        src_addr: arrival.pod,
        dst_addr: arrival.client,
        src_port: arrival.pod_port,
        dst_port: arrival.client_port,
        proto: arrival.proto,
        _pad: [0; 3],
    };
    let ours = arrival.has_frontend || (encapsulated && arrived_encapsulated(&s.reply_key));
    if !ours {
        return None;
    }
    if encapsulated && wire::remove_outer(ctx, v6).is_err() {
        // Untouched: the stack, which has no tunnel for it, drops it.
        return None;
    }
    if arrival.has_frontend {
        if wire::strip_frontend(ctx, v6).is_err() {
            stats::bump(stat::TC_MALFORMED);
            return Some(TC_ACT_SHOT);
        }
        let to = Tuple {
            saddr: arrival.frontend,
            daddr: arrival.client,
            sport: arrival.frontend_port,
            dport: arrival.client_port,
        };
        s.reply = ct::entry(&to, 0, 0, 0, CT_DIR_REPLY);
        s.reply.dsr = if encapsulated {
            CT_DSR | CT_DSR_IPIP
        } else {
            CT_DSR
        };
        if ct::put(&s.reply_key, &s.reply).is_err() {
            // The pod still gets the packet; its replies will leave unrewritten.
            stats::bump(stat::TC_CT_FULL);
        }
    }
    stats::bump(stat::DSR_DECAPSULATED);
    Some(TC_ACT_OK)
}

/// Whether the flow whose replies have `reply_key` arrived encapsulated: its
/// later packets come so too, without the frontend.
#[inline(always)]
fn arrived_encapsulated(reply_key: &CtKey) -> bool {
    // SAFETY: the entry is read at once, before anything else runs.
    unsafe { LB_CT.get(reply_key) }
        .is_some_and(|entry| entry.dir == CT_DIR_REPLY && entry.is_dsr_ipip())
}

/// A pod's packet that matched the reply entry of a DSR flow (`known`): counted;
/// a SYN-ACK of a flow that arrives encapsulated gets its MSS lowered by the
/// outer header, as the client's segments to the pod carry it from the entry
/// node. The caller rewrites and sends it as any reply.
#[inline(always)]
pub fn reply(ctx: &TcContext, flow: &Flow, known: &Known) {
    stats::bump(stat::DSR_REPLY_REWRITTEN);
    if known.is_dsr_ipip() && flow.proto == IPPROTO_TCP && flow.tcp_flags & TCP_FLAG_SYN != 0 {
        let outer = if flow.v6 { IP6_HLEN } else { IP_HLEN } as u16;
        if clamp_mss(ctx, flow, outer) == Ok(true) {
            stats::bump(stat::DSR_MSS_CLAMPED);
        }
    }
}

/// TCP option kinds (RFC 9293 3.2).
const TCPOPT_EOL: u8 = 0;
const TCPOPT_NOP: u8 = 1;
const TCPOPT_MSS: u8 = 2;
const TCPOLEN_MSS: u8 = 4;
/// Options looked at before giving up: a SYN-ACK has a handful, the MSS usually
/// first.
const TCP_OPTIONS_MAX: usize = 8;
/// An MSS this small (IPv4's minimum, RFC 9293) is left as it is.
const MSS_FLOOR: u16 = 536;

/// Lowers the MSS option of a TCP SYN(-ACK) by `by`, with its checksum; `Ok(true)`
/// when it did.
#[inline(always)]
fn clamp_mss(ctx: &TcContext, flow: &Flow, by: u16) -> Result<bool, ()> {
    let [doff, _]: [u8; 2] = ctx.read(flow.l4_off + hdr::TCP_DOFF_FLAGS)?;
    let end = flow.l4_off + ((doff >> 4) as usize) * 4;
    let mut off = flow.l4_off + TCP_HLEN;
    for _ in 0..TCP_OPTIONS_MAX {
        // Read as (kind, length); an MSS option takes 4 bytes.
        if off + 2 > end {
            return Ok(false);
        }
        let [kind, len]: [u8; 2] = ctx.read(off)?;
        match kind {
            TCPOPT_EOL => return Ok(false),
            TCPOPT_NOP => off += 1,
            TCPOPT_MSS => {
                if len != TCPOLEN_MSS || off + 4 > end {
                    return Ok(false);
                }
                let old: u16 = ctx.read(off + 2)?;
                let mss = u16::from_be(old);
                if mss < MSS_FLOOR + by {
                    return Ok(false);
                }
                let new = (mss - by).to_be();
                // The checksum sums 16-bit words from the TCP header's start: a
                // field at an odd offset (the option behind a NOP) straddles two,
                // and counts byte-swapped.
                let (from, to) = if (off + 2 - flow.l4_off).is_multiple_of(2) {
                    (old, new)
                } else {
                    (old.swap_bytes(), new.swap_bytes())
                };
                ctx.l4_csum_update(&flow.l4_csum(), from as u32, to as u32, 2, false)?;
                ctx.write(off + 2, &new)?;
                return Ok(true);
            }
            _ => {
                if len < 2 {
                    return Ok(false);
                }
                off += len as usize;
            }
        }
    }
    Ok(false)
}
