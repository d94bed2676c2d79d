//! End-to-end tests of direct server return (`lb agent --lb-mode dsr`) on the
//! two-node cluster of `lb_tests::cluster`: the external client reaches node1's
//! NodePorts, whose backend (pod-b) runs on node2. With DSR pod-b sees the client's
//! own address, node2 sends the replies to the client itself from the NodePort,
//! and node1 (the entry node) carries only the client's packets: the switch port
//! towards node1 counts no more frames than the client sent.
//!
//! Every case runs TCP and UDP whoami requests and a bulk transfer whose bytes the
//! probe checks, both families. The client sends its TCP segments at their real
//! size (no segmentation offload), so a segment the outer header of `ipip` would
//! push over the MTU is dropped on the way: the bulk transfer completes only
//! because node2 lowered the MSS pod-b announced.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    node_ip, node_ip6, Cluster, BULK_PORT, CLIENT_IP, CLIENT_IP6, WHOAMI_PORT,
};
use lb_tests::manifests::{Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::{cargo_tools, lb_binary, ECHO_TCP_PORT};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const REQUESTS: u32 = 10;
const BULK_BYTES: u64 = 8 << 20;
/// Frames node1 may receive beyond the client's over a case: neighbour
/// discovery the switch floods (node2 asking for the client), nothing more.
const SLACK: u64 = 20;

/// The NodePorts of one family: whoami TCP, whoami UDP, bulk TCP.
struct Ports {
    tcp: u16,
    udp: u16,
    bulk: u16,
}

const PORTS4: Ports = Ports {
    tcp: 30180,
    udp: 30181,
    bulk: 30182,
};
const PORTS6: Ports = Ports {
    tcp: 30183,
    udp: 30184,
    bulk: 30185,
};

fn service(name: &str, vip: Ipv4Addr, ports: &Ports) -> Service {
    Service::new(
        name,
        vip,
        vec![
            ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(ports.tcp.into()),
            ServicePort::udp("whoami-udp", 80, WHOAMI_PORT.into()).with_node_port(ports.udp.into()),
            ServicePort::tcp("bulk", 81, BULK_PORT.into()).with_node_port(ports.bulk.into()),
        ],
    )
    .node_port()
}

/// The cluster with pod-b on node2, both families' Services published, agents
/// started with `args`; the client's segments at their real size.
fn setup(xdp: bool, args: Vec<String>) -> Result<Cluster> {
    let lb = lb_binary()?;
    let mut builder = Cluster::builder().backend("pod-b", 1);
    if xdp {
        builder = builder.xdp_ready();
    }
    let mut cluster = builder.build(cargo_tools!())?;
    // (xdp_ready turned it off already.)
    if !xdp {
        lb_tests::xdp::tx_checksum_off(cluster.client(), "eth0")?;
    }
    cluster.publish(
        &service("dsr4", Ipv4Addr::new(10, 96, 0, 80), &PORTS4),
        &["pod-b"],
    )?;
    cluster.publish(
        &service("dsr6", Ipv4Addr::new(10, 96, 9, 9), &PORTS6)
            .ipv6_only(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 80)),
        &["pod-b"],
    )?;
    cluster.start_agents(&lb, move |_| args.clone())?;
    Ok(cluster)
}

fn dsr_args(dispatch: &str, xdp: bool) -> Vec<String> {
    let mut args: Vec<String> = ["--lb-mode", "dsr", "--dsr-dispatch", dispatch]
        .map(String::from)
        .to_vec();
    if xdp {
        args.extend(["--xdp".to_string(), "native".to_string()]);
    }
    args
}

/// Interface counter `what` ("packets", "bytes") of `dev` in `ns`, received and
/// sent.
fn counter(ns: &NetNs, dev: &str, what: &str) -> Result<(u64, u64)> {
    let out = ns.ip(&["-s", "-j", "link", "show", dev])?;
    let json: serde_json::Value = serde_json::from_str(&out).context("ip -s -j link")?;
    let stats = &json[0]["stats64"];
    let get = |dir: &str| {
        stats[dir][what]
            .as_u64()
            .with_context(|| format!("no {dir} {what} for {dev}: {out}"))
    };
    Ok((get("rx")?, get("tx")?))
}

