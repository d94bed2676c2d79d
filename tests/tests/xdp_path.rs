//! End-to-end tests of the XDP front door (`lb agent --xdp native`) on the two-node
//! cluster of `lb_tests::cluster`: the nodes' uplinks are veths, which take native
//! XDP; the network around them is made fit for it as a network of NICs is
//! (`ClusterBuilder::xdp_ready`). Each test asserts what the client and the backend
//! see and which path carried the packets (the datapath's own counters).
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::cluster::{
    bulk_node_port, node_ip, node_ip6, whoami_node_port, Cluster, ClusterBuilder, BULK_PORT,
    CLIENT_IP, CLIENT_IP6, WHOAMI_PORT,
};
use lb_tests::manifests::{Service, ServicePort};
use lb_tests::{cargo_tools, lb_binary};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

fn xdp_native(_: usize) -> Vec<String> {
    vec!["--xdp".into(), "native".into()]
}

/// pod-a on node1, pod-b on node2; the network fit for XDP on the uplinks.
fn two_backends() -> ClusterBuilder {
    Cluster::builder()
        .backend("pod-a", 0)
        .backend("pod-b", 1)
        .xdp_ready()
}

fn setup(services: &[(&Service, &[&str])], args: impl Fn(usize) -> Vec<String>) -> Result<Cluster> {
    let lb = lb_binary()?;
    let mut cluster = two_backends().build(cargo_tools!())?;
    for (svc, backends) in services {
        cluster.publish(svc, backends)?;
    }
    cluster.start_agents(&lb, args)?;
    Ok(cluster)
}

fn pod_addr(cluster: &Cluster, pod: &str, port: u16, v6: bool) -> Result<SocketAddr> {
    let p = cluster.pod(pod)?;
    Ok(match v6 {
        false => SocketAddr::V4(SocketAddrV4::new(p.ip(), port)),
        true => SocketAddr::V6(SocketAddrV6::new(p.ip6().expect("dual-stack"), port, 0, 0)),
    })
}

fn vip6(n: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, n)
}

/// One connection to `to` before the counted ones: node1 learns the neighbours on
/// the way (the client, node2). A first packet whose next hop is not resolved yet
/// goes to TC, which resolves it (`xdp_pass_no_neigh`); that is by design, and not
/// what the counted connections are about.
fn warm_up(cluster: &Cluster, to: SocketAddr, udp: bool) -> Result<()> {
    let r = cluster.whoami(cluster.client(), to, 1, udp, CONNECT_TIMEOUT)?;
    ensure!(r.tally.answered == 1, "warm-up to {to}: {r:#?}");
    Ok(())
}

/// The counters of node1 that changed between two readings, by name.
fn grew(
    cluster: &Cluster,
    before: &std::collections::BTreeMap<String, u64>,
) -> Result<Vec<String>> {
    let now = cluster.node(0).agent().stats()?;
    Ok(now
        .iter()
        .filter(|(k, v)| before.get(*k).copied().unwrap_or(0) < **v)
        .map(|(k, _)| k.clone())
        .collect())
}

/// A counter of node1 grew by at least `n`.
fn ensure_grew(
    cluster: &Cluster,
    before: &std::collections::BTreeMap<String, u64>,
    name: &str,
    n: u64,
) -> Result<()> {
    let now = cluster.stat(0, name)?;
    let then = before.get(name).copied().unwrap_or(0);
    ensure!(
        now >= then + n,
        "{name} went from {then} to {now}, expected +{n}\nbefore: {before:?}\n{}",
        cluster.all_stats()
    );
    Ok(())
}

