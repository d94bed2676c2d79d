//! Parsing Ethernet + IPv4 + TCP/UDP headers through `bpf_skb_load_bytes`, which
//! bounds-checks every read against the packet: a truncated header is an error, never
//! a read past the end.

use aya_ebpf::programs::TcContext;
use lb_common::{IPPROTO_TCP, IPPROTO_UDP};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IPV4_MIN_HLEN: usize = 20;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
/// More-fragments flag and fragment offset bits of `frag_off` (host order).
const IP_MF_OFFSET_MASK: u16 = 0x3fff;
/// The fragment offset bits alone.
const IP_OFFSET_MASK: u16 = 0x1fff;
const IPPROTO_ICMP: u8 = 1;
const ICMP_HLEN: usize = 8;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

pub const IP_CSUM_OFF: usize = ETH_HLEN + 10;
pub const IP_SRC_OFF: usize = ETH_HLEN + 12;
pub const IP_DST_OFF: usize = ETH_HLEN + 16;

pub const TCP_FLAG_FIN: u8 = 0x01;
pub const TCP_FLAG_SYN: u8 = 0x02;
pub const TCP_FLAG_RST: u8 = 0x04;
pub const TCP_FLAG_ACK: u8 = 0x10;

/// The addresses of one packet, all in network byte order as on the wire.
#[derive(Clone, Copy)]
pub struct Flow {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// TCP flags byte; 0 for UDP.
    pub tcp_flags: u8,
    /// Offset of the L4 header from the start of the frame.
    pub l4_off: usize,
    /// The IPv4 identification (network byte order) when the packet is the first
    /// fragment of a datagram: its translation must be remembered for the rest.
    pub first_fragment_id: Option<u16>,
}

impl Flow {
    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        if self.proto == IPPROTO_TCP {
            self.l4_off + 16
        } else {
            self.l4_off + 6
        }
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
}

/// A later fragment: the datagram it belongs to.
#[derive(Clone, Copy)]
pub struct Fragment {
    /// Network byte order, as on the wire.
    pub saddr: u32,
    pub daddr: u32,
    /// The IPv4 identification, network byte order.
    pub id: u16,
    pub proto: u8,
}

pub enum Parsed {
    /// Not IPv4, or not TCP/UDP: nothing for us.
    Ignored,
    /// Destination unreachable, time exceeded or parameter problem about a TCP/UDP
    /// packet: belongs to that packet's flow.
    IcmpError(IcmpError),
    /// A later fragment of an IPv4 datagram (offset > 0): no L4 header, so it can
    /// only follow what its first fragment got.
    Fragment(Fragment),
    /// Header lengths that do not add up; left to the stack to discard.
    Malformed,
    Flow(Flow),
}

#[inline(always)]
pub fn parse(ctx: &TcContext) -> Parsed {
    match try_parse(ctx) {
        Ok(parsed) => parsed,
        Err(()) => Parsed::Malformed,
    }
}

