//! Packet fixtures for `lb_xdp` through BPF_PROG_TEST_RUN: the real XDP and TC
//! programs, loaded by the agent's loader against real (test-private) pinned maps
//! programmed by the reconciler, fed frames built by etherparse. Each test's thread
//! has a network namespace of its own with an uplink, routes and neighbours
//! (`xdp_fixtures/net.rs`), so the programs' route lookups answer as on a node and
//! see nothing of the host. Needs root and the embedded kernel object (`cargo xtask
//! test` provides both).
//!
//! What is checked is what leaves the program: the verdict, the rewritten
//! addresses, ports and MACs with valid checksums, the TTL, the metadata mark, the
//! conntrack entries (the same as TC writes for the same packet), and a counter
//! for every packet left to TC untouched.

/// What every packet-fixture binary shares (namespace, pins, loading, runs).
#[allow(dead_code)]
mod fixture;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use aya::maps::DevMapHash;
use aya::programs::{SchedClassifier, TcAttachType, TestRun, TestRunAttrs, TestRunOptions, Xdp};
use aya::Ebpf;
use lb_common::{map_names, program_names, stat, CtKey, CtValue, XdpMark, XDP_MARK_MAGIC};
use lb_userspace::datapath::loader;
use lb_userspace::datapath::maps::{ConntrackMap, PinnedMaps};
use lb_userspace::datapath::pins::MapSizes;
use lb_userspace::datapath::source_ranges;
use lb_userspace::model::{BackendAddr, DesiredState, Frontend, FrontendSpec, Protocol};

#[path = "xdp_fixtures/frames.rs"]
mod frames;
/// The IPv6 fixtures, on the same fixture, programs and maps.
#[path = "xdp_fixtures/ipv6.rs"]
mod ipv6;
#[path = "xdp_fixtures/net.rs"]
mod net;

use frames::{inspect, seen, Pkt, ACK, SYN};
use net::{CLIENT_GW_MAC, NODE, PEER_NODE_MAC, UPLINK_MAC};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;
const TC_ACT_OK: u32 = 0;
const TC_ACT_REDIRECT: u32 = 7;

const CLIENT: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);
const OTHER_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 9);
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const OTHER_LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
/// On the other node (routed via `PEER_NODE_MAC`).
const REMOTE_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 21);
/// Behind a gateway whose neighbour entry does not exist.
const UNRESOLVED_POD: Ipv4Addr = Ipv4Addr::new(10, 244, 3, 31);
/// No route at all.
const UNROUTED_POD: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const NODE_PORT: u16 = 30080;
/// The seed the programs hash flows with and the planner builds Maglev tables with.
const MAGLEV_SEED: u64 = 0x6c62_5f6d_6167_6c76;

/// One test's maps and programs, pinned under a private directory that goes away
/// with the fixture, in a network namespace of the test thread's own.
struct Fixture {
    ebpf: Ebpf,
    maps: PinnedMaps,
    conntrack: ConntrackMap,
    net: net::Net,
    /// Last: the pins go once the program and map handles are closed.
    _pins: fixture::PinGuard,
}

/// `struct xdp_md` as BPF_PROG_TEST_RUN takes and returns it.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct XdpMd {
    data: u32,
    data_end: u32,
    data_meta: u32,
    ingress_ifindex: u32,
    rx_queue_index: u32,
    egress_ifindex: u32,
}

