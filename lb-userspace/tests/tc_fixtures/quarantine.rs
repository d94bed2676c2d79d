//! Passive health on the per-packet path: a RST answering a new flow's SYN
//! quarantines its backend for the frontend; new flows skip it (random picks and
//! Maglev alike, the latter down the flow's probe sequence as lb-common predicts);
//! every backend quarantined keeps the first pick; the first SYN-ACK after a
//! quarantine clears it; a refused flow is forgotten, so its tuple is balanced
//! afresh; an established flow's RST, and the feature turned off, change nothing.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use aya::maps::{HashMap as AyaHashMap, MapData};
use lb_common::{
    maglev as flow, map_names, quarantine as q, IpAddrBe, QuarantineKey, QuarantineSettings,
    QuarantineValue,
};
use lb_userspace::control::maglev::{build, identities, table_size};
use lb_userspace::datapath::conntrack::monotonic_now_ns;
use lb_userspace::datapath::maps::QuarantineMap;
use lb_userspace::datapath::table;

use super::*;

const THIRD_LOCAL_POD: [u8; 4] = [10, 244, 1, 13];

fn quarantining() -> Fixture {
    Fixture::with(ProgramSettings {
        maglev_seed: MAGLEV_SEED,
        quarantine: QuarantineSettings { enabled: 1 },
        ..ProgramSettings::default()
    })
}

fn three_local() -> Vec<BackendAddr> {
    [LOCAL_POD, OTHER_LOCAL_POD, THIRD_LOCAL_POD]
        .map(|ip| backend(ip, 8080, true))
        .to_vec()
}

fn node_port_over(backends: &[BackendAddr], maglev: bool) -> DesiredState {
    let mut desired = node_port(Protocol::Tcp, backends, None);
    for spec in desired.frontends.values_mut() {
        spec.maglev = maglev;
    }
    desired
}

impl Fixture {
    /// The NodePort's frontend id and the backend id of each pod address.
    fn ids(&self) -> (u32, Vec<([u8; 4], u32)>) {
        let frontends = table::decode(&self.maps.snapshot().unwrap());
        let f = frontends
            .iter()
            .find(|f| f.frontend.port == NODE_PORT)
            .expect("the NodePort is programmed");
        let ids = f
            .backends
            .iter()
            .map(|b| match b.ip {
                IpAddr::V4(v4) => (v4.octets(), b.id),
                IpAddr::V6(_) => unreachable!("IPv4 backends"),
            })
            .collect();
        (f.rev_nat_id, ids)
    }

    fn record(&self, pod: [u8; 4]) -> Option<QuarantineValue> {
        let (rev_nat_id, ids) = self.ids();
        let id = ids.iter().find(|(ip, _)| *ip == pod)?.1;
        QuarantineMap::open(self._pins.layout())
            .unwrap()
            .entries()
            .unwrap()
            .into_iter()
            .find(|(k, _)| {
                *k == QuarantineKey {
                    rev_nat_id,
                    backend_id: id,
                }
            })
            .map(|(_, v)| v)
    }

    /// Writes `pod`'s record directly (what a refusal long ago, or one just
    /// now, left).
    fn set_record(&self, pod: [u8; 4], value: QuarantineValue) {
        let (rev_nat_id, ids) = self.ids();
        let id = ids.iter().find(|(ip, _)| *ip == pod).unwrap().1;
        let mut map: AyaHashMap<MapData, QuarantineKey, QuarantineValue> = AyaHashMap::try_from(
            aya::maps::Map::from_map_data(
                MapData::from_pin(self._pins.layout().map_path(map_names::QUARANTINE)).unwrap(),
            )
            .unwrap(),
        )
        .unwrap();
        map.insert(
            QuarantineKey {
                rev_nat_id,
                backend_id: id,
            },
            value,
            0,
        )
        .unwrap();
    }

    /// A new flow from `CLIENT:sport`: the backend its SYN went to.
    fn syn(&self, sport: u16) -> [u8; 4] {
        let (verdict, out) =
            self.external(&Packet::tcp(CLIENT, sport, NODE, NODE_PORT, SYN).frame());
        assert_eq!(verdict, TC_ACT_OK);
        inspect(&out).dst
    }

    /// The local backend `pod` answers the flow from `CLIENT:sport` with `flags`
    /// (its replies enter the node on its veth).
    fn answer(&self, pod: [u8; 4], sport: u16, flags: u8) -> Seen {
        let (verdict, out) = self.internal(&Packet::tcp(pod, 8080, CLIENT, sport, flags).frame());
        assert_eq!(verdict, TC_ACT_OK);
        inspect(&out)
    }
}

/// An active record at the programs' clock (CLOCK_MONOTONIC).
fn active_record() -> QuarantineValue {
    let mut value = QuarantineValue::default();
    value.refused(monotonic_now_ns(), 0);
    value
}

