//! Packet fixtures for direct server return (`--lb-mode dsr|hybrid`) through
//! BPF_PROG_TEST_RUN: the real TC and XDP programs, loaded by the agent's loader
//! with a forwarding mode, against test-private pinned maps programmed by the
//! reconciler, in a network namespace of the test thread's own whose routes answer
//! as on a node (`xdp_fixtures/net.rs`: the other node's pods behind 192.168.50.3
//! and 2001:db8:50::3).
//!
//! The entry node's side: what leaves for a remote backend (the client's address
//! kept, the frontend in an IPv4 option / IPv6 Destination Options header, an
//! outer header with `ipip`), its checksums verified by etherparse and its added
//! bytes against literal wire formats. The backend node's side: what reaches the
//! pod (byte for byte the packet the entry node translated), the reply entry it
//! leaves, the pod's reply rewritten to come from the frontend, the MSS clamp; and
//! what is not DSR passing untouched. Needs root and the embedded kernel object
//! (`cargo xtask test` provides both).

/// What every packet-fixture binary shares (namespace, pins, loading, runs).
#[allow(dead_code)]
mod fixture;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use aya::programs::{TestRun, TestRunOptions, Xdp};
use aya::Ebpf;
use etherparse::{
    IpNumber, Ipv4Header, Ipv4Options, Ipv6Header, PacketBuilder, SlicedPacket, TcpHeader,
    TcpOptionElement, TransportSlice,
};
use lb_common::{program_names, stat, CtKey, CtValue, CT_DIR_FORWARD, CT_DIR_REPLY, CT_DSR};
use lb_common::{IpAddrBe, CT_DSR_IPIP};
use lb_userspace::datapath::forwarding::{DsrDispatch, Forwarding, LbMode};
use lb_userspace::datapath::loader::{self, ProgramSettings};
use lb_userspace::datapath::maps::{ConntrackMap, PinnedMaps};
use lb_userspace::datapath::pins::MapSizes;
use lb_userspace::model::{BackendAddr, DesiredState, Frontend, FrontendSpec, Protocol};

#[path = "xdp_fixtures/frames.rs"]
#[allow(dead_code)]
mod frames;
#[path = "xdp_fixtures/net.rs"]
#[allow(dead_code)]
mod net;

use frames::{inspect, seen, Pkt, ACK, SYN};
use net::{NODE, NODE6, PEER_NODE_MAC, UPLINK_MAC};

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const TC_ACT_OK: u32 = 0;
const TC_ACT_REDIRECT: u32 = 7;

const CLIENT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x71, 0, 0, 0, 0, 5);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
/// On the other node, routed via 192.168.50.3 / 2001:db8:50::3 (`PEER_NODE_MAC`).
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 21);
const REMOTE_POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x21);
const PEER_NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 3);
const PEER_NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 3);
/// On-link, behind no gateway (a route the `ipip` test adds).
const ON_LINK_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 9, 21);
const NODE_PORT: u16 = 30080;

/// The wire formats, written out here rather than taken from the program: the
/// IPv4 option (type 0x9e, length 8) and the IPv6 option (type 0x1e, length 18) in
/// a 24-byte Destination Options header ending in a PadN.
const OPT4_TYPE: u8 = 0x9e;
const OPT6_TYPE: u8 = 0x1e;
const IPPROTO_IPIP: u8 = 4;
const IPPROTO_IPV6: u8 = 41;
const NEXT_DEST_OPTS: u8 = 60;

/// One test's maps and programs, pinned under a private directory that goes away
/// with the fixture, in a network namespace of the test thread's own.
struct Fixture {
    ebpf: Ebpf,
    maps: PinnedMaps,
    conntrack: ConntrackMap,
    /// Last: the pins go once the program and map handles are closed.
    _pins: fixture::PinGuard,
}

fn dsr(dispatch: DsrDispatch) -> Forwarding {
    Forwarding {
        mode: LbMode::Dsr,
        dispatch,
    }
}

impl Fixture {
    fn new(forwarding: Forwarding) -> Self {
        let (layout, pins) = fixture::private_pins("dsr");
        net::setup();
        let object = loader::kernel_object(None).expect("kernel object embedded");
        let sizes = MapSizes {
            conntrack: 1024,
            ..MapSizes::default()
        };
        let node_ips = [NODE.into(), NODE6.into()];
        let settings = ProgramSettings {
            forwarding,
            ..ProgramSettings::default()
        };
        let mut ebpf = loader::load_with(&object, &layout, sizes, &node_ips, &settings)
            .expect("load kernel object");
        let xdp: &mut Xdp = ebpf
            .program_mut(program_names::XDP)
            .expect("lb_xdp in the object")
            .try_into()
            .unwrap();
        fixture::load_retrying(|| xdp.load()).expect("verifier accepts lb_xdp");
        fixture::load_tc(
            &mut ebpf,
            &[program_names::TC_EXTERNAL, program_names::TC_INTERNAL],
        );
        let maps = PinnedMaps::open(&layout).expect("open pinned maps");
        let conntrack = ConntrackMap::open(&layout).expect("open the pinned conntrack");
        Fixture {
            ebpf,
            maps,
            conntrack,
            _pins: pins,
        }
    }

