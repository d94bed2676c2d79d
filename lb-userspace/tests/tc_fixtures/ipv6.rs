//! IPv6 through the per-packet programs: NodePort DNAT (and SNAT to the node's IPv6
//! address), conntrack and reverse NAT, extension headers, fragments, malformed
//! headers, neighbour discovery, ICMPv6 errors about a flow (Packet Too Big from
//! beyond the node, a backend's unreachable), and the RST / ICMPv6 unreachable for
//! a Service without endpoints. The
//! frames are built, and the checksums after the program checked, by etherparse.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};

use etherparse::{IpNumber, Ipv6FlowLabel, Ipv6Header, TcpHeader, UdpHeader};
use lb_common::stat;
use lb_userspace::model::{BackendAddr, DesiredState, Frontend, FrontendSpec, Protocol};

use super::{Fixture, ACK, RST, SYN, TCP, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, UDP};

pub const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 2);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x71, 0, 0, 0, 0, 5);
pub(super) const LOCAL_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x11);
pub(super) const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x21);
const NODE_PORT: u16 = 30080;
pub(super) const NEXT_HOP_BY_HOP: u8 = 0;
pub(super) const NEXT_FRAGMENT: u8 = 44;
pub(super) const NEXT_DEST_OPTS: u8 = 60;
const NEXT_ESP: u8 = 50;
const NEXT_ICMPV6: u8 = 58;

fn node_port6(protocol: Protocol, backends: &[(Ipv6Addr, bool)]) -> DesiredState {
    let mut desired = DesiredState::default();
    desired.frontends.insert(
        Frontend::internal(NODE6.into(), NODE_PORT, protocol),
        FrontendSpec {
            service: "default/web:http".into(),
            backends: backends
                .iter()
                .map(|&(ip, local)| BackendAddr {
                    ip: ip.into(),
                    port: 8080,
                    local,
                })
                .collect::<BTreeSet<_>>()
                .into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: false,
        },
    );
    desired
}

/// An IPv6 TCP or UDP packet; `ext` are extension headers (each a next-header
/// value and its bytes, whose first byte is overwritten with the chain's next).
pub(super) struct Packet6 {
    src: Ipv6Addr,
    dst: Ipv6Addr,
    sport: u16,
    dport: u16,
    proto: u8,
    flags: u8,
    ext: Vec<(u8, Vec<u8>)>,
    payload: Vec<u8>,
}

impl Packet6 {
    pub(super) fn tcp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Self {
        Packet6 {
            src,
            dst,
            sport,
            dport,
            proto: TCP,
            flags,
            ext: Vec::new(),
            payload: b"hello".to_vec(),
        }
    }

    fn udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Self {
        Packet6 {
            proto: UDP,
            flags: 0,
            ..Packet6::tcp(src, sport, dst, dport, 0)
        }
    }

    pub(super) fn with_ext(mut self, next: u8, bytes: Vec<u8>) -> Self {
        self.ext.push((next, bytes));
        self
    }

    /// The L4 segment, its checksum computed by etherparse over the IPv6 pseudo
    /// header (which covers the addresses and the upper-layer length only).
    fn l4(&self) -> Vec<u8> {
        let ip = header(self.src, self.dst, self.proto, 0);
        let mut l4 = Vec::new();
        if self.proto == TCP {
            let mut tcp = TcpHeader::new(self.sport, self.dport, 1000, 64240);
            tcp.syn = self.flags & SYN != 0;
            tcp.ack = self.flags & ACK != 0;
            tcp.rst = self.flags & RST != 0;
            tcp.checksum = tcp.calc_checksum_ipv6(&ip, &self.payload).unwrap();
            tcp.write(&mut l4).unwrap();
        } else {
            UdpHeader::with_ipv6_checksum(self.sport, self.dport, &ip, &self.payload)
                .unwrap()
                .write(&mut l4)
                .unwrap();
        }
        l4.extend_from_slice(&self.payload);
        l4
    }

    pub(super) fn frame(&self) -> Vec<u8> {
        let l4 = self.l4();
        let mut chain = Vec::new();
        let mut first = self.proto;
        // Built back to front: each header names the one after it.
        let mut next = self.proto;
        for (kind, bytes) in self.ext.iter().rev() {
            let mut h = bytes.clone();
            h[0] = next;
            chain.splice(0..0, h);
            next = *kind;
            first = *kind;
        }
        frame6(self.src, self.dst, first, &[&chain[..], &l4[..]].concat())
    }
}

