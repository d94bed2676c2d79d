//! Dual-stack end-to-end tests of the socket hooks: the IPv6 hooks (`connect6`,
//! `sendmsg6`, `recvmsg6`, `getpeername6`) with real traffic between namespaces that
//! have both address families, and AF_INET6 sockets naming an IPv4 Service through
//! its IPv4-mapped address (`::ffff:10.96.0.10`), as dual-stack applications do.
//!
//! The pods of the testbed have an IPv4 and an IPv6 address each (see
//! `lb_tests::topology`); the client pods route both Service CIDRs to `unreachable`,
//! so a VIP the hooks did not translate fails at once and never leaves the namespace.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use lb_tests::agent::{find_frontend, SYNC_TIMEOUT};
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, Service, ServicePort};
use lb_tests::topology::Pod;
use lb_tests::{cargo_tools, lb_binary, Testbed, ECHO_TCP_PORT, ECHO_UDP_PORT};

const VIP4: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);

fn ports() -> Vec<ServicePort> {
    vec![
        ServicePort::tcp("http", 80, ECHO_TCP_PORT.into()),
        ServicePort::udp("dns", 53, ECHO_UDP_PORT.into()),
    ]
}

fn v4_endpoints(pods: &[&Pod]) -> Vec<Endpoint> {
    pods.iter()
        .map(|p| Endpoint::ready(p.name(), p.ip()))
        .collect()
}

fn v6_endpoints(pods: &[&Pod]) -> Vec<Endpoint> {
    pods.iter()
        .map(|p| Endpoint::ready(p.name(), p.ip6().expect("dual-stack pod")))
        .collect()
}

/// Writes `<name>.yaml`: the Service, and an EndpointSlice per family given.
fn publish(
    bed: &Testbed,
    svc: &Service,
    v4: Option<Vec<Endpoint>>,
    v6: Option<Vec<Endpoint>>,
) -> Result<()> {
    let mut docs = vec![svc.to_yaml()];
    if let Some(eps) = v4 {
        docs.push(EndpointSlice::for_service(svc, eps).to_yaml());
    }
    if let Some(eps) = v6 {
        docs.push(EndpointSlice::ipv6_for_service(svc, eps).to_yaml());
    }
    bed.manifests
        .write(&format!("{}.yaml", svc.name), &documents(docs))
}

/// Waits until `vip:port/protocol` has exactly `want` as backends.
fn wait_backends(
    bed: &Testbed,
    vip: IpAddr,
    port: u16,
    protocol: &str,
    want: &[SocketAddr],
) -> Result<()> {
    let want: BTreeSet<SocketAddr> = want.iter().copied().collect();
    bed.agent().wait_services(
        &format!("{vip}:{port}/{protocol} to have backends {want:?}"),
        SYNC_TIMEOUT,
        |entries| {
            find_frontend(entries, vip, port, protocol).is_some_and(|e| e.backend_addrs() == want)
        },
    )?;
    Ok(())
}

fn names(pods: &[&Pod]) -> BTreeSet<String> {
    pods.iter().map(|p| p.name().to_owned()).collect()
}

fn owned(tally: &lb_tests::probe::Tally) -> BTreeSet<String> {
    tally.backends.keys().cloned().collect()
}

