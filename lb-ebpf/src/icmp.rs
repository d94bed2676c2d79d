//! ICMP errors about translated flows: a backend's "port unreachable" or a router's
//! "fragmentation needed" quotes the packet as the backend saw it (pod address,
//! maybe our SNAT port). The client only knows the frontend, so both the quoted
//! packet and the outer header are rewritten as the reply direction of the flow
//! would be, or the client's stack could not match the error to its socket.

use aya_ebpf::programs::TcContext;
use lb_common::{stat, CtKey, IpAddrBe, CT_DIR_REPLY};

use crate::{
    csum, ct, fib,
    maps::LB_CT,
    masq,
    packet::{IcmpError, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF},
    stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};

/// Stores through which skb->csum (CHECKSUM_COMPLETE) stays right.
const BPF_F_RECOMPUTE_CSUM: u64 = aya_ebpf::bindings::BPF_F_RECOMPUTE_CSUM as u64;
use crate::hdr::{
    ICMP_CSUM as ICMP_CSUM_OFF, IP_CSUM as IP_CSUM_IN_HDR, IP_DST as IP_DST_IN_HDR,
    IP_SRC as IP_SRC_IN_HDR,
};

/// The verdict for an ICMP error, as `icmp6::handle` gives for ICMPv6: rewritten
/// and sent on to the client when it belongs to one of our flows (forwarded by the
/// program when its new source is this node's); left alone otherwise; dropped and
/// counted when a helper failed half-way, as its checksums no longer hold.
#[inline(always)]
pub fn handle(ctx: &TcContext, error: &IcmpError) -> i32 {
    match translate(ctx, error) {
        Ok(Some((source, destination))) => {
            stats::bump(stat::TC_CT_HIT);
            if source != error.saddr {
                let (source, destination) =
                    (IpAddrBe::from_v4(source), IpAddrBe::from_v4(destination));
                if let Some(verdict) = fib::redirect(ctx, &source, &destination, false) {
                    return verdict;
                }
            }
            TC_ACT_OK
        }
        Ok(None) => TC_ACT_OK,
        Err(_) => {
            stats::bump(stat::TC_MALFORMED);
            TC_ACT_SHOT
        }
    }
}

/// `Ok(Some((source, destination)))`, the new outer addresses, when the error
/// belonged to one of our flows and was rewritten.
#[inline(always)]
fn translate(ctx: &TcContext, e: &IcmpError) -> Result<Option<(u32, u32)>, i64> {
    // The quoted packet went from our side towards the backend; its answers carry
    // the reverse tuple, which is the flow's reply-direction conntrack key.
    let mut key = CtKey {
        src_addr: e.inner.daddr,
        dst_addr: e.inner.saddr,
        src_port: e.inner.dport,
        dst_port: e.inner.sport,
        proto: e.inner.proto,
        _pad: [0; 3],
    };
    // A Service flow's, else a masqueraded flow's (`masq`). By reference on
    // purpose: passed by value, the key was copied for the first lookup and kept
    // for the second, 40 more bytes of a frame at the kernel's limit.
    // SAFETY: copied out at once.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let found = unsafe { LB_CT.get(&key) }.or_else(|| masq::error_entry(&key));
    let Some(entry) = found.copied() else {
        return Ok(None);
    };
    if entry.dir != CT_DIR_REPLY {
        return Ok(None);
    }
    if e.refuses {
        ct::refused_by_error(&mut key, &entry);
    }
    // The reply entry rewrites to (frontend -> client); the quoted packet becomes
    // (client -> frontend), what the client sent.
    let (client, client_port) = (entry.nat_dst_addr.v4(), entry.nat_dst_port);
    let (frontend, frontend_port) = (entry.nat_src_addr.v4(), entry.nat_src_port);

    let inner_ip_csum_off = e.inner_ip_off + IP_CSUM_IN_HDR;
    let inner_l4_csum_off = e.inner.l4_csum_off();
    let old_ip_csum: u16 = ctx.load(inner_ip_csum_off)?;
    let mut ip_csum = old_ip_csum;
    let old_l4_csum: u16 = if e.inner_csum_present {
        ctx.load(inner_l4_csum_off)?
    } else {
        0
    };
    // A zero UDP checksum means "none" and stays so.
    let l4_csum_used =
        e.inner_csum_present && !(e.inner.proto == lb_common::IPPROTO_UDP && old_l4_csum == 0);
    let mut l4_csum = old_l4_csum;
    let mut icmp_csum: u16 = ctx.load(e.icmp_off + ICMP_CSUM_OFF)?;

    // Quoted addresses: covered by the quoted IP header checksum and the quoted
    // L4 checksum's pseudo header; the bytes themselves by the ICMP checksum.
    for (off, old, new) in [
        (e.inner_ip_off + IP_SRC_IN_HDR, e.inner.saddr.v4(), client),
        (e.inner_ip_off + IP_DST_IN_HDR, e.inner.daddr.v4(), frontend),
    ] {
        if old == new {
            continue;
        }
        ip_csum = csum::replace32(ip_csum, old, new);
        if l4_csum_used {
            l4_csum = csum::replace32(l4_csum, old, new);
        }
        icmp_csum = csum::replace32(icmp_csum, old, new);
        ctx.store(off, &new, BPF_F_RECOMPUTE_CSUM)?;
    }
    // Quoted ports: covered by the quoted L4 checksum and the ICMP checksum.
    for (off, old, new) in [
        (e.inner_l4_off, e.inner.sport, client_port),
        (
            e.inner_l4_off + crate::hdr::L4_DPORT,
            e.inner.dport,
            frontend_port,
        ),
    ] {
        if old == new {
            continue;
        }
        if l4_csum_used {
            l4_csum = csum::replace16(l4_csum, old, new);
        }
        icmp_csum = csum::replace16(icmp_csum, old, new);
        ctx.store(off, &new, BPF_F_RECOMPUTE_CSUM)?;
    }
    // The quoted checksum fields are ICMP payload too.
    if ip_csum != old_ip_csum {
        icmp_csum = csum::replace16(icmp_csum, old_ip_csum, ip_csum);
        ctx.store(inner_ip_csum_off, &ip_csum, BPF_F_RECOMPUTE_CSUM)?;
    }
    if l4_csum != old_l4_csum {
        icmp_csum = csum::replace16(icmp_csum, old_l4_csum, l4_csum);
        ctx.store(inner_l4_csum_off, &l4_csum, BPF_F_RECOMPUTE_CSUM)?;
    }
    ctx.store(e.icmp_off + ICMP_CSUM_OFF, &icmp_csum, BPF_F_RECOMPUTE_CSUM)?;

    // Outer header: to the client; from the frontend when the backend itself
    // reported (a router on the way keeps its own address).
    if e.daddr != client {
        ctx.l3_csum_replace(IP_CSUM_OFF, e.daddr as u64, client as u64, 4)?;
        ctx.store(IP_DST_OFF, &client, BPF_F_RECOMPUTE_CSUM)?;
    }
    let mut source = e.saddr;
    if e.saddr == e.inner.daddr.v4() && e.saddr != frontend {
        ctx.l3_csum_replace(IP_CSUM_OFF, e.saddr as u64, frontend as u64, 4)?;
        ctx.store(IP_SRC_OFF, &frontend, BPF_F_RECOMPUTE_CSUM)?;
        source = frontend;
    }
    Ok(Some((source, client)))
}
