//! ICMPv6 errors about translated flows, the twin of `icmp`: a Packet Too Big from
//! a router between this node and a remote backend (or a backend's own port
//! unreachable) quotes the packet as it left the node, DNATed and perhaps SNATed.
//! The client only knows the frontend, so the quoted packet and the outer header
//! are rewritten as the flow's reply direction would be; without it a client
//! behind a smaller MTU never learns the path MTU and its connection stalls.
//!
//! Unlike ICMP, the ICMPv6 checksum covers the IPv6 pseudo header (RFC 4443 2.3),
//! so the outer address changes enter it too; every checksum follows the 16-bit
//! incremental rule, word by word.
//!
//! The addresses (four of 16 bytes) and the conntrack key live in a per-CPU
//! scratch entry, not on the stack: this path is inlined into the TC programs,
//! whose one frame would otherwise pass the kernel's 512 bytes (bpf-linker says
//! so at build time).

use aya_ebpf::{
    btf_maps::PerCpuArray, helpers::generated::bpf_skb_load_bytes, macros::btf_map,
    programs::TcContext,
};
use lb_common::{CtKey, IpAddrBe, CT_DIR_REPLY, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    csum, ct, fib,
    maps::LB_CT,
    masq,
    packet::{ICMP6_OFF, IP6_DST_OFF, IP6_PAYLOAD_LEN_OFF, IP6_SRC_OFF},
    stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};
use lb_common::stat;

/// Stores through which skb->csum (CHECKSUM_COMPLETE) stays right.
const BPF_F_RECOMPUTE_CSUM: u64 = aya_ebpf::bindings::BPF_F_RECOMPUTE_CSUM as u64;
use crate::hdr::{
    ICMP6_CSUM as ICMP_CSUM_OFF, ICMP6_HLEN as ICMP_HLEN, IP6_DST as DST_IN_HDR, IP6_HLEN,
    IP6_NEXT_HDR, IP6_SRC as SRC_IN_HDR, TCP_CSUM, UDP_CSUM,
};

/// What one translation needs to hold, per CPU (a program runs to its end on
/// one CPU, so no two packets share an entry at once).
#[repr(C)]
pub struct Icmp6Scratch {
    /// The flow's reply-direction conntrack key, built from the quoted packet.
    key: CtKey,
    /// The quoted packet's source and destination.
    inner_src: IpAddrBe,
    inner_dst: IpAddrBe,
    /// The error's own source and destination.
    outer_src: IpAddrBe,
    outer_dst: IpAddrBe,
}

#[btf_map]
static LB_ICMP6_SCRATCH: PerCpuArray<Icmp6Scratch, 1> = PerCpuArray::new();

/// Reads `size_of::<T>()` bytes at `off` into `dst` (map memory: no stack).
#[inline(always)]
fn load_into<T>(ctx: &TcContext, off: usize, dst: &mut T) -> Result<(), i64> {
    // SAFETY: `dst` is a live, writable `T`, and the helper writes exactly its size
    // (or fails, bounds-checked against the packet).
    let rc = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb.cast(),
            off as u32,
            (dst as *mut T).cast(),
            core::mem::size_of::<T>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(rc)
    }
}

/// The verdict for an ICMPv6 error: rewritten and sent on to the client when it
/// belongs to one of our flows; left alone otherwise; dropped (and counted) when
/// a helper failed half-way, as its checksums no longer hold.
#[inline(always)]
pub fn handle(ctx: &TcContext) -> i32 {
    match translate(ctx) {
        Ok(verdict) => verdict,
        Err(_) => {
            stats::bump(stat::TC_MALFORMED);
            TC_ACT_SHOT
        }
    }
}

