//! IPv6 through `lb_xdp`: the same flow logic and maps as IPv4, a hop limit
//! instead of a TTL (and no header checksum), and extension headers left to TC.

use std::net::Ipv6Addr;

use lb_common::stat;
use lb_userspace::model::{DesiredState, Protocol};

use super::frames::{inspect, seen, Pkt, ACK, SYN};
use super::net::{CLIENT_GW_MAC, NODE6, PEER_NODE_MAC, UPLINK_MAC};
use super::{backend, counted, frontend, Fixture, NODE_PORT, TC_ACT_OK, TC_ACT_REDIRECT};
use super::{XDP_PASS, XDP_TX};

const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x71, 0, 0, 0, 0, 5);
const LOCAL_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x11);
const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x21);
/// Behind a gateway whose neighbour entry does not exist.
const UNRESOLVED_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 3, 0, 0, 0, 0, 0x31);
const NEXT_DEST_OPTS: u8 = 60;
const NEXT_FRAGMENT: u8 = 44;
const NEXT_ESP: u8 = 50;

fn node_port6(protocol: Protocol, backends: &[super::BackendAddr]) -> DesiredState {
    let mut desired = DesiredState::default();
    frontend(&mut desired, NODE6, NODE_PORT, protocol, backends);
    desired
}

/// `frame` (Ethernet + a 40-byte IPv6 header + its payload) with an extension
/// header of kind `next` inserted after the fixed header; `ext`'s first byte is
/// overwritten with the header that follows. The L4 checksum is unchanged: the
/// pseudo header does not cover extension headers.
fn with_ext(frame: &[u8], next: u8, mut ext: Vec<u8>) -> Vec<u8> {
    let mut out = frame[..54].to_vec();
    ext[0] = out[20];
    out[20] = next;
    let payload_len = u16::from_be_bytes([out[18], out[19]]) as usize + ext.len();
    out[18..20].copy_from_slice(&(payload_len as u16).to_be_bytes());
    out.extend_from_slice(&ext);
    out.extend_from_slice(&frame[54..]);
    out
}

/// An 8-byte destination options header (one PadN option).
fn options_header() -> Vec<u8> {
    vec![0, 0, 1, 4, 0, 0, 0, 0]
}

#[test]
fn ipv6_remote_backend_first_packet_known_flow_and_reply_are_sent_by_xdp() {
    let mut f = Fixture::new();
    f.program(&node_port6(
        Protocol::Tcp,
        &[backend(REMOTE_POD6, 8080, false)],
    ));
    let syn = Pkt::tcp(CLIENT6, 40001, NODE6, NODE_PORT, SYN).frame();
    let run = f.xdp(&syn);
    assert_eq!(run.verdict, XDP_TX);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(NODE6, 40001, REMOTE_POD6, 8080));
    assert_eq!((out.eth_dst, out.eth_src), (PEER_NODE_MAC, UPLINK_MAC));
    assert_eq!(out.ttl, 63, "hop limit decremented");
    assert_eq!(out.payload, b"hello");
    // The entries are TC's for the same packet.
    let by_xdp = f.conntrack();
    assert_eq!(by_xdp.len(), 2);
    f.clear_conntrack();
    let (verdict, tc_out) = f.tc(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&tc_out).tuple, out.tuple);
    assert_eq!(f.conntrack(), by_xdp);

    let run = f.xdp(&Pkt::tcp(CLIENT6, 40001, NODE6, NODE_PORT, ACK).frame());
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(inspect(&run.frame).tuple, out.tuple);
    let mut reply = Pkt::tcp(REMOTE_POD6, 8080, NODE6, 40001, SYN | ACK);
    reply.eth_src = PEER_NODE_MAC;
    let run = f.xdp(&reply.frame());
    assert_eq!(run.verdict, XDP_TX);
    let back = inspect(&run.frame);
    assert_eq!(back.tuple, seen(NODE6, NODE_PORT, CLIENT6, 40001));
    assert_eq!((back.eth_dst, back.eth_src), (CLIENT_GW_MAC, UPLINK_MAC));
    assert_eq!(back.ttl, 63);
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_NEW_FLOW, 1),
            (stat::XDP_NEW_FLOW, 1),
            (stat::XDP_TX, 3)
        ])
    );
}

#[test]
fn ipv6_udp_to_a_remote_backend_keeps_a_valid_checksum() {
    let mut f = Fixture::new();
    f.program(&node_port6(
        Protocol::Udp,
        &[backend(REMOTE_POD6, 5353, false)],
    ));
    let run = f.xdp(&Pkt::udp(CLIENT6, 6001, NODE6, NODE_PORT).frame());
    assert_eq!(run.verdict, XDP_TX);
    // `inspect` checks the UDP checksum over the new pseudo header.
    assert_eq!(
        inspect(&run.frame).tuple,
        seen(NODE6, 6001, REMOTE_POD6, 5353)
    );
}

