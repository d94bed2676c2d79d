//! NetworkPolicy through BPF_PROG_TEST_RUN: `lb_tc_to_pod` (what reaches a local
//! pod: its ingress policy) and `lb_tc_internal` (what leaves it: its egress
//! policy, judged on the backend after the Service path). The policy maps are
//! written here as the agent's compiler would leave them: a local pod's endpoint
//! entry, every pod's identity, CIDR classes, allows by (endpoint, peer,
//! direction, protocol, port prefix).

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap as AyaHashMap, Map, MapData, PerCpuArray};
use lb_common::policy::{
    POLICY_CIDR_CLASS, POLICY_CIDR_V4_PREFIX_BASE, POLICY_DIR_EGRESS, POLICY_DIR_INGRESS,
    POLICY_ENFORCE_EGRESS, POLICY_ENFORCE_INGRESS, POLICY_ID_HOST, POLICY_PREFIX_ANY_PROTO,
    POLICY_PREFIX_FULL,
};
use lb_common::{
    map_names, IpAddrBe, PolicyAllow, PolicyCidrKey, PolicyCounters, PolicyEndpoint, PolicyKey,
    PolicySettings,
};

use super::cluster_ip::{cluster_ip, VIP};
use super::*;

/// LOCAL_POD's endpoint id.
const EP: u32 = 1;
const ID_OTHER_LOCAL: u32 = 300;
const ID_REMOTE: u32 = 301;
const ICMP: u8 = 1;

fn enforcing() -> Fixture {
    Fixture::with(ProgramSettings {
        maglev_seed: MAGLEV_SEED,
        policy: PolicySettings { enabled: 1 },
        ..ProgramSettings::default()
    })
}

fn v4(ip: [u8; 4]) -> IpAddrBe {
    IpAddrBe::from_v4(u32::from_ne_bytes(ip))
}

fn pinned(f: &Fixture, name: &str) -> Map {
    Map::from_map_data(MapData::from_pin(f._pins.layout().map_path(name)).unwrap()).unwrap()
}

impl Fixture {
    /// LOCAL_POD is selected by policies for `flags` (`POLICY_ENFORCE_*`); the
    /// other pods have their identities; this node's address is the host.
    fn select_local_pod(&self, flags: u32) {
        let mut endpoints: AyaHashMap<MapData, IpAddrBe, PolicyEndpoint> =
            AyaHashMap::try_from(pinned(self, map_names::POLICY_ENDPOINTS)).unwrap();
        endpoints
            .insert(v4(LOCAL_POD), PolicyEndpoint { id: EP, flags }, 0)
            .unwrap();
        let mut ids: AyaHashMap<MapData, IpAddrBe, u32> =
            AyaHashMap::try_from(pinned(self, map_names::POLICY_IDENTITY)).unwrap();
        for (ip, id) in [
            (OTHER_LOCAL_POD, ID_OTHER_LOCAL),
            (REMOTE_POD, ID_REMOTE),
            (LOCAL_POD, 302),
            (NODE, POLICY_ID_HOST),
        ] {
            ids.insert(v4(ip), id, 0).unwrap();
        }
    }

    /// An allow for LOCAL_POD: `peer` in `direction`, `proto` and the ports
    /// sharing the first `port_bits` bits of `port` (16: that port; with
    /// `proto` 0 and `port_bits` 0, every protocol).
    fn allow(&self, peer: u32, direction: u8, proto: u8, port: u16, port_bits: u32, rule: u32) {
        let mut trie: LpmTrie<MapData, PolicyKey, PolicyAllow> =
            LpmTrie::try_from(pinned(self, map_names::POLICY)).unwrap();
        let prefix = if proto == 0 {
            POLICY_PREFIX_ANY_PROTO
        } else {
            POLICY_PREFIX_FULL - 16 + port_bits
        };
        let key = PolicyKey {
            endpoint: EP,
            peer,
            direction,
            proto,
            port_be: port.to_be_bytes(),
        };
        trie.insert(&Key::new(prefix, key), PolicyAllow { rule, _pad: 0 }, 0)
            .unwrap();
    }

    /// `cidr` (IPv4 `a.b.c.d/n`) is CIDR class `class`.
    fn cidr_class(&self, ip: [u8; 4], len: u32, class: u32) {
        let mut trie: LpmTrie<MapData, PolicyCidrKey, u32> =
            LpmTrie::try_from(pinned(self, map_names::POLICY_CIDRS)).unwrap();
        let key = PolicyCidrKey { address: v4(ip) };
        trie.insert(&Key::new(POLICY_CIDR_V4_PREFIX_BASE + len, key), class, 0)
            .unwrap();
    }

    fn to_pod(&self, frame: &[u8]) -> u32 {
        self.run(program_names::TC_TO_POD, frame).0
    }