impl XdpMd {
    fn bytes(&self) -> [u8; 24] {
        let mut out = [0u8; 24];
        for (i, v) in [
            self.data,
            self.data_end,
            self.data_meta,
            self.ingress_ifindex,
            self.rx_queue_index,
            self.egress_ifindex,
        ]
        .iter()
        .enumerate()
        {
            out[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        out
    }

    fn data_from(bytes: &[u8]) -> u32 {
        u32::from_ne_bytes(bytes[..4].try_into().unwrap())
    }
}

/// What `lb_xdp` did with one frame.
#[derive(Debug)]
struct XdpRun {
    verdict: u32,
    /// The metadata in front of the frame (empty: none).
    meta: Vec<u8>,
    frame: Vec<u8>,
}

impl XdpRun {
    fn marked(&self) -> bool {
        self.meta.len() == std::mem::size_of::<XdpMark>()
            && self.meta[..] == XDP_MARK_MAGIC.to_ne_bytes()
    }
}

impl Fixture {
    fn new() -> Self {
        let (layout, pins) = fixture::private_pins("xdp");
        let net = net::setup();
        let object = loader::kernel_object(None).expect("kernel object embedded");
        let sizes = MapSizes {
            conntrack: 1024,
            ..MapSizes::default()
        };
        let node_ips = [NODE.into(), net::NODE6.into()];
        let mut ebpf = loader::load(&object, &layout, sizes, &node_ips, MAGLEV_SEED)
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
        let mut maps = PinnedMaps::open(&layout).expect("open pinned maps");
        maps.set_maglev_seed(MAGLEV_SEED);
        let conntrack = ConntrackMap::open(&layout).expect("open the pinned conntrack");
        Fixture {
            ebpf,
            maps,
            conntrack,
            net,
            _pins: pins,
        }
    }

    fn program(&mut self, desired: &DesiredState) {
        fixture::program(&mut self.maps, desired);
        let wanted = source_ranges::wanted(&desired.frontends, &self.maps.snapshot().unwrap());
        self.maps.sync_source_ranges(&wanted, true).unwrap();
    }

    /// Runs one frame through `lb_xdp` as if it arrived on `ingress` (an ifindex
    /// of the fixture's namespace).
    fn xdp_on(&self, ingress: u32, frame: &[u8]) -> XdpRun {
        let prog: &Xdp = self
            .ebpf
            .program(program_names::XDP)
            .unwrap()
            .try_into()
            .unwrap();
        let ctx_in = XdpMd {
            data_end: frame.len() as u32,
            ingress_ifindex: ingress,
            ..XdpMd::default()
        }
        .bytes();
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
        // The output starts at the metadata; `data` is where the frame starts.
        let meta_len = XdpMd::data_from(&ctx_out) as usize;
        let frame = out.split_off(meta_len);
        XdpRun {
            verdict: result.return_value,
            meta: out,
            frame,
        }
    }

    /// [`Fixture::xdp_on`] the uplink.
    fn xdp(&self, frame: &[u8]) -> XdpRun {
        self.xdp_on(self.net.uplink, frame)
    }

    /// Runs one frame through `lb_tc_external`; the verdict and the frame after it.
    fn tc(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        fixture::tc_run(&self.ebpf, program_names::TC_EXTERNAL, frame)
    }

    fn stat(&self, index: u32) -> u64 {
        self.maps.stats().unwrap()[index as usize].1
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

    /// The conntrack table with the timestamps (which differ between any two
    /// writes) zeroed, sorted.
    fn conntrack(&self) -> Vec<(CtKey, CtValue)> {
        let mut entries: Vec<(CtKey, CtValue)> = self
            .conntrack
            .entries()
            .unwrap()
            .into_iter()
            .map(|(k, v)| {
                (
                    k,
                    CtValue {
                        last_seen_ns: 0,
                        ..v
                    },
                )
            })
            .collect();
        entries.sort_by_key(|(k, _)| bytemuck::bytes_of(k).to_vec());
        entries
    }

    fn clear_conntrack(&mut self) {
        for (key, _) in self.conntrack.entries().unwrap() {
            self.conntrack.remove(&key).unwrap();
        }
    }

    /// Lets `lb_xdp` redirect to `ifindex`, as the agent does for a device it
    /// attached XDP to.
    fn allow_redirect_to(&mut self, ifindex: u32) {
        let mut devmap: DevMapHash<_> = self
            .ebpf
            .map_mut(map_names::XDP_DEVMAP)
            .expect("LB_XDP_DEVMAP in the object")
            .try_into()
            .unwrap();
        devmap.insert(ifindex, ifindex, None, 0).unwrap();
    }
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

/// A frontend on `address:port` with the given backends.
fn frontend(
    desired: &mut DesiredState,
    address: impl Into<IpAddr>,
    port: u16,
    protocol: Protocol,
    backends: &[BackendAddr],
) {
    desired.frontends.insert(
        Frontend::internal(address.into(), port, protocol),
        FrontendSpec {
            service: format!("default/web-{port}:http").into(),
            backends: backends.iter().copied().collect::<BTreeSet<_>>().into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: false,
        },
    );
}

/// A NodePort frontend on the node's address and `NODE_PORT`.
fn node_port(protocol: Protocol, backends: &[BackendAddr]) -> DesiredState {
    let mut desired = DesiredState::default();
    frontend(&mut desired, NODE, NODE_PORT, protocol, backends);
    desired
}

// ---- remote backends: XDP_TX and XDP_REDIRECT -------------------------------------

/// The first packet to a NodePort with a backend on another node is DNATed and
/// SNATed to the node, addressed to the other node's MAC from the uplink's, one hop
/// older, and sent back out of the uplink it came in on; its conntrack entries are
/// exactly those TC writes for the same packet.
#[test]
fn first_packet_to_a_remote_backend_is_sent_back_out_translated() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let syn = Pkt::tcp(CLIENT, 40001, NODE, NODE_PORT, SYN).frame();
    let run = f.xdp(&syn);
    assert_eq!(run.verdict, XDP_TX);
    assert!(run.meta.is_empty(), "no mark on a packet XDP sends itself");
    let out = inspect(&run.frame);
    // The client's port is free on the backend side, so SNAT keeps it.
    assert_eq!(out.tuple, seen(NODE, 40001, REMOTE_POD, 8080));
    assert_eq!((out.eth_dst, out.eth_src), (PEER_NODE_MAC, UPLINK_MAC));
    assert_eq!(out.ttl, 63, "TTL decremented like a router");
    assert_eq!(out.payload, b"hello");
    assert_eq!(
        f.counters(),
        counted(&[(stat::XDP_NEW_FLOW, 1), (stat::XDP_TX, 1)])
    );

    // The same packet through TC (its entries cleared first) writes the same
    // entries: either program can continue the flow.
    let by_xdp = f.conntrack();
    assert_eq!(by_xdp.len(), 2, "one entry per direction: {by_xdp:?}");
    f.clear_conntrack();
    let (verdict, tc_out) = f.tc(&syn);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&tc_out).tuple, out.tuple);
    assert_eq!(f.conntrack(), by_xdp);
    // Both flows are connections of the frontend.
    let per_service = f.maps.service_stats().unwrap();
    assert_eq!(per_service.len(), 1);
    assert_eq!(per_service[0].1.connections, 2);
}

/// A new flow to a cluster IP is TC's, where kube-proxy's cluster-IP masquerade
/// rules live: XDP passes it untouched and writes nothing; TC then gives the
/// client, from outside the cluster, the node's address.
#[test]
fn a_new_flow_to_a_cluster_ip_is_left_to_tc() {
    let mut f = Fixture::new();
    let vip = Ipv4Addr::new(10, 96, 0, 10);
    let mut desired = DesiredState::default();
    desired.frontends.insert(
        Frontend::internal(vip.into(), 80, Protocol::Tcp),
        FrontendSpec {
            service: "default/web:http".into(),
            backends: [backend(REMOTE_POD, 8080, false)]
                .into_iter()
                .collect::<BTreeSet<_>>()
                .into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: true,
        },
    );
    f.program(&desired);
    let syn = Pkt::tcp(CLIENT, 40001, vip, 80, SYN).frame();
    let run = f.xdp(&syn);
    assert_eq!(run.verdict, XDP_PASS);
    assert_eq!(run.frame, syn, "passed untouched");
    assert!(run.meta.is_empty(), "not marked: TC must look at it");
    assert!(f.conntrack().is_empty(), "XDP wrote no entry");
    let (_, tc_out) = f.tc(&syn);
    assert_eq!(inspect(&tc_out).tuple, seen(NODE, 40001, REMOTE_POD, 8080));
}

/// Later packets follow the entry; the backend's reply, which comes back on the
/// same device, is reverse-translated to come from the NodePort and sent towards
/// the client's gateway.
#[test]
fn known_flow_and_the_backends_reply_are_sent_on_by_xdp() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let syn = Pkt::tcp(CLIENT, 40002, NODE, NODE_PORT, SYN).frame();
    assert_eq!(f.xdp(&syn).verdict, XDP_TX);
    let ack = Pkt::tcp(CLIENT, 40002, NODE, NODE_PORT, ACK).frame();
    let run = f.xdp(&ack);
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(
        inspect(&run.frame).tuple,
        seen(NODE, 40002, REMOTE_POD, 8080)
    );