    fn program(&mut self, desired: &DesiredState) {
        fixture::program(&mut self.maps, desired);
    }

    /// Runs one frame through a TC program; the verdict and the frame after it.
    fn tc(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        fixture::tc_run(&self.ebpf, program, frame)
    }

    /// `lb_tc_external`: a node-facing device's ingress.
    fn external(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.tc(program_names::TC_EXTERNAL, frame)
    }

    /// `lb_tc_internal`: a pod's veth's ingress (the pod's replies).
    fn internal(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.tc(program_names::TC_INTERNAL, frame)
    }

    /// Runs one frame through `lb_xdp` as if it arrived on the uplink; the verdict
    /// and the frame (without metadata: DSR frames get none).
    fn xdp(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        let prog: &Xdp = self
            .ebpf
            .program(program_names::XDP)
            .unwrap()
            .try_into()
            .unwrap();
        let uplink = ifindex(net::UPLINK);
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, ...
        let mut ctx_in = [0u8; 24];
        ctx_in[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
        ctx_in[12..16].copy_from_slice(&uplink.to_ne_bytes());
        let mut ctx_out = [0u8; 24];
        let mut out = vec![0u8; frame.len() + 256];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx_in),
                ctx_out: Some(&mut ctx_out),
                ..TestRunOptions::default()
            })
            .unwrap_or_else(|e| panic!("XDP test run of a {}-byte frame: {e:?}", frame.len()));
        out.truncate(result.data_size_out as usize);
        let meta_len = u32::from_ne_bytes(ctx_out[..4].try_into().unwrap()) as usize;
        (result.return_value, out.split_off(meta_len))
    }

    /// Every counter that is not zero, by name: a test asserts the whole set, so a
    /// packet counted twice, or under another reason, shows.
    fn counters(&self) -> BTreeSet<(&'static str, u64)> {
        self.maps
            .stats()
            .unwrap()
            .into_iter()
            .filter(|(_, v)| *v != 0)
            .collect()
    }

    fn conntrack(&self) -> Vec<(CtKey, CtValue)> {
        self.conntrack.entries().unwrap()
    }

    /// The conntrack entry a packet with this tuple finds.
    fn entry(&self, src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Option<CtValue> {
        self.conntrack()
            .into_iter()
            .find(|(k, _)| {
                k.src_addr == IpAddrBe::from(src)
                    && k.dst_addr == IpAddrBe::from(dst)
                    && k.src_port == sport.to_be()
                    && k.dst_port == dport.to_be()
            })
            .map(|(_, v)| v)
    }
}

fn ifindex(name: &str) -> u32 {
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name; the call reads it only.
    unsafe { libc::if_nametoindex(name.as_ptr()) }
}

/// The counters as [`Fixture::counters`] lists them.
fn counted(expected: &[(u32, u64)]) -> BTreeSet<(&'static str, u64)> {
    expected
        .iter()
        .map(|&(index, n)| (stat::NAMES[index as usize], n))
        .collect()
}

fn backend(ip: impl Into<IpAddr>, port: u16, local: bool) -> BackendAddr {
    BackendAddr {
        ip: ip.into(),
        port,
        local,
    }
}

/// A NodePort frontend on `node:NODE_PORT` with the given backends.
fn node_port(
    node: impl Into<IpAddr>,
    protocol: Protocol,
    backends: &[BackendAddr],
) -> DesiredState {
    let mut desired = DesiredState::default();
    desired.frontends.insert(
        Frontend::internal(node.into(), NODE_PORT, protocol),
        FrontendSpec {
            service: "default/web:http".into(),
            backends: backends.iter().copied().collect::<BTreeSet<_>>().into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: false,
        },
    );
    desired
}

// ---- frames ----------------------------------------------------------------------

/// The IPv4 option the entry node adds for a frontend.
fn option4(frontend: Ipv4Addr, port: u16) -> [u8; 8] {
    let [p0, p1] = port.to_be_bytes();
    let [a, b, c, d] = frontend.octets();
    [OPT4_TYPE, 8, p0, p1, a, b, c, d]
}

/// The IPv6 Destination Options header the entry node adds for a frontend (its
/// next header filled in by [`with_dstopt6`]).
fn dstopt6(frontend: Ipv6Addr, port: u16) -> [u8; 24] {
    let mut ext = [0u8; 24];
    ext[1] = 2;
    ext[2] = OPT6_TYPE;
    ext[3] = 18;
    ext[4..20].copy_from_slice(&frontend.octets());
    ext[20..22].copy_from_slice(&port.to_be_bytes());
    ext[22] = 1; // PadN
    ext[23] = 0;
    ext
}