    /// LOCAL_POD's drops (ingress, egress), summed over CPUs.
    fn drops(&self) -> (u64, u64) {
        let drops: PerCpuArray<MapData, PolicyCounters> =
            PerCpuArray::try_from(pinned(self, map_names::POLICY_DROPS)).unwrap();
        let per_cpu = drops.get(&EP, 0).unwrap();
        per_cpu.iter().fold((0, 0), |(i, e), c| {
            (i + c.ingress_drops, e + c.egress_drops)
        })
    }
}

fn syn(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
    Packet::tcp(src, sport, dst, dport, SYN).frame()
}

/// An ICMP echo request (`kind` 8) or reply (0) with identifier `id`.
fn echo(src: [u8; 4], dst: [u8; 4], kind: u8, id: u16) -> Vec<u8> {
    let mut icmp = vec![kind, 0, 0, 0, (id >> 8) as u8, id as u8, 0, 1];
    let c = checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());
    ipv4_frame(src, dst, ICMP, &[], 0, &icmp)
}

#[test]
fn a_pod_selected_for_ingress_admits_only_what_an_allow_names() {
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS);
    f.allow(ID_OTHER_LOCAL, POLICY_DIR_INGRESS, TCP, 8080, 16, 7);
    assert_eq!(
        f.to_pod(&syn(OTHER_LOCAL_POD, 40000, LOCAL_POD, 8080)),
        TC_ACT_OK
    );
    assert_eq!(f.stat(stat::POLICY_ALLOWED), 1);
    // Another peer, another port, another protocol: dropped and counted.
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 40000, LOCAL_POD, 8080)),
        TC_ACT_SHOT
    );
    assert_eq!(
        f.to_pod(&syn(OTHER_LOCAL_POD, 40001, LOCAL_POD, 8081)),
        TC_ACT_SHOT
    );
    let udp = Packet::udp(OTHER_LOCAL_POD, 40002, LOCAL_POD, 8080).frame();
    assert_eq!(f.to_pod(&udp), TC_ACT_SHOT);
    assert_eq!(f.drops(), (3, 0));
    assert_eq!(f.stat(stat::POLICY_INGRESS_DROP), 3);
    // The admitted flow goes on both ways: the pod's answer leaves (its egress is
    // not enforced) and the client's next segment comes in.
    let answer = Packet::tcp(LOCAL_POD, 8080, OTHER_LOCAL_POD, 40000, SYN | ACK);
    assert_eq!(f.internal(&answer.frame()).0, TC_ACT_OK);
    let ack = Packet::tcp(OTHER_LOCAL_POD, 40000, LOCAL_POD, 8080, ACK);
    assert_eq!(f.to_pod(&ack.frame()), TC_ACT_OK);
    // A pod no policy selects is open.
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 40003, OTHER_LOCAL_POD, 9)),
        TC_ACT_OK
    );
}

#[test]
fn the_replies_of_a_pod_s_own_connections_pass_its_ingress_policy() {
    let f = enforcing();
    // Deny all ingress: no allow at all.
    f.select_local_pod(POLICY_ENFORCE_INGRESS);
    assert_eq!(
        f.internal(&syn(LOCAL_POD, 41000, REMOTE_POD, 80)).0,
        TC_ACT_OK
    );
    let answer = Packet::tcp(REMOTE_POD, 80, LOCAL_POD, 41000, SYN | ACK);
    assert_eq!(f.to_pod(&answer.frame()), TC_ACT_OK);
    // The same peer opening a connection of its own is refused.
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 41001, LOCAL_POD, 80)),
        TC_ACT_SHOT
    );
    assert_eq!(f.drops(), (1, 0));
}

#[test]
fn egress_is_judged_on_the_backend_after_service_translation() {
    let mut f = enforcing();
    f.program(&cluster_ip(&[backend(REMOTE_POD, 8080, false)]));
    f.select_local_pod(POLICY_ENFORCE_INGRESS | POLICY_ENFORCE_EGRESS);
    // An allow for the cluster IP's port is no allow for the backend's.
    f.allow(ID_REMOTE, POLICY_DIR_EGRESS, TCP, 80, 16, 1);
    let (verdict, _) = f.internal(&syn(LOCAL_POD, 42000, VIP, 80));
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(f.drops(), (0, 1));
    assert_eq!(f.stat(stat::POLICY_EGRESS_DROP), 1);
    // The backend's port admits it: it leaves translated.
    f.allow(ID_REMOTE, POLICY_DIR_EGRESS, TCP, 8080, 16, 2);
    let (verdict, out) = f.internal(&syn(LOCAL_POD, 42001, VIP, 80));
    assert_ne!(verdict, TC_ACT_SHOT);
    assert_eq!((inspect(&out).dst, inspect(&out).dport), (REMOTE_POD, 8080));
    // Its reply, translated back where it entered the node, reaches the pod as
    // from the cluster IP, through the pod's enforced (deny-all) ingress.
    let reply = Packet::tcp(VIP, 80, LOCAL_POD, 42001, SYN | ACK);
    assert_eq!(f.to_pod(&reply.frame()), TC_ACT_OK);
    assert_eq!(f.drops(), (0, 1));
}

