//! Packet fixtures through BPF_PROG_TEST_RUN: the real TC programs, loaded by the
//! agent's loader against real (test-private) pinned maps programmed by the
//! reconciler, fed hand-built frames. Needs root and the embedded kernel object
//! (`cargo xtask test` provides both).

/// What every packet-fixture binary shares (namespace, pins, loading, runs).
#[allow(dead_code)]
mod fixture;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use aya::Ebpf;
use lb_common::{program_names, stat};
use lb_userspace::control::plan as reconcile;
use lb_userspace::datapath::loader::{self, ProgramSettings};
use lb_userspace::datapath::maps::{ConntrackMap, PinnedMaps};
use lb_userspace::datapath::pins::MapSizes;
use lb_userspace::datapath::source_ranges;
use lb_userspace::model::{BackendAddr, DesiredState, Frontend, FrontendSpec, Protocol, Scope};

/// kube-proxy's cluster-IP masquerade rules, on the same fixture.
#[path = "tc_fixtures/cluster_ip.rs"]
mod cluster_ip;
/// The IPv6 fixtures, on the same fixture, programs and maps.
#[path = "tc_fixtures/ipv6.rs"]
mod ipv6;
/// Maglev frontends, on the same fixture.
#[path = "tc_fixtures/maglev.rs"]
mod maglev;
/// NetworkPolicy on a pod's veth, both directions, around the Service path.
#[path = "tc_fixtures/policy.rs"]
mod policy;
/// Passive health: refusals seen in the reply direction, new flows skipping.
#[path = "tc_fixtures/quarantine.rs"]
mod quarantine;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const TCP: u8 = 6;
const UDP: u8 = 17;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const RST: u8 = 0x04;
const FIN: u8 = 0x01;

const NODE: [u8; 4] = [192, 168, 50, 2];
const CLIENT: [u8; 4] = [203, 0, 113, 5];
const LOCAL_POD: [u8; 4] = [10, 244, 1, 11];
const OTHER_LOCAL_POD: [u8; 4] = [10, 244, 1, 12];
const REMOTE_POD: [u8; 4] = [10, 244, 2, 21];
const NODE_PORT: u16 = 30080;
/// The seed the programs hash flows with and the planner builds Maglev tables with.
const MAGLEV_SEED: u64 = 0x6c62_5f6d_6167_6c76;

/// One test's maps and programs, pinned under a private directory that goes away
/// with the fixture. The test's thread runs in a network namespace of its own: the
/// programs' route lookups (see `fib.rs`) then see only what the test sets up, and
/// nothing of the host's.
struct Fixture {
    ebpf: Ebpf,
    maps: PinnedMaps,
    conntrack: ConntrackMap,
    /// Last: the pins go once the program and map handles are closed.
    _pins: fixture::PinGuard,
}

impl Fixture {
    fn new() -> Self {
        Self::with(ProgramSettings {
            maglev_seed: MAGLEV_SEED,
            ..ProgramSettings::default()
        })
    }

    /// The programs loaded with `settings` (the seed included).
    fn with(settings: ProgramSettings) -> Self {
        let (layout, pins) = fixture::private_pins("tc");
        let object = loader::kernel_object(None).expect("kernel object embedded");
        let sizes = MapSizes {
            conntrack: 1024,
            ..MapSizes::default()
        };
        let node_ips = [Ipv4Addr::from(NODE).into(), ipv6::NODE6.into()];
        let mut ebpf = loader::load_with(&object, &layout, sizes, &node_ips, &settings)
            .expect("load kernel object");
        fixture::load_tc(
            &mut ebpf,
            &[
                program_names::TC_EXTERNAL,
                program_names::TC_INTERNAL,
                program_names::TC_TO_POD,
            ],
        );
        let mut maps = PinnedMaps::open(&layout).expect("open pinned maps");
        maps.set_maglev_seed(MAGLEV_SEED);
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

    /// Runs one frame through a program; returns the verdict and the frame after it.
    fn run(&self, program: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        fixture::tc_run(&self.ebpf, program, frame)
    }

    fn external(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_EXTERNAL, frame)
    }

    fn internal(&self, frame: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::TC_INTERNAL, frame)
    }

    fn stat(&self, index: u32) -> u64 {
        self.maps.stats().unwrap()[index as usize].1
    }
}

fn backend(ip: [u8; 4], port: u16, local: bool) -> BackendAddr {
    BackendAddr {
        ip: Ipv4Addr::from(ip).into(),
        port,
        local,
    }
}

/// A NodePort frontend on NODE:30080 with the given backends, optionally with an
/// externalTrafficPolicy: Local entry holding `external_local`.
fn node_port(
    protocol: Protocol,
    backends: &[BackendAddr],
    external_local: Option<&[BackendAddr]>,
) -> DesiredState {
    let mut desired = DesiredState::default();
    let frontend = Frontend::internal(Ipv4Addr::from(NODE).into(), NODE_PORT, protocol);
    let spec = |backends: &[BackendAddr]| FrontendSpec {
        service: "default/web:http".into(),
        backends: backends.iter().copied().collect::<BTreeSet<_>>().into(),
        affinity_timeout_sec: None,
        source_ranges: None,
        maglev: false,
        cluster_ip: false,
    };
    desired.frontends.insert(frontend, spec(backends));
    if let Some(local) = external_local {
        desired
            .frontends
            .insert(frontend.with_scope(Scope::External), spec(local));
    }
    desired
}

// ---- frames ----------------------------------------------------------------------

#[derive(Clone)]
struct Packet {
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
    proto: u8,
    tcp_flags: u8,
    ip_options: Vec<u8>,
    /// Host-order `frag_off` field (flags + offset).
    frag_off: u16,
    /// Send UDP without a checksum (0), as some stacks do.
    udp_no_checksum: bool,
    payload: Vec<u8>,
}

