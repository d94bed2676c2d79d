//! Parsing Ethernet + IPv4 or IPv6 (with its extension headers) + TCP/UDP headers,
//! for both per-packet programs, through [`Packet::read`], which bounds-checks every
//! read against the packet: a truncated header is an error, never a read past the
//! end.

use lb_common::{IpAddrBe, IPPROTO_TCP, IPPROTO_UDP};

use crate::access::{L4Csum, Packet};
pub use crate::hdr::ETH_HLEN;
use crate::hdr::{
    self, ETH_TYPE_IPV4_RAW, ETH_TYPE_IPV6_RAW, ICMP_HLEN, IP6_HLEN as IPV6_HLEN, IPPROTO_ICMP,
    IPPROTO_ICMPV6 as NEXTHDR_ICMPV6, IPPROTO_IPIP, IPPROTO_IPV6, IP_HLEN as IPV4_MIN_HLEN,
    NEXTHDR_AUTH, NEXTHDR_DEST, NEXTHDR_ESP, NEXTHDR_FRAGMENT, NEXTHDR_HOP, NEXTHDR_ROUTING,
    TCP_HLEN as TCP_MIN_HLEN, UDP_HLEN,
};

/// Offsets of the IPv6 hop limit and addresses in the frame.
pub const IP6_HOP_LIMIT_OFF: usize = ETH_HLEN + hdr::IP6_HOP_LIMIT;
pub const IP6_SRC_OFF: usize = ETH_HLEN + hdr::IP6_SRC;
pub const IP6_DST_OFF: usize = ETH_HLEN + hdr::IP6_DST;
/// Offset of the payload length, and of an ICMPv6 header right behind the fixed
/// IPv6 header.
pub const IP6_PAYLOAD_LEN_OFF: usize = ETH_HLEN + hdr::IP6_PAYLOAD_LEN;
pub const ICMP6_OFF: usize = ETH_HLEN + IPV6_HLEN;
/// Most extension headers walked before giving up (and counting the packet).
const IPV6_MAX_EXT: usize = 6;
/// More-fragments flag and fragment offset bits of `frag_off` (host order).
const IP_MF_OFFSET_MASK: u16 = 0x3fff;
/// The fragment offset bits alone.
const IP_OFFSET_MASK: u16 = 0x1fff;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

pub const IP_CSUM_OFF: usize = ETH_HLEN + hdr::IP_CSUM;
pub const IP_SRC_OFF: usize = ETH_HLEN + hdr::IP_SRC;
pub const IP_DST_OFF: usize = ETH_HLEN + hdr::IP_DST;

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// The addresses of one packet, all in network byte order as on the wire; IPv4
/// addresses IPv4-mapped, as the maps hold them.
#[derive(Clone, Copy)]
pub struct Flow {
    pub saddr: IpAddrBe,
    pub daddr: IpAddrBe,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// TCP flags byte; 0 for UDP.
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame.
    pub l4_off: usize,
    /// Length of the IP packet (IPv4 total length, or the IPv6 header and its
    /// payload), capped at 65535: what a route's MTU is checked against.
    pub ip_len: u16,
    /// The identification (IPv4's 16 bits, zero-extended, or the IPv6 Fragment
    /// header's 32, network byte order) when the packet is the first fragment of a
    /// datagram: its translation must be remembered for the rest.
    pub first_fragment_id: Option<u32>,
    /// An IPv6 packet.
    pub v6: bool,
}

impl Flow {
    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        if self.proto == IPPROTO_TCP {
            self.l4_off + hdr::TCP_CSUM
        } else {
            self.l4_off + hdr::UDP_CSUM
        }
    }

    /// The L4 checksum, for rewriting.
    #[inline(always)]
    pub fn l4_csum(&self) -> L4Csum {
        L4Csum {
            off: self.l4_csum_off(),
            udp: self.proto == IPPROTO_UDP,
        }
    }

    /// Where TCP/UDP sits right behind a fixed IP header: no IPv4 options, no IPv6
    /// extension header in between.
    #[inline(always)]
    pub fn has_plain_ip_header(&self) -> bool {
        let fixed = if self.v6 { IPV6_HLEN } else { IPV4_MIN_HLEN };
        self.l4_off == ETH_HLEN + fixed
    }
}