/// What crossed the switch: frames it delivered to node1, frames the client sent
/// and received, and the bytes it received. (A frame may carry many segments: veths
/// hand GSO packets over whole.)
#[derive(Clone, Copy, Debug)]
struct Crossings {
    to_node1: u64,
    client_sent: u64,
    client_received: u64,
    client_received_bytes: u64,
}

impl Crossings {
    fn read(cluster: &Cluster) -> Result<Self> {
        let (_, to_node1) = counter(cluster.switch(), "sw-node1", "packets")?;
        let (client_received, client_sent) = counter(cluster.client(), "eth0", "packets")?;
        let (client_received_bytes, _) = counter(cluster.client(), "eth0", "bytes")?;
        Ok(Crossings {
            to_node1,
            client_sent,
            client_received,
            client_received_bytes,
        })
    }

    fn since(self, before: Crossings) -> Crossings {
        Crossings {
            to_node1: self.to_node1 - before.to_node1,
            client_sent: self.client_sent - before.client_sent,
            client_received: self.client_received - before.client_received,
            client_received_bytes: self.client_received_bytes - before.client_received_bytes,
        }
    }
}

fn stats(cluster: &Cluster, node: usize) -> Result<BTreeMap<String, u64>> {
    cluster.node(node).agent().stats()
}

/// Counter `name` of node `node` grew by at least `n` since `before`.
fn ensure_grew(
    cluster: &Cluster,
    node: usize,
    before: &BTreeMap<String, u64>,
    name: &str,
    n: u64,
) -> Result<()> {
    let now = cluster.stat(node, name)?;
    let then = before.get(name).copied().unwrap_or(0);
    ensure!(
        now >= then + n,
        "node{}: {name} went from {then} to {now}, expected +{n}\n{}",
        node + 1,
        cluster.all_stats()
    );
    Ok(())
}

/// Whoami over TCP and UDP and a bulk transfer from the client to node1's NodePorts
/// of one family; returns what crossed the switch meanwhile. `source` is the
/// address pod-b must see.
fn exchange(cluster: &Cluster, v6: bool, source: IpAddr) -> Result<Crossings> {
    let (ports, node1): (&Ports, IpAddr) = match v6 {
        false => (&PORTS4, node_ip(0).into()),
        true => (&PORTS6, node_ip6(0).into()),
    };
    let at = |port: u16| -> SocketAddr {
        match node1 {
            IpAddr::V4(ip) => SocketAddrV4::new(ip, port).into(),
            IpAddr::V6(ip) => SocketAddrV6::new(ip, port, 0, 0).into(),
        }
    };
    let pod = cluster.pod("pod-b")?;
    let pod_ip: IpAddr = match v6 {
        false => pod.ip().into(),
        true => pod.ip6().context("dual-stack pod")?.into(),
    };
    for (port, protocol, target) in [
        (ports.tcp, "TCP", WHOAMI_PORT),
        (ports.udp, "UDP", WHOAMI_PORT),
        (ports.bulk, "TCP", BULK_PORT),
    ] {
        cluster.wait_frontend(
            0,
            at(port),
            protocol,
            "internal",
            &[SocketAddr::new(pod_ip, target)],
        )?;
    }
    // Neighbours learned on the way (node1 -> node2, node2 -> client) before the
    // counted exchange.
    let warm = cluster.whoami(cluster.client(), at(ports.tcp), 1, false, CONNECT_TIMEOUT)?;
    ensure!(
        warm.tally.answered == 1,
        "warm-up: {warm:#?}\n{}",
        cluster.all_stats()
    );

    let before = Crossings::read(cluster)?;
    for udp in [false, true] {
        let to = at(if udp { ports.udp } else { ports.tcp });
        let r = cluster.whoami(cluster.client(), to, REQUESTS, udp, CONNECT_TIMEOUT)?;
        ensure!(
            r.tally.answered == REQUESTS && r.tally.errors.is_empty(),
            "{to} (udp: {udp}): {r:#?}\n{}",
            cluster.all_stats()
        );
        ensure!(
            r.seen_ips("pod-b") == [source].into(),
            "{to}: pod-b must see {source}: {r:#?}"
        );
        ensure!(
            r.peers() == [to.to_string().as_str()].into(),
            "{to}: the client must be answered from the NodePort: {r:#?}"
        );
    }
    let to = at(ports.bulk);
    let r = cluster.bulk(cluster.client(), to, BULK_BYTES, 7)?;
    ensure!(
        r.complete(BULK_BYTES),
        "{to}: bulk transfer: {r:#?}\n{}",
        cluster.all_stats()
    );
    ensure!(
        r.backend == "pod-b" && r.peer == to.to_string(),
        "{to}: {r:#?}"
    );
    Ok(Crossings::read(cluster)?.since(before))
}

