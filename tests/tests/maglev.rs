//! Maglev end to end: two nodes, each with its own agent over the same manifests and
//! the same `--maglev-seed`, a dual-stack NodePort Service with four backends on
//! both nodes. The external client connects from fixed source ports through node1
//! and then through node2, over IPv4 and over IPv6: each client flow reaches the
//! same backend either way, as the backend itself reports. (With random picks the
//! two nodes would agree only by chance, a quarter of the time; that is not
//! asserted here.)
//!
//! Both ways of turning it on, and off: on the TC path the agents keep the default
//! `--lb-algorithm random` and the Service's `service.lb/algorithm: maglev`
//! annotation chooses Maglev, while a Service without it stays random; on the XDP
//! path (`--xdp native`) the agents run `--lb-algorithm maglev` and a Service
//! annotated `random` opts out. Random Services keep answering through both nodes.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN). All traffic stays in the test's namespaces.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    node_ip, node_ip6, whoami_node_port, Cluster, ClusterBuilder, WHOAMI_PORT,
};
use lb_tests::{cargo_tools, lb_binary};

/// The same seed on both nodes, as the DaemonSet gives every agent.
const SEED: &str = "0x6c62deadbeef2026";
const PODS: [&str; 4] = ["pod-a", "pod-b", "pod-c", "pod-d"];
/// Client flows compared: request `i` leaves from `FIRST_PORT + i`.
const FLOWS: u32 = 20;
const FIRST_PORT: u16 = 45_000;
/// Flows before the counted ones leave from here on.
const WARM_UP_PORT: u16 = 44_000;
/// The Maglev Service's NodePort, and a random one's.
const MAGLEV_PORT: u16 = 30090;
const RANDOM_PORT: u16 = 30091;

/// Four backends, two on each node: `PODS[i]` on node `i % 2`.
fn four_backends() -> ClusterBuilder {
    Cluster::builder()
        .backend("pod-a", 0)
        .backend("pod-b", 1)
        .backend("pod-c", 0)
        .backend("pod-d", 1)
}

/// The two address families, each test covers both.
const FAMILIES: [bool; 2] = [false, true];

/// The IPv6 cluster IP `fd00:96::<n>` of a dual-stack Service.
fn vip6(n: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, n)
}

/// The four backends' whoami addresses, IPv6 ones when `ipv6`.
fn backends(cluster: &Cluster, ipv6: bool) -> Result<Vec<SocketAddr>> {
    PODS.iter()
        .map(|p| {
            let pod = cluster.pod(p)?;
            let ip = match ipv6 {
                true => IpAddr::V6(pod.ip6().context("dual-stack pods")?),
                false => IpAddr::V4(pod.ip()),
            };
            Ok(SocketAddr::new(ip, WHOAMI_PORT))
        })
        .collect()
}

/// The NodePort `port` on each node's address (its IPv6 one when `ipv6`).
fn via(port: u16, ipv6: bool) -> [SocketAddr; 2] {
    [0, 1].map(|n| match ipv6 {
        true => SocketAddr::new(node_ip6(n).into(), port),
        false => SocketAddr::new(node_ip(n).into(), port),
    })
}

/// Both nodes program `port` of both families with the four backends and the
/// algorithm `algorithm`.
fn ensure_algorithm(cluster: &Cluster, port: u16, algorithm: &str) -> Result<()> {
    for ipv6 in FAMILIES {
        ensure_algorithm_of(cluster, port, algorithm, ipv6)?;
    }
    Ok(())
}

fn ensure_algorithm_of(cluster: &Cluster, port: u16, algorithm: &str, ipv6: bool) -> Result<()> {
    let backends = backends(cluster, ipv6)?;
    for (n, frontend) in via(port, ipv6).into_iter().enumerate() {
        let entry = cluster.wait_frontend(n, frontend, "TCP", "internal", &backends)?;
        ensure!(
            entry.algorithm == algorithm,
            "node{}: {frontend} is {:?}, not {algorithm}",
            n + 1,
            entry.algorithm
        );
    }
    Ok(())
}

/// The same `FLOWS` client flows through node1's and node2's NodePort `port`, in
/// each family: each answered, and each reaching the same backend both times.
fn same_backend_through_either_node(cluster: &Cluster, port: u16) -> Result<()> {
    for ipv6 in FAMILIES {
        same_backend_through_either_node_of(cluster, port, ipv6)?;
    }
    Ok(())
}