impl Packet {
    fn tcp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, flags: u8) -> Self {
        Packet {
            src,
            dst,
            sport,
            dport,
            proto: TCP,
            tcp_flags: flags,
            ip_options: Vec::new(),
            frag_off: 0,
            udp_no_checksum: false,
            payload: b"hello".to_vec(),
        }
    }

    fn udp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Self {
        Packet {
            proto: UDP,
            tcp_flags: 0,
            ..Packet::tcp(src, sport, dst, dport, 0)
        }
    }

    /// The frame, built and checksummed by etherparse: the oracle is not the
    /// arithmetic of the program under test, nor a copy of it.
    fn frame(&self) -> Vec<u8> {
        use etherparse::{IpFragOffset, IpNumber, Ipv4Header, Ipv4Options, TcpHeader, UdpHeader};
        let l4_len = if self.proto == TCP {
            TcpHeader::MIN_LEN
        } else {
            UdpHeader::LEN
        };
        let mut ip = Ipv4Header::new(
            (self.ip_options.len() + l4_len + self.payload.len()) as u16,
            64,
            IpNumber(self.proto),
            self.src,
            self.dst,
        )
        .unwrap();
        ip.options = Ipv4Options::try_from(&self.ip_options[..]).unwrap();
        ip.total_len = (ip.header_len() + l4_len + self.payload.len()) as u16;
        ip.identification = 0x1234;
        ip.dont_fragment = self.frag_off & 0x4000 != 0;
        ip.more_fragments = self.frag_off & 0x2000 != 0;
        ip.fragment_offset = IpFragOffset::try_new(self.frag_off & 0x1fff).unwrap();
        ip.header_checksum = ip.calc_header_checksum();
        let mut l4 = Vec::new();
        if self.proto == TCP {
            let mut tcp = TcpHeader::new(self.sport, self.dport, 1000, 64240);
            tcp.fin = self.tcp_flags & FIN != 0;
            tcp.syn = self.tcp_flags & SYN != 0;
            tcp.rst = self.tcp_flags & RST != 0;
            tcp.ack = self.tcp_flags & ACK != 0;
            tcp.checksum = tcp.calc_checksum_ipv4(&ip, &self.payload).unwrap();
            tcp.write(&mut l4).unwrap();
        } else {
            let mut udp =
                UdpHeader::without_ipv4_checksum(self.sport, self.dport, self.payload.len())
                    .unwrap();
            if !self.udp_no_checksum {
                udp.checksum = udp.calc_checksum_ipv4(&ip, &self.payload).unwrap();
            }
            udp.write(&mut l4).unwrap();
        }
        l4.extend_from_slice(&self.payload);
        let mut frame = ETHERNET.to_vec();
        ip.write(&mut frame).unwrap();
        frame.extend_from_slice(&l4);
        frame
    }
}

/// Destination, source, EtherType IPv4.
const ETHERNET: [u8; 14] = [0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];

/// Ethernet + IPv4 (valid header checksum) around `l4`.
fn ipv4_frame(
    src: [u8; 4],
    dst: [u8; 4],
    proto: u8,
    options: &[u8],
    frag_off: u16,
    l4: &[u8],
) -> Vec<u8> {
    let ihl = 20 + options.len();
    assert_eq!(ihl % 4, 0);
    let mut ip = vec![0x40 | (ihl / 4) as u8, 0];
    ip.extend_from_slice(&((ihl + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34]);
    ip.extend_from_slice(&frag_off.to_be_bytes());
    ip.extend_from_slice(&[64, proto, 0, 0]);
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    ip.extend_from_slice(options);
    let c = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());

    let mut frame = ETHERNET.to_vec();
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(l4);
    frame
}

/// The Internet checksum over `parts`, summed by etherparse: 0 over a region that
/// already holds its correct checksum.
fn checksum(parts: &[&[u8]]) -> u16 {
    parts
        .iter()
        .fold(etherparse::checksum::Sum16BitWords::new(), |sum, part| {
            sum.add_slice(part)
        })
        .ones_complement()
        // etherparse sums native-endian words; the wire wants the big-endian value.
        .to_be()
}

/// The IPv4 pseudo header of an L4 segment of `len` bytes.
fn pseudo(src: [u8; 4], dst: [u8; 4], proto: u8, len: usize) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[..4].copy_from_slice(&src);
    p[4..8].copy_from_slice(&dst);
    p[9] = proto;
    p[10..].copy_from_slice(&(len as u16).to_be_bytes());
    p
}

fn l4_checksum(src: [u8; 4], dst: [u8; 4], proto: u8, l4: &[u8]) -> u16 {
    checksum(&[&pseudo(src, dst, proto, l4.len()), l4])
}

/// What a frame says after the program ran, with both checksums verified.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    src: [u8; 4],
    sport: u16,
    dst: [u8; 4],
    dport: u16,
}

fn inspect(frame: &[u8]) -> Seen {
    addresses(&frame[14..], true)
}

/// The addresses of the IPv4 packet that `packet` starts with, after checking its
/// header checksum and, with `verify_l4`, its L4 checksum (a zero UDP checksum
/// means none). A packet quoted in an ICMP error may be cut short.
fn addresses(packet: &[u8], verify_l4: bool) -> Seen {
    let ihl = usize::from(packet[0] & 0x0f) * 4;
    assert_eq!(
        checksum(&[&packet[..ihl]]),
        0,
        "IPv4 header checksum is wrong"
    );
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    let l4 = &packet[ihl..total.min(packet.len())];
    let src: [u8; 4] = packet[12..16].try_into().unwrap();
    let dst: [u8; 4] = packet[16..20].try_into().unwrap();
    let proto = packet[9];
    let checksum_at = if proto == TCP { 16 } else { 6 };
    let has_checksum = verify_l4 && u16::from_be_bytes([l4[checksum_at], l4[checksum_at + 1]]) != 0;
    if verify_l4 && (proto == TCP || has_checksum) {
        assert_eq!(l4_checksum(src, dst, proto, l4), 0, "L4 checksum is wrong");
    }
    Seen {
        src,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dst,
        dport: u16::from_be_bytes([l4[2], l4[3]]),
    }
}

