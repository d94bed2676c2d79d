//! End-to-end tests: the real `lb` agent loads the socket programs into a test cgroup,
//! reads Kubernetes manifests, and probes in client pods talk to Service VIPs.
//!
//! Every test builds its own namespaces, cgroup, manifest dir and pin dir (the
//! `Testbed`), so the tests run in parallel and clean up even when they fail. The
//! client pods route the Service CIDR to `unreachable`, so a VIP connection the hooks
//! did not translate fails at once with EHOSTUNREACH and never leaves the namespace.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{find_frontend, ServiceEntry, SYNC_TIMEOUT};
use lb_tests::manifests::{documents, Conditions, Endpoint, EndpointSlice, Service, ServicePort};
use lb_tests::testbed::Hold;
use lb_tests::topology::Pod;
use lb_tests::{cargo_tools, lb_binary, Testbed, ECHO_TCP_PORT, ECHO_UDP_PORT};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// One frontend of a Service and the pod port it forwards to.
#[derive(Clone, Copy, Debug)]
struct Frontend {
    vip: Ipv4Addr,
    port: u16,
    protocol: &'static str,
    target_port: u16,
}

impl Frontend {
    const fn http(vip: Ipv4Addr) -> Self {
        Frontend {
            vip,
            port: 80,
            protocol: "TCP",
            target_port: ECHO_TCP_PORT,
        }
    }

    const fn dns(vip: Ipv4Addr) -> Self {
        Frontend {
            vip,
            port: 53,
            protocol: "UDP",
            target_port: ECHO_UDP_PORT,
        }
    }

    fn addr(&self) -> SocketAddrV4 {
        SocketAddrV4::new(self.vip, self.port)
    }

    /// What `getpeername`/`recvfrom` must report: the VIP, never a pod.
    fn addr_string(&self) -> String {
        self.addr().to_string()
    }
}

/// A Service like the examples' demo/web: http 80 -> 8080/TCP, dns 53 -> 5353/UDP.
fn web_service(name: &str, vip: Ipv4Addr) -> Service {
    Service::new(
        name,
        vip,
        vec![
            ServicePort::tcp("http", 80, ECHO_TCP_PORT.into()),
            ServicePort::udp("dns", 53, ECHO_UDP_PORT.into()),
        ],
    )
}

/// Endpoints for `pods`, all with the same conditions.
fn endpoints<'a>(pods: impl IntoIterator<Item = &'a Pod>, conditions: Conditions) -> Vec<Endpoint> {
    pods.into_iter()
        .map(|p| Endpoint::ready(p.name(), p.ip()).with_conditions(conditions))
        .collect()
}

/// Write `<service>.yaml` holding the Service and its EndpointSlice (atomically).
fn publish(bed: &Testbed, svc: &Service, endpoints: Vec<Endpoint>) -> Result<()> {
    let slice = EndpointSlice::for_service(svc, endpoints);
    bed.manifests.write(
        &format!("{}.yaml", svc.name),
        &documents([svc.to_yaml(), slice.to_yaml()]),
    )
}

/// A testbed with `pods` backends and `clients` clients, the manifests of `services`
/// (each with all pods ready) written, and the agent started.
fn setup(pods: usize, clients: usize, services: &[Service]) -> Result<Testbed> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), pods, clients)?;
    for svc in services {
        publish(&bed, svc, endpoints(bed.topo.pods(), Conditions::READY))?;
    }
    bed.start_agent(&lb)?;
    Ok(bed)
}

/// Wait until the agent's maps give `fe` exactly the backends `pods` (on the target
/// port). Traffic assertions only start once the datapath is known to be programmed.
fn wait_backends<'a>(
    bed: &Testbed,
    fe: Frontend,
    pods: impl IntoIterator<Item = &'a Pod>,
) -> Result<ServiceEntry> {
    let want: BTreeSet<std::net::SocketAddr> = pods
        .into_iter()
        .map(|p| SocketAddrV4::new(p.ip(), fe.target_port).into())
        .collect();
    let entries = bed.agent().wait_services(
        &format!("{fe:?} to have backends {want:?}"),
        SYNC_TIMEOUT,
        |entries| {
            find_frontend(entries, fe.vip, fe.port, fe.protocol)
                .is_some_and(|e| e.backend_addrs() == want)
        },
    )?;
    Ok(find_frontend(&entries, fe.vip, fe.port, fe.protocol)
        .expect("checked by the predicate")
        .clone())
}