/// A dual-stack Service whose IPv6 endpoints are pod-a and pod-b and whose IPv4
/// endpoint is pod-c: each family's VIP reaches its own family's endpoints only, over
/// TCP, connected and unconnected UDP, and the client sees the VIP it asked for as
/// its peer. An AF_INET6 socket naming `::ffff:<IPv4 VIP>` is served by the IPv4
/// Service and sees that mapped address as its peer.
#[test]
fn dual_stack_service_serves_each_family_from_its_own_endpoints() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 3, 1)?;
    let (six, four, six_backends, four_backend) = {
        let [a, b, c] = [0, 1, 2].map(|i| &bed.topo.pods()[i]);
        let svc = Service::new("web", VIP4, ports()).dual_stack(VIP6);
        publish(
            &bed,
            &svc,
            Some(v4_endpoints(&[c])),
            Some(v6_endpoints(&[a, b])),
        )?;
        let six_backends: Vec<SocketAddr> = [a, b]
            .iter()
            .map(|p| SocketAddr::new(p.ip6().unwrap().into(), ECHO_TCP_PORT))
            .collect();
        let four_backend = SocketAddr::new(c.ip().into(), ECHO_TCP_PORT);
        (names(&[a, b]), names(&[c]), six_backends, four_backend)
    };
    bed.start_agent(&lb)?;
    wait_backends(&bed, VIP6.into(), 80, "TCP", &six_backends)?;
    wait_backends(&bed, VIP4.into(), 80, "TCP", &[four_backend])?;

    let mapped = VIP4.to_ipv6_mapped();
    for (vip, want) in [
        (IpAddr::from(VIP6), &six),
        (IpAddr::from(VIP4), &four),
        (IpAddr::from(mapped), &four),
    ] {
        let http = SocketAddr::new(vip, 80);
        let dns = SocketAddr::new(vip, 53);

        // 40 connections over two backends: missing one has probability 2 * 2^-40.
        let r = bed.tcp(0, http, 40)?;
        ensure!(
            r.tally.answered == 40 && r.tally.errors.is_empty(),
            "TCP {http}: {r:#?}"
        );
        ensure!(owned(&r.tally) == *want, "TCP {http} reached {r:#?}");
        ensure!(
            r.peers == [http.to_string()].into(),
            "getpeername on {http}: {r:#?}"
        );

        let r = bed.udp_connected(0, dns, 20)?;
        ensure!(
            r.tally.answered == 20 && r.tally.errors.is_empty(),
            "connected UDP {dns}: {r:#?}"
        );
        ensure!(owned(&r.tally).is_subset(want), "UDP {dns} reached {r:#?}");
        ensure!(
            r.peers == [dns.to_string()].into(),
            "getpeername on {dns}: {r:#?}"
        );

        // One socket per datagram: independent choices, every answer from the VIP.
        let r = bed.udp(0, dns, 40, 1)?;
        ensure!(
            r.tally.answered == 40 && r.tally.errors.is_empty(),
            "UDP {dns}: {r:#?}"
        );
        ensure!(owned(&r.tally) == *want, "UDP {dns} reached {r:#?}");
        ensure!(
            r.sources == [dns.to_string()].into(),
            "recvfrom source on {dns}: {r:#?}"
        );
    }

    // What an operator reads: the IPv6 frontend and backends bracketed.
    let text = bed.agent().lb_command(&["services"])?;
    let row = text
        .lines()
        .find(|l| l.starts_with("[fd00:96::10]:80/TCP"))
        .unwrap_or_default();
    ensure!(
        row.contains("[fd00:244:1::11]:8080") && row.contains("[fd00:244:1::12]:8080"),
        "lb services:\n{text}"
    );
    Ok(())
}

/// An IPv6-only Service: ClientIP affinity keeps a client on one backend, and a
/// Service without endpoints refuses at once (ECONNREFUSED), as over IPv4.
#[test]
fn ipv6_only_affinity_and_refusal() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 3, 1)?;
    let empty_vip = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);
    let want: Vec<SocketAddr> = {
        let pods: Vec<&Pod> = bed.topo.pods().iter().collect();
        let sticky = Service::new("sticky", Ipv4Addr::UNSPECIFIED, ports())
            .ipv6_only(VIP6)
            .with_affinity(60);
        publish(&bed, &sticky, None, Some(v6_endpoints(&pods)))?;
        let empty = Service::new("empty", Ipv4Addr::UNSPECIFIED, ports()).ipv6_only(empty_vip);
        publish(&bed, &empty, None, Some(Vec::new()))?;
        pods.iter()
            .map(|p| SocketAddr::new(p.ip6().unwrap().into(), ECHO_TCP_PORT))
            .collect()
    };
    bed.start_agent(&lb)?;
    wait_backends(&bed, VIP6.into(), 80, "TCP", &want)?;
    wait_backends(&bed, empty_vip.into(), 80, "TCP", &[])?;

    let r = bed.tcp(0, SocketAddr::new(VIP6.into(), 80), 30)?;
    ensure!(
        r.tally.answered == 30 && r.tally.names().len() == 1,
        "affinity: one backend for one client: {r:#?}"
    );

    for addr in [
        SocketAddr::new(empty_vip.into(), 80),
        SocketAddr::new(empty_vip.into(), 53),
    ] {
        let (errors, answered) = if addr.port() == 80 {
            let r = bed.tcp(0, addr, 5)?;
            (r.tally.errors_of("ECONNREFUSED"), r.tally.answered)
        } else {
            let r = bed.udp(0, addr, 5, 1)?;
            (r.tally.errors_of("ECONNREFUSED"), r.tally.answered)
        };
        ensure!(
            errors == 5 && answered == 0,
            "{addr} without endpoints: {errors} ECONNREFUSED, {answered} answered"
        );
    }
    Ok(())
}