// ---- tests -----------------------------------------------------------------------

#[test]
fn node_port_to_local_backend_keeps_client_address_and_reverses_replies() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
        None,
    ));

    let syn = Packet::tcp(CLIENT, 40000, NODE, NODE_PORT, SYN);
    let (verdict, out) = f.external(&syn.frame());
    assert_eq!(verdict, TC_ACT_OK);
    let expect_forward = Seen {
        src: CLIENT,
        sport: 40000,
        dst: LOCAL_POD,
        dport: 8080,
    };
    assert_eq!(inspect(&out), expect_forward);
    // Payload untouched.
    assert!(out.ends_with(b"hello"));

    // Later packets of the flow follow the conntrack entry.
    let ack = Packet::tcp(CLIENT, 40000, NODE, NODE_PORT, ACK);
    assert_eq!(inspect(&f.external(&ack.frame()).1), expect_forward);

    // The backend's reply enters on the pod side and leaves as NODE:30080.
    let reply = Packet::tcp(LOCAL_POD, 8080, CLIENT, 40000, SYN | ACK);
    let (verdict, out) = f.internal(&reply.frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        inspect(&out),
        Seen {
            src: NODE,
            sport: NODE_PORT,
            dst: CLIENT,
            dport: 40000
        }
    );
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 1);
    assert_eq!(f.stat(stat::TC_CT_HIT), 2);
    // One connection for the frontend, counted once, not per packet.
    let per_service = f.maps.service_stats().unwrap();
    assert_eq!(per_service.len(), 1);
    assert_eq!(
        (per_service[0].1.connections, per_service[0].1.no_backend),
        (1, 0)
    );

    let entries = f.conntrack.entries().unwrap();
    assert_eq!(entries.len(), 2, "one entry per direction: {entries:?}");
}

#[test]
fn remote_backend_is_reached_with_snat_and_replies_come_back() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
        None,
    ));
    let syn = Packet::tcp(CLIENT, 40001, NODE, NODE_PORT, SYN);
    let out = inspect(&f.external(&syn.frame()).1);
    // The client's port is free on the backend side, so SNAT keeps it.
    assert_eq!(
        out,
        Seen {
            src: NODE,
            sport: 40001,
            dst: REMOTE_POD,
            dport: 8080
        }
    );
    // The reply arrives from the other node addressed to us.
    let reply = Packet::tcp(REMOTE_POD, 8080, NODE, 40001, SYN | ACK);
    assert_eq!(
        inspect(&f.external(&reply.frame()).1),
        Seen {
            src: NODE,
            sport: NODE_PORT,
            dst: CLIENT,
            dport: 40001
        }
    );

    // A second client using the same source port must get another SNAT port, or
    // the backend's replies could not be told apart.
    let other = Packet::tcp([198, 51, 100, 9], 40001, NODE, NODE_PORT, SYN);
    let out = inspect(&f.external(&other.frame()).1);
    assert_eq!(out.src, NODE);
    assert_ne!(out.sport, 40001);
    assert!((32768..61000).contains(&out.sport), "{}", out.sport);
}

#[test]
fn udp_is_translated_and_a_missing_checksum_stays_missing() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(LOCAL_POD, 5353, true)],
        None,
    ));
    let with_checksum = Packet::udp(CLIENT, 5000, NODE, NODE_PORT);
    let out = f.external(&with_checksum.frame()).1;
    assert_eq!(inspect(&out).dst, LOCAL_POD);

    let mut no_checksum = Packet::udp(CLIENT, 5001, NODE, NODE_PORT);
    no_checksum.udp_no_checksum = true;
    let out = f.external(&no_checksum.frame()).1;
    assert_eq!(inspect(&out).dport, 5353);
    let ihl = usize::from(out[14] & 0x0f) * 4;
    assert_eq!(&out[14 + ihl + 6..14 + ihl + 8], &[0, 0]);
}

#[test]
fn ip_options_shift_the_l4_header_and_are_handled() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
        None,
    ));
    let mut syn = Packet::tcp(CLIENT, 40002, NODE, NODE_PORT, SYN);
    syn.ip_options = vec![1, 1, 1, 0]; // NOP, NOP, NOP, EOL
    let (verdict, out) = f.external(&syn.frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, LOCAL_POD);
    assert_eq!(inspect(&out).dport, 8080);
}

#[test]
fn traffic_that_is_not_for_a_frontend_passes_untouched() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
        None,
    ));
    let frames = [
        // Another port on the node.
        Packet::tcp(CLIENT, 40003, NODE, 22, SYN).frame(),
        // The NodePort, but UDP.
        Packet::udp(CLIENT, 40003, NODE, NODE_PORT).frame(),
        // Pod-to-pod.
        Packet::tcp(LOCAL_POD, 1234, REMOTE_POD, 80, SYN).frame(),
    ];
    for frame in frames {
        let (verdict, out) = f.external(&frame);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(out, frame);
    }
    // ARP: not IPv4 at all.
    let mut arp = vec![0xff; 6];
    arp.extend_from_slice(&[0x02, 0, 0, 0, 0, 2, 0x08, 0x06]);
    arp.extend_from_slice(&[0u8; 28]);
    let (verdict, out) = f.external(&arp);
    assert_eq!((verdict, out), (TC_ACT_OK, arp));
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
}

