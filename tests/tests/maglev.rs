//! Maglev end to end: two nodes, each with its own agent over the same manifests,
//! a NodePort Service annotated `service.lb/algorithm: maglev` with four backends
//! on both nodes. The external client connects from fixed source ports through
//! node1 and then through node2: each client flow reaches the same backend either
//! way, as the backend itself reports. (With random picks the two nodes would
//! agree only by chance, a quarter of the time; that is not asserted here.)
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN). All traffic stays in the test's namespaces.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4};

use anyhow::{ensure, Result};
use lb_tests::cluster::{node_ip, whoami_node_port, Cluster, WHOAMI_PORT};
use lb_tests::{cargo_tools, lb_binary};

/// The same seed on both nodes, as the DaemonSet gives every agent.
const SEED: &str = "0x6c62deadbeef2026";
const PODS: [&str; 4] = ["pod-a", "pod-b", "pod-c", "pod-d"];
/// Client flows compared: request `i` leaves from `FIRST_PORT + i`.
const FLOWS: u32 = 20;
const FIRST_PORT: u16 = 45_000;

#[test]
fn a_client_flow_reaches_the_same_backend_through_either_node() -> Result<()> {
    let lb = lb_binary()?;
    let builder = Cluster::builder()
        .backend("pod-a", 0)
        .backend("pod-b", 1)
        .backend("pod-c", 0)
        .backend("pod-d", 1);
    let mut cluster = builder.build(cargo_tools!())?;
    let svc = whoami_node_port("consistent", Ipv4Addr::new(10, 96, 0, 60), 30090)
        .with_annotation("service.lb/algorithm", "maglev");
    cluster.publish(&svc, &PODS)?;
    // The agents' default stays random: the annotation chooses Maglev.
    cluster.start_agents(&lb, |_| vec!["--maglev-seed".into(), SEED.into()])?;
    let backends: Vec<SocketAddrV4> = PODS
        .iter()
        .map(|p| Ok(SocketAddrV4::new(cluster.pod(p)?.ip(), WHOAMI_PORT)))
        .collect::<Result<_>>()?;
    let via: Vec<SocketAddrV4> = (0..2)
        .map(|n| SocketAddrV4::new(node_ip(n), 30090))
        .collect();
    for (n, frontend) in via.iter().enumerate() {
        let entry = cluster.wait_frontend(n, *frontend, "TCP", "internal", &backends)?;
        ensure!(
            entry.algorithm == "maglev",
            "node{}: {frontend} is {:?}, not maglev",
            n + 1,
            entry.algorithm
        );
    }
    // The cluster IP stays random.
    let cluster_ip = cluster.node(0).agent().services_json()?;
    let vip = cluster_ip
        .iter()
        .find(|e| e.is(Ipv4Addr::new(10, 96, 0, 60), 80, "TCP"))
        .expect("the cluster IP is programmed with the NodePorts");
    ensure!(vip.algorithm == "random", "cluster IP: {vip:?}");

    let through1 = cluster.whoami_from(cluster.client(), via[0], FLOWS, FIRST_PORT)?;
    let through2 = cluster.whoami_from(cluster.client(), via[1], FLOWS, FIRST_PORT)?;
    for (r, frontend) in [(&through1, via[0]), (&through2, via[1])] {
        ensure!(
            r.tally.answered == FLOWS && r.tally.errors.is_empty(),
            "through {frontend}: {r:#?}\n{}",
            cluster.all_stats()
        );
    }
    let mut reached = BTreeSet::new();
    for (a, b) in through1.answers.iter().zip(&through2.answers) {
        let port = |local: &str| local.parse::<std::net::SocketAddr>().map(|s| s.port());
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
    // The flows spread over the backends (20 flows in four quarters: one backend
    // for all would be a broken table, not bad luck).
    ensure!(reached.len() >= 2, "every flow went to {reached:?}");
    for n in 0..2 {
        ensure!(
            cluster.stat(n, "maglev_miss")? == 0,
            "{}",
            cluster.all_stats()
        );
    }

    // `lb maglev` shows the table and its shares, the same on both nodes.
    let shares: Vec<serde_json::Value> = (0..2)
        .map(|n| {
            let out = cluster.node(n).agent().lb_command(&[
                "maglev",
                &format!("{}/TCP", via[n]),
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