    let mut reply = Pkt::tcp(REMOTE_POD, 8080, NODE, 40002, SYN | ACK);
    reply.eth_src = PEER_NODE_MAC;
    let run = f.xdp(&reply.frame());
    assert_eq!(run.verdict, XDP_TX);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(NODE, NODE_PORT, CLIENT, 40002));
    assert_eq!((out.eth_dst, out.eth_src), (CLIENT_GW_MAC, UPLINK_MAC));
    assert_eq!(out.ttl, 63);
    assert_eq!(
        f.counters(),
        counted(&[(stat::XDP_NEW_FLOW, 1), (stat::XDP_TX, 3)])
    );
    assert_eq!(f.conntrack().len(), 2, "no entry beyond the flow's two");
}

/// A second client on the same source port gets another SNAT port, as with TC.
#[test]
fn a_taken_snat_port_is_replaced_by_a_free_one() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let first = f.xdp(&Pkt::tcp(CLIENT, 40003, NODE, NODE_PORT, SYN).frame());
    assert_eq!(inspect(&first.frame).tuple.sport, 40003);
    let second = f.xdp(&Pkt::tcp(OTHER_CLIENT, 40003, NODE, NODE_PORT, SYN).frame());
    assert_eq!(second.verdict, XDP_TX);
    let out = inspect(&second.frame).tuple;
    assert_eq!((out.src, out.dst), (NODE.into(), REMOTE_POD.into()));
    assert_ne!(out.sport, 40003);
    assert!((32768..61000).contains(&out.sport), "{}", out.sport);
}