#[test]
fn truncated_and_malformed_headers_are_never_rewritten() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
        None,
    ));
    let good = Packet::tcp(CLIENT, 40004, NODE, NODE_PORT, SYN).frame();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    // TCP header cut short (and the IP total length agreeing with the cut).
    let mut short_tcp = good[..14 + 20 + 10].to_vec();
    short_tcp[16..18].copy_from_slice(&30u16.to_be_bytes());
    cases.push(("short TCP header", short_tcp));
    // IP total length larger than the frame.
    let mut long_total = good.clone();
    long_total[16..18].copy_from_slice(&1400u16.to_be_bytes());
    cases.push(("total length past the end", long_total));
    // IHL claims 60 bytes of header that are not there.
    let mut big_ihl = good.clone();
    big_ihl[14] = 0x4f;
    cases.push(("IHL past the end", big_ihl));
    // IHL below the minimum.
    let mut small_ihl = good.clone();
    small_ihl[14] = 0x44;
    cases.push(("IHL below 5", small_ihl));
    // (A frame cut inside the IPv4 header cannot be fed: BPF_PROG_TEST_RUN itself
    // refuses it with EINVAL. The parser reads it through bpf_skb_load_bytes, which
    // fails the same way as for the IHL case above.)
    for (what, frame) in &cases {
        let (verdict, out) = f.external(frame);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(&out, frame, "{what}: frame was changed");
    }
    assert_eq!(f.stat(stat::TC_MALFORMED), cases.len() as u64);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
}

/// A UDP datagram with `payload_len` bytes of payload (valid checksum) cut into IPv4
/// fragments of at most `chunk` L4 bytes each (a multiple of 8), all with IP id
/// `id`, in order.
fn udp_fragments(
    src: [u8; 4],
    sport: u16,
    dst: [u8; 4],
    dport: u16,
    id: u16,
    payload_len: usize,
    chunk: usize,
) -> Vec<Vec<u8>> {
    assert_eq!(chunk % 8, 0);
    let payload: Vec<u8> = (0..payload_len).map(|i| (i * 7 % 251) as u8).collect();
    let mut datagram = Vec::new();
    datagram.extend_from_slice(&sport.to_be_bytes());
    datagram.extend_from_slice(&dport.to_be_bytes());
    datagram.extend_from_slice(&((8 + payload_len) as u16).to_be_bytes());
    datagram.extend_from_slice(&[0, 0]);
    datagram.extend_from_slice(&payload);
    let c = l4_checksum(src, dst, UDP, &datagram);
    datagram[6..8].copy_from_slice(&c.to_be_bytes());
    let pieces: Vec<&[u8]> = datagram.chunks(chunk).collect();
    pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let more = if i + 1 < pieces.len() { 0x2000 } else { 0 };
            let frag_off = more | ((i * chunk / 8) as u16);
            with_ip_id(ipv4_frame(src, dst, UDP, &[], frag_off, piece), id)
        })
        .collect()
}

/// `frame` with another IPv4 identification (and its header checksum redone).
fn with_ip_id(mut frame: Vec<u8>, id: u16) -> Vec<u8> {
    frame[14 + 4..14 + 6].copy_from_slice(&id.to_be_bytes());
    frame[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let c = checksum(&[&frame[14..14 + ihl]]);
    frame[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    frame
}

/// Reassembles fragments as the receiver would (after checking each IP header
/// checksum, and that all carry the same addresses and id) and checks the UDP
/// checksum of the whole datagram: what the receiver sees.
fn reassemble(frames: &[Vec<u8>]) -> Seen {
    let header = |f: &[u8]| -> ([u8; 4], [u8; 4], u16) {
        let ip = &f[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        assert_eq!(checksum(&[&ip[..ihl]]), 0, "IPv4 header checksum is wrong");
        (
            ip[12..16].try_into().unwrap(),
            ip[16..20].try_into().unwrap(),
            u16::from_be_bytes([ip[4], ip[5]]),
        )
    };
    let first = header(&frames[0]);
    let mut datagram = Vec::new();
    for f in frames {
        assert_eq!(header(f), first, "fragments of one datagram disagree");
        let ip = &f[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        let offset = usize::from(u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff) * 8;
        assert_eq!(offset, datagram.len(), "fragments out of order");
        datagram.extend_from_slice(&ip[ihl..total]);
    }
    let (src, dst, _) = first;
    assert_eq!(
        l4_checksum(src, dst, UDP, &datagram),
        0,
        "UDP checksum of the datagram is wrong"
    );
    assert_eq!(
        usize::from(u16::from_be_bytes([datagram[4], datagram[5]])),
        datagram.len()
    );
    Seen {
        src,
        sport: u16::from_be_bytes([datagram[0], datagram[1]]),
        dst,
        dport: u16::from_be_bytes([datagram[2], datagram[3]]),
    }
}

/// A fragmented datagram to a NodePort (remote backend: DNAT and SNAT) and the
/// backend's fragmented answer: the first fragment is translated through the
/// flow, the later ones get the same addresses, and each reassembles into a
/// datagram whose checksum holds.
#[test]
fn later_fragments_follow_their_first_fragment_both_ways() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(REMOTE_POD, 5353, false)],
        None,
    ));
    let request = udp_fragments(CLIENT, 6000, NODE, NODE_PORT, 0x1111, 4000, 1480);
    assert_eq!(request.len(), 3);
    let mut out = Vec::new();
    for frame in &request {
        let (verdict, rewritten) = f.external(frame);
        assert_eq!(verdict, TC_ACT_OK);
        out.push(rewritten);
    }
    let forward = reassemble(&out);
    assert_eq!(
        (forward.src, forward.dst, forward.dport),
        (NODE, REMOTE_POD, 5353)
    );

    // The answer, as large, from the other node back to our SNAT address and port.
    let answer = udp_fragments(REMOTE_POD, 5353, NODE, forward.sport, 0x2222, 3900, 1480);
    let out: Vec<Vec<u8>> = answer.iter().map(|frame| f.external(frame).1).collect();
    assert_eq!(
        reassemble(&out),
        Seen {
            src: NODE,
            sport: NODE_PORT,
            dst: CLIENT,
            dport: 6000
        }
    );
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 1);
    // The answer's first fragment and the four later fragments.
    assert_eq!(f.stat(stat::TC_CT_HIT), 5);
    assert_eq!(f.stat(stat::TC_FRAGMENT), 0);
    assert_eq!(f.stat(stat::TC_MALFORMED), 0);
}