#[test]
fn a_rst_to_a_new_flow_quarantines_its_backend_and_new_flows_skip_it() {
    let mut f = quarantining();
    f.program(&node_port_over(&three_local(), false));
    let victim = f.syn(40_000);
    // A second SYN to it, on its way before the first refusal comes back.
    let also = (40_100..40_200)
        .find(|&sport| f.syn(sport) == victim)
        .expect("a third of the picks land on it");
    // The backend refuses: its RST goes back to the client as the frontend.
    let reset = f.answer(victim, 40_000, RST | ACK);
    assert_eq!((reset.src, reset.sport), (NODE, NODE_PORT));
    assert_eq!(f.stat(stat::QUARANTINED), 1);
    let record = f.record(victim).expect("the refusing backend has a record");
    assert!(record.is_active(monotonic_now_ns()) && record.strikes == 1);
    assert!(!record.is_by_socket());
    let others: BTreeSet<[u8; 4]> = [LOCAL_POD, OTHER_LOCAL_POD, THIRD_LOCAL_POD]
        .into_iter()
        .filter(|p| *p != victim)
        .collect();
    for pod in &others {
        assert_eq!(f.record(*pod), None, "{pod:?} never refused");
    }
    // The refused flow is forgotten: a new connection that gets the same client
    // port is balanced afresh, not sent after the dead pick.
    assert!(others.contains(&f.syn(40_000)));
    // 60 new flows: none goes to the victim, both others get some.
    let picked: Vec<[u8; 4]> = (40_001..40_061).map(|sport| f.syn(sport)).collect();
    assert!(!picked.contains(&victim), "{picked:?}");
    assert_eq!(picked.iter().copied().collect::<BTreeSet<_>>(), others);
    let skips = f.stat(stat::QUARANTINE_SKIP);
    assert!(skips > 0, "a third of 60 picks were the victim");
    assert_eq!(f.record(victim).unwrap().skips, skips);
    // The second RST, of the same outage, adds nothing.
    f.answer(victim, also, RST | ACK);
    let record = f.record(victim).unwrap();
    assert_eq!((record.strikes, record.quarantines), (1, 1));
    assert_eq!(f.stat(stat::QUARANTINED), 1);
    assert_eq!(f.stat(stat::QUARANTINE_ALL), 0);
}

#[test]
fn the_first_syn_ack_after_a_quarantine_clears_it() {
    let mut f = quarantining();
    f.program(&node_port_over(&three_local(), false));
    // A quarantine that ran out: strike 2, ended a moment ago.
    let mut ended = QuarantineValue::default();
    ended.refused(1, 0);
    ended.refused(1 + q::backoff_ns(1), 0);
    assert_eq!(ended.strikes, 2);
    f.set_record(LOCAL_POD, ended);
    // New flows may pick it again; the first it accepts clears its record.
    let sport = (41_000..41_200)
        .find(|&sport| f.syn(sport) == LOCAL_POD)
        .expect("a third of the picks land on it");
    f.answer(LOCAL_POD, sport, SYN | ACK);
    let cleared = f.record(LOCAL_POD).unwrap();
    assert_eq!((cleared.strikes, cleared.until_ns), (0, 0));
    assert_eq!(cleared.quarantines, 2, "the count stays");
    assert_eq!(f.stat(stat::QUARANTINE_CLEARED), 1);
    // The flow is established: its RST now is no refusal.
    f.answer(LOCAL_POD, sport, ACK);
    f.answer(LOCAL_POD, sport, RST | ACK);
    assert_eq!(f.record(LOCAL_POD).unwrap().strikes, 0);
    assert_eq!(f.stat(stat::QUARANTINED), 0);
    // A refusal after the clear starts over at 1 s.
    let sport = (41_200..41_400)
        .find(|&sport| f.syn(sport) == LOCAL_POD)
        .expect("a third of the picks land on it");
    f.answer(LOCAL_POD, sport, RST | ACK);
    let again = f.record(LOCAL_POD).unwrap();
    assert_eq!(again.strikes, 1);
    assert!(again.until_ns - monotonic_now_ns() <= q::backoff_ns(1));
}

#[test]
fn with_every_backend_quarantined_new_flows_keep_their_first_pick() {
    let mut f = quarantining();
    f.program(&node_port_over(&three_local(), false));
    for pod in [LOCAL_POD, OTHER_LOCAL_POD, THIRD_LOCAL_POD] {
        f.set_record(pod, active_record());
    }
    let picked: BTreeSet<[u8; 4]> = (42_000..42_030).map(|sport| f.syn(sport)).collect();
    assert_eq!(picked.len(), 3, "the picks stay spread: {picked:?}");
    assert_eq!(f.stat(stat::QUARANTINE_ALL), 30);
    assert_eq!(f.stat(stat::QUARANTINE_SKIP), 0);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 30);
}