/// An ICMP error quoting a TCP/UDP packet: where its parts are, and the quoted
/// packet's addresses (network byte order, as on the wire).
#[derive(Clone, Copy)]
pub struct IcmpError {
    pub saddr: u32,
    pub daddr: u32,
    pub icmp_off: usize,
    pub inner_ip_off: usize,
    pub inner_l4_off: usize,
    /// The quoted packet.
    pub inner: Flow,
    /// The quoted L4 checksum is inside the packet (quotes may stop after 8 bytes).
    pub inner_csum_present: bool,
    /// A host or port unreachable: the flow's backend refuses it if it is new
    /// (`lb_common::quarantine::icmp_refuses`).
    pub refuses: bool,
}

/// A later fragment: the datagram it belongs to.
#[derive(Clone, Copy)]
pub struct Fragment {
    /// As on the wire (IPv4-mapped for IPv4).
    pub saddr: IpAddrBe,
    pub daddr: IpAddrBe,
    /// The identification, as in [`Flow::first_fragment_id`].
    pub id: u32,
    pub proto: u8,
    pub v6: bool,
}

pub enum Parsed {
    /// Not IPv4, or not TCP/UDP: nothing for us.
    Ignored,
    /// Destination unreachable, time exceeded or parameter problem about a TCP/UDP
    /// packet: belongs to that packet's flow.
    IcmpError(IcmpError),
    /// The ICMPv6 twin of `IcmpError` (destination unreachable, packet too big,
    /// time exceeded, parameter problem), right behind the fixed IPv6 header, at
    /// [`ICMP6_OFF`]; `icmp6` reads the quoted packet as it needs it. Neighbour
    /// discovery and other informational messages are `Ignored`. No payload: a
    /// variant with fields here makes LLVM pass undefined registers around, which
    /// the verifier refuses (`!read_ok`).
    Icmp6Error,
    /// A later fragment of an IPv4 datagram (offset > 0): no L4 header, so it can
    /// only follow what its first fragment got.
    Fragment(Fragment),
    /// Header lengths that do not add up; left to the stack to discard.
    Malformed,
    /// IPv6 whose extension headers were not followed to TCP/UDP: passed on
    /// untouched, and counted.
    Unhandled,
    /// IPv4 in IPv4 or IPv6 in IPv6 right behind a fixed outer header, not
    /// fragmented: maybe a DSR packet for this node (`dsr`), else not ours. No
    /// payload, as for `Icmp6Error`: the family is the frame's EtherType.
    Encapsulated,
    Flow(Flow),
}

#[inline(always)]
pub fn parse<P: Packet>(ctx: &P) -> Parsed {
    match try_parse(ctx) {
        Ok(parsed) => parsed,
        Err(()) => Parsed::Malformed,
    }
}

