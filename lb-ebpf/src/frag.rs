//! IP fragments (IPv4, and IPv6 Fragment headers) of translated flows. Only a datagram's first fragment carries the
//! L4 header, so only it can be matched to a frontend or a conntrack entry. The
//! addresses it was rewritten to are remembered under the datagram's identity
//! (addresses, IP id, protocol; Cilium's IPV4_FRAG_DATAGRAMS does the same) and
//! given to the later fragments. Those need no L4 change: the L4 checksum sits in
//! the first fragment and its update already covers the whole datagram, so only
//! their IP header is rewritten.
//!
//! Not covered: a later fragment that arrives before its first fragment (reordered)
//! passes untranslated, and the receiver cannot reassemble that datagram.

use aya_ebpf::programs::TcContext;
use lb_common::{stat, FragKey, FragValue, IpAddrBe, FRAG_TIMEOUT_NS};

use crate::{
    ct, fib,
    maps::LB_FRAG,
    nat::{self, Tuple},
    packet::{Flow, Fragment},
    stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};

#[inline(always)]
fn key(saddr: IpAddrBe, daddr: IpAddrBe, id: u32, proto: u8) -> FragKey {
    FragKey {
        src_addr: saddr,
        dst_addr: daddr,
        id,
        proto,
        _pad: [0; 3],
    }
}

/// A first fragment, before it is looked at: whatever an earlier datagram with the
/// same identity (the IP id wraps) left must not apply to this one's fragments,
/// whether or not this one is translated.
#[inline(always)]
pub fn forget(flow: &Flow) {
    if let Some(id) = flow.first_fragment_id {
        let _ = LB_FRAG.remove(key(flow.saddr, flow.daddr, id, flow.proto));
    }
}

/// A first fragment was rewritten to `to`: its later fragments get the same
/// addresses. A full map evicts the oldest datagram (LRU), never this one.
#[inline(always)]
pub fn remember(flow: &Flow, to: &Tuple) {
    if let Some(id) = flow.first_fragment_id {
        let value = FragValue {
            created_ns: ct::now(),
            nat_src_addr: to.saddr,
            nat_dst_addr: to.daddr,
        };
        let _ = LB_FRAG.insert(key(flow.saddr, flow.daddr, id, flow.proto), value, 0);
    }
}

/// The entry of a later fragment's datagram, while it applies.
#[inline(always)]
fn live_entry(frag: &Fragment) -> Option<FragValue> {
    LB_FRAG
        .get_ptr(key(frag.saddr, frag.daddr, frag.id, frag.proto))
        // SAFETY: valid for this program run; the value is copied out at once.
        .map(|entry| unsafe { *entry })
        .filter(|entry| ct::now().wrapping_sub(entry.created_ns) < FRAG_TIMEOUT_NS)
}

/// The (source, destination) a later fragment's first fragment was rewritten to,
/// while it applies.
#[inline(always)]
pub fn translation(frag: &Fragment) -> Option<(IpAddrBe, IpAddrBe)> {
    live_entry(frag).map(|entry| (entry.nat_src_addr, entry.nat_dst_addr))
}

/// A later fragment: rewritten and routed like its first fragment, or passed on
/// untouched (and counted) when no first fragment of it was translated.
#[inline(always)]
pub fn follow(ctx: &TcContext, frag: &Fragment) -> i32 {
    let (to_saddr, to_daddr) = match live_entry(frag) {
        Some(entry) => (entry.nat_src_addr, entry.nat_dst_addr),
        None => {
            stats::bump(stat::TC_FRAGMENT);
            return TC_ACT_OK;
        }
    };
    if nat::rewrite_l3(
        ctx,
        frag.v6,
        (&frag.saddr, &frag.daddr),
        (&to_saddr, &to_daddr),
    )
    .is_err()
    {
        // A half-rewritten header would carry a wrong checksum: drop it.
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    stats::bump(stat::TC_CT_HIT);
    // As for the first fragment (`tc_lb::apply`): a source that is now the node's
    // own address must be routed by us, not refused by routing input.
    if to_saddr != frag.saddr {
        if let Some(verdict) = fib::redirect(ctx, &to_saddr, &to_daddr, frag.v6) {
            return verdict;
        }
    }
    TC_ACT_OK
}
