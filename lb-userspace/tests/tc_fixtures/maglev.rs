//! Maglev frontends on the per-packet path: the backend the TC program picks for a
//! new flow is the one `lb_common::maglev`'s flow hash and `control::maglev`'s
//! table predict; the same client flow to another node address of the same
//! NodePort picks the same backend; a table slot naming no backend of the frontend
//! falls back to a random one and is counted.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use aya::maps::{Array, MapData};
use lb_common::{maglev as flow, map_names, IpAddrBe, MaglevSlots};
use lb_userspace::control::maglev::{build, identities, table_size};

use super::*;

/// Another address of the node (a second NIC, or the address of another node
/// whose agent built the same table: the hash leaves the address out).
const NODE_B: [u8; 4] = [192, 168, 51, 2];
const THIRD_LOCAL_POD: [u8; 4] = [10, 244, 1, 13];

/// Three local backends (no SNAT: the frame's new destination is the choice).
fn backends() -> Vec<BackendAddr> {
    [LOCAL_POD, OTHER_LOCAL_POD, THIRD_LOCAL_POD]
        .map(|ip| backend(ip, 8080, true))
        .to_vec()
}

/// NodePort 30080 on `nodes`, Maglev, with [`backends`].
fn maglev_node_port(nodes: &[[u8; 4]], protocol: Protocol) -> DesiredState {
    let mut desired = DesiredState::default();
    for node in nodes {
        desired.frontends.insert(
            Frontend::internal(Ipv4Addr::from(*node).into(), NODE_PORT, protocol),
            FrontendSpec {
                service: "default/web:http".into(),
                backends: backends().into_iter().collect::<BTreeSet<_>>().into(),
                affinity_timeout_sec: None,
                source_ranges: None,
                maglev: true,
                cluster_ip: false,
            },
        );
    }
    desired
}

/// The backend Maglev gives a flow from `client:sport` to port `NODE_PORT`: the
/// table built by the agent's module, indexed by the hash of lb-common's flow
/// hash, both computed here in userspace.
fn predicted(client: [u8; 4], sport: u16, proto: u8) -> [u8; 4] {
    let mut ordered: Vec<(IpAddr, u16)> = backends().iter().map(|b| (b.ip, b.port)).collect();
    ordered.sort();
    let ids = identities(ordered.iter().copied()).unwrap();
    let size = table_size(ids.len()).unwrap();
    let table = build(&ids, size, MAGLEV_SEED).unwrap();
    let hash = flow::flow_hash(
        &IpAddrBe::from(IpAddr::from(client)),
        sport.to_be(),
        NODE_PORT.to_be(),
        proto,
        MAGLEV_SEED,
    );
    let position = table[flow::slot(hash, size) as usize];
    match ordered[usize::from(position)].0 {
        IpAddr::V4(v4) => v4.octets(),
        IpAddr::V6(_) => unreachable!("IPv4 backends"),
    }
}

#[test]
fn maglev_picks_the_backend_the_table_predicts() {
    let mut f = Fixture::new();
    f.program(&maglev_node_port(&[NODE], Protocol::Tcp));
    let mut chosen = BTreeSet::new();
    for sport in 40_000..40_040u16 {
        let syn = Packet::tcp(CLIENT, sport, NODE, NODE_PORT, SYN);
        let (verdict, out) = f.external(&syn.frame());
        assert_eq!(verdict, TC_ACT_OK);
        let seen = inspect(&out);
        assert_eq!(
            seen.dst,
            predicted(CLIENT, sport, TCP),
            "client port {sport}"
        );
        assert_eq!((seen.src, seen.sport, seen.dport), (CLIENT, sport, 8080));
        chosen.insert(seen.dst);
    }
    // 40 flows over three thirds: one backend missed has probability 3 (2/3)^40.
    assert_eq!(chosen.len(), 3, "{chosen:?}");
    assert_eq!(f.stat(stat::MAGLEV_MISS), 0);
    // UDP hashes its protocol too, and still agrees with the prediction.
    let mut f = Fixture::new();
    f.program(&maglev_node_port(&[NODE], Protocol::Udp));
    for sport in [53u16, 5353, 40_000] {
        let (_, out) = f.external(&Packet::udp(CLIENT, sport, NODE, NODE_PORT).frame());
        assert_eq!(inspect(&out).dst, predicted(CLIENT, sport, UDP), "{sport}");
    }
}