/// Later fragments whose first fragment was not translated here (it has not come,
/// or it belongs to no frontend) pass untouched and are counted.
#[test]
fn later_fragments_without_a_translated_first_pass_untouched() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(LOCAL_POD, 5353, true)],
        None,
    ));
    // To the NodePort, but the first fragment never arrives.
    let orphan = udp_fragments(CLIENT, 6001, NODE, NODE_PORT, 0x3333, 3000, 1480);
    // To another port: the first fragment passes as it is, and so do the others.
    let other = udp_fragments(CLIENT, 6002, NODE, 53, 0x4444, 3000, 1480);
    let frames: Vec<&Vec<u8>> = orphan[1..].iter().chain(other.iter()).collect();
    for frame in &frames {
        let (verdict, out) = f.external(frame);
        assert_eq!((verdict, &out), (TC_ACT_OK, *frame));
    }
    assert_eq!(
        f.stat(stat::TC_FRAGMENT),
        4,
        "the later fragments are counted"
    );
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
    assert_eq!(f.stat(stat::TC_CT_HIT), 0);
}

/// A TCP header claiming fewer than 20 bytes, or a UDP length that disagrees with
/// the IP length, is malformed: counted, and passed on as it came.
#[test]
fn tcp_data_offset_below_5_and_udp_length_mismatch_are_malformed() {
    let mut f = Fixture::new();
    let mut desired = node_port(Protocol::Tcp, &[backend(LOCAL_POD, 8080, true)], None);
    desired
        .frontends
        .extend(node_port(Protocol::Udp, &[backend(LOCAL_POD, 5353, true)], None).frontends);
    f.program(&desired);

    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let syn = Packet::tcp(CLIENT, 40010, NODE, NODE_PORT, SYN).frame();
    let tcp_off = 14 + 20 + 12;
    for doff in [0u8, 4] {
        let mut frame = syn.clone();
        frame[tcp_off] = doff << 4;
        cases.push(("TCP data offset below 5", frame));
    }
    let mut past_end = syn.clone();
    past_end[tcp_off] = 15 << 4;
    cases.push(("TCP data offset past the packet", past_end));
    let udp = Packet::udp(CLIENT, 6010, NODE, NODE_PORT).frame();
    let udp_len_off = 14 + 20 + 4;
    let real = u16::from_be_bytes([udp[udp_len_off], udp[udp_len_off + 1]]);
    for (what, len) in [
        ("UDP length above the IP length", real + 4),
        ("UDP length below the IP length", real - 2),
        ("UDP length below its header", 4),
    ] {
        let mut frame = udp.clone();
        frame[udp_len_off..udp_len_off + 2].copy_from_slice(&len.to_be_bytes());
        cases.push((what, frame));
    }
    for (what, frame) in &cases {
        let (verdict, out) = f.external(frame);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(&out, frame, "{what}: frame was changed");
    }
    assert_eq!(f.stat(stat::TC_MALFORMED), cases.len() as u64);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 0);
    // The same packets with honest lengths are translated.
    assert_eq!(inspect(&f.external(&syn).1).dst, LOCAL_POD);
    assert_eq!(inspect(&f.external(&udp).1).dst, LOCAL_POD);
}

#[test]
fn no_backend_answers_tcp_with_a_reset_sent_back_out() {
    let mut f = Fixture::new();
    f.program(&node_port(Protocol::Tcp, &[], None));
    let mut syn = Packet::tcp(CLIENT, 40005, NODE, NODE_PORT, SYN);
    syn.payload = Vec::new();
    let (verdict, out) = f.external(&syn.frame());
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(out.len(), 14 + 20 + 20, "options and payload trimmed");
    // Addressed back to the client, from the address it tried.
    assert_eq!(
        inspect(&out),
        Seen {
            src: NODE,
            sport: NODE_PORT,
            dst: CLIENT,
            dport: 40005
        }
    );
    assert_eq!(&out[0..6], &[0x02, 0, 0, 0, 0, 2], "MACs swapped");
    let tcp = &out[34..];
    assert_eq!(tcp[13], RST | ACK);
    assert_eq!(
        u32::from_be_bytes(tcp[8..12].try_into().unwrap()),
        1001,
        "acks the SYN"
    );
    assert_eq!(f.stat(stat::TC_NO_BACKEND), 1);
    let per_service = f.maps.service_stats().unwrap();
    assert_eq!(per_service[0].1.no_backend, 1);

    // A RST is never answered.
    let rst = Packet::tcp(CLIENT, 40005, NODE, NODE_PORT, RST);
    assert_eq!(f.external(&rst.frame()).0, TC_ACT_SHOT);

    // UDP gets an ICMP port unreachable from the address it tried, quoting the
    // datagram's IP and UDP headers, with valid checksums.
    f.program(&node_port(Protocol::Udp, &[], None));
    let udp = Packet::udp(CLIENT, 40005, NODE, NODE_PORT).frame();
    let (verdict, out) = f.external(&udp);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(&out[0..6], &[0x02, 0, 0, 0, 0, 2], "MACs swapped");
    let p = etherparse::SlicedPacket::from_ethernet(&out).unwrap();
    let Some(etherparse::NetSlice::Ipv4(ip)) = &p.net else {
        panic!("no IPv4 answer: {p:?}");
    };
    assert_eq!(ip.header().source(), NODE);
    assert_eq!(ip.header().destination(), CLIENT);
    assert_eq!(
        ip.header().to_header().calc_header_checksum(),
        ip.header().header_checksum()
    );
    let Some(etherparse::TransportSlice::Icmpv4(icmp)) = &p.transport else {
        panic!("no ICMP answer: {p:?}");
    };
    assert!(matches!(
        icmp.icmp_type(),
        etherparse::Icmpv4Type::DestinationUnreachable(
            etherparse::icmpv4::DestUnreachableHeader::Port
        )
    ));
    assert_eq!(
        icmp.payload(),
        &udp[14..14 + 28],
        "quotes IP and UDP headers"
    );
    assert_eq!(
        icmp.icmp_type().calc_checksum(icmp.payload()),
        icmp.checksum()
    );
}