#[test]
fn established_flows_never_consult_the_quarantine() {
    let mut f = quarantining();
    f.program(&node_port_over(&three_local(), false));
    let pod = f.syn(43_000);
    f.answer(pod, 43_000, SYN | ACK);
    f.set_record(pod, active_record());
    // The client's next segments still go to its backend.
    for _ in 0..5 {
        let (_, out) = f.external(&Packet::tcp(CLIENT, 43_000, NODE, NODE_PORT, ACK).frame());
        assert_eq!(inspect(&out).dst, pod);
    }
    assert_eq!(f.stat(stat::QUARANTINE_SKIP), 0);
}

#[test]
fn turned_off_a_rst_leaves_no_record() {
    let mut f = Fixture::new();
    f.program(&node_port_over(&three_local(), false));
    let pod = f.syn(44_000);
    f.answer(pod, 44_000, RST | ACK);
    assert_eq!(f.record(pod), None);
    assert_eq!(f.stat(stat::QUARANTINED), 0);
}

/// Maglev's fall-through, as lb-common's `maglev_probe` predicts it: a flow whose
/// table slot names the quarantined backend goes to the backend of the first of
/// its next probes that names another; a flow whose slot is healthy keeps it.
#[test]
fn maglev_flows_of_a_quarantined_backend_go_down_their_probe_sequence() {
    let mut f = quarantining();
    let backends = three_local();
    f.program(&node_port_over(&backends, true));
    let mut ordered: Vec<(IpAddr, u16)> = backends.iter().map(|b| (b.ip, b.port)).collect();
    ordered.sort();
    let ids = identities(ordered.iter().copied()).unwrap();
    let size = table_size(ids.len()).unwrap();
    let table = build(&ids, size, MAGLEV_SEED).unwrap();
    let pod_at = |position: u16| match ordered[usize::from(position)].0 {
        IpAddr::V4(v4) => v4.octets(),
        IpAddr::V6(_) => unreachable!(),
    };
    let victim = OTHER_LOCAL_POD;
    f.set_record(victim, active_record());
    let (mut moved, mut kept) = (0, 0);
    for sport in 45_000..45_060u16 {
        let hash = flow::flow_hash(
            &IpAddrBe::from(IpAddr::from(Ipv4Addr::from(CLIENT))),
            sport.to_be(),
            NODE_PORT.to_be(),
            TCP,
            MAGLEV_SEED,
        );
        let want = (0..q::MAGLEV_PROBES)
            .map(|i| pod_at(table[q::maglev_probe(hash, size, i) as usize]))
            .find(|pod| *pod != victim);
        let got = f.syn(sport);
        assert_ne!(got, victim, "client port {sport}");
        let own = pod_at(table[flow::slot(hash, size) as usize]);
        if own == victim {
            moved += 1;
            // Beyond the probes the random scan decides: only check what the
            // probes predict.
            if let Some(want) = want {
                assert_eq!(got, want, "client port {sport}");
            }
        } else {
            kept += 1;
            assert_eq!(got, own, "client port {sport}: its own slot is healthy");
        }
    }
    assert!(moved > 0 && kept > 0, "moved {moved}, kept {kept}");
    assert_eq!(f.stat(stat::QUARANTINE_SKIP), moved);
}

