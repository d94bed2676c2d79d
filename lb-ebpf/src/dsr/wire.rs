//! What DSR adds to a packet on the entry node and finds on the backend's node,
//! byte for byte. Offsets are from the start of the frame; the IP headers the
//! entry node adds to are plain (no options, no extension headers), so everything
//! here lies at fixed places.
//!
//! - IPv4 option, 8 bytes, the first option of the header (IHL 5 -> 7): type
//!   `0x9e` (copied to fragments, control class, number 30: RFC 4727's value for
//!   experiments), length 8, the frontend's port (2 bytes) and address (4 bytes),
//!   network byte order. A receiver that does not know the type ignores it (RFC
//!   1122 3.2.1.8; Linux does).
//! - IPv6 Destination Options header, 24 bytes, right behind the fixed header:
//!   next header, length 2 (3 x 8 bytes), option type `0x1e` (its top bits 00:
//!   "skip if unknown", bit 3 0: unchanged en route; number 30, RFC 4727's
//!   experiment value), option length 18, the frontend's address (16 bytes) and
//!   port (2), then a PadN of 2 bytes.
//! - Outer header (`--dsr-dispatch ipip`): IPv4 (protocol 4, RFC 2003) or IPv6
//!   (next header 41, RFC 2473) in front of the packet, from the entry node to the
//!   backend's node: TTL / hop limit 64, the inner DSCP/ECN byte, IPv4's DF bit
//!   copied from the inner header, no flow label.

use aya_ebpf::{
    bindings::{
        bpf_adj_room_mode::{BPF_ADJ_ROOM_MAC, BPF_ADJ_ROOM_NET},
        BPF_F_ADJ_ROOM_FIXED_GSO,
    },
    programs::TcContext,
};
use lb_common::{IpAddrBe, IPPROTO_TCP, IPPROTO_UDP};

use crate::{
    access::{Packet, Room},
    csum,
    hdr::{self, ETH_HLEN, IP6_HLEN, IPPROTO_IPIP, IPPROTO_IPV6, IP_HLEN, NEXTHDR_DEST, UDP_HLEN},
    packet::Flow,
};

/// The IPv4 option: type, length.
const OPT4_TYPE: u8 = 0x9e;
const OPT4_LEN: usize = 8;
/// The IPv6 option inside the Destination Options header: type, data length; the
/// header's length.
const OPT6_TYPE: u8 = 0x1e;
const OPT6_DATA_LEN: u8 = 18;
const DSTOPT_LEN: usize = 24;
/// The Destination Options header's length field: 8-byte units beyond the first.
const DSTOPT_HDR_EXT_LEN: u8 = (DSTOPT_LEN / 8 - 1) as u8;
/// The PadN option that fills the header to a multiple of 8 bytes.
const PADN: u8 = 1;
const _: () = assert!(2 + 2 + OPT6_DATA_LEN as usize + 2 == DSTOPT_LEN);

/// IPv4 header length with the option, in 32-bit words, and the byte holding it.
const IHL_WITH_OPTION: u8 = ((IP_HLEN + OPT4_LEN) / 4) as u8;
const VERSION_IHL_PLAIN: u8 = 0x40 | (IP_HLEN / 4) as u8;
/// Where the headers lie.
const IP_OFF: usize = ETH_HLEN;
const IP_CSUM_OFF: usize = ETH_HLEN + hdr::IP_CSUM;
const OPTION_OFF: usize = ETH_HLEN + IP_HLEN;
const IP6_PAYLOAD_LEN_OFF: usize = ETH_HLEN + hdr::IP6_PAYLOAD_LEN;
const DSTOPT_OFF: usize = ETH_HLEN + IP6_HLEN;
const OUTER_TTL: u8 = 64;
const IP_DF: u8 = 0x40;