/// One DSR case: both families; pod-b sees the client, the client is answered
/// from the NodePort, node1 receives nothing but the client's frames, and the
/// counters of both nodes say DSR carried it.
fn dsr_case(dispatch: &str, xdp: bool) -> Result<()> {
    let cluster = setup(xdp, dsr_args(dispatch, xdp))?;
    for (v6, client) in [(false, IpAddr::from(CLIENT_IP)), (true, CLIENT_IP6.into())] {
        let entry_before = stats(&cluster, 0)?;
        let backend_before = stats(&cluster, 1)?;
        let crossed = exchange(&cluster, v6, client)?;
        ensure!(
            crossed.to_node1 <= crossed.client_sent + SLACK,
            "v6 {v6}: node1 received {} frames, the client sent {}: replies crossed node1 \
             ({crossed:?})\n{}",
            crossed.to_node1,
            crossed.client_sent,
            cluster.all_stats()
        );
        // The replies did reach the client: the bulk transfer's echo alone.
        ensure!(crossed.client_received_bytes > BULK_BYTES, "{crossed:?}");
        // Per connection: one SYN (and every datagram) carried the frontend.
        ensure_grew(
            &cluster,
            0,
            &entry_before,
            "dsr_encapsulated",
            u64::from(2 * REQUESTS),
        )?;
        ensure_grew(
            &cluster,
            1,
            &backend_before,
            "dsr_decapsulated",
            u64::from(2 * REQUESTS),
        )?;
        // Every reply packet (a GSO packet counts once): at least a SYN-ACK, the
        // answer and a FIN per TCP request, an answer per datagram.
        ensure_grew(
            &cluster,
            1,
            &backend_before,
            "dsr_reply_rewritten",
            u64::from(4 * REQUESTS),
        )?;
        if dispatch == "ipip" {
            // The SYN-ACK of every TCP connection (warm-up, whoami, bulk).
            ensure_grew(
                &cluster,
                1,
                &backend_before,
                "dsr_mss_clamped",
                u64::from(REQUESTS) + 2,
            )?;
        }
        if xdp {
            // The client's bulk segments left node1 from its driver.
            ensure_grew(&cluster, 0, &entry_before, "xdp_tx", 1000)?;
        }
    }
    Ok(())
}

/// `--dsr-dispatch opt`: the frontend in an IPv4 option / IPv6 destination
/// option of each SYN and datagram.
#[test]
fn dsr_with_options_both_families() -> Result<()> {
    dsr_case("opt", false)
}

/// `--dsr-dispatch ipip`: every packet inside an outer header from node1 to node2;
/// the bulk transfer completes only with the MSS clamped.
#[test]
fn dsr_with_ipip_both_families() -> Result<()> {
    dsr_case("ipip", false)
}

/// Both dispatches with native XDP on the nodes' uplinks: node1 sends the DSR
/// packets from its driver; node2's TC takes them after its XDP passed them.
#[test]
fn dsr_through_xdp_both_dispatches() -> Result<()> {
    dsr_case("opt", true)?;
    dsr_case("ipip", true)
}

/// The default, SNAT, is unchanged: pod-b sees node1, and the replies do cross
/// node1, which the count above would see (the control of that count).
#[test]
fn snat_replies_cross_the_entry_node() -> Result<()> {
    let cluster = setup(false, Vec::new())?;
    for (v6, node1) in [
        (false, IpAddr::from(node_ip(0))),
        (true, node_ip6(0).into()),
    ] {
        let crossed = exchange(&cluster, v6, node1)?;
        ensure!(
            crossed.to_node1 >= crossed.client_sent + crossed.client_received / 2,
            "v6 {v6}: SNAT replies must come back through node1: {crossed:?}"
        );
    }
    let counters = stats(&cluster, 0)?;
    ensure!(
        counters
            .iter()
            .all(|(name, v)| !name.starts_with("dsr_") || *v == 0),
        "{counters:?}"
    );
    Ok(())
}

/// A LoadBalancer IP on three nodes whose three backends all run on node3.
const MOVED_LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 210);
const MOVED_PODS: [&str; 3] = ["pod-c", "pod-d", "pod-e"];
/// Connections held across the move. Were node2 to pick its own backend for a
/// moved flow (random), all would survive with probability (1/3)^12.
const HELD: usize = 12;