#[test]
fn external_traffic_policy_local_uses_the_external_entry_only_from_outside() {
    let mut f = Fixture::new();
    let remote = backend(REMOTE_POD, 8080, false);
    // No local endpoint: outside traffic is dropped, inside traffic still served.
    f.program(&node_port(Protocol::Tcp, &[remote], Some(&[])));
    let syn = Packet::tcp(CLIENT, 40006, NODE, NODE_PORT, SYN);
    assert_eq!(f.external(&syn.frame()).0, TC_ACT_SHOT);
    let from_pod = Packet::tcp(LOCAL_POD, 40006, NODE, NODE_PORT, SYN);
    let (verdict, out) = f.internal(&from_pod.frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, REMOTE_POD);

    // With a local endpoint, outside traffic goes there and keeps its source.
    let local = backend(LOCAL_POD, 8080, true);
    f.program(&node_port(Protocol::Tcp, &[remote, local], Some(&[local])));
    for port in 41000..41020 {
        let syn = Packet::tcp(CLIENT, port, NODE, NODE_PORT, SYN);
        let out = inspect(&f.external(&syn.frame()).1);
        assert_eq!((out.src, out.dst), (CLIENT, LOCAL_POD), "port {port}");
    }
}

/// An ICMP error as a host sends it: type/code, quoting `quoted` (a full frame
/// whose IP packet is quoted, cut to `quote_len` bytes).
fn icmp_error(
    src: [u8; 4],
    dst: [u8; 4],
    kind: u8,
    code: u8,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let quote = &quoted[14..14 + quote_len];
    let mut icmp = vec![kind, code, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(quote);
    let c = checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(src, dst, 1, &[], 0, &icmp)
}

/// Outer addresses, and the quoted packet's addresses, after checking the outer
/// IP, ICMP and quoted IP checksums (and the quoted L4 checksum when `full_quote`).
fn inspect_icmp(frame: &[u8], full_quote: bool) -> ([u8; 4], [u8; 4], Seen) {
    let ip = &frame[14..34];
    assert_eq!(checksum(&[ip]), 0, "outer IPv4 checksum");
    let icmp = &frame[34..];
    assert_eq!(checksum(&[icmp]), 0, "ICMP checksum");
    (
        ip[12..16].try_into().unwrap(),
        ip[16..20].try_into().unwrap(),
        addresses(&icmp[8..], full_quote),
    )
}

#[test]
fn icmp_errors_from_a_backend_are_translated_for_the_client() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Udp,
        &[backend(LOCAL_POD, 5353, true)],
        None,
    ));
    let request = Packet::udp(CLIENT, 40010, NODE, NODE_PORT);
    let translated = f.external(&request.frame()).1;
    // The backend answers what it received with "port unreachable", quoting all of it.
    let quoted_len = translated.len() - 14;
    let error = icmp_error(LOCAL_POD, CLIENT, 3, 3, &translated, quoted_len);
    let (verdict, out) = f.internal(&error);
    assert_eq!(verdict, TC_ACT_OK);
    let (outer_src, outer_dst, quoted) = inspect_icmp(&out, true);
    assert_eq!((outer_src, outer_dst), (NODE, CLIENT));
    assert_eq!(
        quoted,
        Seen {
            src: CLIENT,
            sport: 40010,
            dst: NODE,
            dport: NODE_PORT
        }
    );
}

#[test]
fn icmp_errors_on_the_snat_path_reach_the_client() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
        None,
    ));
    let syn = Packet::tcp(CLIENT, 40011, NODE, NODE_PORT, SYN);
    let translated = f.external(&syn.frame()).1;
    // A router between the nodes reports "fragmentation needed", quoting only the
    // IP header and 8 bytes (no TCP checksum).
    let router = [192, 168, 50, 254];
    let error = icmp_error(router, NODE, 3, 4, &translated, 28);
    let (verdict, out) = f.external(&error);
    assert_eq!(verdict, TC_ACT_OK);
    let (outer_src, outer_dst, quoted) = inspect_icmp(&out, false);
    assert_eq!(outer_src, router, "a router keeps its own address");
    assert_eq!(outer_dst, CLIENT);
    assert_eq!(
        quoted,
        Seen {
            src: CLIENT,
            sport: 40011,
            dst: NODE,
            dport: NODE_PORT
        }
    );
}

#[test]
fn icmp_errors_of_unknown_flows_pass_untouched() {
    let f = Fixture::new();
    let unrelated = Packet::udp(CLIENT, 40012, REMOTE_POD, 53).frame();
    let error = icmp_error(REMOTE_POD, CLIENT, 3, 3, &unrelated, unrelated.len() - 14);
    let (verdict, out) = f.external(&error);
    assert_eq!((verdict, out), (TC_ACT_OK, error));
}

