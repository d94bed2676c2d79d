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
//!
//! Every send writes the whole frame afresh from `LB_GEN_FRAME`. Live frames come
//! from a page pool that fills a page with the given frame only when it first
//! allocates the page; a recycled page holds what its last user left there. The
//! node under test rewrites frames in place (MAC addresses and TTL when it routes,
//! addresses and ports when it translates), and the sink's drop hands the page
//! back to the generator's pool, so without the rewrite a page's second trip
//! carried the sink's MAC as destination and the node dropped it as meant for
//! another host: only the pool's first pages (about 128 a run) ever arrived.

use aya_ebpf::{helpers::generated::bpf_get_prandom_u32, programs::XdpContext};
use lb_common::GEN_FRAME_WORDS;

use crate::{
    access::{L4Csum, Packet},
    hdr::{
        ETH_HLEN, ETH_TYPE_IPV4_RAW, ETH_TYPE_OFF, IP_CSUM, IP_HLEN, IP_SRC, TCP_CSUM, TCP_FLAGS,
        TCP_SPORT,
    },
    verdict::{XDP_DROP, XDP_TX},
};

const TCP_FLAG_SYN: u8 = 0x02;
/// Offsets in a frame of Ethernet, a 20-byte IPv4 header and TCP.
const SRC_LOW: usize = ETH_HLEN + IP_SRC + 2;
const TCP: usize = ETH_HLEN + IP_HLEN;

/// The frame to send, in frame order as 16-bit words (`GEN_FRAME_LEN` bytes); set
/// by the loader (`lb_tests::xdp::Generator`). All zero (the agent never sets it):
/// no Ethernet type, so every send is dropped.
#[unsafe(no_mangle)]
static LB_GEN_FRAME: [u16; GEN_FRAME_WORDS] = [0; GEN_FRAME_WORDS];

#[inline(always)]
pub fn handle(ctx: &XdpContext) -> u32 {
    match vary(ctx) {
        Ok(()) => XDP_TX,
        Err(()) => XDP_DROP,
    }
}

#[inline(always)]
fn vary(ctx: &XdpContext) -> Result<(), ()> {
    for i in 0..GEN_FRAME_WORDS {
        // SAFETY: a read-only global the loader patches, read inside its bounds;
        // volatile so the compiler does not fold the zeros it sees at build time.
        let word = unsafe { core::ptr::read_volatile(LB_GEN_FRAME.as_ptr().add(i)) };
        ctx.write(i * 2, &word)?;
    }
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