fn header(src: Ipv6Addr, dst: Ipv6Addr, next: u8, payload_len: usize) -> Ipv6Header {
    Ipv6Header {
        traffic_class: 0,
        flow_label: Ipv6FlowLabel::ZERO,
        payload_length: payload_len as u16,
        next_header: IpNumber(next),
        hop_limit: 64,
        source: src.octets(),
        destination: dst.octets(),
    }
}

/// Ethernet (EtherType IPv6) + a 40-byte header whose next header is `next`.
fn frame6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x86, 0xdd];
    header(src, dst, next, payload.len())
        .write(&mut frame)
        .unwrap();
    frame.extend_from_slice(payload);
    frame
}

/// An 8-byte hop-by-hop or destination options header (one PadN option).
pub(super) fn options_header() -> Vec<u8> {
    vec![0, 0, 1, 4, 0, 0, 0, 0]
}

/// What a frame says after the program ran, its TCP/UDP checksum verified by
/// etherparse (extension headers walked by it too).
#[derive(Debug, PartialEq, Eq)]
struct Seen6 {
    src: Ipv6Addr,
    sport: u16,
    dst: Ipv6Addr,
    dport: u16,
}

fn inspect6(frame: &[u8]) -> Seen6 {
    let p = etherparse::SlicedPacket::from_ethernet(frame).expect("a parsable frame");
    let Some(etherparse::NetSlice::Ipv6(ip)) = p.net else {
        panic!("not IPv6: {p:?}");
    };
    let h = ip.header().to_header();
    let (src, dst) = (Ipv6Addr::from(h.source), Ipv6Addr::from(h.destination));
    let (sport, dport, ok) = match p.transport {
        Some(etherparse::TransportSlice::Tcp(t)) => {
            let want = t.to_header().calc_checksum_ipv6(&h, t.payload()).unwrap();
            (t.source_port(), t.destination_port(), want == t.checksum())
        }
        Some(etherparse::TransportSlice::Udp(u)) => {
            let want = u.to_header().calc_checksum_ipv6(&h, u.payload()).unwrap();
            (u.source_port(), u.destination_port(), want == u.checksum())
        }
        other => panic!("no TCP/UDP: {other:?}"),
    };
    assert!(ok, "L4 checksum is wrong after the rewrite");
    Seen6 {
        src,
        sport,
        dst,
        dport,
    }
}

#[test]
fn ipv6_node_port_to_local_backend_keeps_the_client_and_reverses_replies() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(LOCAL_POD6, true)]));
    let syn = Packet6::tcp(CLIENT6, 40000, NODE6, NODE_PORT, SYN).frame();
    let (verdict, out) = f.external(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        inspect6(&out),
        Seen6 {
            src: CLIENT6,
            sport: 40000,
            dst: LOCAL_POD6,
            dport: 8080
        }
    );
    // The backend's answer enters on its veth: back to the frontend.
    let reply = Packet6::tcp(LOCAL_POD6, 8080, CLIENT6, 40000, SYN | ACK).frame();
    let (verdict, out) = f.internal(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        inspect6(&out),
        Seen6 {
            src: NODE6,
            sport: NODE_PORT,
            dst: CLIENT6,
            dport: 40000
        }
    );
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 1);
    assert_eq!(f.stat(stat::TC_CT_HIT), 1);
}

#[test]
fn ipv6_remote_backend_is_reached_with_snat_to_the_node_address() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Udp, &[(REMOTE_POD6, false)]));
    let (verdict, out) = f.external(&Packet6::udp(CLIENT6, 40001, NODE6, NODE_PORT).frame());
    assert_eq!(verdict, TC_ACT_OK);
    let seen = inspect6(&out);
    assert_eq!((seen.src, seen.dst, seen.dport), (NODE6, REMOTE_POD6, 8080));
    let reply = Packet6::udp(REMOTE_POD6, 8080, NODE6, seen.sport).frame();
    let (_, out) = f.external(&reply);
    assert_eq!(
        inspect6(&out),
        Seen6 {
            src: NODE6,
            sport: NODE_PORT,
            dst: CLIENT6,
            dport: 40001
        }
    );
}

#[test]
fn ipv6_extension_headers_are_followed_to_the_ports() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(LOCAL_POD6, true)]));
    let syn = Packet6::tcp(CLIENT6, 40002, NODE6, NODE_PORT, SYN)
        .with_ext(NEXT_HOP_BY_HOP, options_header())
        .with_ext(NEXT_DEST_OPTS, options_header())
        .frame();
    let (verdict, out) = f.external(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(out.len(), syn.len());
    // The headers in between are untouched.
    assert_eq!(out[54..70], syn[54..70]);
    assert_eq!(
        inspect6(&out),
        Seen6 {
            src: CLIENT6,
            sport: 40002,
            dst: LOCAL_POD6,
            dport: 8080
        }
    );
}