/// Runs `ip` in the calling thread's network namespace (a forked child keeps it).
fn ip(args: &str) {
    let status = std::process::Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .expect("run ip");
    assert!(status.success(), "ip {args}");
}

#[test]
fn packets_with_a_node_source_are_routed_by_the_program_not_the_stack() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(REMOTE_POD, 8080, false)],
        None,
    ));
    let syn = Packet::tcp(CLIENT, 40013, NODE, NODE_PORT, SYN).frame();
    // No route to the backend in this namespace: the stack gets the packet.
    assert_eq!(f.external(&syn).0, TC_ACT_OK);

    // With a route, the SNATed packet (source = this node, which routing input would
    // drop as a martian) is sent to the egress device with its TTL decremented.
    // A router forwards: the lookup honours the forwarding switch.
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").unwrap();
    ip("link set lo up");
    ip("link add lbfib0 type veth peer name lbfib1");
    ip("link set lbfib0 up");
    ip("link set lbfib1 up");
    ip("addr add 192.168.50.2/24 dev lbfib0");
    ip("route add 10.244.2.0/24 via 192.168.50.3");
    let ack = Packet::tcp(CLIENT, 40013, NODE, NODE_PORT, ACK).frame();
    let (verdict, out) = f.external(&ack);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(inspect(&out).src, NODE);
    assert_eq!(out[14 + 8], 63, "TTL decremented like a router");
}

#[test]
fn session_affinity_keeps_a_client_address_on_one_backend() {
    let mut f = Fixture::new();
    let mut desired = node_port(
        Protocol::Tcp,
        &[
            backend(LOCAL_POD, 8080, true),
            backend([10, 244, 1, 12], 8080, true),
            backend([10, 244, 1, 13], 8080, true),
        ],
        None,
    );
    for spec in desired.frontends.values_mut() {
        spec.affinity_timeout_sec = Some(60);
    }
    f.program(&desired);
    let backends: BTreeSet<[u8; 4]> = (41100..41130)
        .map(|port| {
            let syn = Packet::tcp(CLIENT, port, NODE, NODE_PORT, SYN);
            inspect(&f.external(&syn.frame()).1).dst
        })
        .collect();
    assert_eq!(
        backends.len(),
        1,
        "one client address, one backend: {backends:?}"
    );

    // Another client address is another client: over a few of them, more than one
    // backend shows up (3 backends, 12 clients: all on one has odds 3^-11).
    let spread: BTreeSet<[u8; 4]> = (1..=12u8)
        .map(|host| {
            let syn = Packet::tcp([198, 51, 100, host], 41200, NODE, NODE_PORT, SYN);
            inspect(&f.external(&syn.frame()).1).dst
        })
        .collect();
    assert!(spread.len() > 1, "{spread:?}");
}

/// The agent writes long runs of inserts as batched syscalls: what the kernel holds
/// afterwards must be exactly what the reconciler planned, through a first fill
/// and through a change that replaces half of the table.
#[test]
fn a_large_table_is_written_in_batches_exactly_as_planned() {
    let mut fx = Fixture::new();
    let table = |services: std::ops::Range<u32>| {
        let mut desired = DesiredState::default();
        for i in services {
            let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i);
            let backends = (0..10)
                .map(|j| BackendAddr {
                    ip: Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * 10 + j).into(),
                    port: 8080,
                    local: j % 2 == 0,
                })
                .collect::<BTreeSet<_>>()
                .into();
            desired.frontends.insert(
                Frontend::internal(vip.into(), 80, Protocol::Tcp),
                FrontendSpec {
                    service: format!("default/svc-{i}:http").into(),
                    backends,
                    affinity_timeout_sec: None,
                    source_ranges: None,
                    maglev: false,
                    cluster_ip: false,
                },
            );
        }
        desired
    };
    for desired in [table(0..3000), table(1500..4500)] {
        let before = fx.maps.snapshot().unwrap();
        let plan = reconcile::plan(&desired, &before, fx.maps.capacity());
        assert!(plan.rejected.is_empty(), "{:?}", plan.rejected);
        let mut expected = before;
        expected.apply(&plan.ops);
        let batched_before = fx.maps.batched_writes();
        fx.maps.apply(&plan.ops).unwrap();
        // Nearly every op is an insert in a long run: those went as batches.
        let puts = plan
            .ops
            .iter()
            .filter(|op| {
                matches!(
                    op,
                    lb_userspace::datapath::snapshot::MapOp::PutBackend { .. }
                        | lb_userspace::datapath::snapshot::MapOp::PutService { .. }
                )
            })
            .count() as u64;
        assert_eq!(fx.maps.batched_writes() - batched_before, puts);
        let written = fx.maps.snapshot().unwrap();
        assert_eq!(written.services.len(), 3000 * 11);
        assert_eq!(written.backends.len(), 3000 * 10);
        assert!(
            written == expected,
            "the kernel's table differs from the plan's"
        );
    }
}

