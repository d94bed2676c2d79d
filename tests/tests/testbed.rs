//! Tests of the testbed itself, without the agent: the pod network works, untranslated
//! VIP traffic fails at once inside the client namespace, and teardown leaves nothing.
//! If these fail, the end-to-end failures in socket_lb.rs mean nothing.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;

use anyhow::{ensure, Result};
use lb_tests::topology::pod_ip;
use lb_tests::util::ip;
use lb_tests::{cargo_tools, Testbed, ECHO_TCP_PORT, ECHO_UDP_PORT};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

#[test]
fn client_reaches_every_pod_directly() -> Result<()> {
    let bed = Testbed::new(cargo_tools!(), 3, 1)?;
    for pod in bed.topo.pods() {
        let tcp_addr = SocketAddrV4::new(pod.ip(), ECHO_TCP_PORT);
        let tcp = bed.tcp(0, tcp_addr, 3)?;
        ensure!(tcp.tally.errors.is_empty(), "tcp to {tcp_addr}: {tcp:?}");
        ensure!(tcp.tally.names() == [pod.name()].into(), "{tcp:?}");
        ensure!(tcp.peers == [tcp_addr.to_string()].into(), "{tcp:?}");

        let udp_addr = SocketAddrV4::new(pod.ip(), ECHO_UDP_PORT);
        let udp = bed.udp(0, udp_addr, 4, 2)?;
        ensure!(udp.tally.answered == 4, "udp to {udp_addr}: {udp:?}");
        ensure!(udp.sources == [udp_addr.to_string()].into(), "{udp:?}");
        ensure!(udp.per_socket.len() == 2, "{udp:?}");

        let conn = bed.udp_connected(0, udp_addr, 2)?;
        ensure!(conn.tally.answered == 2, "{conn:?}");
        ensure!(conn.peers == [udp_addr.to_string()].into(), "{conn:?}");
    }
    Ok(())
}

#[test]
fn hold_keeps_one_connection() -> Result<()> {
    let bed = Testbed::new(cargo_tools!(), 2, 1)?;
    let mut hold = bed.hold(0, SocketAddrV4::new(pod_ip(1), ECHO_TCP_PORT))?;
    ensure!(hold.backend == "pod-b", "greeted by {}", hold.backend);
    ensure!(hold.echo("one")? == "pod-b one");
    ensure!(hold.echo("two words")? == "pod-b two words");
    Ok(())
}

#[test]
fn untranslated_vip_fails_fast_with_ehostunreach() -> Result<()> {
    let bed = Testbed::new(cargo_tools!(), 1, 1)?;
    let tcp = bed.tcp(0, SocketAddrV4::new(VIP, 80), 5)?;
    ensure!(tcp.tally.errors_of("EHOSTUNREACH") == 5, "{tcp:?}");
    ensure!(tcp.max_connect_ms < 1000.0, "{tcp:?}");
    let udp = bed.udp(0, SocketAddrV4::new(VIP, 53), 3, 1)?;
    ensure!(udp.tally.errors_of("EHOSTUNREACH") == 3, "{udp:?}");
    Ok(())
}

#[test]
fn teardown_removes_everything() -> Result<()> {
    let bed = Testbed::new(cargo_tools!(), 2, 2)?;
    let base = bed.topo.base().to_string();
    let cgroup = bed.cgroup.path().to_path_buf();
    let manifests = bed.manifests.path().to_path_buf();
    // A process left running in the cgroup must not block its removal.
    let hold = bed.hold(0, SocketAddrV4::new(pod_ip(0), ECHO_TCP_PORT))?;
    // Leak the handle, as a panicking test might: the cgroup's teardown must still
    // kill the process.
    std::mem::forget(hold);
    drop(bed);
    let namespaces = ip(&["netns", "list"])?;
    ensure!(!namespaces.contains(&base), "namespaces left: {namespaces}");
    ensure!(!cgroup.exists(), "{} left", cgroup.display());
    ensure!(
        !Path::new(&manifests).exists(),
        "{} left",
        manifests.display()
    );
    Ok(())
}
