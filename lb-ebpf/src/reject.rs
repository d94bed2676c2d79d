//! kube-proxy's REJECT for the per-packet path: a packet to a frontend without
//! usable backend is turned, in place, into the answer the client's stack expects
//! (a RST for TCP, an ICMP / ICMPv6 port unreachable for UDP) and sent back out of
//! the device it came in on, so the client fails at once instead of retrying into
//! silence.

use aya_ebpf::{
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};

use crate::csum::{fold, sum};
use crate::packet::{Flow, ETH_HLEN, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN};

use crate::hdr::{
    self, ICMP6_HLEN, ICMP_HLEN, IP6_HLEN, IPPROTO_ICMP, IPPROTO_ICMPV6, IP_HLEN, TCP_HLEN,
    UDP_HLEN,
};
use lb_common::IpAddrBe;
/// What a port unreachable quotes: the IP header and the UDP header, the least
/// the client's stack needs to find its socket (RFC 792, RFC 4443 2.4 allows it).
const QUOTE4: usize = IP_HLEN + UDP_HLEN;
const QUOTE6: usize = IP6_HLEN + UDP_HLEN;
/// ICMP "destination unreachable", code "port unreachable".
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
/// ICMPv6 "destination unreachable", code "port unreachable".
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
use crate::verdict::TC_ACT_REDIRECT;

/// What the RST answering a TCP segment carries: (seq, ack, flags), and the
/// swapped MAC addresses. `Err` for a RST (never answered) or a failed load.
/// `ip_end`: where the IP packet ends in the frame.
#[inline(always)]
fn answer(ctx: &TcContext, flow: &Flow, ip_end: usize) -> Result<(u32, u32, u8, [u8; 12]), ()> {
    if flow.tcp_flags & TCP_FLAG_RST != 0 {
        return Err(()); // never answer a RST with a RST
    }
    let tcp: [u8; 16] = ctx.load(flow.l4_off).map_err(|_| ())?;
    let be32 = |at: usize| u32::from_be_bytes([tcp[at], tcp[at + 1], tcp[at + 2], tcp[at + 3]]);
    let (seq, ack) = (be32(hdr::TCP_SEQ), be32(hdr::TCP_ACK));
    let data_off = ((tcp[hdr::TCP_DOFF_FLAGS] >> 4) as usize) * 4;
    let payload = ip_end.saturating_sub(flow.l4_off + data_off) as u32;

    // RFC 793: answer an ACK with seq = its ack; otherwise ACK what it occupied.
    let (rst_seq, rst_ack, rst_flags) = if flow.tcp_flags & TCP_FLAG_ACK != 0 {
        (ack, 0, TCP_FLAG_RST)
    } else {
        let mut consumed = payload;
        if flow.tcp_flags & TCP_FLAG_SYN != 0 {
            consumed += 1;
        }
        if flow.tcp_flags & TCP_FLAG_FIN != 0 {
            consumed += 1;
        }
        (0, seq.wrapping_add(consumed), TCP_FLAG_RST | TCP_FLAG_ACK)
    };

    Ok((rst_seq, rst_ack, rst_flags, swapped_mac(ctx)?))
}

/// The RST's TCP header, its checksum over `pseudo` (the pseudo header's sum).
#[inline(always)]
fn rst_header(flow: &Flow, seq: u32, ack: u32, flags: u8, pseudo: u32) -> [u8; TCP_HLEN] {
    let mut th = [0u8; TCP_HLEN];
    put(&mut th, hdr::TCP_SPORT, &flow.dport.to_ne_bytes());
    put(&mut th, hdr::TCP_DPORT, &flow.sport.to_ne_bytes());
    put(&mut th, hdr::TCP_SEQ, &seq.to_be_bytes());
    put(&mut th, hdr::TCP_ACK, &ack.to_be_bytes());
    th[hdr::TCP_DOFF_FLAGS] = ((TCP_HLEN / 4) as u8) << 4;
    th[hdr::TCP_FLAGS] = flags;
    let tcp_csum = !fold(pseudo + sum(&th));
    put(&mut th, hdr::TCP_CSUM, &tcp_csum.to_be_bytes());
    th
}

/// Writes `bytes` into `buf` at `at`.
#[inline(always)]
fn put(buf: &mut [u8], at: usize, bytes: &[u8]) {
    buf[at..at + bytes.len()].copy_from_slice(bytes);
}