/// NodePort TCP to a remote backend (pod-b, via node1) and to a local one (pod-a),
/// both families, with XDP on node1's uplink: the remote backend sees node1's
/// address (SNAT) and the frames leave with XDP_TX, its replies come back through
/// XDP too; the local backend sees the client's address, the frame translated in
/// XDP and handed to the stack marked, so TC passes it without a second look. The
/// client always sees the NodePort as its peer.
#[test]
fn node_ports_are_served_in_xdp_both_families() -> Result<()> {
    let remote = whoami_node_port("remote", Ipv4Addr::new(10, 96, 0, 60), 30160);
    let local = whoami_node_port("local", Ipv4Addr::new(10, 96, 0, 61), 30161);
    let remote6 =
        whoami_node_port("remote6", Ipv4Addr::new(10, 96, 9, 9), 30162).ipv6_only(vip6(60));
    let local6 = whoami_node_port("local6", Ipv4Addr::new(10, 96, 9, 9), 30163).ipv6_only(vip6(61));
    let cluster = setup(
        &[
            (&remote, &["pod-b"]),
            (&local, &["pod-a"]),
            (&remote6, &["pod-b"]),
            (&local6, &["pod-a"]),
        ],
        xdp_native,
    )?;
    let cases: [(u16, &str, IpAddr, bool); 4] = [
        (30160, "pod-b", node_ip(0).into(), false),
        (30161, "pod-a", CLIENT_IP.into(), false),
        (30162, "pod-b", node_ip6(0).into(), true),
        (30163, "pod-a", CLIENT_IP6.into(), true),
    ];
    for (port, pod, source, v6) in cases {
        let np: SocketAddr = match v6 {
            false => SocketAddrV4::new(node_ip(0), port).into(),
            true => SocketAddrV6::new(node_ip6(0), port, 0, 0).into(),
        };
        cluster.wait_frontend(
            0,
            np,
            "TCP",
            "internal",
            &[pod_addr(&cluster, pod, WHOAMI_PORT, v6)?],
        )?;
        warm_up(&cluster, np, false)?;
        let before = cluster.node(0).agent().stats()?;
        cluster
            .expect_answers(cluster.client(), np, 10, &[(pod, source)], true)
            .with_context(|| format!("{np} -> {pod}"))?;
        ensure_grew(&cluster, &before, "xdp_new_flow", 10)?;
        if pod == "pod-b" {
            // Out to pod-b and back to the client: both ways in XDP.
            ensure_grew(&cluster, &before, "xdp_tx", 20)?;
        } else {
            ensure_grew(&cluster, &before, "xdp_pass_local", 10)?;
            ensure_grew(&cluster, &before, "tc_xdp_marked", 10)?;
        }
        let tc = cluster.stat(0, "tc_new_flow")? - before.get("tc_new_flow").copied().unwrap_or(0);
        ensure!(
            tc == 0,
            "{np}: {tc} flows went through TC's lookup; grew: {:?}",
            grew(&cluster, &before)?
        );
    }
    Ok(())
}

/// UDP through a NodePort to the remote backend in XDP: every datagram is
/// answered from the NodePort, pod-b sees node1.
#[test]
fn udp_node_port_in_xdp() -> Result<()> {
    let svc = Service::new(
        "dns",
        Ipv4Addr::new(10, 96, 0, 62),
        vec![ServicePort::udp("dns", 53, WHOAMI_PORT.into()).with_node_port(30164)],
    )
    .node_port();
    let cluster = setup(&[(&svc, &["pod-b"])], xdp_native)?;
    let np = SocketAddrV4::new(node_ip(0), 30164);
    cluster.wait_frontend(
        0,
        np,
        "UDP",
        "internal",
        &[pod_addr(&cluster, "pod-b", WHOAMI_PORT, false)?],
    )?;
    warm_up(&cluster, np.into(), true)?;
    let before = cluster.node(0).agent().stats()?;
    let r = cluster.whoami(cluster.client(), np, 10, true, CONNECT_TIMEOUT)?;
    ensure!(
        r.tally.answered == 10 && r.tally.errors.is_empty(),
        "{r:#?}\n{}",
        cluster.all_stats()
    );
    ensure!(r.peers() == [np.to_string().as_str()].into(), "{r:#?}");
    ensure!(
        r.seen_ips("pod-b") == [IpAddr::from(node_ip(0))].into(),
        "{r:#?}"
    );
    ensure_grew(&cluster, &before, "xdp_tx", 20)?;
    Ok(())
}

