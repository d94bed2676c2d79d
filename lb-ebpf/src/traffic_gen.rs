//! A packet generator for the benchmark, not part of the datapath (the agent never
//! loads or attaches it). Run through BPF_PROG_TEST_RUN's live-frames mode on the
//! generator's own device, it sends the frame it was given out of that device
//! (`XDP_TX`) over and over without an skb or a system call per packet, so the
//! generator's cost is small beside the node's under test.
//!
//! A frame whose TCP flags hold SYN gets a new source port and low half of its
//! source address on every send (a new flow each time: the SYN flood row); any
//! other frame is sent as given (one established flow). IPv4 only; checksums are
//! kept right, as the node's stack verifies the IPv4 header's.

use aya_ebpf::{helpers::generated::bpf_get_prandom_u32, programs::XdpContext};

use crate::{
    access::{L4Csum, Packet},
    hdr::{
        ETH_HLEN, ETH_TYPE_IPV4_RAW, ETH_TYPE_OFF, IP_CSUM, IP_HLEN, IP_SRC, TCP_CSUM,
        TCP_FLAGS, TCP_SPORT,
    },
    verdict::{XDP_DROP, XDP_TX},
};

const TCP_FLAG_SYN: u8 = 0x02;
/// Offsets in a frame of Ethernet, a 20-byte IPv4 header and TCP.
const SRC_LOW: usize = ETH_HLEN + IP_SRC + 2;
const TCP: usize = ETH_HLEN + IP_HLEN;

#[inline(always)]
pub fn handle(ctx: &XdpContext) -> u32 {
    match vary(ctx) {
        Ok(()) => XDP_TX,
        Err(()) => XDP_DROP,
    }
}

#[inline(always)]
fn vary(ctx: &XdpContext) -> Result<(), ()> {
    let ether_type: u16 = ctx.read(ETH_TYPE_OFF)?;
    if ether_type != ETH_TYPE_IPV4_RAW {
        return Err(());
    }
    let flags: [u8; 2] = ctx.read(TCP + TCP_FLAGS - 1)?;
    if flags[1] & TCP_FLAG_SYN == 0 {
        return Ok(());
    }
    // SAFETY: a helper without arguments.
    let random = unsafe { bpf_get_prandom_u32() };
    // Port 0 is not a port; any other value is.
    let port = (random as u16).max(1);
    let low = (random >> 16) as u16;
    let old_port: u16 = ctx.read(TCP + TCP_SPORT)?;
    let old_low: u16 = ctx.read(SRC_LOW)?;
    ctx.write(TCP + TCP_SPORT, &port)?;
    ctx.write(SRC_LOW, &low)?;
    ctx.ip_csum_update(ETH_HLEN + IP_CSUM, old_low as u32, low as u32, 2)?;
    let csum = L4Csum {
        off: TCP + TCP_CSUM,
        udp: false,
    };
    ctx.l4_csum_update(&csum, old_port as u32, port as u32, 2, false)?;
    ctx.l4_csum_update(&csum, old_low as u32, low as u32, 2, true)
}