/// A fixed IPv6 header (version 6, no traffic class or flow label, hop limit 64)
/// from `src` to `dst` carrying `payload_len` bytes of `next`.
#[inline(always)]
fn ip6_header(src: &IpAddrBe, dst: &IpAddrBe, next: u8, payload_len: usize) -> [u8; IP6_HLEN] {
    let mut ip = [0u8; IP6_HLEN];
    ip[0] = 0x60;
    put(
        &mut ip,
        hdr::IP6_PAYLOAD_LEN,
        &(payload_len as u16).to_be_bytes(),
    );
    ip[hdr::IP6_NEXT_HDR] = next;
    ip[hdr::IP6_HOP_LIMIT] = 64;
    for i in 0..4 {
        put(&mut ip, hdr::IP6_SRC + i * 4, &src.words[i].to_ne_bytes());
        put(&mut ip, hdr::IP6_DST + i * 4, &dst.words[i].to_ne_bytes());
    }
    ip
}

/// An IPv4 header without options (TTL 64), its checksum filled in.
#[inline(always)]
fn ip_header(
    src: u32,
    dst: u32,
    proto: u8,
    total_len: usize,
    dont_fragment: bool,
) -> [u8; IP_HLEN] {
    let mut ip = [0u8; IP_HLEN];
    ip[0] = 0x45;
    put(&mut ip, hdr::IP_TOT_LEN, &(total_len as u16).to_be_bytes());
    if dont_fragment {
        ip[hdr::IP_FRAG_OFF] = 0x40;
    }
    ip[hdr::IP_TTL] = 64;
    ip[hdr::IP_PROTO] = proto;
    put(&mut ip, hdr::IP_SRC, &src.to_ne_bytes());
    put(&mut ip, hdr::IP_DST, &dst.to_ne_bytes());
    let csum = !fold(sum(&ip));
    put(&mut ip, hdr::IP_CSUM, &csum.to_be_bytes());
    ip
}

/// The frame becomes the answer: swapped MACs, then `ip`, `l4` and `quote` (the
/// part of the offending packet an ICMP error carries; none for a RST), sent
/// back out of the device it came in on.
#[inline(always)]
fn reply<const H: usize, const L: usize, const Q: usize>(
    ctx: &TcContext,
    mac: &[u8; 12],
    ip: &[u8; H],
    l4: &[u8; L],
    quote: &[u8; Q],
) -> Result<i32, ()> {
    send_back(ctx, mac, ETH_HLEN + H + L + Q)?;
    ctx.store(ETH_HLEN, ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + H, l4, 0).map_err(|_| ())?;
    if Q > 0 {
        ctx.store(ETH_HLEN + H + L, quote, 0).map_err(|_| ())?;
    }
    Ok(redirect_back(ctx))
}

/// Shrinks the frame to `new_len` bytes and swaps its MAC addresses; the caller
/// writes the headers behind them.
#[inline(always)]
fn send_back(ctx: &TcContext, mac: &[u8; 12], new_len: usize) -> Result<i32, ()> {
    // SAFETY: the context pointer is the program's skb.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb.cast(), new_len as u32, 0) } != 0 {
        return Err(());
    }
    ctx.store(0, mac, 0).map_err(|_| ())?;
    Ok(0)
}

#[inline(always)]
fn redirect_back(ctx: &TcContext) -> i32 {
    // SAFETY: reading the ingress device index from the program's own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper; redirecting to the egress of the device we came in on.
    let _ = unsafe { bpf_redirect(ifindex, 0) };
    TC_ACT_REDIRECT
}

/// The IPv6 twin of [`tcp_reset`]: a 40-byte header without extension headers,
/// hop limit 64, the TCP checksum over the IPv6 pseudo header (RFC 8200 8.1).
#[inline(always)]
pub fn tcp_reset6(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    let payload_len = u16::from_be(
        ctx.load::<u16>(ETH_HLEN + hdr::IP6_PAYLOAD_LEN)
            .map_err(|_| ())?,
    ) as usize;
    let (seq, ack, flags, mac) = answer(ctx, flow, ETH_HLEN + IP6_HLEN + payload_len)?;
    let ip = ip6_header(&flow.daddr, &flow.saddr, flow.proto, TCP_HLEN);
    let pseudo = sum(&ip[hdr::IP6_SRC..IP6_HLEN]) + flow.proto as u32 + TCP_HLEN as u32;
    let th = rst_header(flow, seq, ack, flags, pseudo);
    reply(ctx, &mac, &ip, &th, &[])
}