/// Bytes DSR adds to a packet: the frontend when it `carry`s it, the outer header
/// with `ipip`.
#[inline(always)]
pub fn overhead(v6: bool, carry: bool, ipip: bool) -> u16 {
    let mut bytes = 0;
    if carry {
        bytes += if v6 { DSTOPT_LEN } else { OPT4_LEN };
    }
    if ipip {
        bytes += if v6 { IP6_HLEN } else { IP_HLEN };
    }
    bytes as u16
}

// Headers are read and written as the 16- and 32-bit words they lie in, never as
// whole byte arrays: inlined into programs whose one stack frame is near the
// kernel's 512 bytes, a 40-byte header buffer is what tips it over.

/// Four bytes as the word they make in memory.
#[inline(always)]
fn word(bytes: [u8; 4]) -> u32 {
    u32::from_ne_bytes(bytes)
}

/// Adds to a translated packet with a plain IP header what DSR carries: the
/// frontend it was sent to (`flow.daddr`, `flow.dport`) when it `carry`s it, then
/// an outer header `outer` = (source, destination) when given. `Ok(true)` when
/// anything was added. On `Err` the packet may be half-changed: drop it.
#[inline(always)]
pub fn add<P: Packet>(
    ctx: &P,
    flow: &Flow,
    carry: bool,
    outer: Option<(&IpAddrBe, &IpAddrBe)>,
) -> Result<bool, ()> {
    if carry {
        if flow.v6 {
            add_frontend6(ctx, flow)?;
        } else {
            add_frontend4(ctx, flow)?;
        }
    }
    if let Some((source, destination)) = outer {
        if flow.v6 {
            add_outer6(ctx, source, destination)?;
        } else {
            add_outer4(ctx, source.v4(), destination.v4())?;
        }
    }
    Ok(carry || outer.is_some())
}

/// The IPv4 option: its bytes are new to the header checksum (as if they had been
/// zero), and the IHL and total length grow. The writes keep the header's sum, so
/// they need no receive-checksum upkeep (nor does the room, zeros).
#[inline(always)]
fn add_frontend4<P: Packet>(ctx: &P, flow: &Flow) -> Result<(), ()> {
    ctx.open_room(Room::AfterIp { v6: false }, OPT4_LEN as u32)?;
    // Version/IHL, DSCP/ECN, total length.
    let [version_ihl, tos, len_hi, len_lo]: [u8; 4] = ctx.read(IP_OFF)?;
    let first = word([version_ihl, tos, len_hi, len_lo]);
    let total = u16::from_be_bytes([len_hi, len_lo]) + OPT4_LEN as u16;
    let [len_hi, len_lo] = total.to_be_bytes();
    let grown = word([(version_ihl & 0xf0) | IHL_WITH_OPTION, tos, len_hi, len_lo]);
    let [port_hi, port_lo] = flow.dport.to_ne_bytes();
    let option = [
        word([OPT4_TYPE, OPT4_LEN as u8, port_hi, port_lo]),
        flow.daddr.v4(),
    ];
    ctx.ip_csum_update(IP_CSUM_OFF, first, grown, 4)?;
    ctx.ip_csum_update(IP_CSUM_OFF, 0, option[0], 4)?;
    ctx.ip_csum_update(IP_CSUM_OFF, 0, option[1], 4)?;
    ctx.write(IP_OFF, &grown)?;
    ctx.write(OPTION_OFF, &option)
}

