//! Egress masquerading through BPF_PROG_TEST_RUN: `lb_tc_egress` (a node-facing
//! device's egress) and `lb_tc_external` (its ingress, where replies and ICMP
//! errors come back), loaded by the agent's loader with `--masquerade bpf` against
//! test-private pinned maps, the address sets written by the agent's own writer.
//! Every expected frame is built by etherparse for the tuple it must carry, so
//! a translated frame equal to it has every checksum right. Needs root and the
//! embedded kernel object (`cargo xtask test` provides both).
//!
//! The test's thread runs in a network namespace of its own with no routes, so
//! the source the programs give a flow is `--node-ip`'s (the route's source is
//! what the end-to-end test sees).

/// What every packet-fixture binary shares (namespace, pins, loading, runs).
#[allow(dead_code)]
mod fixture;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use aya::Ebpf;
use etherparse::{
    icmpv4::DestUnreachableHeader, Icmpv4Type, Icmpv6Type, PacketBuilder, PacketBuilderStep,
    PacketHeaders, TransportHeader,
};
use lb_common::{program_names, stat, MasqSettings};
use lb_userspace::control::masquerade::{self as rules};
use lb_userspace::datapath::loader::{self, ProgramSettings};
use lb_userspace::datapath::maps::PinnedMaps;
use lb_userspace::datapath::masquerade::{self, MasqMaps};
use lb_userspace::datapath::pins::MapSizes;
use lb_userspace::source::masq_config::MasqConfig;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 21);
/// Outside every default exempt range.
const OUTSIDE: Ipv4Addr = Ipv4Addr::new(11, 22, 33, 44);
const ROUTER: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 1);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x11);
const OUTSIDE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x44);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);

struct Fixture {
    ebpf: Ebpf,
    maps: PinnedMaps,
    masq: MasqMaps,
    _pins: fixture::PinGuard,
}

impl Fixture {
    fn new() -> Self {
        Self::with_map_size(lb_common::DEFAULT_MASQ_MAX)
    }

    fn with_map_size(masq_entries: u32) -> Self {
        let (layout, pins) = fixture::private_pins("masq");
        let object = loader::kernel_object(None).expect("kernel object embedded");
        let sizes = MapSizes {
            conntrack: 1024,
            masquerade: masq_entries,
            ..MapSizes::default()
        };
        let settings = ProgramSettings {
            masquerade: MasqSettings {
                enabled: 1,
                nodeport_first_host: 30000,
                nodeport_last_host: 32767,
                ..MasqSettings::default()
            },
            ..ProgramSettings::default()
        };
        let node_ips = [IpAddr::from(NODE), IpAddr::from(NODE6)];
        let mut ebpf = loader::load_with(&object, &layout, sizes, &node_ips, &settings)
            .expect("load kernel object");
        fixture::load_tc(
            &mut ebpf,
            &[program_names::TC_EXTERNAL, program_names::TC_EGRESS],
        );
        let maps = PinnedMaps::open(&layout).expect("open pinned maps");
        let mut masq = MasqMaps::open(&layout).expect("open masquerade maps");
        // As the agent derives them: ip-masq-agent's defaults, both nodes' pods.
        let node = |name: &str, cidrs: &[&str]| {
            std::sync::Arc::new(
                serde_json::from_value(serde_json::json!({
                    "metadata": {"name": name}, "spec": {"podCIDRs": cidrs},
                }))
                .unwrap(),
            )
        };
        let nodes = [
            node("node1", &["10.244.1.0/24", "fd00:244:1::/64"]),
            node("node2", &["10.244.2.0/24", "fd00:244:2::/64"]),
        ];
        let sets = rules::derive(
            rules::MasqueradeMode::Bpf,
            &MasqConfig::default(),
            &nodes,
            "node1",
            &[],
        );
        masq.sync_cidrs(&sets).expect("write the address sets");
        Fixture {
            ebpf,
            maps,
            masq,
            _pins: pins,
        }
    }

    fn run(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        fixture::tc_run(&self.ebpf, program, frame)
    }

    /// A packet leaving through a node-facing device.
    fn egress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_EGRESS, frame)
    }

    /// A packet arriving on a node-facing device.
    fn ingress(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_EXTERNAL, frame)
    }

    fn stat(&self, index: u32) -> u64 {
        self.maps.stats().unwrap()[index as usize].1
    }

    fn translations(&self) -> Vec<masquerade::Translation> {
        masquerade::translations(&self.masq.translations().unwrap(), u64::MAX)
    }
}

// ---- frames, built by etherparse -------------------------------------------------