/// A packet that came in on another device than the one its next hop is behind is
/// redirected, but only to a device in `LB_XDP_DEVMAP` (one the agent put XDP on):
/// before it is there, the packet goes to TC untouched, and no flow is recorded.
#[test]
fn redirect_only_to_devices_in_the_devmap() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
    ));
    let request = Pkt::udp(CLIENT, 6001, NODE, NODE_PORT).frame();
    let side = f.net.side;
    let run = f.xdp_on(side, &request);
    assert_eq!(run.verdict, XDP_PASS);
    assert_eq!(run.frame, request, "passed untouched");
    assert!(run.meta.is_empty());
    assert!(f.conntrack().is_empty(), "no state for a packet passed on");
    assert_eq!(f.counters(), counted(&[(stat::XDP_PASS_NO_DEVMAP, 1)]));

    f.allow_redirect_to(f.net.uplink);
    let run = f.xdp_on(side, &request);
    assert_eq!(run.verdict, XDP_REDIRECT);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(NODE, 6001, REMOTE_POD, 5353));
    assert_eq!((out.eth_dst, out.eth_src), (PEER_NODE_MAC, UPLINK_MAC));
    assert_eq!(out.ttl, 63);
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::XDP_PASS_NO_DEVMAP, 1),
            (stat::XDP_NEW_FLOW, 1),
            (stat::XDP_REDIRECT, 1)
        ])
    );
}

// ---- local backends: translated, marked, passed -----------------------------------

/// A local backend: the packet is translated (the client's address kept, no new
/// hop: the stack delivers it), marked in the metadata and passed; the entries are
/// TC's.
#[test]
fn local_backend_is_translated_marked_and_passed_to_the_stack() {
    let mut f = Fixture::new();
    f.program(&node_port(Protocol::Tcp, &[backend(LOCAL_POD, 8080, true)]));
    let syn = Pkt::tcp(CLIENT, 40004, NODE, NODE_PORT, SYN).frame();
    let run = f.xdp(&syn);
    assert_eq!(run.verdict, XDP_PASS);
    assert!(run.marked(), "metadata {:?}", run.meta);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(CLIENT, 40004, LOCAL_POD, 8080));
    assert_eq!((out.eth_dst, out.eth_src), (UPLINK_MAC, CLIENT_GW_MAC));
    assert_eq!(out.ttl, 64, "the stack forwards it, and counts the hop");
    assert_eq!(
        f.counters(),
        counted(&[(stat::XDP_NEW_FLOW, 1), (stat::XDP_PASS_LOCAL, 1)])
    );
    let by_xdp = f.conntrack();
    assert_eq!(by_xdp.len(), 2);
    f.clear_conntrack();
    let (verdict, tc_out) = f.tc(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&tc_out).tuple, out.tuple);
    assert_eq!(f.conntrack(), by_xdp);

    // Known flow: marked and passed again.
    let ack = Pkt::tcp(CLIENT, 40004, NODE, NODE_PORT, ACK).frame();
    let run = f.xdp(&ack);
    assert_eq!((run.verdict, run.marked()), (XDP_PASS, true));
    assert_eq!(inspect(&run.frame).tuple, out.tuple);
}

/// UDP without a checksum (0 over IPv4) keeps none after the rewrite.
#[test]
fn a_missing_udp_checksum_stays_missing() {
    let mut f = Fixture::new();
    f.program(&node_port(Protocol::Udp, &[backend(LOCAL_POD, 5353, true)]));
    let mut frame = Pkt::udp(CLIENT, 6002, NODE, NODE_PORT).frame();
    frame[14 + 20 + 6..14 + 20 + 8].copy_from_slice(&[0, 0]);
    let run = f.xdp(&frame);
    assert_eq!(run.verdict, XDP_PASS);
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(CLIENT, 6002, LOCAL_POD, 5353));
    assert_eq!(out.udp_checksum, Some(0));
}