/// `frame` (Ethernet + IPv4) with `options` in its header, rebuilt by etherparse.
fn with_options4(frame: &[u8], options: &[u8]) -> Vec<u8> {
    let (mut ip, rest) = Ipv4Header::from_slice(&frame[14..]).unwrap();
    let payload = &rest[..ip.payload_len().unwrap() as usize];
    ip.options = Ipv4Options::try_from(options).unwrap();
    ip.set_payload_len(payload.len()).unwrap();
    ip.header_checksum = ip.calc_header_checksum();
    let mut out = frame[..14].to_vec();
    ip.write(&mut out).unwrap();
    out.extend_from_slice(payload);
    out
}

/// `frame` (Ethernet + IPv6) with `ext` as a Destination Options header right
/// behind the fixed header (its first byte becomes the next header). The L4
/// checksum is unchanged: the pseudo header does not cover extension headers.
fn with_dstopt6(frame: &[u8], mut ext: [u8; 24]) -> Vec<u8> {
    let (mut ip, rest) = Ipv6Header::from_slice(&frame[14..]).unwrap();
    ext[0] = ip.next_header.0;
    ip.next_header = IpNumber(NEXT_DEST_OPTS);
    ip.payload_length += 24;
    let mut out = frame[..14].to_vec();
    ip.write(&mut out).unwrap();
    out.extend_from_slice(&ext);
    out.extend_from_slice(rest);
    out
}

/// `frame`'s IP packet inside an outer header from `src` to `dst` of its family.
fn encapsulated(frame: &[u8], src: IpAddr, dst: IpAddr) -> Vec<u8> {
    let inner = &frame[14..];
    let mut out = frame[..14].to_vec();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut outer = Ipv4Header::new(
                inner.len() as u16,
                64,
                IpNumber(IPPROTO_IPIP),
                s.octets(),
                d.octets(),
            )
            .unwrap();
            outer.header_checksum = outer.calc_header_checksum();
            outer.write(&mut out).unwrap();
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let outer = Ipv6Header {
                traffic_class: 0,
                flow_label: Default::default(),
                payload_length: inner.len() as u16,
                next_header: IpNumber(IPPROTO_IPV6),
                hop_limit: 64,
                source: s.octets(),
                destination: d.octets(),
            };
            outer.write(&mut out).unwrap();
        }
        _ => panic!("addresses of two families"),
    }
    out.extend_from_slice(inner);
    out
}

/// The packet inside an IPv4 outer header: the outer header (its checksum
/// verified) and the inner packet as a frame of its own (the same Ethernet
/// header), for [`inspect`].
fn decapsulate4(frame: &[u8]) -> (Ipv4Header, Vec<u8>) {
    let (outer, rest) = Ipv4Header::from_slice(&frame[14..]).unwrap();
    assert_eq!(
        outer.header_checksum,
        outer.calc_header_checksum(),
        "outer header checksum"
    );
    assert_eq!(outer.total_len as usize, frame.len() - 14, "outer length");
    let mut inner = frame[..14].to_vec();
    inner.extend_from_slice(rest);
    (outer, inner)
}

fn decapsulate6(frame: &[u8]) -> (Ipv6Header, Vec<u8>) {
    let (outer, rest) = Ipv6Header::from_slice(&frame[14..]).unwrap();
    assert_eq!(outer.payload_length as usize, rest.len(), "outer length");
    let mut inner = frame[..14].to_vec();
    inner.extend_from_slice(rest);
    (outer, inner)
}

/// The options of the frame's IPv4 header.
fn options4(frame: &[u8]) -> Vec<u8> {
    let (ip, _) = Ipv4Header::from_slice(&frame[14..]).unwrap();
    ip.options[..].to_vec()
}

/// A pod's SYN-ACK announcing `mss` (behind a NOP, as some stacks order it, so the
/// option walk is exercised), from `src:sport` to `dst:dport`.
fn syn_ack(src: IpAddr, sport: u16, dst: IpAddr, dport: u16, mss: u16) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2([0x02, 0, 0, 0, 0, 0x21], [0x02, 0, 0, 0, 0, 0x22]);
    let ip = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
        (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
        _ => panic!("addresses of two families"),
    };
    let mut tcp = TcpHeader::new(sport, dport, 7000, 64240);
    tcp.syn = true;
    tcp.ack = true;
    tcp.acknowledgment_number = 1001;
    tcp.set_options(&[
        TcpOptionElement::Noop,
        TcpOptionElement::MaximumSegmentSize(mss),
        TcpOptionElement::SelectiveAcknowledgementPermitted,
        TcpOptionElement::WindowScale(7),
    ])
    .unwrap();
    let mut out = Vec::new();
    ip.tcp_header(tcp).write(&mut out, &[]).unwrap();
    out
}

