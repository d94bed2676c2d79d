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

const IP_HLEN: usize = 20;
const IP6_HLEN: usize = 40;
const TCP_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
const ICMP_HLEN: usize = 8;
/// What a port unreachable quotes: the IP header and the UDP header, the least
/// the client's stack needs to find its socket (RFC 792, RFC 4443 2.4 allows it).
const QUOTE4: usize = IP_HLEN + UDP_HLEN;
const QUOTE6: usize = IP6_HLEN + UDP_HLEN;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_ICMPV6: u8 = 58;
/// ICMP "destination unreachable", code "port unreachable".
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
/// ICMPv6 "destination unreachable", code "port unreachable".
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
use aya_ebpf::bindings::TC_ACT_REDIRECT;

/// What the RST answering a TCP segment carries: (seq, ack, flags), and the
/// swapped MAC addresses. `Err` for a RST (never answered) or a failed load.
/// `ip_end`: where the IP packet ends in the frame.
#[inline(always)]
fn answer(ctx: &TcContext, flow: &Flow, ip_end: usize) -> Result<(u32, u32, u8, [u8; 12]), ()> {
    if flow.tcp_flags & TCP_FLAG_RST != 0 {
        return Err(()); // never answer a RST with a RST
    }
    let eth: [u8; 12] = ctx.load(0).map_err(|_| ())?;
    let tcp: [u8; 16] = ctx.load(flow.l4_off).map_err(|_| ())?;
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let data_off = ((tcp[12] >> 4) as usize) * 4;
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

    let mut mac = [0u8; 12];
    mac[..6].copy_from_slice(&eth[6..12]);
    mac[6..].copy_from_slice(&eth[..6]);
    Ok((rst_seq, rst_ack, rst_flags, mac))
}

/// The RST's TCP header, its checksum over `pseudo` (the pseudo header's sum).
#[inline(always)]
fn rst_header(flow: &Flow, seq: u32, ack: u32, flags: u8, pseudo: u32) -> [u8; TCP_HLEN] {
    let mut th = [0u8; TCP_HLEN];
    th[0..2].copy_from_slice(&flow.dport.to_ne_bytes());
    th[2..4].copy_from_slice(&flow.sport.to_ne_bytes());
    th[4..8].copy_from_slice(&seq.to_be_bytes());
    th[8..12].copy_from_slice(&ack.to_be_bytes());
    th[12] = ((TCP_HLEN / 4) as u8) << 4;
    th[13] = flags;
    let tcp_csum = !fold(pseudo + sum(&th));
    th[16..18].copy_from_slice(&tcp_csum.to_be_bytes());
    th
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
    let payload_len = u16::from_be(ctx.load::<u16>(ETH_HLEN + 4).map_err(|_| ())?) as usize;
    let (seq, ack, flags, mac) = answer(ctx, flow, ETH_HLEN + IP6_HLEN + payload_len)?;
    let mut ip = [0u8; IP6_HLEN];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&(TCP_HLEN as u16).to_be_bytes());
    ip[6] = flow.proto;
    ip[7] = 64;
    for i in 0..4 {
        ip[8 + i * 4..12 + i * 4].copy_from_slice(&flow.daddr.words[i].to_ne_bytes());
        ip[24 + i * 4..28 + i * 4].copy_from_slice(&flow.saddr.words[i].to_ne_bytes());
    }
    let pseudo = sum(&ip[8..40]) + flow.proto as u32 + TCP_HLEN as u32;
    let th = rst_header(flow, seq, ack, flags, pseudo);
    send_back(ctx, &mac, ETH_HLEN + IP6_HLEN + TCP_HLEN)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP6_HLEN, &th, 0).map_err(|_| ())?;
    Ok(redirect_back(ctx))
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
    let mut ip = [0u8; IP_HLEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((IP_HLEN + ICMP_HLEN + QUOTE4) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = IPPROTO_ICMP;
    ip[12..16].copy_from_slice(&flow.daddr.v4().to_ne_bytes());
    ip[16..20].copy_from_slice(&flow.saddr.v4().to_ne_bytes());
    let ip_csum = !fold(sum(&ip));
    ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    let mut icmp = [0u8; ICMP_HLEN];
    icmp[0] = ICMP_DEST_UNREACH;
    icmp[1] = ICMP_PORT_UNREACH;
    let icmp_csum = !fold(sum(&icmp) + sum(&quote));
    icmp[2..4].copy_from_slice(&icmp_csum.to_be_bytes());
    send_back(ctx, &mac, ETH_HLEN + IP_HLEN + ICMP_HLEN + QUOTE4)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_HLEN, &icmp, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_HLEN + ICMP_HLEN, &quote, 0)
        .map_err(|_| ())?;
    Ok(redirect_back(ctx))
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
    let mut ip = [0u8; IP6_HLEN];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&((ICMP_HLEN + QUOTE6) as u16).to_be_bytes());
    ip[6] = IPPROTO_ICMPV6;
    ip[7] = 64;
    for i in 0..4 {
        ip[8 + i * 4..12 + i * 4].copy_from_slice(&flow.daddr.words[i].to_ne_bytes());
        ip[24 + i * 4..28 + i * 4].copy_from_slice(&flow.saddr.words[i].to_ne_bytes());
    }
    let mut icmp = [0u8; ICMP_HLEN];
    icmp[0] = ICMPV6_DEST_UNREACH;
    icmp[1] = ICMPV6_PORT_UNREACH;
    let pseudo = sum(&ip[8..40]) + IPPROTO_ICMPV6 as u32 + (ICMP_HLEN + QUOTE6) as u32;
    let icmp_csum = !fold(pseudo + sum(&icmp) + sum(&quote));
    icmp[2..4].copy_from_slice(&icmp_csum.to_be_bytes());
    send_back(ctx, &mac, ETH_HLEN + IP6_HLEN + ICMP_HLEN + QUOTE6)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP6_HLEN, &icmp, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP6_HLEN + ICMP_HLEN, &quote, 0)
        .map_err(|_| ())?;
    Ok(redirect_back(ctx))
}

/// Rewrites the packet into a RST answering it and redirects it back. `Err` when
/// the packet cannot be answered (it is a RST itself, or a helper failed); the
/// caller drops it then.
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    let ip_total = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).map_err(|_| ())?) as usize;
    let (rst_seq, rst_ack, rst_flags, mac) = answer(ctx, flow, ETH_HLEN + ip_total)?;

    let mut ip = [0u8; IP_HLEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((IP_HLEN + TCP_HLEN) as u16).to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64;
    ip[9] = flow.proto;
    ip[12..16].copy_from_slice(&flow.daddr.v4().to_ne_bytes());
    ip[16..20].copy_from_slice(&flow.saddr.v4().to_ne_bytes());
    let ip_csum = !fold(sum(&ip));
    ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());

    let pseudo = sum(&ip[12..20]) + flow.proto as u32 + TCP_HLEN as u32;
    let th = rst_header(flow, rst_seq, rst_ack, rst_flags, pseudo);
    send_back(ctx, &mac, ETH_HLEN + IP_HLEN + TCP_HLEN)?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_HLEN, &th, 0).map_err(|_| ())?;
    Ok(redirect_back(ctx))
}