/// Connected UDP sockets of both kinds the IPv6 hooks serve, an IPv6 one to the
/// IPv6 VIP and an AF_INET6 one to the IPv4 VIP's mapped address, are closed within
/// 1 s of their endpoint leaving the Service, and reconnect to the other endpoint.
#[test]
fn connected_udp_of_both_families_follows_endpoint_removal() -> Result<()> {
    let lb = lb_binary()?;
    let mut bed = Testbed::new(cargo_tools!(), 2, 1)?;
    let svc = Service::new("web", VIP4, ports()).dual_stack(VIP6);
    {
        let pods: Vec<&Pod> = bed.topo.pods().iter().collect();
        publish(
            &bed,
            &svc,
            Some(v4_endpoints(&pods)),
            Some(v6_endpoints(&pods)),
        )?;
    }
    let udp_backends = |v6: bool, pods: &[&Pod]| -> Vec<SocketAddr> {
        pods.iter()
            .map(|p| match v6 {
                true => SocketAddr::new(p.ip6().unwrap().into(), ECHO_UDP_PORT),
                false => SocketAddr::new(p.ip().into(), ECHO_UDP_PORT),
            })
            .collect()
    };
    bed.start_agent(&lb)?;
    let pods: Vec<&Pod> = bed.topo.pods().iter().collect();
    wait_backends(&bed, VIP6.into(), 53, "UDP", &udp_backends(true, &pods))?;
    wait_backends(&bed, VIP4.into(), 53, "UDP", &udp_backends(false, &pods))?;

    let mut six = bed.udp_follow(0, SocketAddr::new(VIP6.into(), 53))?;
    let mut mapped = bed.udp_follow(0, SocketAddr::new(VIP4.to_ipv6_mapped().into(), 53))?;
    let wait = Duration::from_secs(5);
    let six_gone = six.next(wait)?.answer.unwrap_or_default();
    let mapped_gone = mapped.next(wait)?.answer.unwrap_or_default();
    let kept =
        |gone: &str| -> Vec<&Pod> { pods.iter().copied().filter(|p| p.name() != gone).collect() };
    let changed = Instant::now();
    publish(
        &bed,
        &svc,
        Some(v4_endpoints(&kept(&mapped_gone))),
        Some(v6_endpoints(&kept(&six_gone))),
    )?;
    for (follow, gone) in [(&mut six, &six_gone), (&mut mapped, &mapped_gone)] {
        let closed = follow.next(Duration::from_secs(1).saturating_sub(changed.elapsed()))?;
        ensure!(
            closed.socket == 0 && closed.error.is_some(),
            "expected the socket to {gone} to fail within 1 s of the change: {closed:?}"
        );
        let again = follow.next(wait)?;
        ensure!(
            again.socket == 1 && again.answer.as_deref() == Some(kept(gone)[0].name()),
            "the reconnected socket should reach the other endpoint: {again:?}"
        );
    }
    six.close()?;
    mapped.close()
}