#[test]
fn the_same_flow_through_two_node_addresses_picks_the_same_backend() {
    let mut f = Fixture::new();
    f.program(&maglev_node_port(&[NODE, NODE_B], Protocol::Tcp));
    // Both frontends name one table.
    let snapshot = f.maps.snapshot().unwrap();
    let tables: BTreeSet<u32> = snapshot
        .services
        .values()
        .filter_map(|v| v.maglev())
        .map(|(first, _)| first)
        .collect();
    assert_eq!(tables.len(), 1);
    for sport in 41_000..41_020u16 {
        let via_a = inspect(
            &f.external(&Packet::tcp(CLIENT, sport, NODE, NODE_PORT, SYN).frame())
                .1,
        );
        let via_b = inspect(
            &f.external(&Packet::tcp(CLIENT, sport, NODE_B, NODE_PORT, SYN).frame())
                .1,
        );
        assert_eq!(via_a.dst, via_b.dst, "client port {sport}");
    }
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 40);
}

#[test]
fn a_slot_past_the_backend_count_falls_back_to_random_and_is_counted() {
    let mut f = Fixture::new();
    f.program(&maglev_node_port(&[NODE], Protocol::Tcp));
    let snapshot = f.maps.snapshot().unwrap();
    let (first, size) = snapshot
        .services
        .values()
        .find_map(|v| v.maglev())
        .expect("a Maglev master");
    // Damage the whole table: every slot names position 7 of a 3-backend frontend.
    let mut arena: Array<MapData, MaglevSlots> = Array::try_from(
        aya::maps::Map::from_map_data(
            MapData::from_pin(f._pins.layout().map_path(map_names::MAGLEV)).unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    for entry in first / 4..(first + size).div_ceil(4) {
        arena
            .set(entry, MaglevSlots { positions: [7; 4] }, 0)
            .unwrap();
    }
    let mine = [LOCAL_POD, OTHER_LOCAL_POD, THIRD_LOCAL_POD];
    for sport in 42_000..42_010u16 {
        let (verdict, out) = f.external(&Packet::tcp(CLIENT, sport, NODE, NODE_PORT, SYN).frame());
        assert_eq!(verdict, TC_ACT_OK);
        let dst = inspect(&out).dst;
        assert!(mine.contains(&dst), "{dst:?}");
    }
    assert_eq!(f.stat(stat::MAGLEV_MISS), 10);
    assert_eq!(f.stat(stat::TC_NEW_FLOW), 10);
}

/// ClientIP affinity applies first: a client keeps the backend it had, whatever
/// its new flows hash to.
#[test]
fn affinity_comes_before_the_table() {
    let mut f = Fixture::new();
    let mut desired = maglev_node_port(&[NODE], Protocol::Tcp);
    for spec in desired.frontends.values_mut() {
        spec.affinity_timeout_sec = Some(600);
    }
    f.program(&desired);
    let first = inspect(
        &f.external(&Packet::tcp(CLIENT, 43_000, NODE, NODE_PORT, SYN).frame())
            .1,
    );
    assert_eq!(first.dst, predicted(CLIENT, 43_000, TCP));
    let mut hashed_elsewhere = 0;
    for sport in 43_001..43_031u16 {
        let seen = inspect(
            &f.external(&Packet::tcp(CLIENT, sport, NODE, NODE_PORT, SYN).frame())
                .1,
        );
        assert_eq!(seen.dst, first.dst, "client port {sport}");
        hashed_elsewhere += u32::from(predicted(CLIENT, sport, TCP) != first.dst);
    }
    assert!(hashed_elsewhere > 0, "the ports chosen must test something");
}