/// The MAC addresses of the frame, swapped.
#[inline(always)]
fn swapped_mac(ctx: &TcContext) -> Result<[u8; 12], ()> {
    let eth: [u8; 12] = ctx.load(0).map_err(|_| ())?;
    let mut mac = [0u8; 12];
    mac[..6].copy_from_slice(&eth[6..12]);
    mac[6..].copy_from_slice(&eth[..6]);
    Ok(mac)
}

/// An ICMP or ICMPv6 error header (both 8 bytes, the checksum at the same place)
/// of `kind`/`code` quoting `quote`; `pseudo`: the sum of the pseudo header
/// (ICMPv6), or 0 (ICMP has none).
#[inline(always)]
fn unreachable_header(kind: u8, code: u8, pseudo: u32, quote: &[u8]) -> [u8; ICMP_HLEN] {
    let mut icmp = [0u8; ICMP_HLEN];
    icmp[0] = kind;
    icmp[1] = code;
    let csum = !fold(pseudo + sum(&icmp) + sum(quote));
    put(&mut icmp, hdr::ICMP_CSUM, &csum.to_be_bytes());
    icmp
}

/// Rewrites a UDP datagram into the ICMP port unreachable answering it, from the
/// frontend it was sent to, and redirects it back. Only a header without options
/// is quoted (else `Err`: the caller drops, as before).
#[inline(always)]
pub fn udp_unreachable(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    if flow.l4_off != ETH_HLEN + IP_HLEN {
        return Err(());
    }
    let mac = swapped_mac(ctx)?;
    let quote: [u8; QUOTE4] = ctx.load(ETH_HLEN).map_err(|_| ())?;
    let ip = ip_header(
        flow.daddr.v4(),
        flow.saddr.v4(),
        IPPROTO_ICMP,
        IP_HLEN + ICMP_HLEN + QUOTE4,
        false,
    );
    // ICMP's checksum has no pseudo header.
    let icmp = unreachable_header(ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, &quote);
    reply(ctx, &mac, &ip, &icmp, &quote)
}

/// The IPv6 twin of [`udp_unreachable`]: an ICMPv6 port unreachable, its checksum
/// over the IPv6 pseudo header. A datagram behind extension headers is not
/// answered (`Err`).
#[inline(always)]
pub fn udp_unreachable6(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    if flow.l4_off != ETH_HLEN + IP6_HLEN {
        return Err(());
    }
    let mac = swapped_mac(ctx)?;
    let quote: [u8; QUOTE6] = ctx.load(ETH_HLEN).map_err(|_| ())?;
    let ip = ip6_header(
        &flow.daddr,
        &flow.saddr,
        IPPROTO_ICMPV6,
        ICMP6_HLEN + QUOTE6,
    );
    let pseudo =
        sum(&ip[hdr::IP6_SRC..IP6_HLEN]) + IPPROTO_ICMPV6 as u32 + (ICMP6_HLEN + QUOTE6) as u32;
    let icmp = unreachable_header(ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, pseudo, &quote);
    reply(ctx, &mac, &ip, &icmp, &quote)
}

/// Rewrites the packet into a RST answering it and redirects it back. `Err` when
/// the packet cannot be answered (it is a RST itself, or a helper failed); the
/// caller drops it then.
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    let ip_total = u16::from_be(
        ctx.load::<u16>(ETH_HLEN + hdr::IP_TOT_LEN)
            .map_err(|_| ())?,
    ) as usize;
    let (rst_seq, rst_ack, rst_flags, mac) = answer(ctx, flow, ETH_HLEN + ip_total)?;
    let ip = ip_header(
        flow.daddr.v4(),
        flow.saddr.v4(),
        flow.proto,
        IP_HLEN + TCP_HLEN,
        true,
    );
    let pseudo = sum(&ip[hdr::IP_SRC..IP_HLEN]) + flow.proto as u32 + TCP_HLEN as u32;
    let th = rst_header(flow, rst_seq, rst_ack, rst_flags, pseudo);
    reply(ctx, &mac, &ip, &th, &[])
}