#[test]
fn ipv6_headers_not_followed_pass_untouched_and_are_counted() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(LOCAL_POD6, true)]));
    // ESP: what follows is encrypted; nothing to translate, nothing to rewrite.
    let esp = frame6(CLIENT6, NODE6, NEXT_ESP, &[0u8; 32]);
    assert_eq!(f.external(&esp), (TC_ACT_OK, esp.clone()));
    // Seven options headers: more than the program walks.
    let mut deep = Packet6::tcp(CLIENT6, 40003, NODE6, NODE_PORT, SYN);
    for _ in 0..7 {
        deep = deep.with_ext(NEXT_DEST_OPTS, options_header());
    }
    let deep = deep.frame();
    assert_eq!(f.external(&deep), (TC_ACT_OK, deep.clone()));
    assert_eq!(f.stat(stat::TC_IPV6_EXT_UNHANDLED), 2);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
}

#[test]
fn ipv6_neighbour_discovery_and_truncated_headers_are_left_alone() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(LOCAL_POD6, true)]));
    // A neighbour solicitation for the node's address (type 135).
    let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0];
    ns.extend_from_slice(&NODE6.octets());
    let ns = frame6(CLIENT6, NODE6, NEXT_ICMPV6, &ns);
    assert_eq!(f.external(&ns), (TC_ACT_OK, ns.clone()));
    // A payload length past the end of the frame, and a TCP header cut short.
    let syn = Packet6::tcp(CLIENT6, 40004, NODE6, NODE_PORT, SYN).frame();
    let mut long = syn.clone();
    long[18..20].copy_from_slice(&500u16.to_be_bytes());
    let mut short = syn[..14 + 40 + 10].to_vec();
    short[18..20].copy_from_slice(&10u16.to_be_bytes());
    for bad in [long, short] {
        assert_eq!(f.external(&bad), (TC_ACT_OK, bad.clone()));
    }
    assert_eq!(f.stat(stat::TC_MALFORMED), 2);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
}

/// A fragmented UDP datagram: the first fragment carries the ports and is
/// translated; the later one gets the same addresses.
#[test]
fn ipv6_later_fragments_follow_their_first() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Udp, &[(LOCAL_POD6, true)]));
    let mut datagram = Packet6::udp(CLIENT6, 40005, NODE6, NODE_PORT);
    datagram.payload = vec![7u8; 64];
    let l4 = datagram.l4();
    let (head, tail) = l4.split_at(32);
    // Fragment header: next, reserved, offset (8-byte units) << 3 | M, id.
    let fragment = |offset: u16, more: bool| {
        let mut h = vec![UDP, 0];
        h.extend_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
        h.extend_from_slice(&0x1234_5678u32.to_be_bytes());
        h
    };
    let first = frame6(
        CLIENT6,
        NODE6,
        NEXT_FRAGMENT,
        &[&fragment(0, true)[..], head].concat(),
    );
    let later = frame6(
        CLIENT6,
        NODE6,
        NEXT_FRAGMENT,
        &[&fragment(4, false)[..], tail].concat(),
    );
    let (verdict, out) = f.external(&first);
    assert_eq!(verdict, TC_ACT_OK);
    let dst = |frame: &[u8]| Ipv6Addr::from(<[u8; 16]>::try_from(&frame[38..54]).unwrap());
    let src = |frame: &[u8]| Ipv6Addr::from(<[u8; 16]>::try_from(&frame[22..38]).unwrap());
    assert_eq!((src(&out), dst(&out)), (CLIENT6, LOCAL_POD6));
    let (verdict, out_later) = f.external(&later);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!((src(&out_later), dst(&out_later)), (CLIENT6, LOCAL_POD6));
    // Reassembled, the datagram's UDP checksum holds for its new addresses.
    let mut whole = out[62..].to_vec();
    whole.extend_from_slice(&out_later[62..]);
    let ip = header(CLIENT6, LOCAL_POD6, UDP, 0);
    let (udp, payload) = UdpHeader::from_slice(&whole).unwrap();
    assert_eq!(udp.destination_port, 8080);
    assert_eq!(udp.calc_checksum_ipv6(&ip, payload).unwrap(), udp.checksum);
}

