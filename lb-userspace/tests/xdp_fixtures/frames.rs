//! Frames for both families, built and checked by etherparse: the oracle is an
//! independent packet library, not the arithmetic of the programs under test.

use std::net::IpAddr;

use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TcpHeader, TransportSlice};

use super::net::{CLIENT_GW_MAC, UPLINK_MAC};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

/// A TCP or UDP packet in an Ethernet frame (from the client side's gateway to the
/// uplink unless changed).
#[derive(Clone)]
pub struct Pkt {
    pub eth_src: [u8; 6],
    pub eth_dst: [u8; 6],
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub flags: u8,
    /// TTL (IPv4) or hop limit (IPv6).
    pub ttl: u8,
    pub payload: Vec<u8>,
}

impl Pkt {
    pub fn tcp(
        src: impl Into<IpAddr>,
        sport: u16,
        dst: impl Into<IpAddr>,
        dport: u16,
        flags: u8,
    ) -> Self {
        Pkt {
            eth_src: CLIENT_GW_MAC,
            eth_dst: UPLINK_MAC,
            src: src.into(),
            dst: dst.into(),
            sport,
            dport,
            proto: TCP,
            flags,
            ttl: 64,
            payload: b"hello".to_vec(),
        }
    }

    pub fn udp(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Self {
        Pkt {
            proto: UDP,
            ..Pkt::tcp(src, sport, dst, dport, 0)
        }
    }

    pub fn frame(&self) -> Vec<u8> {
        let eth = PacketBuilder::ethernet2(self.eth_src, self.eth_dst);
        let ip = match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), self.ttl),
            (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), self.ttl),
            _ => panic!("addresses of two families"),
        };
        let mut out = Vec::new();
        if self.proto == TCP {
            let mut tcp = TcpHeader::new(self.sport, self.dport, 1000, 64240);
            tcp.fin = self.flags & FIN != 0;
            tcp.syn = self.flags & SYN != 0;
            tcp.rst = self.flags & RST != 0;
            tcp.ack = self.flags & ACK != 0;
            ip.tcp_header(tcp).write(&mut out, &self.payload).unwrap();
        } else {
            ip.udp(self.sport, self.dport)
                .write(&mut out, &self.payload)
                .unwrap();
        }
        out
    }
}

/// The tuple a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
}

pub fn seen(src: impl Into<IpAddr>, sport: u16, dst: impl Into<IpAddr>, dport: u16) -> Seen {
    Seen {
        src: src.into(),
        sport,
        dst: dst.into(),
        dport,
    }
}

/// What a frame says after a program ran, its checksums verified: the IPv4 header
/// checksum, and the TCP/UDP checksum over its pseudo header (a zero UDP checksum
/// over IPv4 means none).
#[derive(Debug)]
pub struct Inspected {
    pub tuple: Seen,
    pub eth_dst: [u8; 6],
    pub eth_src: [u8; 6],
    /// TTL (IPv4) or hop limit (IPv6).
    pub ttl: u8,
    pub payload: Vec<u8>,
    /// The UDP checksum field as sent (0: none).
    pub udp_checksum: Option<u16>,
}

pub fn inspect(frame: &[u8]) -> Inspected {
    let p = SlicedPacket::from_ethernet(frame).expect("a parsable frame");
    let Some(etherparse::LinkSlice::Ethernet2(eth)) = &p.link else {
        panic!("no Ethernet header: {p:?}");
    };
    let (eth_dst, eth_src) = (eth.destination(), eth.source());
    let (src, dst, ttl, v4, v6) = match &p.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            assert_eq!(
                h.header_checksum,
                h.calc_header_checksum(),
                "IPv4 header checksum is wrong"
            );
            (
                IpAddr::from(h.source),
                IpAddr::from(h.destination),
                h.time_to_live,
                Some(h),
                None,
            )
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header().to_header();
            (
                IpAddr::from(h.source),
                IpAddr::from(h.destination),
                h.hop_limit,
                None,
                Some(h),
            )
        }
        other => panic!("not IP: {other:?}"),
    };
    let (sport, dport, payload, udp_checksum) = match &p.transport {
        Some(TransportSlice::Tcp(t)) => {
            let h = t.to_header();
            let want = match (&v4, &v6) {
                (Some(ip), _) => h.calc_checksum_ipv4(ip, t.payload()).unwrap(),
                (_, Some(ip)) => h.calc_checksum_ipv6(ip, t.payload()).unwrap(),
                _ => unreachable!(),
            };
            assert_eq!(want, t.checksum(), "TCP checksum is wrong");
            (
                t.source_port(),
                t.destination_port(),
                t.payload().to_vec(),
                None,
            )
        }
        Some(TransportSlice::Udp(u)) => {
            let h = u.to_header();
            if v6.is_some() || u.checksum() != 0 {
                let want = match (&v4, &v6) {
                    (Some(ip), _) => h.calc_checksum_ipv4(ip, u.payload()).unwrap(),
                    (_, Some(ip)) => h.calc_checksum_ipv6(ip, u.payload()).unwrap(),
                    _ => unreachable!(),
                };
                assert_eq!(want, u.checksum(), "UDP checksum is wrong");
            }
            (
                u.source_port(),
                u.destination_port(),
                u.payload().to_vec(),
                Some(u.checksum()),
            )
        }
        other => panic!("no TCP/UDP: {other:?}"),
    };
    Inspected {
        tuple: Seen {
            src,
            sport,
            dst,
            dport,
        },
        eth_dst,
        eth_src,
        ttl,
        payload,
        udp_checksum,
    }
}