#[inline(always)]
fn try_parse<P: Packet>(ctx: &P) -> Result<Parsed, ()> {
    // First: under XDP this is a helper call, across which nothing read yet has to
    // be kept (on the stack).
    let packet_len = ctx.packet_len();
    let ethertype: u16 = ctx.read(hdr::ETH_TYPE_OFF)?;
    if ethertype == ETH_TYPE_IPV6_RAW {
        return try_parse6(ctx, packet_len);
    }
    if ethertype != ETH_TYPE_IPV4_RAW {
        return Ok(Parsed::Ignored);
    }
    let ip: [u32; IPV4_MIN_HLEN / 4] = ctx.read(ETH_HLEN)?;
    let version_ihl = byte(&ip, 0);
    if version_ihl >> 4 != 4 {
        return Err(());
    }
    let ihl = ((version_ihl & 0x0f) as usize) * 4;
    let total_len = be16(&ip, hdr::IP_TOT_LEN) as usize;
    if ihl < IPV4_MIN_HLEN || total_len < ihl || ETH_HLEN + total_len > packet_len {
        return Err(());
    }
    let proto = byte(&ip, hdr::IP_PROTO);
    let frag_off = be16(&ip, hdr::IP_FRAG_OFF);
    if proto == IPPROTO_IPIP && ihl == IPV4_MIN_HLEN && frag_off & IP_MF_OFFSET_MASK == 0 {
        return Ok(Parsed::Encapsulated);
    }
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP {
        return Ok(Parsed::Ignored);
    }
    let saddr = IpAddrBe::from_v4(word(&ip, hdr::IP_SRC));
    let daddr = IpAddrBe::from_v4(word(&ip, hdr::IP_DST));
    let id = u16::from_ne_bytes([byte(&ip, hdr::IP_ID), byte(&ip, hdr::IP_ID + 1)]) as u32;
    let fragmented = frag_off & IP_MF_OFFSET_MASK != 0;
    if fragmented && frag_off & IP_OFFSET_MASK != 0 {
        return Ok(Parsed::Fragment(Fragment {
            saddr,
            daddr,
            id,
            proto,
            v6: false,
        }));
    }
    let l4_len = total_len - ihl;
    let l4_off = ETH_HLEN + ihl;
    if proto == IPPROTO_ICMP {
        // An ICMP error split in fragments is not worth translating.
        if fragmented {
            return Ok(Parsed::Ignored);
        }
        return parse_icmp_error(ctx, (saddr, daddr), l4_off, ETH_HLEN + total_len);
    }
    let (sport, dport, tcp_flags) = parse_l4(ctx, proto, l4_off, l4_len, fragmented)?;
    Ok(Parsed::Flow(Flow {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        tcp_flags,
        l4_off,
        ip_len: total_len as u16,
        first_fragment_id: fragmented.then_some(id),
        v6: false,
    }))
}

/// IPv6: the extension header chain is followed to TCP/UDP (hop-by-hop, routing,
/// destination options, authentication, fragment). ICMPv6 (neighbour discovery,
/// router traffic, echo, errors) is left alone, as is everything else.
#[inline(always)]
fn try_parse6<P: Packet>(ctx: &P, packet_len: usize) -> Result<Parsed, ()> {
    let ip: [u32; IPV6_HLEN / 4] = ctx.read(ETH_HLEN)?;
    if byte(&ip, 0) >> 4 != 6 {
        return Err(());
    }
    let payload_len = be16(&ip, hdr::IP6_PAYLOAD_LEN) as usize;
    let end = ETH_HLEN + IPV6_HLEN + payload_len;
    // A zero payload length is a jumbogram (hop-by-hop option); not ours.
    if payload_len == 0 || end > packet_len {
        return Err(());
    }
    let saddr = IpAddrBe::from_v6(words(&ip, hdr::IP6_SRC));
    let daddr = IpAddrBe::from_v6(words(&ip, hdr::IP6_DST));
    let mut next = byte(&ip, hdr::IP6_NEXT_HDR);
    let mut off = ETH_HLEN + IPV6_HLEN;
    // (identification, more fragments, offset) of a Fragment header.
    let mut fragment: Option<(u32, bool, u16)> = None;
    let mut followed = false;
    for _ in 0..IPV6_MAX_EXT {
        match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST => {
                let h: [u8; 2] = ctx.read(off)?;
                next = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            NEXTHDR_AUTH => {
                let h: [u8; 2] = ctx.read(off)?;
                next = h[0];
                off += (h[1] as usize + 2) * 4;
            }
            NEXTHDR_FRAGMENT => {
                let h: [u8; 8] = ctx.read(off)?;
                next = h[0];
                let offset_flags = u16::from_be_bytes([h[2], h[3]]);
                let id = u32::from_ne_bytes([h[4], h[5], h[6], h[7]]);
                fragment = Some((id, offset_flags & 1 != 0, offset_flags >> 3));
                off += 8;
            }
            _ => {
                followed = true;
                break;
            }
        }
        if off > end {
            return Err(());
        }
    }
    if let Some((id, _, offset)) = fragment {
        if offset != 0 {
            return Ok(Parsed::Fragment(Fragment {
                saddr,
                daddr,
                id,
                proto: next,
                v6: true,
            }));
        }
    }
    if next == IPPROTO_IPV6 && off == ETH_HLEN + IPV6_HLEN {
        return Ok(Parsed::Encapsulated);
    }
    if next == NEXTHDR_ICMPV6 {
        // Errors come without extension headers (a router's own message); one
        // split in fragments, or behind options, is not worth translating.
        if off != ICMP6_OFF {
            return Ok(Parsed::Ignored);
        }
        // With its code (see `Packet::read`).
        let [icmp_type, _code]: [u8; 2] = ctx.read(off)?;
        return Ok(if is_icmp6_error(icmp_type) {
            Parsed::Icmp6Error
        } else {
            Parsed::Ignored
        });
    }
    if !followed || (next != IPPROTO_TCP && next != IPPROTO_UDP) {
        // More headers than we walk, ESP, or anything else before TCP/UDP: a
        // header we cannot see past must not be rewritten behind.
        return Ok(if followed && !is_extension(next) {
            Parsed::Ignored
        } else {
            Parsed::Unhandled
        });
    }
    let fragmented = fragment.is_some_and(|(_, more, _)| more);
    let (sport, dport, tcp_flags) = parse_l4(ctx, next, off, end - off, fragmented)?;
    Ok(Parsed::Flow(Flow {
        saddr,
        daddr,
        sport,
        dport,
        proto: next,
        tcp_flags,
        l4_off: off,
        ip_len: (end - ETH_HLEN).min(u16::MAX as usize) as u16,
        first_fragment_id: fragment.filter(|f| f.1).map(|f| f.0),
        v6: true,
    }))
}