#[test]
fn ip_blocks_and_port_ranges_match_by_prefix() {
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS);
    let class = POLICY_CIDR_CLASS | 1;
    f.cidr_class([203, 0, 113, 0], 24, class);
    // endPort 8000-8063: the ports sharing their first 10 bits with 8000.
    f.allow(class, POLICY_DIR_INGRESS, TCP, 8000, 10, 3);
    assert_eq!(f.to_pod(&syn(CLIENT, 40000, LOCAL_POD, 8000)), TC_ACT_OK);
    assert_eq!(f.to_pod(&syn(CLIENT, 40001, LOCAL_POD, 8063)), TC_ACT_OK);
    assert_eq!(f.to_pod(&syn(CLIENT, 40002, LOCAL_POD, 8064)), TC_ACT_SHOT);
    assert_eq!(f.to_pod(&syn(CLIENT, 40003, LOCAL_POD, 7999)), TC_ACT_SHOT);
    assert_eq!(
        f.to_pod(&syn([198, 51, 100, 1], 40004, LOCAL_POD, 8000)),
        TC_ACT_SHOT
    );
    // A pod's address inside the block matches it too (REMOTE_POD is in no block
    // here: refused).
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 40005, LOCAL_POD, 8000)),
        TC_ACT_SHOT
    );
    f.cidr_class([10, 244, 2, 0], 24, class);
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 40006, LOCAL_POD, 8000)),
        TC_ACT_OK
    );
}

#[test]
fn ping_needs_a_rule_without_ports_and_its_reply_follows() {
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS | POLICY_ENFORCE_EGRESS);
    f.allow(ID_REMOTE, POLICY_DIR_INGRESS, TCP, 80, 16, 1);
    assert_eq!(f.to_pod(&echo(REMOTE_POD, LOCAL_POD, 8, 77)), TC_ACT_SHOT);
    f.allow(ID_REMOTE, POLICY_DIR_INGRESS, 0, 0, 0, 2);
    assert_eq!(f.to_pod(&echo(REMOTE_POD, LOCAL_POD, 8, 78)), TC_ACT_OK);
    // The pod's reply leaves though its egress allows nothing.
    assert_eq!(f.internal(&echo(LOCAL_POD, REMOTE_POD, 0, 78)).0, TC_ACT_OK);
    // Its own ping does not.
    assert_eq!(
        f.internal(&echo(LOCAL_POD, REMOTE_POD, 8, 79)).0,
        TC_ACT_SHOT
    );
    assert_eq!(f.drops(), (1, 1));
}

#[test]
fn this_node_always_reaches_its_pods() {
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS);
    assert_eq!(f.to_pod(&syn(NODE, 40000, LOCAL_POD, 8080)), TC_ACT_OK);
    assert_eq!(f.drops(), (0, 0));
}

#[test]
fn an_icmp_error_about_an_admitted_flow_reaches_the_pod() {
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS | POLICY_ENFORCE_EGRESS);
    f.allow(ID_REMOTE, POLICY_DIR_EGRESS, TCP, 80, 16, 1);
    let sent = syn(LOCAL_POD, 43000, REMOTE_POD, 80);
    assert_eq!(f.internal(&sent).0, TC_ACT_OK);
    // A router on the way: fragmentation needed, quoting the pod's packet.
    let router = [192, 168, 50, 9];
    let error = icmp_error(router, LOCAL_POD, 3, 4, &sent, sent.len() - 14);
    assert_eq!(f.to_pod(&error), TC_ACT_OK);
    // About a flow the pod never had: dropped.
    let other = syn(LOCAL_POD, 43001, REMOTE_POD, 81);
    let error = icmp_error(router, LOCAL_POD, 3, 4, &other, other.len() - 14);
    assert_eq!(f.to_pod(&error), TC_ACT_SHOT);
}

#[test]
fn turned_off_the_maps_are_never_read() {
    let f = Fixture::new();
    f.select_local_pod(POLICY_ENFORCE_INGRESS | POLICY_ENFORCE_EGRESS);
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 40000, LOCAL_POD, 8080)),
        TC_ACT_OK
    );
    assert_eq!(
        f.internal(&syn(LOCAL_POD, 40000, REMOTE_POD, 80)).0,
        TC_ACT_OK
    );
    assert_eq!(f.drops(), (0, 0));
}