#[inline(always)]
fn add_frontend6<P: Packet>(ctx: &P, flow: &Flow) -> Result<(), ()> {
    ctx.open_room(Room::AfterIp { v6: true }, DSTOPT_LEN as u32)?;
    // Payload length, next header, hop limit.
    let [len_hi, len_lo, next, hops]: [u8; 4] = ctx.read(IP6_PAYLOAD_LEN_OFF)?;
    let payload = u16::from_be_bytes([len_hi, len_lo]) + DSTOPT_LEN as u16;
    let [len_hi, len_lo] = payload.to_be_bytes();
    let [port_hi, port_lo] = flow.dport.to_ne_bytes();
    ctx.write_added(
        IP6_PAYLOAD_LEN_OFF,
        &word([len_hi, len_lo, NEXTHDR_DEST, hops]),
    )?;
    ctx.write_added(
        DSTOPT_OFF,
        &word([next, DSTOPT_HDR_EXT_LEN, OPT6_TYPE, OPT6_DATA_LEN]),
    )?;
    ctx.write_added(DSTOPT_OFF + 4, &flow.daddr.words)?;
    ctx.write_added(DSTOPT_OFF + 20, &word([port_hi, port_lo, PADN, 0]))
}

/// The IPv4 header checksum of a header given as its five words as they lie in
/// memory (the checksum word zero), in the same order.
#[inline(always)]
fn ip_checksum(header: &[u32; 5]) -> u16 {
    let mut sum = 0u32;
    for w in header {
        sum += (w & 0xffff) + (w >> 16);
    }
    !csum::fold(sum)
}

#[inline(always)]
fn add_outer4<P: Packet>(ctx: &P, source: u32, destination: u32) -> Result<(), ()> {
    let [_, tos, len_hi, len_lo]: [u8; 4] = ctx.read(IP_OFF)?;
    let [flags, _]: [u8; 2] = ctx.read(IP_OFF + hdr::IP_FRAG_OFF)?;
    let total = u16::from_be_bytes([len_hi, len_lo]) + IP_HLEN as u16;
    let [len_hi, len_lo] = total.to_be_bytes();
    ctx.open_room(Room::AfterEthernet { v6: false }, IP_HLEN as u32)?;
    let mut outer = [
        word([VERSION_IHL_PLAIN, tos, len_hi, len_lo]),
        // No identification: DF, copied from the inner header, says none is needed.
        word([0, 0, flags & IP_DF, 0]),
        word([OUTER_TTL, IPPROTO_IPIP, 0, 0]),
        source,
        destination,
    ];
    // Summed as the words lie in memory, the checksum comes out the same way.
    let [check0, check1] = ip_checksum(&outer).to_ne_bytes();
    outer[2] = word([OUTER_TTL, IPPROTO_IPIP, check0, check1]);
    ctx.write(IP_OFF, &outer)
}

#[inline(always)]
fn add_outer6<P: Packet>(ctx: &P, source: &IpAddrBe, destination: &IpAddrBe) -> Result<(), ()> {
    let [version_class, class_label, _, _]: [u8; 4] = ctx.read(IP_OFF)?;
    let [len_hi, len_lo]: [u8; 2] = ctx.read(IP6_PAYLOAD_LEN_OFF)?;
    let total = u16::from_be_bytes([len_hi, len_lo]) + IP6_HLEN as u16;
    let [len_hi, len_lo] = total.to_be_bytes();
    ctx.open_room(Room::AfterEthernet { v6: true }, IP6_HLEN as u32)?;
    // Version 6, the inner traffic class (which straddles the first two bytes),
    // no flow label; the length, IPv6 in IPv6, the hop limit.
    let first = [
        word([0x60 | (version_class & 0x0f), class_label & 0xf0, 0, 0]),
        word([len_hi, len_lo, IPPROTO_IPV6, OUTER_TTL]),
    ];
    ctx.write_added(IP_OFF, &first)?;
    ctx.write_added(IP_OFF + hdr::IP6_SRC, &source.words)?;
    ctx.write_added(IP_OFF + hdr::IP6_DST, &destination.words)
}

/// A TCP/UDP packet as it reaches the backend's node from an entry node: the
/// client's and the pod's ends, and the frontend when it carries one.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Arrival {
    pub client: IpAddrBe,
    pub pod: IpAddrBe,
    /// Network byte order, as in the packet.
    pub client_port: u16,
    pub pod_port: u16,
    pub proto: u8,
    /// The packet carries the frontend below (our option, or our Destination
    /// Options header). Without it both are zero. (A flag rather than an
    /// `Option`: see `packet::Parsed::Icmp6Error`.)
    pub has_frontend: bool,
    pub frontend: IpAddrBe,
    pub frontend_port: u16,
}