const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 1];
const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
const PAYLOAD: &[u8] = b"hello through the masquerade";

fn ip(src: IpAddr, dst: IpAddr) -> PacketBuilderStep<etherparse::IpHeaders> {
    let eth = PacketBuilder::ethernet2(MAC_A, MAC_B);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
        _ => panic!("one family"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Syn,
    SynAck,
    Udp,
    EchoRequest,
    EchoReply,
}

/// A frame from `src` to `dst` (ports, or the echo identifier as the port of its
/// sender for a request and of its receiver for a reply).
fn frame(kind: Kind, src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let ip = ip(src.ip(), dst.ip());
    let mut out = Vec::new();
    let v6 = src.is_ipv6();
    match kind {
        Kind::Syn => ip
            .tcp(src.port(), dst.port(), 1000, 64240)
            .syn()
            .write(&mut out, PAYLOAD),
        Kind::SynAck => ip
            .tcp(src.port(), dst.port(), 5000, 64240)
            .syn()
            .ack(1001)
            .write(&mut out, PAYLOAD),
        Kind::Udp => ip.udp(src.port(), dst.port()).write(&mut out, PAYLOAD),
        Kind::EchoRequest if v6 => ip
            .icmpv6_echo_request(src.port(), 7)
            .write(&mut out, PAYLOAD),
        Kind::EchoRequest => ip
            .icmpv4_echo_request(src.port(), 7)
            .write(&mut out, PAYLOAD),
        Kind::EchoReply if v6 => ip.icmpv6_echo_reply(dst.port(), 7).write(&mut out, PAYLOAD),
        Kind::EchoReply => ip.icmpv4_echo_reply(dst.port(), 7).write(&mut out, PAYLOAD),
    }
    .unwrap();
    out
}

fn sa(ip: impl Into<IpAddr>, port: u16) -> SocketAddr {
    SocketAddr::new(ip.into(), port)
}

/// The source port (or echo identifier) a translated frame carries.
fn source_port(frame: &[u8]) -> u16 {
    let headers = PacketHeaders::from_ethernet_slice(frame).expect("a parsable frame");
    match headers.transport.expect("a transport header") {
        TransportHeader::Tcp(t) => t.source_port,
        TransportHeader::Udp(u) => u.source_port,
        TransportHeader::Icmpv4(i) => match i.icmp_type {
            Icmpv4Type::EchoRequest(e) => e.id,
            other => panic!("{other:?}"),
        },
        TransportHeader::Icmpv6(i) => match i.icmp_type {
            Icmpv6Type::EchoRequest(e) => e.id,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

/// Sends `kind` from the pod out of the node and checks it left as `expected_port`
/// from the node (or, with `None`, from whatever port it got, returned).
fn out_and_back(f: &Fixture, kind: Kind, pod: SocketAddr, dst: SocketAddr, node: IpAddr) -> u16 {
    let (verdict, out) = f.egress(&frame(kind, pod, dst));
    assert_eq!(verdict, TC_ACT_OK, "{kind:?} {pod} -> {dst}");
    let port = source_port(&out);
    assert_eq!(
        out,
        frame(kind, sa(node, port), dst),
        "{kind:?} {pod} -> {dst} leaves from {node}:{port}, every checksum right"
    );
    let reply = match kind {
        Kind::Syn => Kind::SynAck,
        Kind::EchoRequest => Kind::EchoReply,
        other => other,
    };
    let (verdict, back) = f.ingress(&frame(reply, dst, sa(node, port)));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        back,
        frame(reply, dst, pod),
        "the {reply:?} to {node}:{port} reaches {pod}"
    );
    port
}

// ---- tests -----------------------------------------------------------------------

#[test]
fn an_outbound_syn_leaves_with_the_node_s_address_and_its_reply_comes_back() {
    let f = Fixture::new();
    let port = out_and_back(&f, Kind::Syn, sa(POD, 40000), sa(OUTSIDE, 443), NODE.into());
    assert_eq!(port, 40000, "the pod's port is kept when free");
    assert_eq!(f.stat(stat::MASQ_NEW_FLOW), 1);
    assert_eq!(f.stat(stat::MASQ_INGRESS), 1);
    // The next segment follows the same translation without a new flow.
    let (_, out) = f.egress(&frame(Kind::Syn, sa(POD, 40000), sa(OUTSIDE, 443)));
    assert_eq!(out, frame(Kind::Syn, sa(NODE, 40000), sa(OUTSIDE, 443)));
    assert_eq!(f.stat(stat::MASQ_NEW_FLOW), 1);
    let listed = f.translations();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].node, sa(NODE, 40000));
    assert_eq!(listed[0].destination, sa(OUTSIDE, 443));
    assert!(!listed[0].half);
    // UDP, and both over IPv6.
    out_and_back(&f, Kind::Udp, sa(POD, 5353), sa(OUTSIDE, 53), NODE.into());
    out_and_back(
        &f,
        Kind::Syn,
        sa(POD6, 40000),
        sa(OUTSIDE6, 443),
        NODE6.into(),
    );
    out_and_back(
        &f,
        Kind::Udp,
        sa(POD6, 5353),
        sa(OUTSIDE6, 53),
        NODE6.into(),
    );
}

#[test]
fn exempt_destinations_and_the_node_s_own_traffic_are_untouched() {
    let f = Fixture::new();
    for (src, dst) in [
        // Another node's pod (the cluster's pod CIDRs are always exempt).
        (sa(POD, 40000), sa(REMOTE_POD, 80)),
        // ip-masq-agent's defaults: private ranges, link-local.
        (sa(POD, 40001), sa(Ipv4Addr::new(172, 20, 0, 5), 80)),
        (sa(POD, 40002), sa(Ipv4Addr::new(169, 254, 169, 254), 80)),
        (
            sa(POD6, 40003),
            sa("fd00:244:2::21".parse::<Ipv6Addr>().unwrap(), 80),
        ),
    ] {
        let sent = frame(Kind::Syn, src, dst);
        assert_eq!(f.egress(&sent), (TC_ACT_OK, sent.clone()), "{src} -> {dst}");
    }
    assert_eq!(f.stat(stat::MASQ_EXEMPT), 4);
    // Not from a local pod: the node itself, another node's pod.
    for src in [sa(NODE, 40000), sa(REMOTE_POD, 40000)] {
        let sent = frame(Kind::Syn, src, sa(OUTSIDE, 80));
        assert_eq!(f.egress(&sent), (TC_ACT_OK, sent.clone()), "{src}");
    }
    assert_eq!(f.stat(stat::MASQ_NEW_FLOW), 0);
    assert!(f.translations().is_empty());
}

#[test]
fn a_taken_port_makes_the_flow_pick_another() {
    let f = Fixture::new();
    let dst = sa(OUTSIDE, 443);
    assert_eq!(
        out_and_back(&f, Kind::Syn, sa(POD, 40000), dst, NODE.into()),
        40000
    );
    // Another pod with the same port to the same destination: another port, and
    // each flow's replies reach its own pod.
    let other = out_and_back(&f, Kind::Syn, sa(POD2, 40000), dst, NODE.into());
    assert_ne!(other, 40000);
    assert!(
        other >= 1024 && !(30000..=32767).contains(&other),
        "{other}"
    );
    out_and_back(&f, Kind::Syn, sa(POD, 40000), dst, NODE.into());
    // The same pod port towards another destination keeps it: exhaustion and
    // collisions are per destination.
    assert_eq!(
        out_and_back(&f, Kind::Syn, sa(POD2, 40000), sa(OUTSIDE, 80), NODE.into()),
        40000
    );
    // A port in the NodePort range is never kept.
    let from_node_port = out_and_back(&f, Kind::Syn, sa(POD, 30080), dst, NODE.into());
    assert!(
        !(30000..=32767).contains(&from_node_port),
        "{from_node_port}"
    );
    // A port a socket of the node holds (UDP bound on every address) is not taken.
    let socket = UdpSocket::bind("0.0.0.0:0").expect("a UDP socket in the test's namespace");
    let held = socket.local_addr().unwrap().port();
    let got = out_and_back(&f, Kind::Udp, sa(POD, held), sa(OUTSIDE, 53), NODE.into());
    assert_ne!(got, held, "the node's socket keeps its port");
    assert_eq!(f.stat(stat::MASQ_PORT_EXHAUSTED), 0);
}

#[test]
fn pings_are_masqueraded_by_their_identifier() {
    let f = Fixture::new();
    let dst = sa(OUTSIDE, 0);
    assert_eq!(
        out_and_back(&f, Kind::EchoRequest, sa(POD, 0x1234), dst, NODE.into()),
        0x1234
    );
    let other = out_and_back(&f, Kind::EchoRequest, sa(POD2, 0x1234), dst, NODE.into());
    assert_ne!(
        other, 0x1234,
        "two pods' pings to one host get two identifiers"
    );
    out_and_back(
        &f,
        Kind::EchoRequest,
        sa(POD6, 0x77),
        sa(OUTSIDE6, 0),
        NODE6.into(),
    );
    assert_eq!(
        f.translations()
            .iter()
            .filter(|t| t.protocol.starts_with("ICMP"))
            .count(),
        3
    );
}

#[test]
fn an_icmp_error_about_a_masqueraded_flow_reaches_the_pod() {
    let f = Fixture::new();
    let (pod, dst) = (sa(POD, 40000), sa(OUTSIDE, 443));
    out_and_back(&f, Kind::Syn, pod, dst, NODE.into());
    // A router on the way cannot forward the segment as sent (PMTU discovery).
    let need_frag =
        Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::FragmentationNeeded {
            next_hop_mtu: 1400,
        });
    let error = |to: IpAddr, quoted: &[u8]| {
        let mut out = Vec::new();
        ip(ROUTER.into(), to)
            .icmpv4(need_frag.clone())
            .write(&mut out, quoted)
            .unwrap();
        out
    };
    let sent = frame(Kind::Syn, sa(NODE, 40000), dst);
    let (verdict, out) = f.ingress(&error(NODE.into(), &sent[14..]));
    assert_eq!(verdict, TC_ACT_OK);
    let original = frame(Kind::Syn, pod, dst);
    assert_eq!(
        out,
        error(POD.into(), &original[14..]),
        "the error goes to the pod, quoting what the pod sent"
    );
    assert_eq!(f.stat(stat::MASQ_ICMP_ERROR), 1);

    // IPv6: Packet Too Big.
    let (pod6, dst6) = (sa(POD6, 40000), sa(OUTSIDE6, 443));
    out_and_back(&f, Kind::Syn, pod6, dst6, NODE6.into());
    let too_big = |to: IpAddr, quoted: &[u8]| {
        let mut out = Vec::new();
        ip(ROUTER6.into(), to)
            .icmpv6(Icmpv6Type::PacketTooBig { mtu: 1280 })
            .write(&mut out, quoted)
            .unwrap();
        out
    };
    let sent6 = frame(Kind::Syn, sa(NODE6, 40000), dst6);
    let (verdict, out) = f.ingress(&too_big(NODE6.into(), &sent6[14..]));
    assert_eq!(verdict, TC_ACT_OK);
    let original6 = frame(Kind::Syn, pod6, dst6);
    assert_eq!(out, too_big(POD6.into(), &original6[14..]));
    assert_eq!(f.stat(stat::MASQ_ICMP_ERROR), 2);
}