/// The client reaches a LoadBalancer IP through node1, then an upstream router
/// changes its mind and the same flows enter through node2 mid-stream (the route
/// to the IP is replaced). With DSR and Maglev on every node (same seed), node2
/// picks the backend node1 picked for each flow it has never seen, and node3's
/// pods keep answering the client directly: every held connection goes on, with
/// the same backend. (Cilium 27730: such a flow was reset.)
fn moved_flows_keep_their_backend(dispatch: &str) -> Result<()> {
    let lb = lb_binary()?;
    let mut builder = Cluster::builder()
        .nodes(3)
        .client_route_via_node1(MOVED_LB_IP);
    for pod in MOVED_PODS {
        builder = builder.backend(pod, 2);
    }
    let mut cluster = builder.build(cargo_tools!())?;
    lb_tests::xdp::tx_checksum_off(cluster.client(), "eth0")?;
    let svc = Service::new(
        "moved",
        Ipv4Addr::new(10, 96, 0, 90),
        vec![ServicePort::tcp("echo", 80, ECHO_TCP_PORT.into()).with_node_port(30190)],
    )
    .load_balancer([MOVED_LB_IP]);
    cluster.publish(&svc, &MOVED_PODS)?;
    let mut args = dsr_args(dispatch, false);
    args.extend(
        [
            "--lb-algorithm",
            "maglev",
            "--maglev-seed",
            "0x6c62deadbeef2026",
        ]
        .map(String::from),
    );
    cluster.start_agents(&lb, move |_| args.clone())?;
    let backends: Vec<SocketAddr> = MOVED_PODS
        .iter()
        .map(|p| Ok(SocketAddr::new(cluster.pod(p)?.ip().into(), ECHO_TCP_PORT)))
        .collect::<Result<_>>()?;
    let frontend = SocketAddrV4::new(MOVED_LB_IP, 80);
    for node in 0..2 {
        cluster.wait_frontend(node, frontend, "TCP", "internal", &backends)?;
    }
    // Neighbours learned first (node1 and node2 -> node3, node3 -> the client),
    // through each entry node's NodePort.
    for node in 0..2 {
        let to = SocketAddrV4::new(node_ip(node), 30190);
        let r = cluster.tcp(cluster.client(), to, 3, CONNECT_TIMEOUT)?;
        ensure!(
            r.tally.answered == 3,
            "warm-up through {to}: {r:#?}\n{}",
            cluster.all_stats()
        );
    }

    let mut held = Vec::with_capacity(HELD);
    for _ in 0..HELD {
        held.push(cluster.hold(cluster.client(), frontend)?);
    }
    for (i, h) in held.iter_mut().enumerate() {
        let reply = h.echo(&format!("before {i}"))?;
        ensure!(reply == format!("{} before {i}", h.backend), "{reply}");
    }
    let spread: std::collections::BTreeSet<&str> =
        held.iter().map(|h| h.backend.as_str()).collect();
    ensure!(spread.len() >= 2, "every held flow went to {spread:?}");
    let node2_before = stats(&cluster, 1)?;

    cluster.client().ip(&[
        "route",
        "replace",
        &format!("{MOVED_LB_IP}/32"),
        "via",
        &node_ip(1).to_string(),
    ])?;
    for (i, h) in held.iter_mut().enumerate() {
        let reply = h.echo(&format!("after {i}")).with_context(|| {
            format!(
                "held connection {i} to {} after the move\n{}",
                h.backend,
                cluster.all_stats()
            )
        })?;
        ensure!(
            reply == format!("{} after {i}", h.backend),
            "held connection {i}: {reply} (greeted by {})",
            h.backend
        );
    }
    // node2 did carry them, as new flows it sent to node3 by DSR.
    ensure_grew(&cluster, 1, &node2_before, "tc_new_flow", HELD as u64)?;
    for h in held {
        h.close()?;
    }
    Ok(())
}

#[test]
fn a_flow_moved_to_another_entry_node_keeps_its_backend_with_options() -> Result<()> {
    moved_flows_keep_their_backend("opt")
}

#[test]
fn a_flow_moved_to_another_entry_node_keeps_its_backend_with_ipip() -> Result<()> {
    moved_flows_keep_their_backend("ipip")
}