/// The testbed's pods other than `gone`.
fn pods_but<'a>(bed: &'a Testbed, gone: &str) -> Vec<&'a Pod> {
    bed.topo
        .pods()
        .iter()
        .filter(|p| p.name() != gone)
        .collect()
}

fn pod_names(pods: &[Pod]) -> BTreeSet<&str> {
    pods.iter().map(Pod::name).collect()
}

/// a. Plain round-robin-ish TCP: every backend gets a fair share and the client only
/// ever sees the VIP as its peer.
#[test]
fn tcp_spreads_over_all_backends_and_hides_pod_ips() -> Result<()> {
    let bed = setup(3, 1, &[web_service("web", VIP)])?;
    let http = Frontend::http(VIP);
    wait_backends(&bed, http, bed.topo.pods())?;

    let r = bed.tcp(0, http.addr(), 300)?;
    ensure!(
        r.tally.answered == 300 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    ensure!(r.tally.names() == pod_names(bed.topo.pods()), "{r:#?}");
    // Binomial(300, 1/3): mean 100, sd 8.2; 60..=140 is more than 4.8 sd either side.
    for (name, &n) in &r.tally.backends {
        ensure!((60..=140).contains(&n), "{name} got {n} of 300: {r:#?}");
    }
    ensure!(
        r.peers == [http.addr_string()].into(),
        "getpeername: {r:#?}"
    );
    Ok(())
}

/// b. UDP: unconnected sockets reach every backend and always see the VIP as the
/// source of the answer; one socket sticks to one backend; connected UDP reports the
/// VIP as its peer.
#[test]
fn udp_translates_both_ways() -> Result<()> {
    let bed = setup(3, 1, &[web_service("web", VIP)])?;
    let dns = Frontend::dns(VIP);
    wait_backends(&bed, dns, bed.topo.pods())?;

    // One socket per datagram: 150 independent choices; missing a backend has
    // probability 3 * (2/3)^150.
    let r = bed.udp(0, dns.addr(), 150, 1)?;
    ensure!(
        r.tally.answered == 150 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    ensure!(r.tally.names() == pod_names(bed.topo.pods()), "{r:#?}");
    ensure!(
        r.sources == [dns.addr_string()].into(),
        "recvfrom source: {r:#?}"
    );

    // 20 datagrams per socket: each socket keeps talking to one backend.
    let r = bed.udp(0, dns.addr(), 200, 20)?;
    ensure!(
        r.tally.answered == 200 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    ensure!(r.per_socket.len() == 10, "{r:#?}");
    ensure!(
        r.per_socket.iter().all(|names| names.len() == 1),
        "a socket was answered by several backends: {:?}",
        r.per_socket
    );
    ensure!(
        r.sources == [dns.addr_string()].into(),
        "recvfrom source: {r:#?}"
    );

    let r = bed.udp_connected(0, dns.addr(), 30)?;
    ensure!(
        r.tally.answered == 30 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    ensure!(
        r.tally.names().is_subset(&pod_names(bed.topo.pods())),
        "{r:#?}"
    );
    ensure!(r.peers == [dns.addr_string()].into(), "getpeername: {r:#?}");
    Ok(())
}

/// c. sessionAffinity ClientIP: each client pod (its own network namespace) sticks to
/// one backend. Different clients may or may not share it; that is chance, so only
/// stickiness is asserted.
#[test]
fn client_ip_affinity_sticks_per_client() -> Result<()> {
    let clients = 3;
    let bed = setup(3, clients, &[web_service("web", VIP).with_affinity(60)])?;
    let http = Frontend::http(VIP);
    let entry = wait_backends(&bed, http, bed.topo.pods())?;
    ensure!(entry.affinity_timeout_sec == Some(60), "{entry:#?}");

    for client in 0..clients {
        let r = bed.tcp(client, http.addr(), 50)?;
        let who = bed.topo.clients()[client].name();
        ensure!(r.tally.answered == 50, "{who}: {r:#?}");
        ensure!(r.tally.backends.len() == 1, "{who} was not sticky: {r:#?}");
        ensure!(r.peers == [http.addr_string()].into(), "{who}: {r:#?}");
    }
    Ok(())
}

/// d. A Service without usable endpoints rejects at once (kube-proxy's REJECT):
/// ECONNREFUSED for connect and for sendto, never a hang.
#[test]
fn service_without_endpoints_refuses_immediately() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 2, 1)?;
    // An EndpointSlice with no endpoints at all, and one whose pods are all unready.
    let empty = web_service("empty", Ipv4Addr::new(10, 96, 0, 11));
    let unready = web_service("unready", Ipv4Addr::new(10, 96, 0, 12));
    publish(&bed, &empty, vec![])?;
    publish(
        &bed,
        &unready,
        endpoints(bed.topo.pods(), Conditions::NOT_READY),
    )?;
    bed.start_agent(&lb)?;

    for svc in [&empty, &unready] {
        let vip: Ipv4Addr = svc.cluster_ip.parse()?;
        let (http, dns) = (Frontend::http(vip), Frontend::dns(vip));
        wait_backends(&bed, http, [])?;
        wait_backends(&bed, dns, [])?;

        let r = bed.tcp(0, http.addr(), 10)?;
        ensure!(
            r.tally.errors_of("ECONNREFUSED") == 10,
            "{}: {r:#?}",
            svc.name
        );
        // A hang would show as the probe's 2 s connect timeout.
        ensure!(
            r.max_connect_ms < 1000.0,
            "{}: connect was slow: {r:#?}",
            svc.name
        );

        let r = bed.udp(0, dns.addr(), 5, 1)?;
        ensure!(
            r.tally.errors_of("ECONNREFUSED") == 5,
            "{}: {r:#?}",
            svc.name
        );
    }
    Ok(())
}

/// e. Removing a backend from the EndpointSlice: new connections avoid it at once,
/// while a connection already established to it keeps working.
#[test]
fn removed_backend_gets_no_new_connections_but_keeps_old_ones() -> Result<()> {
    let svc = web_service("web", VIP);
    let bed = setup(3, 1, std::slice::from_ref(&svc))?;
    let http = Frontend::http(VIP);
    wait_backends(&bed, http, bed.topo.pods())?;

    let mut held = bed.hold(0, http.addr())?;
    let gone = held.backend.clone();
    ensure!(held.echo("before")? == format!("{gone} before"));

    let remaining = pods_but(&bed, &gone);
    ensure!(
        remaining.len() == 2,
        "held backend {gone} is not one of the pods"
    );
    publish(
        &bed,
        &svc,
        endpoints(remaining.iter().copied(), Conditions::READY),
    )?;
    wait_backends(&bed, http, remaining.iter().copied())?;

    let r = bed.tcp(0, http.addr(), 100)?;
    ensure!(
        r.tally.answered == 100 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    ensure!(
        !r.tally.backends.contains_key(&gone),
        "{gone} still chosen: {r:#?}"
    );

    let reply = held.echo("after").context("the held connection broke")?;
    ensure!(
        reply == format!("{gone} after"),
        "held connection answered {reply:?}"
    );
    Ok(())
}

/// f. Only Service frontends are touched: another port, or the other protocol, of
/// the VIP is not translated (EHOSTUNREACH from the client's unreachable route), and
/// pod IPs are reached directly.
#[test]
fn only_service_ports_are_translated() -> Result<()> {
    let bed = setup(3, 1, &[web_service("web", VIP)])?;
    let http = Frontend::http(VIP);
    wait_backends(&bed, http, bed.topo.pods())?;

    let r = bed.tcp(0, SocketAddrV4::new(VIP, 81), 5)?;
    ensure!(r.tally.errors_of("EHOSTUNREACH") == 5, "VIP:81: {r:#?}");
    ensure!(r.max_connect_ms < 1000.0, "VIP:81: {r:#?}");
    // Port 80 is a TCP port of the Service; UDP to it is not a frontend.
    let r = bed.udp(0, SocketAddrV4::new(VIP, 80), 3, 1)?;
    ensure!(r.tally.errors_of("EHOSTUNREACH") == 3, "UDP VIP:80: {r:#?}");

    let r = bed.tcp(0, http.addr(), 10)?;
    ensure!(r.tally.answered == 10, "VIP:80: {r:#?}");

    let pod = &bed.topo.pods()[1];
    let direct = SocketAddrV4::new(pod.ip(), ECHO_TCP_PORT);
    let r = bed.tcp(0, direct, 5)?;
    ensure!(r.tally.names() == [pod.name()].into(), "direct: {r:#?}");
    ensure!(r.peers == [direct.to_string()].into(), "direct: {r:#?}");
    Ok(())
}

/// g. Bad objects are reported by name and skipped; the good Service still works.
#[test]
fn bad_manifests_are_reported_and_skipped() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 3, 1)?;
    let good = web_service("web", VIP);
    publish(&bed, &good, endpoints(bed.topo.pods(), Conditions::READY))?;

    bed.manifests.write(
        "broken.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: broken, namespace: demo\nspec: [\n",
    )?;
    let bad_port = Service::new(
        "bad-port",
        Ipv4Addr::new(10, 96, 0, 20),
        vec![ServicePort::tcp("http", 70000, 8080)],
    );
    bed.manifests.write("bad-port.yaml", &bad_port.to_yaml())?;
    // spec.ipFamilies contradicting the cluster IP: which family was meant?
    let mut mismatch = web_service("family-mismatch", Ipv4Addr::UNSPECIFIED);
    mismatch.cluster_ip = "fd00:10:96::10".into();
    mismatch.ip_families = vec!["IPv4"];
    bed.manifests
        .write("family-mismatch.yaml", &mismatch.to_yaml())?;
    let orphan = EndpointSlice::for_service(
        &web_service("no-such-service", Ipv4Addr::UNSPECIFIED),
        endpoints(bed.topo.pods(), Conditions::READY),
    );
    bed.manifests.write("orphan.yaml", &orphan.to_yaml())?;

    bed.start_agent(&lb)?;
    let agent = bed.agent();
    // The unparsable document has no name to give; its file is how to find it.
    for name in [
        "broken.yaml",
        "demo/bad-port",
        "demo/family-mismatch",
        &format!("demo/{}", orphan.name),
    ] {
        agent.wait_for_log(&format!("a WARN naming {name}"), SYNC_TIMEOUT, |l| {
            l.contains("WARN") && l.contains(name)
        })?;
    }

    let http = Frontend::http(VIP);
    let entries = bed.agent().services_json()?;
    ensure!(
        entries.iter().all(|e| e.frontend.ip == VIP),
        "a bad Service was programmed: {entries:#?}"
    );
    wait_backends(&bed, http, bed.topo.pods())?;
    let r = bed.tcp(0, http.addr(), 20)?;
    ensure!(
        r.tally.answered == 20 && r.tally.errors.is_empty(),
        "{r:#?}"
    );
    Ok(())
}

/// h. KEP-1669: when no endpoint is ready, serving+terminating endpoints still take
/// traffic; once one is ready, only the ready ones do.
#[test]
fn terminating_endpoints_serve_only_as_fallback() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 3, 1)?;
    let svc = web_service("web", VIP);
    publish(
        &bed,
        &svc,
        endpoints(bed.topo.pods(), Conditions::TERMINATING_SERVING),
    )?;
    bed.start_agent(&lb)?;
    let (http, dns) = (Frontend::http(VIP), Frontend::dns(VIP));

    wait_backends(&bed, http, bed.topo.pods())?;
    // Missing one of three backends in 60 tries: probability 3 * (2/3)^60.
    let r = bed.tcp(0, http.addr(), 60)?;
    ensure!(r.tally.answered == 60, "{r:#?}");
    ensure!(r.tally.names() == pod_names(bed.topo.pods()), "{r:#?}");
    wait_backends(&bed, dns, bed.topo.pods())?;
    let r = bed.udp(0, dns.addr(), 10, 1)?;
    ensure!(r.tally.answered == 10, "{r:#?}");

    // pod-a becomes ready: the terminating ones drop out of the rotation.
    let pods = bed.topo.pods();
    let mut eps = endpoints(&pods[..1], Conditions::READY);
    eps.extend(endpoints(&pods[1..], Conditions::TERMINATING_SERVING));
    publish(&bed, &svc, eps)?;
    wait_backends(&bed, http, &pods[..1])?;
    let r = bed.tcp(0, http.addr(), 30)?;
    ensure!(r.tally.names() == [pods[0].name()].into(), "{r:#?}");
    Ok(())
}