/// The MSS a TCP segment announces (its checksum verified by [`inspect`] first).
fn mss_of(frame: &[u8]) -> Option<u16> {
    inspect(frame);
    let p = SlicedPacket::from_ethernet(frame).unwrap();
    let Some(TransportSlice::Tcp(tcp)) = p.transport else {
        panic!("not TCP");
    };
    tcp.options_iterator().find_map(|o| match o {
        Ok(TcpOptionElement::MaximumSegmentSize(mss)) => Some(mss),
        _ => None,
    })
}

// ---- entry node: TC --------------------------------------------------------------

/// The SYN to a NodePort with a backend on another node leaves DNATed with the
/// client's address, the frontend in the IPv4 option (the only one, first), valid
/// header and TCP checksums, one hop older, redirected out; the forward entry is
/// marked DSR. The ACK that follows goes the same way, without the option.
#[test]
fn tc_syn_carries_the_frontend_in_an_ipv4_option_and_later_segments_go_plain() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    f.program(&node_port(
        NODE,
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40001, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(options4(&out), option4(NODE, NODE_PORT));
    let seen_out = inspect(&out);
    assert_eq!(seen_out.tuple, seen(CLIENT, 40001, REMOTE_POD, 8080));
    assert_eq!(seen_out.ttl, 63);
    assert_eq!(seen_out.payload, b"hello");
    let forward = f
        .entry(CLIENT.into(), 40001, NODE.into(), NODE_PORT)
        .unwrap();
    assert_eq!((forward.dir, forward.dsr), (CT_DIR_FORWARD, CT_DSR));

    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40001, NODE, NODE_PORT, ACK).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(options4(&out).is_empty(), "later segments carry no option");
    assert_eq!(inspect(&out).tuple, seen(CLIENT, 40001, REMOTE_POD, 8080));
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_NEW_FLOW, 1),
            (stat::TC_CT_HIT, 1),
            (stat::DSR_ENCAPSULATED, 1)
        ])
    );
}

/// IPv6: the frontend rides in a 24-byte Destination Options header right behind
/// the fixed header; TCP's checksum holds.
#[test]
fn tc_syn_carries_the_frontend_in_an_ipv6_destination_option() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    f.program(&node_port(
        NODE6,
        Protocol::Tcp,
        &[backend(REMOTE_POD6, 8080, false)],
    ));
    let (verdict, out) = f.external(&Pkt::tcp(CLIENT6, 40002, NODE6, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(out[14 + 6], NEXT_DEST_OPTS, "next header");
    let mut expected = dstopt6(NODE6, NODE_PORT);
    expected[0] = 6; // TCP behind it
    assert_eq!(out[54..78], expected);
    let seen_out = inspect(&out);
    assert_eq!(seen_out.tuple, seen(CLIENT6, 40002, REMOTE_POD6, 8080));
    assert_eq!(seen_out.ttl, 63);
    assert_eq!(seen_out.payload, b"hello");
}

/// UDP: every datagram carries the frontend (the backend's node learns the flow
/// from any of them), IPv4 and IPv6.
#[test]
fn every_udp_datagram_carries_the_frontend() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    let mut desired = node_port(NODE, Protocol::Udp, &[backend(REMOTE_POD, 5353, false)]);
    desired
        .frontends
        .extend(node_port(NODE6, Protocol::Udp, &[backend(REMOTE_POD6, 5353, false)]).frontends);
    f.program(&desired);
    for _ in 0..2 {
        let (verdict, out) = f.external(&Pkt::udp(CLIENT, 6001, NODE, NODE_PORT).frame());
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(options4(&out), option4(NODE, NODE_PORT));
        assert_eq!(inspect(&out).tuple, seen(CLIENT, 6001, REMOTE_POD, 5353));
        let (verdict, out) = f.external(&Pkt::udp(CLIENT6, 6001, NODE6, NODE_PORT).frame());
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(out[14 + 6], NEXT_DEST_OPTS);
        assert_eq!(inspect(&out).tuple, seen(CLIENT6, 6001, REMOTE_POD6, 5353));
    }
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_NEW_FLOW, 2),
            (stat::TC_CT_HIT, 2),
            (stat::DSR_ENCAPSULATED, 4)
        ])
    );
}