fn same_backend_through_either_node_of(cluster: &Cluster, port: u16, ipv6: bool) -> Result<()> {
    let [one, two] = via(port, ipv6);
    let through1 = cluster.whoami_from(cluster.client(), one, FLOWS, FIRST_PORT)?;
    let through2 = cluster.whoami_from(cluster.client(), two, FLOWS, FIRST_PORT)?;
    for (r, frontend) in [(&through1, one), (&through2, two)] {
        ensure!(
            r.tally.answered == FLOWS && r.tally.errors.is_empty(),
            "through {frontend}: {r:#?}\n{}",
            cluster.all_stats()
        );
    }
    let mut reached = BTreeSet::new();
    for (a, b) in through1.answers.iter().zip(&through2.answers) {
        let port = |local: &str| local.parse::<SocketAddr>().map(|s| s.port());
        ensure!(
            port(&a.local)? == port(&b.local)?,
            "request order differs: {a:?} / {b:?}"
        );
        ensure!(
            a.backend == b.backend,
            "client port {}: {} through node1, {} through node2\n{}",
            port(&a.local)?,
            a.backend,
            b.backend,
            cluster.all_stats()
        );
        reached.insert(a.backend.clone());
    }
    // The flows spread over the backends (20 flows over four quarters: one backend
    // for all would be a broken table, not bad luck).
    ensure!(
        reached.len() >= 2,
        "every flow through {one} went to {reached:?}"
    );
    Ok(())
}

/// A random Service still answers through both nodes, from more than one backend.
fn random_still_serves(cluster: &Cluster, port: u16) -> Result<()> {
    for frontend in FAMILIES.into_iter().flat_map(|ipv6| via(port, ipv6)) {
        let r = cluster.whoami(
            cluster.client(),
            frontend,
            FLOWS,
            false,
            Duration::from_secs(2),
        )?;
        ensure!(
            r.tally.answered == FLOWS && r.tally.errors.is_empty(),
            "random through {frontend}: {r:#?}\n{}",
            cluster.all_stats()
        );
        let reached: BTreeSet<&str> = r.answers.iter().map(|a| a.backend.as_str()).collect();
        // 20 random picks of four: all on one has probability 4 / 4^20.
        ensure!(reached.len() >= 2, "through {frontend}: only {reached:?}");
    }
    Ok(())
}

/// `lb maglev` on both nodes, for each family's NodePort: a 509-slot table (four
/// backends), every slot one of theirs, balanced to a slot, and the same on both
/// nodes.
fn ensure_same_tables(cluster: &Cluster, port: u16) -> Result<()> {
    for ipv6 in FAMILIES {
        ensure_same_tables_of(cluster, port, ipv6)?;
    }
    Ok(())
}

fn ensure_same_tables_of(cluster: &Cluster, port: u16, ipv6: bool) -> Result<()> {
    let shares: Vec<serde_json::Value> = via(port, ipv6)
        .into_iter()
        .enumerate()
        .map(|(n, frontend)| {
            let out = cluster.node(n).agent().lb_command(&[
                "maglev",
                &format!("{frontend}/TCP"),
                "--json",
            ])?;
            Ok(serde_json::from_str(&out)?)
        })
        .collect::<Result<_>>()?;
    for s in &shares {
        ensure!(s["table"]["size"] == 509, "4 backends: 509 slots: {s}");
        let slots: Vec<u64> = s["backends"]
            .as_array()
            .map(|b| b.iter().filter_map(|b| b["slots"].as_u64()).collect())
            .unwrap_or_default();
        ensure!(
            slots.len() == 4 && slots.iter().sum::<u64>() == 509,
            "every slot to one of the four backends: {s}"
        );
        ensure!(
            slots.iter().all(|&n| (127..=128).contains(&n)),
            "509 / 4 slots each, or one more: {s}"
        );
    }
    ensure!(
        same_shares(&shares[0], &shares[1]),
        "the nodes' tables differ: {shares:?}"
    );
    Ok(())
}

/// Both listings give every backend (address and port) the same slots.
fn same_shares(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    let rows = |v: &serde_json::Value| -> BTreeSet<(String, u64, u64)> {
        v["backends"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r["backend"]["ip"].to_string(),
                    r["backend"]["port"].as_u64().unwrap_or_default(),
                    r["slots"].as_u64().unwrap_or_default(),
                )
            })
            .collect()
    };
    rows(a) == rows(b)
}

fn ensure_no_miss(cluster: &Cluster) -> Result<()> {
    for n in 0..2 {
        ensure!(
            cluster.stat(n, "maglev_miss")? == 0,
            "{}",
            cluster.all_stats()
        );
    }
    Ok(())
}

