//! Rewriting a packet's addresses and ports with incremental checksum updates.

use aya_ebpf::{helpers::generated::bpf_csum_diff, programs::TcContext};
use lb_common::{IpAddrBe, IPPROTO_UDP};

use crate::packet::{Flow, IP6_DST_OFF, IP6_SRC_OFF, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF};

const BPF_F_PSEUDO_HDR: u64 = aya_ebpf::bindings::BPF_F_PSEUDO_HDR as u64;
const BPF_F_MARK_MANGLED_0: u64 = aya_ebpf::bindings::BPF_F_MARK_MANGLED_0 as u64;

/// The tuple a packet should leave with (IPv4 addresses IPv4-mapped).
#[derive(Clone, Copy)]
pub struct Tuple {
    pub saddr: IpAddrBe,
    pub daddr: IpAddrBe,
    pub sport: u16,
    pub dport: u16,
}

/// Rewrites only the fields that change. Address changes touch the IPv4 header
/// checksum (IPv6 has none) and, through the pseudo header, the L4 checksum; port
/// changes only the latter. A UDP checksum of 0 means "none" (IPv4) and must stay 0
/// (BPF_F_MARK_MANGLED_0).
#[inline(always)]
pub fn rewrite(ctx: &TcContext, flow: &Flow, to: &Tuple) -> Result<(), i64> {
    let l4_flags = if flow.proto == IPPROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    let csum_off = flow.l4_csum_off();
    let (src_off, dst_off) = if flow.v6 {
        (IP6_SRC_OFF, IP6_DST_OFF)
    } else {
        (IP_SRC_OFF, IP_DST_OFF)
    };
    for (field_off, from, to) in [
        (src_off, &flow.saddr, &to.saddr),
        (dst_off, &flow.daddr, &to.daddr),
    ] {
        if from == to {
            continue;
        }
        if flow.v6 {
            rewrite_addr6(ctx, field_off, csum_off, l4_flags, from, to)?;
        } else {
            rewrite_addr(ctx, field_off, csum_off, l4_flags, from.v4(), to.v4())?;
        }
    }
    if flow.sport != to.sport {
        rewrite_port(ctx, flow.l4_off, csum_off, l4_flags, flow.sport, to.sport)?;
    }
    if flow.dport != to.dport {
        rewrite_port(
            ctx,
            flow.l4_off + crate::hdr::L4_DPORT,
            csum_off,
            l4_flags,
            flow.dport,
            to.dport,
        )?;
    }
    Ok(())
}

/// Rewrites the addresses of a later fragment: an IP header without an L4 header
/// behind it, so only the IPv4 header checksum follows (IPv6 has none).
#[inline(always)]
pub fn rewrite_l3(
    ctx: &TcContext,
    v6: bool,
    from: (&IpAddrBe, &IpAddrBe),
    to: (&IpAddrBe, &IpAddrBe),
) -> Result<(), i64> {
    if v6 {
        for (field_off, old, new) in [(IP6_SRC_OFF, from.0, to.0), (IP6_DST_OFF, from.1, to.1)] {
            if old != new {
                ctx.store(field_off, &new.words, 0)?;
            }
        }
        return Ok(());
    }
    for (field_off, old, new) in [
        (IP_SRC_OFF, from.0.v4(), to.0.v4()),
        (IP_DST_OFF, from.1.v4(), to.1.v4()),
    ] {
        if old != new {
            ctx.l3_csum_replace(IP_CSUM_OFF, old as u64, new as u64, 4)?;
            ctx.store(field_off, &new, 0)?;
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

/// An IPv6 address: 16 bytes into the L4 checksum's pseudo header as one
/// difference (size 0 tells the helper `to` is a difference, not a field).
#[inline(always)]
fn rewrite_addr6(
    ctx: &TcContext,
    field_off: usize,
    l4_csum_off: usize,
    l4_flags: u64,
    from: &IpAddrBe,
    to: &IpAddrBe,
) -> Result<(), i64> {
    let mut old = from.words;
    let mut new = to.words;
    // SAFETY: both buffers are 16 bytes on this stack frame.
    let diff = unsafe { bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return Err(diff);
    }
    ctx.l4_csum_replace(l4_csum_off, 0, diff as u64, l4_flags | BPF_F_PSEUDO_HDR)?;
    ctx.store(field_off, &new, 0)
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
