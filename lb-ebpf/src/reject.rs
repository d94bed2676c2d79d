//! kube-proxy's REJECT for the per-packet path: a TCP packet to a frontend without
//! usable backend is turned, in place, into the RST the client's stack expects and
//! sent back out of the device it came in on, so the client fails at once instead of
//! retrying SYNs into silence.

use aya_ebpf::{
    helpers::generated::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};

use crate::csum::{fold, sum};
use crate::packet::{Flow, ETH_HLEN, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN};

const IP_HLEN: usize = 20;
const TCP_HLEN: usize = 20;
use aya_ebpf::bindings::TC_ACT_REDIRECT;

/// Rewrites the packet into a RST answering it and redirects it back. `Err` when
/// the packet cannot be answered (it is a RST itself, or a helper failed); the
/// caller drops it then.
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, flow: &Flow) -> Result<i32, ()> {
    if flow.tcp_flags & TCP_FLAG_RST != 0 {
        return Err(()); // never answer a RST with a RST
    }
    let eth: [u8; 12] = ctx.load(0).map_err(|_| ())?;
    let ip_total = u16::from_be(ctx.load::<u16>(ETH_HLEN + 2).map_err(|_| ())?) as usize;
    let tcp: [u8; 16] = ctx.load(flow.l4_off).map_err(|_| ())?;
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    let ack = u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]);
    let data_off = ((tcp[12] >> 4) as usize) * 4;
    let ip_hlen = flow.l4_off - ETH_HLEN;
    let payload = ip_total.saturating_sub(ip_hlen + data_off) as u32;

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

    let mut ip = [0u8; IP_HLEN];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((IP_HLEN + TCP_HLEN) as u16).to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64;
    ip[9] = flow.proto;
    ip[12..16].copy_from_slice(&flow.daddr.to_ne_bytes());
    ip[16..20].copy_from_slice(&flow.saddr.to_ne_bytes());
    let ip_csum = !fold(sum(&ip));
    ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());

    let mut th = [0u8; TCP_HLEN];
    th[0..2].copy_from_slice(&flow.dport.to_ne_bytes());
    th[2..4].copy_from_slice(&flow.sport.to_ne_bytes());
    th[4..8].copy_from_slice(&rst_seq.to_be_bytes());
    th[8..12].copy_from_slice(&rst_ack.to_be_bytes());
    th[12] = ((TCP_HLEN / 4) as u8) << 4;
    th[13] = rst_flags;
    let pseudo = sum(&ip[12..20]) + flow.proto as u32 + TCP_HLEN as u32;
    let tcp_csum = !fold(pseudo + sum(&th));
    th[16..18].copy_from_slice(&tcp_csum.to_be_bytes());

    let new_len = (ETH_HLEN + IP_HLEN + TCP_HLEN) as u32;
    // SAFETY: the context pointer is the program's skb.
    if unsafe { bpf_skb_change_tail(ctx.skb.skb.cast(), new_len, 0) } != 0 {
        return Err(());
    }
    ctx.store(0, &mac, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN, &ip, 0).map_err(|_| ())?;
    ctx.store(ETH_HLEN + IP_HLEN, &th, 0).map_err(|_| ())?;
    // SAFETY: reading the ingress device index from the program's own context.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: plain helper; redirecting to the egress of the device we came in on.
    let _ = unsafe { bpf_redirect(ifindex, 0) };
    Ok(TC_ACT_REDIRECT)
}