/// The verifier walks the quarantine's branches only when the setting is on (a
/// load-time constant): every program the agent loads, with it on.
#[test]
fn every_program_verifies_with_quarantine_on() {
    let (layout, _pins) = fixture::private_pins("tc-quarantine-verify");
    let object = loader::kernel_object(None).expect("kernel object embedded");
    let settings = ProgramSettings {
        quarantine: QuarantineSettings { enabled: 1 },
        ..ProgramSettings::default()
    };
    let sizes = MapSizes {
        conntrack: 1024,
        ..MapSizes::default()
    };
    let mut ebpf = loader::load_with(&object, &layout, sizes, &[], &settings).unwrap();
    loader::verify(
        &mut ebpf,
        loader::TcAttach::Tcx,
        loader::XdpAttach::Native,
        &settings,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

// ---- UDP and ICMP errors ----------------------------------------------------------
//
// A UDP backend has no RST: a closed port answers a datagram with an ICMP port
// unreachable (a host unreachable when its node has no neighbour for it). The error
// about a new flow's datagram refuses it; the backend's first datagram back accepts.

const UDP_PORT: u16 = 8080;

fn udp_node_port(backends: &[BackendAddr]) -> DesiredState {
    node_port(Protocol::Udp, backends, None)
}

impl Fixture {
    /// A datagram of a new flow from `CLIENT:sport`: the backend it went to, and
    /// the frame as it left for it.
    fn datagram(&self, sport: u16) -> ([u8; 4], Vec<u8>) {
        let (verdict, out) = self.external(&Packet::udp(CLIENT, sport, NODE, NODE_PORT).frame());
        assert_eq!(verdict, TC_ACT_OK);
        (inspect(&out).dst, out)
    }

    /// The local backend `pod` answers `sent` with ICMP destination unreachable
    /// `code`, quoting all of it; the client gets it as from the frontend.
    fn unreachable(&self, pod: [u8; 4], sent: &[u8], code: u8) {
        let error = icmp_error(pod, CLIENT, 3, code, sent, sent.len() - 14);
        let (verdict, out) = self.internal(&error);
        assert_eq!(verdict, TC_ACT_OK);
        let (outer_src, outer_dst, _) = inspect_icmp(&out, true);
        assert_eq!((outer_src, outer_dst), (NODE, CLIENT));
    }
}

#[test]
fn a_port_unreachable_to_a_new_udp_flow_quarantines_its_backend() {
    let mut f = quarantining();
    f.program(&udp_node_port(&three_local()));
    let (victim, sent) = f.datagram(45_000);
    f.unreachable(victim, &sent, 3);
    assert_eq!(f.stat(stat::QUARANTINED), 1);
    let record = f.record(victim).expect("the refusing backend has a record");
    assert!(record.is_active(monotonic_now_ns()) && record.strikes == 1);
    // The refused flow is forgotten: the next datagram on its tuple (a retry on
    // the same socket, or a new socket given the same port) is balanced afresh.
    assert_ne!(f.datagram(45_000).0, victim);
    let picked: BTreeSet<[u8; 4]> = (45_001..45_061).map(|s| f.datagram(s).0).collect();
    assert!(!picked.contains(&victim), "{picked:?}");
    assert_eq!(
        picked.len(),
        2,
        "both others share the new flows: {picked:?}"
    );
    assert!(f.stat(stat::QUARANTINE_SKIP) > 0);
}

#[test]
fn a_host_unreachable_refuses_but_other_errors_and_answered_flows_do_not() {
    let mut f = quarantining();
    f.program(&udp_node_port(&three_local()));
    // Fragmentation needed and administratively prohibited say nothing about the
    // backend's port.
    let (pod, sent) = f.datagram(46_000);
    f.unreachable(pod, &sent, 4);
    let (other, sent) = f.datagram(46_001);
    f.unreachable(other, &sent, 13);
    assert_eq!(f.stat(stat::QUARANTINED), 0);
    // A flow its backend answered is established: a later port unreachable (the
    // server went away mid-flow) is no refusal of a new flow.
    let (pod, sent) = f.datagram(46_002);
    f.internal(&Packet::udp(pod, UDP_PORT, CLIENT, 46_002).frame());
    f.unreachable(pod, &sent, 3);
    assert_eq!(f.record(pod).map(|r| r.strikes).unwrap_or(0), 0);
    assert_eq!(
        f.datagram(46_002).0,
        pod,
        "an answered flow keeps its backend"
    );
    assert_eq!(f.stat(stat::QUARANTINED), 0);
    // A host unreachable to a new flow refuses it.
    let (pod, sent) = f.datagram(46_003);
    f.unreachable(pod, &sent, 1);
    assert_eq!(f.record(pod).map(|r| r.strikes), Some(1));
    assert_eq!(f.stat(stat::QUARANTINED), 1);
}

#[test]
fn a_udp_backend_s_first_answer_clears_its_quarantine() {
    let mut f = quarantining();
    f.program(&udp_node_port(&three_local()));
    let mut ended = QuarantineValue::default();
    ended.refused(1, 0);
    f.set_record(LOCAL_POD, ended);
    let sport = (47_000..47_200)
        .find(|&sport| f.datagram(sport).0 == LOCAL_POD)
        .expect("a third of the picks land on it");
    f.internal(&Packet::udp(LOCAL_POD, UDP_PORT, CLIENT, sport).frame());
    let cleared = f.record(LOCAL_POD).unwrap();
    assert_eq!((cleared.strikes, cleared.until_ns), (0, 0));
    assert_eq!(f.stat(stat::QUARANTINE_CLEARED), 1);
}

#[test]
fn turned_off_a_port_unreachable_leaves_no_record() {
    let mut f = Fixture::new();
    f.program(&udp_node_port(&three_local()));
    let (pod, sent) = f.datagram(48_000);
    f.unreachable(pod, &sent, 3);
    assert_eq!(f.record(pod), None);
    assert_eq!(f.datagram(48_000).0, pod, "off, the flow keeps its pick");
}