/// The hand-over to TC, live: `lb_xdp` runs on frames injected into the uplink
/// (BPF_PROG_TEST_RUN's live-frames mode), and what it passes enters the stack
/// there, through `lb_tc_external` attached to the same device. TC finds the mark
/// and lets the packet through without a second look, even though the translated
/// packet is addressed to another frontend, which TC would otherwise translate
/// again (shown last, by the same frame without the mark).
#[test]
fn tc_lets_a_packet_xdp_marked_through_without_looking_again() {
    let mut f = Fixture::new();
    let mut desired = node_port(Protocol::Tcp, &[backend(LOCAL_POD, 8080, true)]);
    // A frontend that the translated packet happens to match (an externalIP equal
    // to the pod's address).
    frontend(
        &mut desired,
        LOCAL_POD,
        8080,
        Protocol::Tcp,
        &[backend(OTHER_LOCAL_POD, 8080, true)],
    );
    f.program(&desired);
    let tc: &mut SchedClassifier = f
        .ebpf
        .program_mut(program_names::TC_EXTERNAL)
        .unwrap()
        .try_into()
        .unwrap();
    tc.attach(net::UPLINK, TcAttachType::Ingress)
        .expect("attach lb_tc_external to the uplink");

    let syn = Pkt::tcp(CLIENT, 40005, NODE, NODE_PORT, SYN).frame();
    let prog: &Xdp = f
        .ebpf
        .program(program_names::XDP)
        .unwrap()
        .try_into()
        .unwrap();
    let ctx_in = XdpMd {
        data_end: syn.len() as u32,
        ingress_ifindex: f.net.uplink,
        ..XdpMd::default()
    }
    .bytes();
    prog.test_run(TestRunOptions {
        data_in: Some(&syn),
        ctx_in: Some(&ctx_in),
        repeat: 1,
        attrs: TestRunAttrs::new().xdp_live_frames(1),
        ..TestRunOptions::default()
    })
    .expect("live-frames test run");
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::XDP_NEW_FLOW, 1),
            (stat::XDP_PASS_LOCAL, 1),
            (stat::TC_XDP_MARKED, 1)
        ]),
        "TC saw the mark and nothing else"
    );

    // Without the mark, TC takes the translated packet for a new flow to the
    // second frontend.
    let translated = Pkt::tcp(CLIENT, 40005, LOCAL_POD, 8080, SYN).frame();
    let (verdict, out) = f.tc(&translated);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        inspect(&out).tuple,
        seen(CLIENT, 40005, OTHER_LOCAL_POD, 8080)
    );
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 1);
}

// ---- left to TC, untouched ---------------------------------------------------------

/// `pkt`'s frame with its IPv4 header rebuilt around `l4` (a part of its L4
/// bytes): `options` after the fixed header, the `frag_off` field (host order),
/// and the header checksum redone by etherparse.
fn ipv4_variant(pkt: &Pkt, l4: &[u8], options: &[u8], frag_off: u16) -> Vec<u8> {
    use etherparse::{IpFragOffset, IpNumber, Ipv4Header, Ipv4Options};
    let (IpAddr::V4(src), IpAddr::V4(dst)) = (pkt.src, pkt.dst) else {
        panic!("IPv4 only");
    };
    let mut ip =
        Ipv4Header::new(0, pkt.ttl, IpNumber(pkt.proto), src.octets(), dst.octets()).unwrap();
    ip.options = Ipv4Options::try_from(options).unwrap();
    ip.total_len = (ip.header_len() + l4.len()) as u16;
    ip.more_fragments = frag_off & 0x2000 != 0;
    ip.fragment_offset = IpFragOffset::try_new(frag_off & 0x1fff).unwrap();
    ip.header_checksum = ip.calc_header_checksum();
    let mut frame = pkt.frame()[..14].to_vec();
    ip.write(&mut frame).unwrap();
    frame.extend_from_slice(l4);
    frame
}

/// The L4 bytes of `pkt` (its header and payload).
fn l4_of(pkt: &Pkt) -> Vec<u8> {
    pkt.frame()[14 + 20..].to_vec()
}

/// An ICMP error from `src` to `dst` (destination unreachable, `code`) quoting
/// the IP packet of `quoted` (a frame), checksummed by etherparse.
fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, code: u8, quoted: &[u8]) -> Vec<u8> {
    use etherparse::{icmpv4::DestUnreachableHeader, Icmpv4Type, PacketBuilder};
    let kind =
        Icmpv4Type::DestinationUnreachable(DestUnreachableHeader::from_values(code, 0).unwrap());
    let mut out = Vec::new();
    PacketBuilder::ethernet2(CLIENT_GW_MAC, UPLINK_MAC)
        .ipv4(src.octets(), dst.octets(), 64)
        .icmpv4(kind)
        .write(&mut out, &quoted[14..])
        .unwrap();
    out
}