/// A new UDP flow whose first datagram would not fit the route's MTU with the
/// option goes by SNAT (as in `snat` mode); a DSR flow's later datagram that no
/// longer fits goes to the backend translated, without the option.
#[test]
fn a_udp_datagram_that_would_not_fit_goes_by_snat() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    f.program(&node_port(
        NODE,
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
    ));
    // A small datagram starts a DSR flow before the MTU shrinks.
    let small = Pkt::udp(CLIENT, 6002, NODE, NODE_PORT);
    assert_eq!(options4(&f.external(&small.frame()).1).len(), 8);
    net::set_mtu(net::UPLINK, 1000);
    // 20 + 8 + 972 = 1000 bytes: fits alone, not with the option's 8.
    let mut big = Pkt::udp(CLIENT, 6003, NODE, NODE_PORT);
    big.payload = vec![7; 972];
    let (verdict, out) = f.external(&big.frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(options4(&out).is_empty());
    let seen_out = inspect(&out);
    assert_eq!(seen_out.tuple, seen(NODE, 6003, REMOTE_POD, 5353), "SNAT");
    assert_eq!(seen_out.payload, vec![7; 972]);
    // The known DSR flow's big datagram: translated, no option, routed by the stack.
    let mut later = small.clone();
    later.payload = vec![8; 972];
    let (verdict, out) = f.external(&later.frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert!(options4(&out).is_empty());
    assert_eq!(inspect(&out).tuple, seen(CLIENT, 6002, REMOTE_POD, 5353));
    let counters = f.counters();
    for (name, n) in counted(&[(stat::DSR_UDP_TOO_BIG_SNAT, 1), (stat::DSR_PLAIN, 1)]) {
        assert!(counters.contains(&(name, n)), "{name}: {counters:?}");
    }
}

/// `--dsr-dispatch ipip`: every packet of the flow leaves inside an outer header
/// from the node to the gateway the route to the pod names (the backend's node);
/// the SYN's inner packet carries the frontend as with `opt`, later ones do not.
#[test]
fn ipip_encapsulates_every_packet_to_the_backends_node() {
    let mut f = Fixture::new(dsr(DsrDispatch::Ipip));
    let mut desired = node_port(NODE, Protocol::Tcp, &[backend(REMOTE_POD, 8080, false)]);
    desired
        .frontends
        .extend(node_port(NODE6, Protocol::Tcp, &[backend(REMOTE_POD6, 8080, false)]).frontends);
    f.program(&desired);

    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40003, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (outer, inner) = decapsulate4(&out);
    assert_eq!(
        (outer.source, outer.destination),
        (NODE.octets(), PEER_NODE.octets())
    );
    assert_eq!(outer.protocol, IpNumber(IPPROTO_IPIP));
    assert_eq!(outer.time_to_live, 64);
    assert_eq!(options4(&inner), option4(NODE, NODE_PORT));
    let seen_in = inspect(&inner);
    assert_eq!(seen_in.tuple, seen(CLIENT, 40003, REMOTE_POD, 8080));
    assert_eq!(seen_in.ttl, 63);
    let forward = f
        .entry(CLIENT.into(), 40003, NODE.into(), NODE_PORT)
        .unwrap();
    assert_eq!(forward.dsr, CT_DSR | CT_DSR_IPIP);

    let (_, out) = f.external(&Pkt::tcp(CLIENT, 40003, NODE, NODE_PORT, ACK).frame());
    let (outer, inner) = decapsulate4(&out);
    assert_eq!(outer.destination, PEER_NODE.octets());
    assert!(options4(&inner).is_empty());
    assert_eq!(inspect(&inner).payload, b"hello");

    let (verdict, out) = f.external(&Pkt::tcp(CLIENT6, 40003, NODE6, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (outer, inner) = decapsulate6(&out);
    assert_eq!(
        (outer.source, outer.destination),
        (NODE6.octets(), PEER_NODE6.octets())
    );
    assert_eq!(outer.next_header, IpNumber(IPPROTO_IPV6));
    assert_eq!(inner[14 + 6], NEXT_DEST_OPTS);
    assert_eq!(
        inspect(&inner).tuple,
        seen(CLIENT6, 40003, REMOTE_POD6, 8080)
    );
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_NEW_FLOW, 2),
            (stat::TC_CT_HIT, 1),
            (stat::DSR_ENCAPSULATED, 3)
        ])
    );
}

/// `ipip` needs the backend's node: a pod reached on-link (no gateway names its
/// node) goes by SNAT, counted.
#[test]
fn ipip_without_a_gateway_falls_back_to_snat() {
    let mut f = Fixture::new(dsr(DsrDispatch::Ipip));
    let status = std::process::Command::new("ip")
        .args(["route", "add", "10.244.9.0/24", "dev", net::UPLINK])
        .status()
        .unwrap();
    assert!(status.success());
    f.program(&node_port(
        NODE,
        Protocol::Tcp,
        &[backend(ON_LINK_POD, 8080, false)],
    ));
    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40004, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, seen(NODE, 40004, ON_LINK_POD, 8080));
    assert!(f
        .counters()
        .contains(&(stat::NAMES[stat::DSR_SNAT_FALLBACK as usize], 1)));
}

