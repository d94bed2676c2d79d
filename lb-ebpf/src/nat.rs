//! Rewriting a packet's addresses and ports with incremental checksum updates.

use aya_ebpf::programs::TcContext;
use lb_common::IPPROTO_UDP;

use crate::packet::{Flow, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF};

const BPF_F_PSEUDO_HDR: u64 = aya_ebpf::bindings::BPF_F_PSEUDO_HDR as u64;
const BPF_F_MARK_MANGLED_0: u64 = aya_ebpf::bindings::BPF_F_MARK_MANGLED_0 as u64;

/// The tuple a packet should leave with.
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
}

/// Rewrites only the fields that change. Address changes touch the IP header checksum
/// and, through the pseudo header, the L4 checksum; port changes only the latter.
/// A UDP checksum of 0 means "none" and must stay 0 (BPF_F_MARK_MANGLED_0).
#[inline(always)]
pub fn rewrite(ctx: &TcContext, flow: &Flow, to: &Tuple) -> Result<(), i64> {
    let l4_flags = if flow.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    let csum_off = flow.l4_csum_off();
    if flow.saddr != to.saddr {
        rewrite_addr(ctx, IP_SRC_OFF, csum_off, l4_flags, flow.saddr, to.saddr)?;
    }
    if flow.daddr != to.daddr {
        rewrite_addr(ctx, IP_DST_OFF, csum_off, l4_flags, flow.daddr, to.daddr)?;
    }
    if flow.sport != to.sport {
        rewrite_port(ctx, flow.l4_off, csum_off, l4_flags, flow.sport, to.sport)?;
    }
    if flow.dport != to.dport {
        rewrite_port(
            ctx,
            flow.l4_off + 2,
            csum_off,
            l4_flags,
            flow.dport,
            to.dport,
        )?;
    }
    Ok(())
}

/// Rewrites the addresses of a later fragment: an IP header without an L4 header
/// behind it, so only the IP header checksum follows.
#[inline(always)]
pub fn rewrite_l3(
    ctx: &TcContext,
    saddr: u32,
    daddr: u32,
    to_saddr: u32,
    to_daddr: u32,
) -> Result<(), i64> {
    for (field_off, from, to) in [(IP_SRC_OFF, saddr, to_saddr), (IP_DST_OFF, daddr, to_daddr)] {
        if from != to {
            ctx.l3_csum_replace(IP_CSUM_OFF, from as u64, to as u64, 4)?;
            ctx.store(field_off, &to, 0)?;
        }
    }
    Ok(())
}

#[inline(always)]
fn rewrite_addr(
    ctx: &TcContext,
    field_off: usize,
    l4_csum_off: usize,
    l4_flags: u64,
    from: u32,
    to: u32,
) -> Result<(), i64> {
    ctx.l4_csum_replace(
        l4_csum_off,
        from as u64,
        to as u64,
        l4_flags | BPF_F_PSEUDO_HDR | 4,
    )?;
    ctx.l3_csum_replace(IP_CSUM_OFF, from as u64, to as u64, 4)?;
    ctx.store(field_off, &to, 0)
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    field_off: usize,
    l4_csum_off: usize,
    l4_flags: u64,
    from: u16,
    to: u16,
) -> Result<(), i64> {
    ctx.l4_csum_replace(l4_csum_off, from as u64, to as u64, l4_flags | 2)?;
    ctx.store(field_off, &to, 0)
}