/// Everything XDP is not sure of goes to TC as it came, counted by reason, with
/// no conntrack entry written; TC then does what it always did.
#[test]
fn what_xdp_is_unsure_of_is_passed_to_tc_untouched_and_counted() {
    let mut f = Fixture::new();
    let mut desired = node_port(Protocol::Tcp, &[backend(REMOTE_POD, 8080, false)]);
    frontend(
        &mut desired,
        NODE,
        NODE_PORT,
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
    );
    frontend(
        &mut desired,
        NODE,
        30081,
        Protocol::Tcp,
        &[backend(UNRESOLVED_POD, 8080, false)],
    );
    frontend(
        &mut desired,
        NODE,
        30082,
        Protocol::Tcp,
        &[backend(UNROUTED_POD, 8080, false)],
    );
    frontend(&mut desired, NODE, 30083, Protocol::Tcp, &[]);
    f.program(&desired);

    let mut udp = Pkt::udp(CLIENT, 6003, NODE, NODE_PORT);
    udp.payload = vec![7; 40];
    // Fragments of 24 and 24 bytes of its 48 (UDP header and payload).
    let datagram = l4_of(&udp);
    let syn = Pkt::tcp(CLIENT, 40006, NODE, NODE_PORT, SYN);
    let mut last_hop = syn.clone();
    last_hop.ttl = 1;
    let mut no_payload = Pkt::tcp(CLIENT, 40007, NODE, 30083, SYN);
    no_payload.payload.clear();
    let to_remote = f.xdp(&Pkt::tcp(CLIENT, 40008, NODE, NODE_PORT, SYN).frame());
    let cases: Vec<(&str, Vec<u8>, u32)> = vec![
        (
            "first fragment",
            ipv4_variant(&udp, &datagram[..24], &[], 0x2000),
            stat::XDP_PASS_FRAGMENT,
        ),
        (
            "later fragment",
            ipv4_variant(&udp, &datagram[24..], &[], 0x0003),
            stat::XDP_PASS_FRAGMENT,
        ),
        (
            "IP options",
            ipv4_variant(&syn, &l4_of(&syn), &[1, 1, 1, 0], 0),
            stat::XDP_PASS_IP_OPTIONS,
        ),
        (
            "ICMP error about a flow",
            icmp_error(REMOTE_POD, NODE, 3, &to_remote.frame),
            stat::XDP_PASS_ICMP_ERROR,
        ),
        (
            "next hop without a neighbour entry",
            Pkt::tcp(CLIENT, 40009, NODE, 30081, SYN).frame(),
            stat::XDP_PASS_NO_NEIGH,
        ),
        (
            "no route to the backend",
            Pkt::tcp(CLIENT, 40010, NODE, 30082, SYN).frame(),
            stat::XDP_PASS_FIB,
        ),
        (
            "frontend without a backend",
            no_payload.frame(),
            stat::XDP_PASS_NO_BACKEND,
        ),
        ("TTL expiring here", last_hop.frame(), stat::XDP_PASS_TTL),
    ];
    let entries_before = f.conntrack();
    assert_eq!(entries_before.len(), 2, "the one flow sent to the backend");
    let mut expected = vec![(stat::XDP_NEW_FLOW, 1), (stat::XDP_TX, 1)];
    for (what, frame, counter) in &cases {
        let run = f.xdp(frame);
        assert_eq!(run.verdict, XDP_PASS, "{what}");
        assert_eq!(&run.frame, frame, "{what}: passed untouched");
        assert!(run.meta.is_empty(), "{what}: no mark");
        match expected.iter_mut().find(|(c, _)| c == counter) {
            Some((_, n)) => *n += 1,
            None => expected.push((*counter, 1)),
        }
        assert_eq!(f.counters(), counted(&expected), "{what}");
        assert_eq!(f.conntrack(), entries_before, "{what}: no state written");
    }

    // TC takes them as before: the unresolved neighbour is its redirect_neigh's,
    // the frontend without a backend gets its RST.
    let (verdict, out) = f.tc(&cases[4].1);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, seen(NODE, 40009, UNRESOLVED_POD, 8080));
    let (verdict, out) = f.tc(&cases[6].1);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let rst = etherparse::SlicedPacket::from_ethernet(&out).unwrap();
    let Some(etherparse::TransportSlice::Tcp(rst)) = rst.transport else {
        panic!("no RST: {rst:?}");
    };
    assert!(rst.rst());
    assert_eq!(f.stat(stat::TC_NO_BACKEND), 1);
}