/// Bulk TCP to the remote backend through XDP, both families: every byte comes
/// back as sent (the probe checks the stream), so XDP's incremental checksums hold
/// on full-sized segments both ways.
#[test]
fn bulk_transfer_through_xdp_is_byte_exact() -> Result<()> {
    const BYTES: u64 = 32 << 20;
    let bulk = bulk_node_port;
    let v4 = bulk("bulk4", Ipv4Addr::new(10, 96, 0, 63), 30165);
    let v6 = bulk("bulk6", Ipv4Addr::new(10, 96, 9, 9), 30166).ipv6_only(vip6(63));
    let cluster = setup(&[(&v4, &["pod-b"]), (&v6, &["pod-b"])], xdp_native)?;
    let targets: [SocketAddr; 2] = [
        SocketAddrV4::new(node_ip(0), 30165).into(),
        SocketAddrV6::new(node_ip6(0), 30166, 0, 0).into(),
    ];
    for (seed, to) in targets.into_iter().enumerate() {
        let v6 = to.is_ipv6();
        cluster.wait_frontend(
            0,
            to,
            "TCP",
            "internal",
            &[pod_addr(&cluster, "pod-b", BULK_PORT, v6)?],
        )?;
        let before = cluster.node(0).agent().stats()?;
        let r = cluster.bulk(cluster.client(), to, BYTES, seed as u64 + 1)?;
        ensure!(r.complete(BYTES), "{to}: {r:#?}\n{}", cluster.all_stats());
        ensure!(
            r.backend == "pod-b" && r.peer == to.to_string(),
            "{to}: {r:#?}"
        );
        // Tens of thousands of segments each way; TC's lookup saw none of them.
        ensure_grew(&cluster, &before, "xdp_tx", 10_000)?;
        ensure!(
            cluster.stat(0, "tc_ct_hit")? == before.get("tc_ct_hit").copied().unwrap_or(0),
            "{to}: segments went through TC: {:?}",
            grew(&cluster, &before)?
        );
    }
    Ok(())
}

