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

pub enum Parsed {
    /// Not IPv4, or not TCP/UDP: nothing for us.
    Ignored,
    /// An IPv4 fragment: later fragments carry no ports, so it cannot be matched.
    Fragment,
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
    if proto != IPPROTO_TCP && proto != IPPROTO_UDP {
        return Ok(Parsed::Ignored);
    }
    if u16::from_be_bytes([ip[6], ip[7]]) & IP_MF_OFFSET_MASK != 0 {
        return Ok(Parsed::Fragment);
    }
    let l4_len = total_len - ihl;
    let l4_off = ETH_HLEN + ihl;
    let tcp_flags = if proto == IPPROTO_TCP {
        if l4_len < TCP_MIN_HLEN {
            return Err(());
        }
        ctx.load::<u8>(l4_off + 13).map_err(|_| ())?
    } else {
        if l4_len < UDP_HLEN {
            return Err(());
        }
        0
    };
    let ports: [u16; 2] = ctx.load(l4_off).map_err(|_| ())?;
    Ok(Parsed::Flow(Flow {
        saddr: u32::from_ne_bytes([ip[12], ip[13], ip[14], ip[15]]),
        daddr: u32::from_ne_bytes([ip[16], ip[17], ip[18], ip[19]]),
        sport: ports[0],
        dport: ports[1],
        proto,
        tcp_flags,
        l4_off,
    }))
}