#[test]
fn malformed_packets_pass_untouched() {
    let f = Fixture::new();
    let good = frame(Kind::Syn, sa(POD, 40000), sa(OUTSIDE, 443));
    let mut cases: Vec<Vec<u8>> = vec![
        // Cut inside the TCP header.
        good[..14 + 20 + 10].to_vec(),
        // An IPv4 header length below its minimum.
        {
            let mut short = good.clone();
            short[14] = 0x44;
            short
        },
        // A TCP data offset past the packet.
        {
            let mut long = good.clone();
            long[14 + 20 + 12] = 0xf0;
            long
        },
        // Not IP.
        {
            let mut arp = good.clone();
            arp[12..14].copy_from_slice(&[0x08, 0x06]);
            arp
        },
    ];
    // An echo request cut before its identifier.
    let ping = frame(Kind::EchoRequest, sa(POD, 9), sa(OUTSIDE, 0));
    cases.push(ping[..14 + 20 + 3].to_vec());
    for (i, case) in cases.iter().enumerate() {
        assert_eq!(f.egress(case), (TC_ACT_OK, case.clone()), "case {i}");
    }
    assert_eq!(f.stat(stat::MASQ_NEW_FLOW), 0);
    assert!(f.translations().is_empty());
}

#[test]
fn a_full_map_drops_new_flows_and_says_so() {
    // Two entries: room for one flow.
    let f = Fixture::with_map_size(2);
    out_and_back(&f, Kind::Syn, sa(POD, 40000), sa(OUTSIDE, 443), NODE.into());
    let (verdict, _) = f.egress(&frame(Kind::Syn, sa(POD2, 40000), sa(OUTSIDE, 80)));
    assert_eq!(
        verdict, TC_ACT_SHOT,
        "no room: dropped, never sent untranslated"
    );
    assert_eq!(f.stat(stat::MASQ_MAP_FULL), 1);
    // The flow that has its entries keeps working.
    out_and_back(&f, Kind::Syn, sa(POD, 40000), sa(OUTSIDE, 443), NODE.into());
}