/// A client that reuses its port after a NodePort connection ended: a SYN-ACK from
/// the pod for a connection the client opened to the pod IP directly must arrive
/// untouched, and a new SYN to the NodePort is balanced afresh (here onto the
/// backend that replaced the old one), instead of following the ended flow's entry.
#[test]
fn an_ended_flow_does_not_capture_a_new_connection_on_the_same_ports() {
    let mut f = Fixture::new();
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(LOCAL_POD, 8080, true)],
        None,
    ));
    let to_pod = Seen {
        src: CLIENT,
        sport: 40000,
        dst: LOCAL_POD,
        dport: 8080,
    };
    let syn = Packet::tcp(CLIENT, 40000, NODE, NODE_PORT, SYN);
    assert_eq!(inspect(&f.external(&syn.frame()).1), to_pod);
    // Both sides close.
    let fin = Packet::tcp(CLIENT, 40000, NODE, NODE_PORT, FIN | ACK);
    assert_eq!(inspect(&f.external(&fin.frame()).1), to_pod);
    let reply_fin = Packet::tcp(LOCAL_POD, 8080, CLIENT, 40000, FIN | ACK);
    assert_eq!(inspect(&f.internal(&reply_fin.frame()).1).src, NODE);

    // The client now connects to the pod IP from the same port; the pod's SYN-ACK
    // must keep the pod's address, or the client would reset it.
    let direct_reply = Packet::tcp(LOCAL_POD, 8080, CLIENT, 40000, SYN | ACK);
    let (verdict, out) = f.internal(&direct_reply.frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        inspect(&out),
        Seen {
            src: LOCAL_POD,
            sport: 8080,
            dst: CLIENT,
            dport: 40000
        }
    );

    // The Service's backend changed meanwhile; a new SYN to the NodePort from the
    // same port goes to the current backend, not the ended flow's.
    f.program(&node_port(
        Protocol::Tcp,
        &[backend(OTHER_LOCAL_POD, 8080, true)],
        None,
    ));
    let out = inspect(&f.external(&syn.frame()).1);
    assert_eq!(out.dst, OTHER_LOCAL_POD);
    let reply = Packet::tcp(OTHER_LOCAL_POD, 8080, CLIENT, 40000, SYN | ACK);
    assert_eq!(inspect(&f.internal(&reply.frame()).1).src, NODE);
}

/// A LoadBalancer IP whose Service has `loadBalancerSourceRanges: [203.0.113.0/24]`,
/// next to the same Service's NodePort, both to a local backend.
fn restricted_load_balancer(ranges: Option<&[&str]>) -> DesiredState {
    let mut desired = node_port(Protocol::Tcp, &[backend(LOCAL_POD, 8080, true)], None);
    let spec = FrontendSpec {
        service: "default/web:http".into(),
        backends: BTreeSet::from([backend(LOCAL_POD, 8080, true)]).into(),
        affinity_timeout_sec: None,
        source_ranges: ranges.map(|r| r.iter().map(|c| c.parse().unwrap()).collect()),
        maglev: false,
        cluster_ip: false,
    };
    let lb = Frontend::internal(Ipv4Addr::from(LB_IP).into(), 80, Protocol::Tcp);
    desired.frontends.insert(lb, spec);
    desired
}

const LB_IP: [u8; 4] = [198, 51, 100, 7];
const OUTSIDER: [u8; 4] = [198, 18, 0, 9];

impl Fixture {
    /// [`Fixture::program`], then the source-range trie as the agent syncs it.
    fn program_with_ranges(&mut self, desired: &DesiredState) {
        self.program(desired);
        let wanted = source_ranges::wanted(&desired.frontends, &self.maps.snapshot().unwrap());
        self.maps.sync_source_ranges(&wanted, true).unwrap();
    }

    fn source_range_drops(&self) -> u64 {
        self.maps
            .service_stats()
            .unwrap()
            .iter()
            .map(|(_, c)| c.source_range_drops)
            .sum()
    }
}

#[test]
fn load_balancer_source_ranges_drop_new_flows_from_outside_only() {
    let mut f = Fixture::new();
    f.program_with_ranges(&restricted_load_balancer(Some(&["203.0.113.0/24"])));
    let to_local_pod = |sport| Seen {
        src: CLIENT,
        sport,
        dst: LOCAL_POD,
        dport: 8080,
    };

    // CLIENT (203.0.113.5) is inside the range.
    let (verdict, out) = f.external(&Packet::tcp(CLIENT, 40000, LB_IP, 80, SYN).frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out), to_local_pod(40000));

    // OUTSIDER is not: dropped and counted, globally and for the frontend.
    let (verdict, _) = f.external(&Packet::tcp(OUTSIDER, 40001, LB_IP, 80, SYN).frame());
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(f.stat(stat::TC_SOURCE_RANGE_DROP), 1);
    assert_eq!(f.source_range_drops(), 1);
    // Pods are held to the ranges too, as kube-proxy's firewall chain holds them.
    let (verdict, _) = f.internal(&Packet::tcp(OTHER_LOCAL_POD, 40002, LB_IP, 80, SYN).frame());
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(f.stat(stat::TC_SOURCE_RANGE_DROP), 2);

    // The same Service's NodePort is open to everyone.
    let (verdict, out) = f.external(&Packet::tcp(OUTSIDER, 40003, NODE, NODE_PORT, SYN).frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, LOCAL_POD);

    // Ranges that admit nobody (only invalid values were given): CLIENT is dropped.
    f.program_with_ranges(&restricted_load_balancer(Some(&[])));
    assert!(f.maps.source_ranges().unwrap().is_empty());
    let (verdict, _) = f.external(&Packet::tcp(CLIENT, 40004, LB_IP, 80, SYN).frame());
    assert_eq!(verdict, TC_ACT_SHOT);
    // The flow admitted before keeps going (conntrack), as with kube-proxy.
    let (verdict, out) = f.external(&Packet::tcp(CLIENT, 40000, LB_IP, 80, ACK).frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out), to_local_pod(40000));

    // The restriction lifted: OUTSIDER gets through, nothing is left in the trie.
    f.program_with_ranges(&restricted_load_balancer(None));
    let (verdict, out) = f.external(&Packet::tcp(OUTSIDER, 40005, LB_IP, 80, SYN).frame());
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(inspect(&out).dst, LOCAL_POD);
    assert_eq!(f.stat(stat::TC_SOURCE_RANGE_DROP), 3);
}