/// `hybrid`: TCP by DSR, UDP by SNAT.
#[test]
fn hybrid_takes_tcp_by_dsr_and_udp_by_snat() {
    let mut f = Fixture::new(Forwarding {
        mode: LbMode::Hybrid,
        dispatch: DsrDispatch::Opt,
    });
    let mut desired = node_port(NODE, Protocol::Tcp, &[backend(REMOTE_POD, 8080, false)]);
    desired
        .frontends
        .extend(node_port(NODE, Protocol::Udp, &[backend(REMOTE_POD, 5353, false)]).frontends);
    f.program(&desired);
    let (_, out) = f.external(&Pkt::tcp(CLIENT, 40005, NODE, NODE_PORT, SYN).frame());
    assert_eq!(inspect(&out).tuple.src, IpAddr::from(CLIENT));
    assert_eq!(options4(&out).len(), 8);
    let (_, out) = f.external(&Pkt::udp(CLIENT, 40005, NODE, NODE_PORT).frame());
    assert_eq!(inspect(&out).tuple, seen(NODE, 40005, REMOTE_POD, 5353));
    assert!(options4(&out).is_empty());
}

/// A local backend needs no DSR: DNAT only, handed to the stack, as always.
#[test]
fn local_backends_need_no_dsr() {
    let mut f = Fixture::new(dsr(DsrDispatch::Ipip));
    f.program(&node_port(
        NODE,
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
    ));
    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40008, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert!(options4(&out).is_empty());
    assert_eq!(inspect(&out).tuple, seen(CLIENT, 40008, LOCAL_POD, 8080));
    let forward = f
        .entry(CLIENT.into(), 40008, NODE.into(), NODE_PORT)
        .unwrap();
    assert_eq!(forward.dsr, 0);
}

