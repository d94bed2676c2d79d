//! kube-proxy's cluster-IP masquerade rules on the per-packet path: a pod keeps its
//! address towards a remote backend and the reply is translated back where it
//! enters; a source outside the cluster's pod CIDRs gets the node's address, a
//! local backend included; so does a pod that reaches itself (hairpin). While no
//! pod CIDR is known, the device decides: a pod's is inside, a node-facing one
//! outside.

use lb_userspace::datapath::masquerade::{MasqCidrs, MasqMaps};

use super::*;

pub(super) const VIP: [u8; 4] = [10, 96, 0, 10];

/// The cluster IP VIP:80 with `backends`.
pub(super) fn cluster_ip(backends: &[BackendAddr]) -> DesiredState {
    let mut desired = DesiredState::default();
    desired.frontends.insert(
        Frontend::internal(Ipv4Addr::from(VIP).into(), 80, Protocol::Tcp),
        FrontendSpec {
            service: "default/web:http".into(),
            backends: backends.iter().copied().collect::<BTreeSet<_>>().into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: true,
        },
    );
    desired
}

/// Tells the programs the cluster's pod CIDRs, as the agent does from the Nodes.
fn know_pod_cidrs(f: &Fixture, cidrs: &[&str]) {
    let mut maps = MasqMaps::open(f._pins.layout()).expect("open the masquerade maps");
    let wanted = MasqCidrs {
        cluster: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        ..MasqCidrs::default()
    };
    maps.sync_cidrs(&wanted).expect("write the cluster set");
}

#[test]
fn a_pod_keeps_its_address_towards_a_remote_backend_and_the_reply_comes_back() {
    for known in [false, true] {
        let mut f = Fixture::new();
        if known {
            know_pod_cidrs(&f, &["10.244.0.0/16"]);
        }
        f.program(&cluster_ip(&[backend(REMOTE_POD, 8080, false)]));
        let syn = Packet::tcp(LOCAL_POD, 40001, VIP, 80, SYN);
        let out = inspect(&f.internal(&syn.frame()).1);
        let to_backend = Seen {
            src: LOCAL_POD,
            sport: 40001,
            dst: REMOTE_POD,
            dport: 8080,
        };
        assert_eq!(out, to_backend, "pod CIDRs known: {known}");
        // Routed to the pod's node, the reply enters on the node-facing device.
        let reply = Packet::tcp(REMOTE_POD, 8080, LOCAL_POD, 40001, SYN | ACK);
        let back = Seen {
            src: VIP,
            sport: 80,
            dst: LOCAL_POD,
            dport: 40001,
        };
        assert_eq!(
            inspect(&f.external(&reply.frame()).1),
            back,
            "known: {known}"
        );
    }
}

#[test]
fn a_source_outside_the_pod_cidrs_gets_the_node_address_towards_a_local_backend_too() {
    // Known CIDRs: the source decides, whichever device it came in on.
    let mut f = Fixture::new();
    know_pod_cidrs(&f, &["10.244.0.0/16"]);
    f.program(&cluster_ip(&[backend(LOCAL_POD, 8080, true)]));
    let from_outside = Packet::tcp(CLIENT, 40001, VIP, 80, SYN);
    let out = inspect(&f.external(&from_outside.frame()).1);
    assert_eq!((out.src, out.dst), (NODE, LOCAL_POD));
    // The local backend answers the node; the client gets the VIP back.
    let reply = Packet::tcp(LOCAL_POD, 8080, NODE, out.sport, SYN | ACK);
    let back = inspect(&f.internal(&reply.frame()).1);
    assert_eq!(
        (back.src, back.sport, back.dst, back.dport),
        (VIP, 80, CLIENT, 40001)
    );
    // A pod of the cluster coming in over a node-facing device (another node's,
    // routed here) is inside.
    let from_pod = Packet::tcp(REMOTE_POD, 40002, VIP, 80, SYN);
    assert_eq!(inspect(&f.external(&from_pod.frame()).1).src, REMOTE_POD);

    // Nothing known: a node-facing device means outside, a pod's inside.
    let mut f = Fixture::new();
    f.program(&cluster_ip(&[backend(LOCAL_POD, 8080, true)]));
    let out = inspect(&f.external(&from_outside.frame()).1);
    assert_eq!((out.src, out.dst), (NODE, LOCAL_POD));
    let from_local_pod = Packet::tcp(OTHER_LOCAL_POD, 40003, VIP, 80, SYN);
    assert_eq!(
        inspect(&f.internal(&from_local_pod.frame()).1).src,
        OTHER_LOCAL_POD
    );
}

#[test]
fn a_pod_reaching_itself_through_its_service_gets_the_node_address() {
    let mut f = Fixture::new();
    know_pod_cidrs(&f, &["10.244.0.0/16"]);
    f.program(&cluster_ip(&[backend(LOCAL_POD, 8080, true)]));
    let syn = Packet::tcp(LOCAL_POD, 40001, VIP, 80, SYN);
    let out = inspect(&f.internal(&syn.frame()).1);
    assert_eq!((out.src, out.dst, out.dport), (NODE, LOCAL_POD, 8080));
    let reply = Packet::tcp(LOCAL_POD, 8080, NODE, out.sport, SYN | ACK);
    let back = inspect(&f.internal(&reply.frame()).1);
    assert_eq!(
        (back.src, back.sport, back.dst, back.dport),
        (VIP, 80, LOCAL_POD, 40001)
    );
}