#[test]
fn ipv6_service_without_endpoints_resets_tcp_and_refuses_udp() {
    let mut f = Fixture::new();
    let mut desired = node_port6(Protocol::Tcp, &[]);
    desired
        .frontends
        .extend(node_port6(Protocol::Udp, &[]).frontends);
    f.program(&desired);
    let (verdict, out) = f.external(&Packet6::tcp(CLIENT6, 40006, NODE6, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let p = etherparse::SlicedPacket::from_ethernet(&out).unwrap();
    let Some(etherparse::TransportSlice::Tcp(tcp)) = p.transport else {
        panic!("no TCP answer: {p:?}");
    };
    assert!(tcp.rst() && tcp.ack());
    assert_eq!(tcp.acknowledgment_number(), 1001 + 5);
    assert_eq!(
        inspect6(&out),
        Seen6 {
            src: NODE6,
            sport: NODE_PORT,
            dst: CLIENT6,
            dport: 40006
        }
    );
    // UDP: an ICMPv6 port unreachable from the address tried, quoting the
    // datagram's IPv6 and UDP headers, its checksum over the pseudo header.
    let udp = Packet6::udp(CLIENT6, 40007, NODE6, NODE_PORT).frame();
    let (verdict, out) = f.external(&udp);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let p = etherparse::SlicedPacket::from_ethernet(&out).unwrap();
    let Some(etherparse::NetSlice::Ipv6(ip)) = &p.net else {
        panic!("no IPv6 answer: {p:?}");
    };
    assert_eq!(ip.header().source_addr(), NODE6);
    assert_eq!(ip.header().destination_addr(), CLIENT6);
    let Some(etherparse::TransportSlice::Icmpv6(icmp)) = &p.transport else {
        panic!("no ICMPv6 answer: {p:?}");
    };
    assert_eq!(
        icmp.icmp_type(),
        etherparse::Icmpv6Type::DestinationUnreachable(
            etherparse::icmpv6::DestUnreachableCode::Port
        )
    );
    assert_eq!(
        icmp.payload(),
        &udp[14..14 + 48],
        "quotes IPv6 and UDP headers"
    );
    let sum = icmp
        .icmp_type()
        .calc_checksum(
            ip.header().source(),
            ip.header().destination(),
            icmp.payload(),
        )
        .unwrap();
    assert_eq!(sum, icmp.checksum());
    // Behind an extension header the datagram is not answered: dropped.
    let behind = Packet6::udp(CLIENT6, 40008, NODE6, NODE_PORT)
        .with_ext(0, options_header())
        .frame();
    assert_eq!(f.external(&behind).0, TC_ACT_SHOT);
    // Addresses of both families in one table: the IPv4 key space is untouched.
    assert!(f
        .maps
        .snapshot()
        .unwrap()
        .services
        .keys()
        .all(|k| IpAddr::from(k.address) == IpAddr::from(NODE6)));
}

/// An ICMPv6 error from `src` to `dst` quoting the IPv6 packet of `quoted` (a
/// frame) cut to `quote_len` bytes, its checksum computed by etherparse.
fn icmp6_error(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    kind: etherparse::Icmpv6Type,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let quote = &quoted[14..14 + quote_len];
    let icmp =
        etherparse::Icmpv6Header::with_checksum(kind, src.octets(), dst.octets(), quote).unwrap();
    let mut payload = icmp.to_bytes().to_vec();
    payload.extend_from_slice(quote);
    frame6(src, dst, NEXT_ICMPV6, &payload)
}

/// The outer addresses of an ICMPv6 error and its type, after checking its
/// checksum (over the pseudo header of those addresses), and its quote as a frame.
fn inspect_icmp6(frame: &[u8]) -> (Ipv6Addr, Ipv6Addr, etherparse::Icmpv6Type, Vec<u8>) {
    let p = etherparse::SlicedPacket::from_ethernet(frame).expect("a parsable frame");
    let Some(etherparse::NetSlice::Ipv6(ip)) = &p.net else {
        panic!("not IPv6: {p:?}");
    };
    let Some(etherparse::TransportSlice::Icmpv6(icmp)) = &p.transport else {
        panic!("not ICMPv6: {p:?}");
    };
    let (src, dst) = (ip.header().source(), ip.header().destination());
    let want = icmp
        .icmp_type()
        .calc_checksum(src, dst, icmp.payload())
        .unwrap();
    assert_eq!(want, icmp.checksum(), "ICMPv6 checksum after the rewrite");
    let mut quote = frame[..14].to_vec();
    quote.extend_from_slice(icmp.payload());
    (src.into(), dst.into(), icmp.icmp_type(), quote)
}

/// A router between the node and a remote backend cannot forward the SNATed
/// packet: its Packet Too Big goes to the node's address, quoting the packet as the
/// node sent it. The client gets it, quoting what the client sent (its own address
/// and port, the NodePort), with every checksum valid, the MTU and the router's
/// address kept; a quote cut after the ports is translated as well.
#[test]
fn ipv6_packet_too_big_from_beyond_the_node_reaches_the_client() {
    let router = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 9);
    let ptb = etherparse::Icmpv6Type::PacketTooBig { mtu: 1280 };
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(REMOTE_POD6, false)]));
    let syn = Packet6::tcp(CLIENT6, 40020, NODE6, NODE_PORT, ACK).frame();
    let sent = f.external(&syn).1;
    assert_eq!(inspect6(&sent).dst, REMOTE_POD6);
    let hits = f.stat(stat::TC_CT_HIT);

    for quote_len in [sent.len() - 14, 40 + 8] {
        let error = icmp6_error(router, NODE6, ptb, &sent, quote_len);
        let (verdict, out) = f.external(&error);
        assert_eq!(verdict, TC_ACT_OK, "forwarded by the stack: from a router");
        let (src, dst, kind, quote) = inspect_icmp6(&out);
        assert_eq!(
            (src, dst, kind),
            (router, CLIENT6, ptb),
            "quote {quote_len}"
        );
        let quoted = if quote_len == sent.len() - 14 {
            inspect6(&quote)
        } else {
            let ip = Ipv6Header::from_slice(&quote[14..]).unwrap().0;
            let ports = &quote[54..58];
            Seen6 {
                src: ip.source.into(),
                sport: u16::from_be_bytes([ports[0], ports[1]]),
                dst: ip.destination.into(),
                dport: u16::from_be_bytes([ports[2], ports[3]]),
            }
        };
        assert_eq!(
            quoted,
            Seen6 {
                src: CLIENT6,
                sport: 40020,
                dst: NODE6,
                dport: NODE_PORT
            },
            "quote {quote_len}"
        );
    }
    assert_eq!(f.stat(stat::TC_CT_HIT), hits + 2);
}