/// The default mode is SNAT, whatever the object could do.
#[test]
fn snat_mode_is_unchanged() {
    let mut f = Fixture::new(Forwarding::default());
    f.program(&node_port(
        NODE,
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let (verdict, out) = f.external(&Pkt::tcp(CLIENT, 40006, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert!(options4(&out).is_empty());
    assert_eq!(inspect(&out).tuple, seen(NODE, 40006, REMOTE_POD, 8080));
    let forward = f
        .entry(CLIENT.into(), 40006, NODE.into(), NODE_PORT)
        .unwrap();
    assert_eq!(forward.dsr, 0);
}

// ---- entry node: XDP -------------------------------------------------------------

/// XDP sends a DSR SYN itself, both dispatches: the option (IPv4) or the outer
/// header (IPv6 in IPv6), addressed to the other node's MAC, back out of the
/// uplink; the later segment of the `opt` flow goes the same way, plain.
#[test]
fn xdp_sends_dsr_packets_itself() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    f.program(&node_port(
        NODE,
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let (verdict, out) = f.xdp(&Pkt::tcp(CLIENT, 40007, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, XDP_TX);
    assert_eq!(options4(&out), option4(NODE, NODE_PORT));
    let seen_out = inspect(&out);
    assert_eq!(seen_out.tuple, seen(CLIENT, 40007, REMOTE_POD, 8080));
    assert_eq!(
        (seen_out.eth_dst, seen_out.eth_src),
        (PEER_NODE_MAC, UPLINK_MAC)
    );
    assert_eq!(seen_out.ttl, 63);
    let (verdict, out) = f.xdp(&Pkt::tcp(CLIENT, 40007, NODE, NODE_PORT, ACK).frame());
    assert_eq!(verdict, XDP_TX);
    assert!(options4(&out).is_empty());
    assert_eq!(inspect(&out).tuple, seen(CLIENT, 40007, REMOTE_POD, 8080));
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::XDP_NEW_FLOW, 1),
            (stat::XDP_TX, 2),
            (stat::DSR_ENCAPSULATED, 1)
        ])
    );

    let mut f = Fixture::new(dsr(DsrDispatch::Ipip));
    f.program(&node_port(
        NODE6,
        Protocol::Udp,
        &[backend(REMOTE_POD6, 5353, false)],
    ));
    let (verdict, out) = f.xdp(&Pkt::udp(CLIENT6, 6004, NODE6, NODE_PORT).frame());
    assert_eq!(verdict, XDP_TX);
    assert_eq!(
        (out[..6].to_vec(), out[6..12].to_vec()),
        (PEER_NODE_MAC.to_vec(), UPLINK_MAC.to_vec())
    );
    let (outer, inner) = decapsulate6(&out);
    assert_eq!(
        (outer.source, outer.destination),
        (NODE6.octets(), PEER_NODE6.octets())
    );
    let mut expected = dstopt6(NODE6, NODE_PORT);
    expected[0] = 17;
    assert_eq!(inner[54..78], expected);
    let seen_in = inspect(&inner);
    assert_eq!(seen_in.tuple, seen(CLIENT6, 6004, REMOTE_POD6, 5353));
    assert_eq!(seen_in.payload, b"hello");
}

/// A datagram that would not fit with the option is not XDP's to decide: it goes
/// to TC untouched (which sends it by SNAT), and nothing is recorded.
#[test]
fn xdp_leaves_a_datagram_that_would_not_fit_to_tc() {
    let mut f = Fixture::new(dsr(DsrDispatch::Opt));
    f.program(&node_port(
        NODE,
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
    ));
    net::set_mtu(net::UPLINK, 1000);
    let mut big = Pkt::udp(CLIENT, 6005, NODE, NODE_PORT);
    big.payload = vec![9; 972];
    let frame = big.frame();
    let (verdict, out) = f.xdp(&frame);
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(out, frame, "untouched");
    assert!(f.conntrack().is_empty());
    let (_, out) = f.external(&frame);
    assert_eq!(inspect(&out).tuple, seen(NODE, 6005, REMOTE_POD, 5353));
}

// ---- backend's node --------------------------------------------------------------

/// The client's SYN as the entry node sends it: DNATed to the pod, from the client.
fn dnated_syn(client: IpAddr, pod: IpAddr) -> Vec<u8> {
    Pkt::tcp(client, 40100, pod, 8080, SYN).frame()
}

/// `opt`, IPv4 and IPv6: the pod gets, byte for byte, the packet without the
/// option; the reply entry maps the pod's replies to the frontend, and its SYN-ACK
/// leaves from the frontend towards the client (MSS untouched: nothing is added
/// to the client's segments in `opt`).
#[test]
fn an_arriving_option_is_removed_and_the_reply_leaves_from_the_frontend() {
    // The backend node's own mode does not matter: it takes DSR arrivals anyway.
    let f = Fixture::new(Forwarding::default());
    let cases: [(IpAddr, IpAddr, IpAddr); 2] = [
        (CLIENT.into(), REMOTE_POD.into(), NODE.into()),
        (CLIENT6.into(), REMOTE_POD6.into(), NODE6.into()),
    ];
    for (client, pod, frontend) in cases {
        let plain = dnated_syn(client, pod);
        let arriving = match frontend {
            IpAddr::V4(a) => with_options4(&plain, &option4(a, NODE_PORT)),
            IpAddr::V6(a) => with_dstopt6(&plain, dstopt6(a, NODE_PORT)),
        };
        let (verdict, out) = f.external(&arriving);
        assert_eq!(verdict, TC_ACT_OK, "{pod}");
        assert_eq!(
            out, plain,
            "{pod}: the pod gets the packet without the option"
        );
        let reply = f.entry(pod, 8080, client, 40100).expect("a reply entry");
        assert_eq!((reply.dir, reply.dsr), (CT_DIR_REPLY, CT_DSR));
        assert_eq!(
            (
                IpAddr::from(reply.nat_src_addr),
                u16::from_be(reply.nat_src_port)
            ),
            (frontend, NODE_PORT)
        );

        let (verdict, out) = f.internal(&syn_ack(pod, 8080, client, 40100, 1460));
        assert_eq!(
            verdict, TC_ACT_REDIRECT,
            "{pod}: sent towards the client by us"
        );
        assert_eq!(
            inspect(&out).tuple,
            seen(frontend, NODE_PORT, client, 40100)
        );
        assert_eq!(mss_of(&out), Some(1460));
    }
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::DSR_DECAPSULATED, 2),
            (stat::TC_CT_HIT, 2),
            (stat::DSR_REPLY_REWRITTEN, 2)
        ])
    );
}