#[test]
fn ipv6_local_backend_is_translated_marked_and_passed() {
    let mut f = Fixture::new();
    f.program(&node_port6(
        Protocol::Tcp,
        &[backend(LOCAL_POD6, 8080, true)],
    ));
    let syn = Pkt::tcp(CLIENT6, 40002, NODE6, NODE_PORT, SYN).frame();
    let run = f.xdp(&syn);
    assert_eq!(run.verdict, XDP_PASS);
    assert!(run.marked(), "metadata {:?}", run.meta);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(CLIENT6, 40002, LOCAL_POD6, 8080));
    assert_eq!(out.ttl, 64);
    assert_eq!(
        f.counters(),
        counted(&[(stat::XDP_NEW_FLOW, 1), (stat::XDP_PASS_LOCAL, 1)])
    );
    let by_xdp = f.conntrack();
    f.clear_conntrack();
    let (verdict, tc_out) = f.tc(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&tc_out).tuple, out.tuple);
    assert_eq!(f.conntrack(), by_xdp);
}

#[test]
fn ipv6_what_xdp_is_unsure_of_is_passed_to_tc_untouched_and_counted() {
    let mut f = Fixture::new();
    let mut desired = node_port6(Protocol::Tcp, &[backend(REMOTE_POD6, 8080, false)]);
    frontend(
        &mut desired,
        NODE6,
        30081,
        Protocol::Tcp,
        &[backend(UNRESOLVED_POD6, 8080, false)],
    );
    f.program(&desired);

    let syn = Pkt::tcp(CLIENT6, 40003, NODE6, NODE_PORT, SYN);
    let mut last_hop = syn.clone();
    last_hop.ttl = 1;
    let sent = f.xdp(&Pkt::tcp(CLIENT6, 40004, NODE6, NODE_PORT, ACK).frame());
    assert_eq!(sent.verdict, XDP_TX);
    let mut too_big = Vec::new();
    etherparse::PacketBuilder::ethernet2(PEER_NODE_MAC, UPLINK_MAC)
        .ipv6(REMOTE_POD6.octets(), NODE6.octets(), 64)
        .icmpv6(etherparse::Icmpv6Type::PacketTooBig { mtu: 1280 })
        .write(&mut too_big, &sent.frame[14..])
        .unwrap();
    // Fragment header: next, reserved, offset << 3 | M, identification.
    let first_fragment = vec![0, 0, 0, 1, 0x12, 0x34, 0x56, 0x78];
    let mut long = syn.frame();
    long[18..20].copy_from_slice(&500u16.to_be_bytes());
    let mut neighbour_solicitation = Vec::new();
    etherparse::PacketBuilder::ethernet2(CLIENT_GW_MAC, UPLINK_MAC)
        .ipv6(CLIENT6.octets(), NODE6.octets(), 255)
        .icmpv6(etherparse::Icmpv6Type::Unknown {
            type_u8: 135,
            code_u8: 0,
            bytes5to8: [0; 4],
        })
        .write(&mut neighbour_solicitation, &NODE6.octets())
        .unwrap();
    let cases: Vec<(&str, Vec<u8>, Option<u32>)> = vec![
        (
            "destination options",
            with_ext(&syn.frame(), NEXT_DEST_OPTS, options_header()),
            Some(stat::XDP_PASS_IPV6_EXT),
        ),
        (
            "ESP",
            with_ext(&syn.frame(), NEXT_ESP, vec![0u8; 16]),
            Some(stat::XDP_PASS_IPV6_EXT),
        ),
        (
            "first fragment",
            with_ext(&syn.frame(), NEXT_FRAGMENT, first_fragment),
            Some(stat::XDP_PASS_FRAGMENT),
        ),
        (
            "Packet Too Big about a flow",
            too_big,
            Some(stat::XDP_PASS_ICMP_ERROR),
        ),
        (
            "hop limit expiring here",
            last_hop.frame(),
            Some(stat::XDP_PASS_TTL),
        ),
        (
            "next hop without a neighbour entry",
            Pkt::tcp(CLIENT6, 40005, NODE6, 30081, SYN).frame(),
            Some(stat::XDP_PASS_NO_NEIGH),
        ),
        (
            "payload length past the end",
            long,
            Some(stat::XDP_PASS_MALFORMED),
        ),
        ("neighbour solicitation", neighbour_solicitation, None),
    ];
    let entries_before = f.conntrack();
    let mut expected = vec![(stat::XDP_NEW_FLOW, 1), (stat::XDP_TX, 1)];
    for (what, frame, counter) in &cases {
        let run = f.xdp(frame);
        assert_eq!(run.verdict, XDP_PASS, "{what}");
        assert_eq!(&run.frame, frame, "{what}: passed untouched");
        assert!(run.meta.is_empty(), "{what}: no mark");
        if let Some(counter) = counter {
            match expected.iter_mut().find(|(c, _)| c == counter) {
                Some((_, n)) => *n += 1,
                None => expected.push((*counter, 1)),
            }
        }
        assert_eq!(f.counters(), counted(&expected), "{what}");
        assert_eq!(f.conntrack(), entries_before, "{what}: no state written");
    }
    // TC forwards the packet behind an options header as it always did.
    let (verdict, out) = f.tc(&cases[0].1);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, seen(NODE6, 40003, REMOTE_POD6, 8080));
}