/// A connection that started in XDP goes on when node1's agent restarts without
/// XDP (TC continues the flow from the same conntrack entries), and again when it
/// restarts with XDP (XDP continues what TC carried).
#[test]
fn a_flow_moves_between_xdp_and_tc_across_restarts() -> Result<()> {
    let svc = Service::new(
        "held",
        Ipv4Addr::new(10, 96, 0, 64),
        vec![
            ServicePort::tcp("echo", 82, lb_tests::ECHO_TCP_PORT.into()).with_node_port(30167),
            ServicePort::tcp("whoami", 80, WHOAMI_PORT.into()).with_node_port(30169),
        ],
    )
    .node_port();
    let lb = lb_binary()?;
    let mut cluster = setup(&[(&svc, &["pod-b"])], xdp_native)?;
    let np = SocketAddrV4::new(node_ip(0), 30167);
    cluster.wait_frontend(
        0,
        np,
        "TCP",
        "internal",
        &[pod_addr(&cluster, "pod-b", lb_tests::ECHO_TCP_PORT, false)?],
    )?;
    let whoami = SocketAddrV4::new(node_ip(0), 30169);
    cluster.wait_frontend(
        0,
        whoami,
        "TCP",
        "internal",
        &[pod_addr(&cluster, "pod-b", WHOAMI_PORT, false)?],
    )?;
    warm_up(&cluster, whoami.into(), false)?;
    let mut held = cluster.hold(cluster.client(), np)?;
    ensure!(held.echo("in xdp")? == "pod-b in xdp");
    ensure!(
        cluster.stat(0, "xdp_new_flow")? >= 1,
        "{}",
        cluster.all_stats()
    );

    cluster.restart_agent(&lb, 0, Vec::new())?;
    let links = cluster.node(0).agent().status_links()?;
    ensure!(
        links.iter().all(|l| l.xdp == "-"),
        "XDP still attached after a restart without it: {links:#?}"
    );
    // Unpinning the old agent's XDP link detaches it from a kernel work item, a
    // moment after the new agent is ready: TC is asked only once the device says
    // it has no XDP program.
    lb_tests::util::poll(
        "lb_xdp to leave node1's eth0",
        Duration::from_secs(5),
        || {
            let link = cluster
                .node(0)
                .netns()
                .ip(&["-d", "link", "show", "eth0"])?;
            Ok((!link.contains("prog/xdp")).then_some(()))
        },
    )?;
    let tc_before = cluster.stat(0, "tc_ct_hit")?;
    let reply = held.echo("in tc");
    ensure!(
        reply.as_deref().ok() == Some("pod-b in tc"),
        "the flow broke when XDP went: {reply:?}\n{}",
        cluster.all_stats()
    );
    ensure!(
        cluster.stat(0, "tc_ct_hit")? > tc_before,
        "TC carried nothing: {}",
        cluster.all_stats()
    );

    cluster.restart_agent(&lb, 0, xdp_native(0))?;
    let tx_before = cluster.stat(0, "xdp_tx")?;
    let reply = held.echo("in xdp again");
    ensure!(
        reply.as_deref().ok() == Some("pod-b in xdp again"),
        "the flow broke when XDP came: {reply:?}\n{}",
        cluster.all_stats()
    );
    ensure!(
        cluster.stat(0, "xdp_tx")? > tx_before,
        "XDP carried nothing: {}",
        cluster.all_stats()
    );
    held.close()
}

/// Where the driver has no native XDP (the node's pod bridge, a node-facing device
/// here since it holds an address of the node), lb_xdp is not attached, nor
/// attached generically on its own: the device keeps the TC path, `lb status`
/// says it was refused and the agent's log why. The veth uplink takes native XDP.
#[test]
fn a_device_without_native_xdp_keeps_the_tc_path_and_says_why() -> Result<()> {
    let svc = whoami_node_port("refused", Ipv4Addr::new(10, 96, 0, 65), 30168);
    let cluster = setup(&[(&svc, &["pod-b"])], xdp_native)?;
    let links = cluster.node(0).agent().status_links()?;
    let xdp_of = |name: &str| {
        links
            .iter()
            .find(|l| l.name == name)
            .map(|l| l.xdp.clone())
            .with_context(|| format!("no {name} in {links:#?}"))
    };
    ensure!(xdp_of("eth0")? == "native", "{links:#?}");
    let bridge = xdp_of("br0")?;
    ensure!(bridge.starts_with("refused ("), "br0: {bridge}");
    ensure!(
        links
            .iter()
            .filter(|l| l.role == "pod-facing")
            .all(|l| l.xdp == "-"),
        "a pod veth got XDP: {links:#?}"
    );
    // The record says it was refused and the kernel's errno; the agent says why
    // (also in its /status, which `lb status` prints when it reaches the agent).
    ensure!(
        cluster
            .node(0)
            .agent()
            .log()
            .iter()
            .any(|l| l.contains("a bridge device refused native XDP")),
        "the agent's log does not say why"
    );
    // The NodePort still answers (through eth0's XDP; br0 is on no path here).
    let np = SocketAddrV4::new(node_ip(0), 30168);
    cluster.wait_frontend(
        0,
        np,
        "TCP",
        "internal",
        &[pod_addr(&cluster, "pod-b", WHOAMI_PORT, false)?],
    )?;
    cluster
        .expect_answers(
            cluster.client(),
            np,
            5,
            &[("pod-b", node_ip(0).into())],
            true,
        )
        .map(drop)
}
