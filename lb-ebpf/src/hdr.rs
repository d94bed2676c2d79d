//! Header sizes, field offsets and protocol numbers, taken from network-types'
//! `#[repr(C)]` header structs (the layouts of the kernel's own headers) rather than
//! written out as numbers. The parser still reads fields through
//! `bpf_skb_load_bytes` at these offsets: a whole header is never loaded where only
//! a field is needed, and no packet byte ever becomes a Rust enum.

use core::mem::{offset_of, size_of};

use network_types::{
    eth::{EthHdr, EtherType},
    icmp::{Icmpv4Hdr, Icmpv6Hdr},
    ip::{IpProto, Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
};

pub const ETH_HLEN: usize = EthHdr::LEN;
/// The EtherType field and its IPv4 / IPv6 values, as they lie in the frame.
pub const ETH_TYPE_OFF: usize = offset_of!(EthHdr, ether_type);
pub const ETH_TYPE_IPV4_RAW: u16 = EtherType::Ipv4 as u16;
pub const ETH_TYPE_IPV6_RAW: u16 = EtherType::Ipv6 as u16;

/// An IPv4 header without options.
pub const IP_HLEN: usize = Ipv4Hdr::LEN;
pub const IP_TOT_LEN: usize = offset_of!(Ipv4Hdr, tot_len);
pub const IP_ID: usize = offset_of!(Ipv4Hdr, id);
pub const IP_FRAG_OFF: usize = offset_of!(Ipv4Hdr, frags);
pub const IP_TTL: usize = offset_of!(Ipv4Hdr, ttl);
pub const IP_PROTO: usize = offset_of!(Ipv4Hdr, proto);
pub const IP_CSUM: usize = offset_of!(Ipv4Hdr, check);
pub const IP_SRC: usize = offset_of!(Ipv4Hdr, src_addr);
pub const IP_DST: usize = offset_of!(Ipv4Hdr, dst_addr);

pub const IP6_HLEN: usize = Ipv6Hdr::LEN;
pub const IP6_PAYLOAD_LEN: usize = offset_of!(Ipv6Hdr, payload_len);
pub const IP6_NEXT_HDR: usize = offset_of!(Ipv6Hdr, next_hdr);
pub const IP6_HOP_LIMIT: usize = offset_of!(Ipv6Hdr, hop_limit);
pub const IP6_SRC: usize = offset_of!(Ipv6Hdr, src_addr);
pub const IP6_DST: usize = offset_of!(Ipv6Hdr, dst_addr);

/// A TCP header without options.
pub const TCP_HLEN: usize = TcpHdr::LEN;
pub const TCP_CSUM: usize = offset_of!(TcpHdr, check);
pub const TCP_SPORT: usize = offset_of!(TcpHdr, source);
pub const TCP_DPORT: usize = offset_of!(TcpHdr, dest);
pub const TCP_SEQ: usize = offset_of!(TcpHdr, seq);
pub const TCP_ACK: usize = offset_of!(TcpHdr, ack_seq);
/// The data offset (high nibble) and the flags byte follow the acknowledgement.
pub const TCP_DOFF_FLAGS: usize = TCP_ACK + size_of::<[u8; 4]>();
pub const TCP_FLAGS: usize = TCP_DOFF_FLAGS + 1;
pub const UDP_HLEN: usize = UdpHdr::LEN;
/// The destination port, at the same offset in TCP and UDP headers.
pub const L4_DPORT: usize = offset_of!(UdpHdr, dst);
pub const UDP_LEN: usize = offset_of!(UdpHdr, len);
pub const UDP_CSUM: usize = offset_of!(UdpHdr, check);

pub const ICMP_HLEN: usize = Icmpv4Hdr::LEN;
pub const ICMP_CSUM: usize = offset_of!(Icmpv4Hdr, check);
pub const ICMP6_HLEN: usize = Icmpv6Hdr::LEN;
pub const ICMP6_CSUM: usize = offset_of!(Icmpv6Hdr, check);

pub const IPPROTO_ICMP: u8 = IpProto::Icmp as u8;
pub const IPPROTO_ICMPV6: u8 = IpProto::Ipv6Icmp as u8;
/// IPv6 extension headers the parser walks over (RFC 8200 section 4).
pub const NEXTHDR_HOP: u8 = IpProto::HopOpt as u8;
pub const NEXTHDR_ROUTING: u8 = IpProto::Ipv6Route as u8;
pub const NEXTHDR_FRAGMENT: u8 = IpProto::Ipv6Frag as u8;
pub const NEXTHDR_AUTH: u8 = IpProto::Ah as u8;
pub const NEXTHDR_DEST: u8 = IpProto::Ipv6Opts as u8;
pub const NEXTHDR_ESP: u8 = IpProto::Esp as u8;
/// IP in IP (RFC 2003) and IPv6 in IPv6 (RFC 2473): an inner packet right behind
/// the outer header.
pub const IPPROTO_IPIP: u8 = IpProto::Ipv4 as u8;
pub const IPPROTO_IPV6: u8 = IpProto::Ipv6 as u8;

// The wire formats, checked against the crate at build time.
const _: () = assert!(ETH_HLEN == 14 && IP_HLEN == 20 && IP6_HLEN == 40);
const _: () = assert!(IPPROTO_IPIP == 4 && IPPROTO_IPV6 == 41 && NEXTHDR_DEST == 60);
const _: () = assert!(TCP_HLEN == 20 && UDP_HLEN == 8 && ICMP_HLEN == 8 && ICMP6_HLEN == 8);
const _: () = assert!(IP_CSUM == 10 && IP6_SRC == 8 && TCP_CSUM == 16 && TCP_DOFF_FLAGS == 12);
const _: () = assert!(L4_DPORT == TCP_DPORT && ICMP_HLEN == ICMP6_HLEN && ICMP_CSUM == ICMP6_CSUM);