/// Reads into `a` the packet whose IP header starts at `ip_off`, if it is as DSR
/// sends it: TCP or UDP, not a fragment, behind a plain header or one carrying
/// exactly our option (IPv4: IHL 7 with our option first; IPv6: our Destination
/// Options header and nothing else). `None` for anything else (another option or
/// header, a truncated or inconsistent one): not ours, left as it is, and `a`
/// half-filled. (Filled in place: the caller keeps it off the stack.)
#[inline(always)]
pub fn arrival<P: Packet>(ctx: &P, ip_off: usize, v6: bool, a: &mut Arrival) -> Option<()> {
    a.has_frontend = false;
    a.frontend = IpAddrBe::default();
    a.frontend_port = 0;
    let l4_off = if v6 {
        arrival6(ctx, ip_off, a)?
    } else {
        arrival4(ctx, ip_off, a)?
    };
    let ports: [u16; 2] = ctx.read(l4_off).ok()?;
    a.client_port = ports[0];
    a.pod_port = ports[1];
    Some(())
}

/// The IPv4 part of [`arrival`]; the offset of the TCP/UDP header.
#[inline(always)]
fn arrival4<P: Packet>(ctx: &P, ip_off: usize, a: &mut Arrival) -> Option<usize> {
    let [version_ihl, _, len_hi, len_lo]: [u8; 4] = ctx.read(ip_off).ok()?;
    let [flags, offset]: [u8; 2] = ctx.read(ip_off + hdr::IP_FRAG_OFF).ok()?;
    let [_, proto]: [u8; 2] = ctx.read(ip_off + hdr::IP_TTL).ok()?;
    let ihl = version_ihl & 0x0f;
    let total = u16::from_be_bytes([len_hi, len_lo]) as usize;
    let fragmented = flags & 0x3f != 0 || offset != 0;
    if version_ihl >> 4 != 4
        || (ihl != 5 && ihl != IHL_WITH_OPTION)
        || fragmented
        || (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        || total < (ihl as usize) * 4 + UDP_HLEN
    {
        return None;
    }
    a.client = IpAddrBe::from_v4(ctx.read(ip_off + hdr::IP_SRC).ok()?);
    a.pod = IpAddrBe::from_v4(ctx.read(ip_off + hdr::IP_DST).ok()?);
    a.proto = proto;
    if ihl == IHL_WITH_OPTION {
        let [kind, len, port_hi, port_lo]: [u8; 4] = ctx.read(ip_off + IP_HLEN).ok()?;
        if kind != OPT4_TYPE || len != OPT4_LEN as u8 {
            return None;
        }
        a.has_frontend = true;
        a.frontend_port = u16::from_ne_bytes([port_hi, port_lo]);
        a.frontend = IpAddrBe::from_v4(ctx.read(ip_off + IP_HLEN + 4).ok()?);
    }
    Some(ip_off + (ihl as usize) * 4)
}

/// The IPv6 part of [`arrival`]; the offset of the TCP/UDP header.
#[inline(always)]
fn arrival6<P: Packet>(ctx: &P, ip_off: usize, a: &mut Arrival) -> Option<usize> {
    let [version_class, _]: [u8; 2] = ctx.read(ip_off).ok()?;
    let [len_hi, len_lo, mut next, _]: [u8; 4] = ctx.read(ip_off + hdr::IP6_PAYLOAD_LEN).ok()?;
    if version_class >> 4 != 6 {
        return None;
    }
    let payload = u16::from_be_bytes([len_hi, len_lo]) as usize;
    a.client = IpAddrBe::from_v6(ctx.read(ip_off + hdr::IP6_SRC).ok()?);
    a.pod = IpAddrBe::from_v6(ctx.read(ip_off + hdr::IP6_DST).ok()?);
    let mut l4_off = ip_off + IP6_HLEN;
    if next == NEXTHDR_DEST {
        let [inner_next, ext_len, kind, len]: [u8; 4] = ctx.read(l4_off).ok()?;
        if ext_len != DSTOPT_HDR_EXT_LEN || kind != OPT6_TYPE || len != OPT6_DATA_LEN {
            return None;
        }
        let [port_hi, port_lo]: [u8; 2] = ctx.read(l4_off + 20).ok()?;
        a.has_frontend = true;
        a.frontend = IpAddrBe::from_v6(ctx.read(l4_off + 4).ok()?);
        a.frontend_port = u16::from_ne_bytes([port_hi, port_lo]);
        next = inner_next;
        l4_off += DSTOPT_LEN;
    }
    if (next != IPPROTO_TCP && next != IPPROTO_UDP)
        || payload < (l4_off - ip_off - IP6_HLEN) + UDP_HLEN
    {
        return None;
    }
    a.proto = next;
    Some(l4_off)
}

/// Removes the outer header in front of the packet (TC, on the backend's node).
/// GSO (a merged IPIP packet) keeps its segment size: the segments were cut to fit
/// with the outer header, so they fit without it.
#[inline(always)]
pub fn remove_outer(ctx: &TcContext, v6: bool) -> Result<(), ()> {
    let len = if v6 { IP6_HLEN } else { IP_HLEN } as i32;
    ctx.adjust_room(-len, BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_FIXED_GSO as u64)
        .map_err(|_| ())
}

/// Removes the frontend the packet carries (found by [`arrival`] right behind
/// its fixed header), so the pod receives the packet the client sent, DNATed; the
/// IPv4 header gets its length and checksum back (the option's words leave the
/// checksum), the IPv6 header its payload length and next header. Neither touches
/// the TCP/UDP checksum, whose pseudo header has no options. On `Err` the packet
/// may be half-changed: drop it.
#[inline(always)]
pub fn strip_frontend(ctx: &TcContext, v6: bool) -> Result<(), ()> {
    if v6 {
        let [next, _]: [u8; 2] = ctx.read(DSTOPT_OFF)?;
        ctx.adjust_room(-(DSTOPT_LEN as i32), BPF_ADJ_ROOM_NET, 0)
            .map_err(|_| ())?;
        let [len_hi, len_lo, _, hops]: [u8; 4] = ctx.read(IP6_PAYLOAD_LEN_OFF)?;
        let payload = u16::from_be_bytes([len_hi, len_lo]) - DSTOPT_LEN as u16;
        let [len_hi, len_lo] = payload.to_be_bytes();
        return ctx.write_added(IP6_PAYLOAD_LEN_OFF, &word([len_hi, len_lo, next, hops]));
    }
    let option: [u32; 2] = ctx.read(OPTION_OFF)?;
    ctx.adjust_room(-(OPT4_LEN as i32), BPF_ADJ_ROOM_NET, 0)
        .map_err(|_| ())?;
    let [version_ihl, tos, len_hi, len_lo]: [u8; 4] = ctx.read(IP_OFF)?;
    let first = word([version_ihl, tos, len_hi, len_lo]);
    let total = u16::from_be_bytes([len_hi, len_lo]) - OPT4_LEN as u16;
    let [len_hi, len_lo] = total.to_be_bytes();
    let plain = word([VERSION_IHL_PLAIN, tos, len_hi, len_lo]);
    ctx.ip_csum_update(IP_CSUM_OFF, first, plain, 4)?;
    ctx.ip_csum_update(IP_CSUM_OFF, option[0], 0, 4)?;
    ctx.ip_csum_update(IP_CSUM_OFF, option[1], 0, 4)?;
    ctx.write(IP_OFF, &plain)
}