/// After a failed write the agent rewrites the maps from its compiler and
/// removes every entry the compiler no longer holds
/// (`PolicyMaps::remove_others`): a stale allow stops admitting its peer, and
/// what is kept still admits.
#[test]
fn a_rewrite_removes_stale_entries_and_their_allows_stop_admitting() {
    use lb_userspace::datapath::policy::{PolicyKeys, PolicyMaps};
    let f = enforcing();
    f.select_local_pod(POLICY_ENFORCE_INGRESS);
    f.allow(ID_OTHER_LOCAL, POLICY_DIR_INGRESS, TCP, 8080, 16, 7);
    // Left behind by a removal that never happened.
    f.allow(ID_REMOTE, POLICY_DIR_INGRESS, TCP, 8080, 16, 8);
    f.cidr_class([192, 0, 2, 0], 24, POLICY_CIDR_CLASS | 1);
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 41000, LOCAL_POD, 8080)),
        TC_ACT_OK
    );

    let keep = PolicyKeys {
        endpoints: [v4(LOCAL_POD)].into(),
        identities: [OTHER_LOCAL_POD, REMOTE_POD, LOCAL_POD, NODE]
            .map(v4)
            .into(),
        cidrs: Default::default(),
        allows: [(
            POLICY_PREFIX_FULL,
            PolicyKey {
                endpoint: EP,
                peer: ID_OTHER_LOCAL,
                direction: POLICY_DIR_INGRESS,
                proto: TCP,
                port_be: 8080u16.to_be_bytes(),
            },
        )]
        .into(),
    };
    let mut maps = PolicyMaps::open(f._pins.layout()).unwrap();
    assert_eq!(
        maps.remove_others(&keep).unwrap(),
        2,
        "the stale allow and class"
    );
    assert_eq!(
        maps.remove_others(&keep).unwrap(),
        0,
        "nothing is left to remove"
    );
    assert_eq!(
        f.to_pod(&syn(REMOTE_POD, 41001, LOCAL_POD, 8080)),
        TC_ACT_SHOT
    );
    assert_eq!(
        f.to_pod(&syn(OTHER_LOCAL_POD, 41002, LOCAL_POD, 8080)),
        TC_ACT_OK
    );
}

/// IPv6 extension headers are walked to the upper layer: a SYN behind hop-by-hop
/// and destination options is judged by its real port, and a later fragment
/// passes as a later IPv4 fragment does (its first was judged).
#[test]
fn ipv6_extension_headers_are_walked_to_the_port() {
    use super::ipv6::{
        options_header, Packet6, LOCAL_POD6, NEXT_DEST_OPTS, NEXT_FRAGMENT, NEXT_HOP_BY_HOP,
        REMOTE_POD6,
    };
    use lb_userspace::datapath::policy::PolicyMaps;
    let f = enforcing();
    let mut maps = PolicyMaps::open(f._pins.layout()).unwrap();
    let pod = IpAddrBe::from(std::net::IpAddr::from(LOCAL_POD6));
    let peer = IpAddrBe::from(std::net::IpAddr::from(REMOTE_POD6));
    maps.put_endpoint(
        pod,
        PolicyEndpoint {
            id: EP,
            flags: POLICY_ENFORCE_INGRESS,
        },
    )
    .unwrap();
    maps.put_identity(peer, ID_REMOTE).unwrap();
    let key = PolicyKey {
        endpoint: EP,
        peer: ID_REMOTE,
        direction: POLICY_DIR_INGRESS,
        proto: TCP,
        port_be: 8080u16.to_be_bytes(),
    };
    maps.put_allow(POLICY_PREFIX_FULL, key, PolicyAllow { rule: 3, _pad: 0 })
        .unwrap();
    let syn = |sport, dport| {
        Packet6::tcp(REMOTE_POD6, sport, LOCAL_POD6, dport, SYN)
            .with_ext(NEXT_HOP_BY_HOP, options_header())
            .with_ext(NEXT_DEST_OPTS, options_header())
            .frame()
    };
    assert_eq!(f.to_pod(&syn(42000, 8080)), TC_ACT_OK);
    assert_eq!(f.to_pod(&syn(42001, 8081)), TC_ACT_SHOT);
    assert_eq!(f.drops(), (1, 0));
    // Offset 1 (8 bytes in), more fragments: a later fragment.
    let later = Packet6::tcp(REMOTE_POD6, 42002, LOCAL_POD6, 9999, SYN)
        .with_ext(NEXT_FRAGMENT, vec![0, 0, 0, 0x09, 0, 0, 0, 7])
        .frame();
    assert_eq!(f.to_pod(&later), TC_ACT_OK);
}