/// TC path, agents at the default `--lb-algorithm random`: the annotation turns
/// Maglev on for its Service only; the cluster IP and the other Service stay random.
#[test]
fn a_client_flow_reaches_the_same_backend_through_either_node() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = four_backends().build(cargo_tools!())?;
    let consistent = whoami_node_port("consistent", Ipv4Addr::new(10, 96, 0, 60), MAGLEV_PORT)
        .dual_stack(vip6(0x60))
        .with_annotation("service.lb/algorithm", "maglev");
    let plain =
        whoami_node_port("plain", Ipv4Addr::new(10, 96, 0, 61), RANDOM_PORT).dual_stack(vip6(0x61));
    cluster.publish(&consistent, &PODS)?;
    cluster.publish(&plain, &PODS)?;
    cluster.start_agents(&lb, |_| vec!["--maglev-seed".into(), SEED.into()])?;
    ensure_algorithm(&cluster, MAGLEV_PORT, "maglev")?;
    ensure_algorithm(&cluster, RANDOM_PORT, "random")?;
    // The cluster IPs of the Maglev Service stay random.
    let listing = cluster.node(0).agent().services_json()?;
    for ip in [
        IpAddr::from(Ipv4Addr::new(10, 96, 0, 60)),
        vip6(0x60).into(),
    ] {
        let vip = listing
            .iter()
            .find(|e| e.is(ip, 80, "TCP"))
            .expect("the cluster IPs are programmed with the NodePorts");
        ensure!(vip.algorithm == "random", "cluster IP: {vip:?}");
    }

    same_backend_through_either_node(&cluster, MAGLEV_PORT)?;
    ensure_no_miss(&cluster)?;
    ensure_same_tables(&cluster, MAGLEV_PORT)?;
    random_still_serves(&cluster, RANDOM_PORT)?;
    Ok(())
}

/// XDP path (`--xdp native` on the uplinks), agents at `--lb-algorithm maglev`:
/// the flag turns Maglev on for a Service without the annotation; `random` in the
/// annotation opts a Service out. The compared flows are new flows in XDP on
/// both nodes.
#[test]
fn through_xdp_a_client_flow_reaches_the_same_backend_through_either_node() -> Result<()> {
    let lb = lb_binary()?;
    let mut cluster = four_backends().xdp_ready().build(cargo_tools!())?;
    let consistent = whoami_node_port("consistent", Ipv4Addr::new(10, 96, 0, 70), MAGLEV_PORT)
        .dual_stack(vip6(0x70));
    let opted_out = whoami_node_port("opted-out", Ipv4Addr::new(10, 96, 0, 71), RANDOM_PORT)
        .dual_stack(vip6(0x71))
        .with_annotation("service.lb/algorithm", "random");
    cluster.publish(&consistent, &PODS)?;
    cluster.publish(&opted_out, &PODS)?;
    cluster.start_agents(&lb, |_| {
        [
            "--xdp",
            "native",
            "--lb-algorithm",
            "maglev",
            "--maglev-seed",
            SEED,
        ]
        .map(String::from)
        .to_vec()
    })?;
    ensure_algorithm(&cluster, MAGLEV_PORT, "maglev")?;
    ensure_algorithm(&cluster, RANDOM_PORT, "random")?;
    // Each node learns its neighbours first (the client, the other node): a first
    // packet whose next hop is not resolved goes to TC by design, and is not what
    // the counted flows are about. Flows from other ports than the counted ones,
    // until both nodes' pods answered through each node.
    for frontend in FAMILIES.into_iter().flat_map(|ipv6| via(MAGLEV_PORT, ipv6)) {
        let r = cluster.whoami_from(cluster.client(), frontend, 16, WARM_UP_PORT)?;
        let nodes: BTreeSet<usize> = r
            .answers
            .iter()
            .filter_map(|a| PODS.iter().position(|p| *p == a.backend))
            .map(|i| i % 2)
            .collect();
        ensure!(
            nodes.len() == 2,
            "warm-up through {frontend} did not reach both nodes' pods: {r:#?}"
        );
    }
    let before: Vec<u64> = (0..2)
        .map(|n| cluster.stat(n, "xdp_new_flow"))
        .collect::<Result<_>>()?;

    same_backend_through_either_node(&cluster, MAGLEV_PORT)?;
    for (n, then) in before.into_iter().enumerate() {
        let now = cluster.stat(n, "xdp_new_flow")?;
        ensure!(
            now >= then + 2 * u64::from(FLOWS),
            "node{}: xdp_new_flow went from {then} to {now}, expected +{FLOWS} per family\n{}",
            n + 1,
            cluster.all_stats()
        );
    }
    ensure_no_miss(&cluster)?;
    ensure_same_tables(&cluster, MAGLEV_PORT)?;
    random_still_serves(&cluster, RANDOM_PORT)?;
    Ok(())
}
