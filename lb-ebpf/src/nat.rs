//! Rewriting a packet's addresses and ports with incremental checksum updates, for
//! both per-packet programs (see `access.rs` for how each reaches the packet).

use lb_common::IpAddrBe;

use crate::{
    access::{L4Csum, Packet},
    packet::{Flow, IP6_DST_OFF, IP6_SRC_OFF, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF},
};

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
/// changes only the latter. A UDP checksum of 0 means "none" (IPv4) and stays 0.
#[inline(always)]
pub fn rewrite<P: Packet>(ctx: &P, flow: &Flow, to: &Tuple) -> Result<(), ()> {
    let csum = flow.l4_csum();
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
            rewrite_addr6(ctx, field_off, &csum, from, to)?;
        } else {
            rewrite_addr(ctx, field_off, &csum, from.v4(), to.v4())?;
        }
    }
    if flow.sport != to.sport {
        rewrite_port(ctx, flow.l4_off, &csum, flow.sport, to.sport)?;
    }
    if flow.dport != to.dport {
        rewrite_port(
            ctx,
            flow.l4_off + crate::hdr::L4_DPORT,
            &csum,
            flow.dport,
            to.dport,
        )?;
    }
    Ok(())
}

/// Rewrites the addresses of a later fragment: an IP header without an L4 header
/// behind it, so only the IPv4 header checksum follows (IPv6 has none).
#[inline(always)]
pub fn rewrite_l3<P: Packet>(
    ctx: &P,
    v6: bool,
    from: (&IpAddrBe, &IpAddrBe),
    to: (&IpAddrBe, &IpAddrBe),
) -> Result<(), ()> {
    if v6 {
        for (field_off, old, new) in [(IP6_SRC_OFF, from.0, to.0), (IP6_DST_OFF, from.1, to.1)] {
            if old != new {
                ctx.write(field_off, &new.words)?;
            }
        }
        return Ok(());
    }
    for (field_off, old, new) in [
        (IP_SRC_OFF, from.0.v4(), to.0.v4()),
        (IP_DST_OFF, from.1.v4(), to.1.v4()),
    ] {
        if old != new {
            ctx.ip_csum_update(IP_CSUM_OFF, old, new, 4)?;
            ctx.write(field_off, &new)?;
        }
    }
    Ok(())
}

#[inline(always)]
fn rewrite_addr<P: Packet>(
    ctx: &P,
    field_off: usize,
    csum: &L4Csum,
    from: u32,
    to: u32,
) -> Result<(), ()> {
    ctx.l4_csum_update(csum, from, to, 4, true)?;
    ctx.ip_csum_update(IP_CSUM_OFF, from, to, 4)?;
    ctx.write(field_off, &to)
}

/// An IPv6 address: in the L4 checksum's pseudo header only.
#[inline(always)]
fn rewrite_addr6<P: Packet>(
    ctx: &P,
    field_off: usize,
    csum: &L4Csum,
    from: &IpAddrBe,
    to: &IpAddrBe,
) -> Result<(), ()> {
    ctx.l4_csum_update6(csum, from, to)?;
    ctx.write(field_off, &to.words)
}

#[inline(always)]
fn rewrite_port<P: Packet>(
    ctx: &P,
    field_off: usize,
    csum: &L4Csum,
    from: u16,
    to: u16,
) -> Result<(), ()> {
    ctx.l4_csum_update(csum, from as u32, to as u32, 2, false)?;
    ctx.write(field_off, &to)
}