/// `ipip`, IPv4 and IPv6: the outer header goes, then the option; a later packet
/// of the flow (outer header, no option) is decapsulated by its reply entry; the
/// pod's SYN-ACK gets its MSS lowered by the outer header (20 / 40 bytes), its
/// checksum kept right.
#[test]
fn ipip_arrivals_are_decapsulated_and_the_syn_ack_clamped() {
    let f = Fixture::new(dsr(DsrDispatch::Ipip));
    let cases: [(IpAddr, IpAddr, IpAddr, IpAddr, u16); 2] = [
        (
            CLIENT.into(),
            REMOTE_POD.into(),
            NODE.into(),
            PEER_NODE.into(),
            1440,
        ),
        (
            CLIENT6.into(),
            REMOTE_POD6.into(),
            NODE6.into(),
            PEER_NODE6.into(),
            1420,
        ),
    ];
    for (client, pod, frontend, this_node, clamped) in cases {
        let plain = dnated_syn(client, pod);
        let with_frontend = match frontend {
            IpAddr::V4(a) => with_options4(&plain, &option4(a, NODE_PORT)),
            IpAddr::V6(a) => with_dstopt6(&plain, dstopt6(a, NODE_PORT)),
        };
        let (verdict, out) = f.external(&encapsulated(&with_frontend, frontend, this_node));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, plain, "{pod}: decapsulated, the option removed");
        let reply = f.entry(pod, 8080, client, 40100).expect("a reply entry");
        assert_eq!(reply.dsr, CT_DSR | CT_DSR_IPIP);

        let later = Pkt::tcp(client, 40100, pod, 8080, ACK).frame();
        let (verdict, out) = f.external(&encapsulated(&later, frontend, this_node));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, later, "{pod}: a later packet decapsulated");

        let (verdict, out) = f.internal(&syn_ack(pod, 8080, client, 40100, 1460));
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(
            inspect(&out).tuple,
            seen(frontend, NODE_PORT, client, 40100)
        );
        assert_eq!(mss_of(&out), Some(clamped), "{pod}");
        // Not the SYN-ACK: nothing to clamp.
        let (_, out) = f.internal(&Pkt::tcp(pod, 8080, client, 40100, ACK).frame());
        assert_eq!(
            inspect(&out).tuple,
            seen(frontend, NODE_PORT, client, 40100)
        );
    }
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::DSR_DECAPSULATED, 4),
            (stat::TC_CT_HIT, 4),
            (stat::DSR_REPLY_REWRITTEN, 4),
            (stat::DSR_MSS_CLAMPED, 2)
        ])
    );
}

/// What is not a DSR arrival passes as it came, and leaves no state: an outer
/// header around a flow we do not know (another tunnel's), other IPv4 options,
/// our option type with another length, a fragment carrying our option, an
/// outer header around a truncated packet, another IPv6 destination option, and
/// an outer IPv6 header around a packet that ends after our option.
#[test]
fn what_is_not_a_dsr_arrival_passes_untouched() {
    let f = Fixture::new(dsr(DsrDispatch::Ipip));
    let plain = dnated_syn(CLIENT.into(), REMOTE_POD.into());
    let plain6 = dnated_syn(CLIENT6.into(), REMOTE_POD6.into());
    let later = Pkt::tcp(CLIENT, 40100, REMOTE_POD, 8080, ACK).frame();
    let mut wrong_length = option4(NODE, NODE_PORT);
    wrong_length[1] = 6;
    let fragment = {
        let with_option = with_options4(&plain, &option4(NODE, NODE_PORT));
        let (mut ip, rest) = Ipv4Header::from_slice(&with_option[14..]).unwrap();
        ip.more_fragments = true;
        ip.header_checksum = ip.calc_header_checksum();
        let mut frame = with_option[..14].to_vec();
        ip.write(&mut frame).unwrap();
        frame.extend_from_slice(rest);
        frame
    };
    let mut truncated = encapsulated(&plain, NODE.into(), PEER_NODE.into());
    truncated.truncate(14 + 20 + 12);
    let (mut outer, _) = Ipv4Header::from_slice(&truncated[14..]).unwrap();
    outer.total_len = 32;
    outer.header_checksum = outer.calc_header_checksum();
    truncated[14..34].copy_from_slice(&outer.to_bytes());
    let mut other6 = dstopt6(NODE6, NODE_PORT);
    other6[2] = 0x1d;
    // The inner packet ends right after its Destination Options header.
    let mut cut6 = encapsulated(
        &with_dstopt6(&plain6, dstopt6(NODE6, NODE_PORT)),
        NODE6.into(),
        PEER_NODE6.into(),
    );
    cut6.truncate(14 + 40 + 40 + 24);
    cut6[18..20].copy_from_slice(&64u16.to_be_bytes());
    let frames: [(&str, Vec<u8>); 7] = [
        (
            "another tunnel",
            encapsulated(&later, NODE.into(), PEER_NODE.into()),
        ),
        ("router alert", with_options4(&plain, &[0x94, 4, 0, 0])),
        (
            "our type, another length",
            with_options4(&plain, &[wrong_length[..6].to_vec(), vec![1, 0]].concat()),
        ),
        ("a fragment", fragment),
        ("truncated", truncated),
        ("another IPv6 option", with_dstopt6(&plain6, other6)),
        ("an IPv6 inner packet cut short", cut6),
    ];
    for (what, frame) in frames {
        let (verdict, out) = f.external(&frame);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(out, frame, "{what}: untouched");
    }
    assert!(f.conntrack().is_empty(), "{:?}", f.conntrack());
    let dsr_counters: Vec<_> = f
        .counters()
        .into_iter()
        .filter(|(name, _)| name.starts_with("dsr_"))
        .collect();
    assert!(dsr_counters.is_empty(), "{dsr_counters:?}");
}