/// Headers that do not add up never crash the program and are never rewritten:
/// passed to TC (which counts them as malformed) and counted.
#[test]
fn malformed_headers_are_passed_untouched_and_counted() {
    let mut f = Fixture::new();
    let mut desired = node_port(Protocol::Tcp, &[backend(LOCAL_POD, 8080, true)]);
    frontend(
        &mut desired,
        NODE,
        NODE_PORT,
        Protocol::Udp,
        &[backend(LOCAL_POD, 5353, true)],
    );
    f.program(&desired);
    let good = Pkt::tcp(CLIENT, 40011, NODE, NODE_PORT, SYN).frame();
    let udp = Pkt::udp(CLIENT, 6004, NODE, NODE_PORT).frame();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut short_tcp = good[..14 + 20 + 10].to_vec();
    short_tcp[16..18].copy_from_slice(&30u16.to_be_bytes());
    cases.push(("TCP header cut short", short_tcp));
    cases.push(("IPv4 header cut short", good[..14 + 10].to_vec()));
    let mut long_total = good.clone();
    long_total[16..18].copy_from_slice(&1400u16.to_be_bytes());
    cases.push(("IP total length past the end", long_total));
    let mut big_ihl = good.clone();
    big_ihl[14] = 0x4f;
    cases.push(("IHL past the end", big_ihl));
    let mut small_ihl = good.clone();
    small_ihl[14] = 0x44;
    cases.push(("IHL below 5", small_ihl));
    let mut small_doff = good.clone();
    small_doff[14 + 20 + 12] = 4 << 4;
    cases.push(("TCP data offset below 5", small_doff));
    let mut udp_len = udp.clone();
    udp_len[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&100u16.to_be_bytes());
    cases.push(("UDP length above the IP length", udp_len));
    for (what, frame) in &cases {
        let run = f.xdp(frame);
        assert_eq!(run.verdict, XDP_PASS, "{what}");
        assert_eq!(&run.frame, frame, "{what}: frame was changed");
    }
    assert_eq!(
        f.counters(),
        counted(&[(stat::XDP_PASS_MALFORMED, cases.len() as u64)])
    );
    assert!(f.conntrack().is_empty());
    // The honest packets are translated.
    assert_eq!(f.xdp(&good).verdict, XDP_PASS);
    assert_eq!(f.stat(stat::XDP_PASS_LOCAL), 1);
}

// ---- one flow, two programs ---------------------------------------------------------

/// A flow TC started (XDP not attached yet) is continued by XDP in both
/// directions, and one XDP started is continued by TC (XDP detached), with the
/// same translation throughout.
#[test]
fn a_flow_moves_between_tc_and_xdp_both_ways() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
    ));
    let forward = seen(NODE, 40012, REMOTE_POD, 8080);
    let backward = seen(NODE, NODE_PORT, CLIENT, 40012);
    let mut reply = Pkt::tcp(REMOTE_POD, 8080, NODE, 40012, SYN | ACK);
    reply.eth_src = PEER_NODE_MAC;

    let (verdict, out) = f.tc(&Pkt::tcp(CLIENT, 40012, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, forward);
    let run = f.xdp(&reply.frame());
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(inspect(&run.frame).tuple, backward);
    let run = f.xdp(&Pkt::tcp(CLIENT, 40012, NODE, NODE_PORT, ACK).frame());
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(inspect(&run.frame).tuple, forward);

    // The other way: XDP starts, TC continues.
    let forward = seen(NODE, 40013, REMOTE_POD, 8080);
    let backward = seen(NODE, NODE_PORT, CLIENT, 40013);
    let mut reply = Pkt::tcp(REMOTE_POD, 8080, NODE, 40013, SYN | ACK);
    reply.eth_src = PEER_NODE_MAC;
    let run = f.xdp(&Pkt::tcp(CLIENT, 40013, NODE, NODE_PORT, SYN).frame());
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(inspect(&run.frame).tuple, forward);
    let (verdict, out) = f.tc(&reply.frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, backward);
    let (verdict, out) = f.tc(&Pkt::tcp(CLIENT, 40013, NODE, NODE_PORT, ACK).frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).tuple, forward);

    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_NEW_FLOW, 1),
            (stat::TC_CT_HIT, 2),
            (stat::XDP_NEW_FLOW, 1),
            (stat::XDP_TX, 3)
        ])
    );
    assert_eq!(f.conntrack().len(), 4, "two flows, two entries each");
}

// ---- loadBalancerSourceRanges ------------------------------------------------------

const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const OUTSIDER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 9);