#[inline(always)]
fn translate(ctx: &TcContext) -> Result<i32, i64> {
    let pass = TC_ACT_OK;
    let payload_len = u16::from_be(ctx.load::<u16>(IP6_PAYLOAD_LEN_OFF)?) as usize;
    let end = ICMP6_OFF + payload_len;
    let inner_ip_off = ICMP6_OFF + ICMP_HLEN;
    let inner_l4_off = inner_ip_off + IP6_HLEN;
    let proto: u8 = ctx.load(inner_ip_off + IP6_NEXT_HDR)?;
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(pass);
    }
    let Some(s) = LB_ICMP6_SCRATCH.get_ptr_mut(0) else {
        return Ok(pass);
    };
    // SAFETY: this CPU's entry, used by nothing else until the program ends.
    let s = unsafe { &mut *s };
    load_into(ctx, inner_ip_off + SRC_IN_HDR, &mut s.inner_src)?;
    load_into(ctx, inner_ip_off + DST_IN_HDR, &mut s.inner_dst)?;
    let ports: [u16; 2] = ctx.load(inner_l4_off)?;
    // The quoted packet went from our side towards the backend; its answers carry
    // the reverse tuple, which is the flow's reply-direction conntrack key.
    s.key.src_addr = s.inner_dst;
    s.key.dst_addr = s.inner_src;
    s.key.src_port = ports[1];
    s.key.dst_port = ports[0];
    s.key.proto = proto;
    s.key._pad = [0; 3];
    // By reference on purpose: the key stays in the scratch entry, off the stack.
    // A Service flow's entry, else a masqueraded flow's (`masq`).
    // SAFETY: a pointer into the map's value, read before the program ends.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let found = unsafe { LB_CT.get(&s.key) }.or_else(|| masq::error_entry(&s.key));
    let Some(entry) = found else {
        return Ok(pass);
    };
    if entry.dir != CT_DIR_REPLY {
        return Ok(pass);
    }
    // With its code (see `Packet::read`).
    let [icmp_type, code]: [u8; 2] = ctx.load(ICMP6_OFF)?;
    if lb_common::quarantine::icmp6_refuses(icmp_type, code) {
        ct::refused_by_error(&mut s.key, entry);
    }
    // The reply entry rewrites to (frontend -> client); the quoted packet becomes
    // (client -> frontend), what the client sent.
    let client = &entry.nat_dst_addr;
    let frontend = &entry.nat_src_addr;

    let l4_csum_off = inner_l4_off
        + if proto == IPPROTO_TCP {
            TCP_CSUM
        } else {
            UDP_CSUM
        };
    // A quote may stop after the ports; a zero UDP checksum stays zero.
    let l4_present = l4_csum_off + 2 <= end;
    let old_l4: u16 = if l4_present {
        ctx.load(l4_csum_off)?
    } else {
        0
    };
    let l4_used = l4_present && !(proto == IPPROTO_UDP && old_l4 == 0);
    let mut l4 = old_l4;
    let mut icmp: u16 = ctx.load(ICMP6_OFF + ICMP_CSUM_OFF)?;

    // Quoted addresses: in the quoted L4 checksum's pseudo header, and ICMP payload.
    for (off, old, new) in [
        (inner_ip_off + SRC_IN_HDR, &s.inner_src, client),
        (inner_ip_off + DST_IN_HDR, &s.inner_dst, frontend),
    ] {
        if old == new {
            continue;
        }
        for i in 0..4 {
            icmp = csum::replace32(icmp, old.words[i], new.words[i]);
            if l4_used {
                l4 = csum::replace32(l4, old.words[i], new.words[i]);
            }
        }
        ctx.store(off, &new.words, BPF_F_RECOMPUTE_CSUM)?;
    }
    // Quoted ports: in the quoted L4 checksum, and ICMP payload.
    for (off, old, new) in [
        (inner_l4_off, ports[0], entry.nat_dst_port),
        (
            inner_l4_off + crate::hdr::L4_DPORT,
            ports[1],
            entry.nat_src_port,
        ),
    ] {
        if old == new {
            continue;
        }
        icmp = csum::replace16(icmp, old, new);
        if l4_used {
            l4 = csum::replace16(l4, old, new);
        }
        ctx.store(off, &new, BPF_F_RECOMPUTE_CSUM)?;
    }
    if l4 != old_l4 {
        icmp = csum::replace16(icmp, old_l4, l4);
        ctx.store(l4_csum_off, &l4, BPF_F_RECOMPUTE_CSUM)?;
    }

    // Outer header, in the ICMPv6 pseudo header: to the client; from the frontend
    // when the backend itself reported (a router on the way keeps its address).
    load_into(ctx, IP6_SRC_OFF, &mut s.outer_src)?;
    load_into(ctx, IP6_DST_OFF, &mut s.outer_dst)?;
    let source_changed = s.outer_src == s.inner_dst && s.outer_src != *frontend;
    let source = if source_changed {
        frontend
    } else {
        &s.outer_src
    };
    for (off, old, new) in [
        (IP6_DST_OFF, &s.outer_dst, client),
        (IP6_SRC_OFF, &s.outer_src, source),
    ] {
        if old == new {
            continue;
        }
        for i in 0..4 {
            icmp = csum::replace32(icmp, old.words[i], new.words[i]);
        }
        ctx.store(off, &new.words, BPF_F_RECOMPUTE_CSUM)?;
    }
    ctx.store(ICMP6_OFF + ICMP_CSUM_OFF, &icmp, BPF_F_RECOMPUTE_CSUM)?;
    stats::bump(stat::TC_CT_HIT);
    // From an address of this node now: routing input would refuse it.
    if source_changed {
        if let Some(verdict) = fib::redirect(ctx, source, client, true) {
            return Ok(verdict);
        }
    }
    Ok(pass)
}