/// ICMPv6 types 1-4 (RFC 4443 2.1: errors have the high bit clear; 1-4 are the
/// ones that quote a packet of a flow). Neighbour discovery (133-137) and every
/// informational message are never touched.
#[inline(always)]
fn is_icmp6_error(icmp_type: u8) -> bool {
    matches!(icmp_type, 1..=4)
}

/// IPv6 next-header values that are extension headers rather than an upper layer
/// (RFC 8200, RFC 7045): ESP, mobility, HIP, shim6, experiments.
#[inline(always)]
fn is_extension(next: u8) -> bool {
    matches!(
        next,
        NEXTHDR_HOP
            | NEXTHDR_ROUTING
            | NEXTHDR_FRAGMENT
            | NEXTHDR_AUTH
            | NEXTHDR_DEST
            | NEXTHDR_ESP
            | 135
            | 139
            | 140
            | 253
            | 254
    )
}

// A header is read as the words it lies in memory as, not as bytes: under XDP
// each byte would be a register of its own, and the compiler spills what does not
// fit, which the 512-byte stack cannot afford. Offsets are the header's own.

/// The byte at `at` of a header read as words.
#[inline(always)]
fn byte(header: &[u32], at: usize) -> u8 {
    header[at / 4].to_ne_bytes()[at % 4]
}

/// Four network-order words of an address at `at` (a multiple of 4).
#[inline(always)]
fn words(header: &[u32], at: usize) -> [u32; 4] {
    [
        word(header, at),
        word(header, at + 4),
        word(header, at + 8),
        word(header, at + 12),
    ]
}

/// The network-order word at `at` (a multiple of 4), as it lies in memory (an
/// IPv4 address).
#[inline(always)]
fn word(header: &[u32], at: usize) -> u32 {
    header[at / 4]
}

/// The big-endian 16-bit field at `at`, in host order.
#[inline(always)]
fn be16(header: &[u32], at: usize) -> u16 {
    u16::from_be_bytes([byte(header, at), byte(header, at + 1)])
}