/// New flows to a LoadBalancer IP from outside its ranges are dropped in XDP and
/// counted as TC counts them (globally and for the frontend); inside the ranges
/// they are served.
#[test]
fn source_ranges_drop_outsiders_in_xdp_as_tc_counts_them() {
    let mut f = Fixture::new();
    let mut desired = DesiredState::default();
    desired.frontends.insert(
        Frontend::internal(LB_IP.into(), 80, Protocol::Tcp),
        FrontendSpec {
            service: "default/web:http".into(),
            backends: BTreeSet::from([backend(LOCAL_POD, 8080, true)]).into(),
            affinity_timeout_sec: None,
            source_ranges: Some(["203.0.113.0/24".parse().unwrap()].into_iter().collect()),
            maglev: false,
            cluster_ip: false,
        },
    );
    f.program(&desired);
    let run = f.xdp(&Pkt::tcp(OUTSIDER, 40014, LB_IP, 80, SYN).frame());
    assert_eq!(run.verdict, XDP_DROP);
    assert_eq!(
        f.counters(),
        counted(&[
            (stat::TC_SOURCE_RANGE_DROP, 1),
            (stat::XDP_DROP_SOURCE_RANGE, 1)
        ])
    );
    let per_service = f.maps.service_stats().unwrap();
    assert_eq!(per_service[0].1.source_range_drops, 1);
    assert!(f.conntrack().is_empty());

    let run = f.xdp(&Pkt::tcp(CLIENT, 40015, LB_IP, 80, SYN).frame());
    assert_eq!((run.verdict, run.marked()), (XDP_PASS, true));
    assert_eq!(
        inspect(&run.frame).tuple,
        seen(CLIENT, 40015, LOCAL_POD, 8080)
    );
}

// ---- multi-buffer frames ------------------------------------------------------------

/// A jumbo datagram (9000-byte frame): BPF_PROG_TEST_RUN hands a frags-aware
/// program a multi-buffer frame, whose headers alone are rewritten; the whole
/// datagram's checksum still holds, its payload intact. The route's MTU is
/// checked first: behind a 1500-byte MTU the frame is TC's (and the stack's, which
/// answers with "fragmentation needed"), untouched.
#[test]
fn a_jumbo_frame_is_translated_by_its_headers_alone() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
    ));
    let mut datagram = Pkt::udp(CLIENT, 6005, NODE, NODE_PORT);
    datagram.payload = (0..9000 - 14 - 20 - 8)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let frame = datagram.frame();
    assert_eq!(frame.len(), 9000);
    let run = f.xdp(&frame);
    assert_eq!((run.verdict, &run.frame), (XDP_PASS, &frame));
    assert_eq!(f.counters(), counted(&[(stat::XDP_PASS_FIB, 1)]));
    assert!(f.conntrack().is_empty());

    net::set_mtu(net::UPLINK, 9000);
    let run = f.xdp(&frame);
    assert_eq!(run.verdict, XDP_TX);
    assert_eq!(run.frame.len(), frame.len());
    let out = inspect(&run.frame);
    assert_eq!(out.tuple, seen(NODE, 6005, REMOTE_POD, 5353));
    assert_eq!(out.payload, datagram.payload);
    assert_eq!(out.ttl, 63);
}

/// A Maglev frontend: XDP and TC pick the same backend for the same client flow
/// (the table and the flow hash, not a random draw), and the flows spread over
/// the backends.
#[test]
fn xdp_and_tc_pick_a_maglev_frontends_backend_alike() {
    let mut f = Fixture::new();
    let third_local_pod = Ipv4Addr::new(10, 244, 1, 13);
    let mut desired = node_port(
        Protocol::Tcp,
        &[LOCAL_POD, OTHER_LOCAL_POD, third_local_pod].map(|ip| backend(ip, 8080, true)),
    );
    for spec in desired.frontends.values_mut() {
        spec.maglev = true;
    }
    f.program(&desired);
    let mut reached = BTreeSet::new();
    for sport in 44_000..44_030u16 {
        let syn = Pkt::tcp(CLIENT, sport, NODE, NODE_PORT, SYN).frame();
        let run = f.xdp(&syn);
        assert_eq!((run.verdict, run.marked()), (XDP_PASS, true));
        let by_xdp = inspect(&run.frame).tuple;
        f.clear_conntrack();
        let (verdict, out) = f.tc(&syn);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(inspect(&out).tuple, by_xdp, "client port {sport}");
        f.clear_conntrack();
        reached.insert(by_xdp.dst);
    }
    // 30 flows over three thirds: one backend missed has probability 3 (2/3)^30.
    assert_eq!(reached.len(), 3, "{reached:?}");
    assert_eq!(f.counters().iter().find(|(n, _)| *n == "maglev_miss"), None);
}