#[inline(always)]
fn try_parse(ctx: &TcContext) -> Result<Parsed, ()> {
    let ethertype = u16::from_be(ctx.load::<u16>(12).map_err(|_| ())?);
    if ethertype != ETH_P_IP {
        return Ok(Parsed::Ignored);
    }
    let ip: [u8; IPV4_MIN_HLEN] = ctx.load(ETH_HLEN).map_err(|_| ())?;
    if ip[0] >> 4 != 4 {
        return Err(());
    }
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    let total_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    if ihl < IPV4_MIN_HLEN || total_len < ihl || ETH_HLEN + total_len > ctx.len() as usize {
        return Err(());
    }
    let proto = ip[9];
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP && proto != IPPROTO_ICMP {
        return Ok(Parsed::Ignored);
    }
    let saddr = u32::from_ne_bytes([ip[12], ip[13], ip[14], ip[15]]);
    let daddr = u32::from_ne_bytes([ip[16], ip[17], ip[18], ip[19]]);
    let frag_off = u16::from_be_bytes([ip[6], ip[7]]);
    let id = u16::from_ne_bytes([ip[4], ip[5]]);
    let fragmented = frag_off & IP_MF_OFFSET_MASK != 0;
    if fragmented && frag_off & IP_OFFSET_MASK != 0 {
        return Ok(Parsed::Fragment(Fragment {
            saddr,
            daddr,
            id,
            proto,
        }));
    }
    let l4_len = total_len - ihl;
    let l4_off = ETH_HLEN + ihl;
    if proto == IPPROTO_ICMP {
        // An ICMP error split in fragments is not worth translating.
        if fragmented {
            return Ok(Parsed::Ignored);
        }
        return parse_icmp_error(ctx, &ip, l4_off, ETH_HLEN + total_len);
    }
    let tcp_flags = if proto == IPPROTO_TCP {
        if l4_len < TCP_MIN_HLEN {
            return Err(());
        }
        let [doff, flags]: [u8; 2] = ctx.load(l4_off + 12).map_err(|_| ())?;
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
        let udp_len = u16::from_be(ctx.load::<u16>(l4_off + 4).map_err(|_| ())?) as usize;
        if udp_len < UDP_HLEN
            || (!fragmented && udp_len != l4_len)
            || (fragmented && udp_len <= l4_len)
        {
            return Err(());
        }
        0
    };
    let ports: [u16; 2] = ctx.load(l4_off).map_err(|_| ())?;
    Ok(Parsed::Flow(Flow {
        saddr,
        daddr,
        sport: ports[0],
        dport: ports[1],
        proto,
        tcp_flags,
        l4_off,
        first_fragment_id: fragmented.then_some(id),
    }))
}

#[inline(always)]
fn parse_icmp_error(
    ctx: &TcContext,
    ip: &[u8; IPV4_MIN_HLEN],
    icmp_off: usize,
    end: usize,
) -> Result<Parsed, ()> {
    let icmp_type = ctx.load::<u8>(icmp_off).map_err(|_| ())?;
    if icmp_type != ICMP_DEST_UNREACH
        && icmp_type != ICMP_TIME_EXCEEDED
        && icmp_type != ICMP_PARAMETERPROB
    {
        return Ok(Parsed::Ignored);
    }
    let inner_ip_off = icmp_off + ICMP_HLEN;
    let inner: [u8; IPV4_MIN_HLEN] = ctx.load(inner_ip_off).map_err(|_| ())?;
    let inner_ihl = ((inner[0] & 0x0f) as usize) * 4;
    if inner[0] >> 4 != 4 || inner_ihl < IPV4_MIN_HLEN {
        return Err(());
    }
    let inner_proto = inner[9];
    if inner_proto != IPPROTO_TCP && inner_proto != IPPROTO_UDP {
        return Ok(Parsed::Ignored);
    }
    let inner_l4_off = inner_ip_off + inner_ihl;
    // RFC 792 quotes at least the first 8 bytes of the datagram: the ports.
    if inner_l4_off + 8 > end {
        return Err(());
    }
    let ports: [u16; 2] = ctx.load(inner_l4_off).map_err(|_| ())?;
    let inner_flow = Flow {
        saddr: u32::from_ne_bytes([inner[12], inner[13], inner[14], inner[15]]),
        daddr: u32::from_ne_bytes([inner[16], inner[17], inner[18], inner[19]]),
        sport: ports[0],
        dport: ports[1],
        proto: inner_proto,
        tcp_flags: 0,
        l4_off: inner_l4_off,
        first_fragment_id: None,
    };
    Ok(Parsed::IcmpError(IcmpError {
        saddr: u32::from_ne_bytes([ip[12], ip[13], ip[14], ip[15]]),
        daddr: u32::from_ne_bytes([ip[16], ip[17], ip[18], ip[19]]),
        icmp_off,
        inner_ip_off,
        inner_l4_off,
        inner_csum_present: inner_flow.l4_csum_off() + 2 <= end,
        inner: inner_flow,
    }))
}