/// The agent's exit leaves the datapath in place (links pinned), so a restart or a
/// crash does not interrupt Service traffic; `lb cleanup` then really removes it.
#[test]
fn datapath_outlives_the_agent_until_cleanup() -> Result<()> {
    let mut bed = setup(2, 1, &[web_service("web", VIP)])?;
    let http = Frontend::http(VIP);
    wait_backends(&bed, http, bed.topo.pods())?;

    bed.agent_mut().stop()?;
    let r = bed.tcp(0, http.addr(), 20)?;
    ensure!(r.tally.answered == 20, "after the agent exited: {r:#?}");

    bed.agent().cleanup()?;
    let r = bed.tcp(0, http.addr(), 3)?;
    ensure!(
        r.tally.errors_of("EHOSTUNREACH") == 3,
        "after lb cleanup: {r:#?}"
    );
    Ok(())
}

/// The backends `LB_SOCK_REVNAT` names: the sockets the hooks translated, as the
/// agent's map has them.
fn revnat_backends(bed: &Testbed) -> Result<BTreeSet<SocketAddr>> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{map_names, SockRevNatKey, SockRevNatValue, PIN_LAYOUT_VERSION};
    let path = bed
        .agent()
        .pin_dir()
        .join(format!("v{PIN_LAYOUT_VERSION}"))
        .join(map_names::SOCK_REVNAT);
    let data = MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))?;
    let map: HashMap<_, SockRevNatKey, SockRevNatValue> =
        HashMap::try_from(Map::from_map_data(data)?)?;
    map.keys()
        .map(|key| {
            let key = key?;
            let port = u16::from_be_bytes(key.port.to_ne_bytes());
            Ok(SocketAddr::new(key.address.into(), port))
        })
        .collect()
}