/// The ports and TCP flags of a TCP/UDP header of `l4_len` bytes at `l4_off`, its
/// lengths checked; `fragmented`: a first fragment (UDP's length covers more).
#[inline(always)]
fn parse_l4<P: Packet>(
    ctx: &P,
    proto: u8,
    l4_off: usize,
    l4_len: usize,
    fragmented: bool,
) -> Result<(u16, u16, u8), ()> {
    let tcp_flags = if proto == IPPROTO_TCP {
        if l4_len < TCP_MIN_HLEN {
            return Err(());
        }
        let [doff, flags]: [u8; 2] = ctx.read(l4_off + hdr::TCP_DOFF_FLAGS)?;
        // The header length must cover the fixed header and fit in the packet.
        let doff = ((doff >> 4) as usize) * 4;
        if doff < TCP_MIN_HLEN || doff > l4_len {
            return Err(());
        }
        flags
    } else {
        if l4_len < UDP_HLEN {
            return Err(());
        }
        // The UDP length covers the whole datagram: exactly this payload, or in a
        // first fragment, more than it (the rest follows).
        let udp_len = u16::from_be(ctx.read::<u16>(l4_off + hdr::UDP_LEN)?) as usize;
        if udp_len < UDP_HLEN
            || (!fragmented && udp_len != l4_len)
            || (fragmented && udp_len <= l4_len)
        {
            return Err(());
        }
        0
    };
    let ports: [u16; 2] = ctx.read(l4_off)?;
    Ok((ports[0], ports[1], tcp_flags))
}

#[inline(always)]
fn parse_icmp_error<P: Packet>(
    ctx: &P,
    (saddr, daddr): (IpAddrBe, IpAddrBe),
    icmp_off: usize,
    end: usize,
) -> Result<Parsed, ()> {
    // With its code (see `Packet::read`).
    let [icmp_type, code]: [u8; 2] = ctx.read(icmp_off)?;
    if icmp_type != ICMP_DEST_UNREACH
        && icmp_type != ICMP_TIME_EXCEEDED
        && icmp_type != ICMP_PARAMETERPROB
    {
        return Ok(Parsed::Ignored);
    }
    let inner_ip_off = icmp_off + ICMP_HLEN;
    let inner: [u32; IPV4_MIN_HLEN / 4] = ctx.read(inner_ip_off)?;
    let inner_ihl = ((byte(&inner, 0) & 0x0f) as usize) * 4;
    if byte(&inner, 0) >> 4 != 4 || inner_ihl < IPV4_MIN_HLEN {
        return Err(());
    }
    let inner_proto = byte(&inner, hdr::IP_PROTO);
    if inner_proto != IPPROTO_TCP && inner_proto != IPPROTO_UDP {
        return Ok(Parsed::Ignored);
    }
    let inner_l4_off = inner_ip_off + inner_ihl;
    // RFC 792 quotes at least the first 8 bytes of the datagram: the ports.
    if inner_l4_off + UDP_HLEN > end {
        return Err(());
    }
    let ports: [u16; 2] = ctx.read(inner_l4_off)?;
    let inner_flow = Flow {
        saddr: IpAddrBe::from_v4(word(&inner, hdr::IP_SRC)),
        daddr: IpAddrBe::from_v4(word(&inner, hdr::IP_DST)),
        sport: ports[0],
        dport: ports[1],
        proto: inner_proto,
        tcp_flags: 0,
        l4_off: inner_l4_off,
        ip_len: 0,
        first_fragment_id: None,
        v6: false,
    };
    Ok(Parsed::IcmpError(IcmpError {
        saddr: saddr.v4(),
        daddr: daddr.v4(),
        icmp_off,
        inner_ip_off,
        inner_l4_off,
        inner_csum_present: inner_flow.l4_csum_off() + 2 <= end,
        inner: inner_flow,
        refuses: lb_common::quarantine::icmp_refuses(icmp_type, code),
    }))
}