/// A local backend answers a datagram with "port unreachable": the client gets
/// it from the frontend it used, about what it sent.
#[test]
fn ipv6_unreachable_from_a_local_backend_comes_from_the_frontend() {
    let unreachable = etherparse::Icmpv6Type::DestinationUnreachable(
        etherparse::icmpv6::DestUnreachableCode::Port,
    );
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Udp, &[(LOCAL_POD6, true)]));
    let sent = f
        .external(&Packet6::udp(CLIENT6, 40021, NODE6, NODE_PORT).frame())
        .1;
    assert_eq!(inspect6(&sent).dst, LOCAL_POD6);
    let error = icmp6_error(LOCAL_POD6, CLIENT6, unreachable, &sent, sent.len() - 14);
    let (_, out) = f.internal(&error);
    let (src, dst, kind, quote) = inspect_icmp6(&out);
    assert_eq!((src, dst, kind), (NODE6, CLIENT6, unreachable));
    assert_eq!(
        inspect6(&quote),
        Seen6 {
            src: CLIENT6,
            sport: 40021,
            dst: NODE6,
            dport: NODE_PORT
        }
    );
}

/// ICMPv6 errors about no flow of ours, and informational messages, pass as they
/// came.
#[test]
fn ipv6_icmp_errors_of_unknown_flows_pass_untouched() {
    let mut f = Fixture::new();
    f.program(&node_port6(Protocol::Tcp, &[(REMOTE_POD6, false)]));
    let stranger = Packet6::tcp(CLIENT6, 40022, REMOTE_POD6, 8080, ACK).frame();
    let ptb = etherparse::Icmpv6Type::PacketTooBig { mtu: 1280 };
    let error = icmp6_error(NODE6, CLIENT6, ptb, &stranger, stranger.len() - 14);
    let (verdict, out) = f.external(&error);
    assert_eq!((verdict, &out), (TC_ACT_OK, &error));
    let echo = etherparse::Icmpv6Type::EchoRequest(etherparse::IcmpEchoHeader { id: 1, seq: 1 });
    let ping = icmp6_error(CLIENT6, NODE6, echo, &stranger, 8);
    let (verdict, out) = f.external(&ping);
    assert_eq!((verdict, &out), (TC_ACT_OK, &ping));
}