/// Waits (bounded) until `done` holds, re-checking every 20 ms.
fn eventually(what: &str, timeout: Duration, done: impl Fn() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !done()? {
        ensure!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Holds TCP connections to `to` until one reaches `backend` (bounded: 40 tries,
/// each missing with probability 2/3 or less).
fn hold_to(bed: &Testbed, to: SocketAddrV4, backend: &str) -> Result<Hold> {
    for _ in 0..40 {
        let held = bed.hold(0, to)?;
        if held.backend == backend {
            return Ok(held);
        }
        held.close()?;
    }
    anyhow::bail!("40 connections to {to} and none reached {backend}")
}

/// g. A connected UDP socket stays with the backend its `connect()` got. When that
/// endpoint leaves the Service, the agent closes the socket within 1 s of the
/// change: the client's next call fails, it reconnects through the Service and
/// reaches a remaining backend. A TCP connection to the same endpoint is left open
/// (as kube-proxy leaves it). Unconnected sockets never pick the endpoint again and
/// their reverse-translation entries for it are deleted.
#[test]
fn connected_udp_to_a_removed_endpoint_is_closed_and_reconnects() -> Result<()> {
    let svc = web_service("web", VIP);
    let bed = setup(3, 1, std::slice::from_ref(&svc))?;
    let (dns, http) = (Frontend::dns(VIP), Frontend::http(VIP));
    wait_backends(&bed, dns, bed.topo.pods())?;

    let mut follow = bed.udp_follow(0, dns.addr())?;
    let gone = follow
        .next(Duration::from_secs(5))?
        .answer
        .context("udp-follow's first line is an answer")?;
    let gone_pod = bed
        .topo
        .pods()
        .iter()
        .find(|p| p.name() == gone)
        .context("the answer names a pod")?;
    let gone_addr = SocketAddr::new(gone_pod.ip().into(), ECHO_UDP_PORT);
    let mut held = hold_to(&bed, http.addr(), &gone)?;
    // Unconnected sockets: 60 picks, each missing `gone` with probability 2/3.
    let r = bed.udp(0, dns.addr(), 60, 1)?;
    ensure!(r.tally.backends.contains_key(&gone), "{r:#?}");
    ensure!(revnat_backends(&bed)?.contains(&gone_addr));

    let remaining = pods_but(&bed, &gone);
    let changed = Instant::now();
    publish(
        &bed,
        &svc,
        endpoints(remaining.iter().copied(), Conditions::READY),
    )?;
    let closed = follow.next(Duration::from_secs(1).saturating_sub(changed.elapsed()))?;
    eprintln!(
        "socket closed {:?} after the change: {closed:?}",
        changed.elapsed()
    );
    let errno = closed.error.as_deref().unwrap_or_default();
    // ECONNABORTED when the socket was closed under a call; a send after it finds the
    // socket unconnected (EDESTADDRREQ).
    ensure!(
        closed.socket == 0 && (errno.ends_with("ECONNABORTED") || errno.ends_with("EDESTADDRREQ")),
        "expected the connected socket to fail within 1 s of the change: {closed:?}"
    );
    let again = follow.next(Duration::from_secs(5))?;
    ensure!(
        again.socket == 1
            && again
                .answer
                .as_deref()
                .is_some_and(|a| a != gone && pod_names(bed.topo.pods()).contains(a)),
        "the reconnected socket should reach a remaining backend: {again:?}"
    );
    follow.close()?;

    let reply = held
        .echo("after")
        .context("the TCP connection was closed")?;
    ensure!(
        reply == format!("{gone} after"),
        "held connection answered {reply:?}"
    );

    eventually(
        "the reverse entries of the removed endpoint deleted",
        Duration::from_secs(2),
        || Ok(!revnat_backends(&bed)?.contains(&gone_addr)),
    )?;
    let r = bed.udp(0, dns.addr(), 60, 1)?;
    ensure!(r.tally.answered == 60, "{r:#?}");
    ensure!(
        !r.tally.backends.contains_key(&gone),
        "{gone} still chosen: {r:#?}"
    );
    Ok(())
}

/// h. With --terminate-tcp-to-removed-endpoints, a TCP connection to an endpoint
/// that left the Service is closed too; one to a remaining endpoint is not.
#[test]
fn tcp_to_a_removed_endpoint_is_closed_with_the_flag() -> Result<()> {
    let lb = lb_binary()?;
    let svc = web_service("web", VIP);
    let mut bed = Testbed::new(cargo_tools!(), 2, 1)?;
    publish(&bed, &svc, endpoints(bed.topo.pods(), Conditions::READY))?;
    bed.start_agent_with(&lb, &["--terminate-tcp-to-removed-endpoints"])?;
    let http = Frontend::http(VIP);
    wait_backends(&bed, http, bed.topo.pods())?;

    let (gone, kept) = (&bed.topo.pods()[0], &bed.topo.pods()[1]);
    let mut to_gone = hold_to(&bed, http.addr(), gone.name())?;
    let mut to_kept = hold_to(&bed, http.addr(), kept.name())?;
    let changed = Instant::now();
    publish(&bed, &svc, endpoints([kept], Conditions::READY))?;
    wait_backends(&bed, http, [kept])?;
    // The close comes just after the change: echo until the connection fails.
    let mut failed = None;
    while failed.is_none() && changed.elapsed() < Duration::from_secs(1) {
        match to_gone.echo("ping") {
            Ok(reply) => ensure!(reply == format!("{} ping", gone.name()), "{reply:?}"),
            Err(e) => failed = Some(e),
        }
    }
    ensure!(
        failed.is_some(),
        "the connection to the removed endpoint still answers 1 s after the change"
    );
    let reply = to_kept.echo("after")?;
    ensure!(reply == format!("{} after", kept.name()), "{reply:?}");
    Ok(())
}
