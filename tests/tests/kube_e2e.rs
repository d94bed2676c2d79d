//! The agent following an API server (`lb agent --kubeconfig`), with real traffic.
//!
//! The API server is lb-userspace's fake one (list/watch over HTTP on 127.0.0.1,
//! scripted by the test: held lists, 410 Gone, outages); the agent reaches it through
//! a kubeconfig without credentials. The datapath is the socket LB testbed's: three
//! backend pods running lb-echo, a client pod, the test cgroup. Traffic stays in the
//! test's namespaces; only the agent talks to the fake server, over loopback.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use lb_fake_apiserver::{node, service, slice, FakeApiServer, Res};
use lb_tests::agent::{find_frontend, ServiceEntry, READY_TIMEOUT};
use lb_tests::agent_proc::{
    check_hooks_once, default_hook_pins, AgentProc, Kubeconfig, PinDir, Source,
};
use lb_tests::manifests::NODE_NAME;
use lb_tests::topology::Pod;
use lb_tests::util::poll;
use lb_tests::{cargo_tools, lb_binary, Testbed, ECHO_TCP_PORT};
use tokio::runtime::Runtime;

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The fake server's `service()` has one port: http 80 -> 8080/TCP (lb-echo's port).
const PORT: u16 = 80;
/// The testbed's backend pods.
const PODS: [&str; 3] = ["pod-a", "pod-b", "pod-c"];
const SERVICE: &str = "web";
const SLICE: &str = "web-1";
/// Bound for a change on the fake server to reach the maps (watch, debounce, sync).
const SYNC: Duration = Duration::from_secs(15);
/// Bound for the agent's client to come back after an outage (its retries back off
/// from 0.1 s to at most 1 s), generous for a loaded machine.
const RECONNECT: Duration = Duration::from_secs(60);
/// A change made during an outage reaches the maps within this of the server
/// answering again (the target).
const RECOVERY: Duration = Duration::from_secs(2);
/// Bound for requests to reach the fake server.
const REQUEST: Duration = Duration::from_secs(20);

/// Everything one test needs. Field order is teardown order: the agent is killed,
/// the pins removed, the namespaces and cgroup deleted, and the fake server goes
/// with its runtime last.
struct KubeBed {
    agent: Option<AgentProc>,
    pins: PinDir,
    bed: Testbed,
    kubeconfig: Kubeconfig,
    server: FakeApiServer,
    rt: Runtime,
    lb: PathBuf,
}

impl KubeBed {
    /// Testbed with three backends and a client; the fake server holding Service
    /// `web` (the VIP), slice `web-1` with all three pods, and Node `node-1`. The
    /// agent is not started.
    fn new() -> Result<Self> {
        let lb = lb_binary()?;
        let bed = Testbed::new(cargo_tools!(), 3, 1)?;
        let pins = PinDir::create(&lb)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let server = rt.block_on(FakeApiServer::start());
        let kubeconfig = Kubeconfig::write(&server.kubeconfig())?;
        let this = KubeBed {
            agent: None,
            pins,
            bed,
            kubeconfig,
            server,
            rt,
            lb,
        };
        this.server
            .apply(Res::Services, service(SERVICE, &VIP.to_string(), &[]));
        let names: Vec<&str> = this.bed.topo.pods().iter().map(Pod::name).collect();
        ensure!(names == PODS, "the testbed's pods are {names:?}");
        this.set_slice(&PODS)?;
        this.server.apply(Res::Nodes, node(NODE_NAME));
        Ok(this)
    }

    /// Start `lb agent --kubeconfig` (without waiting for anything).
    fn start_agent(&mut self) -> Result<&AgentProc> {
        let agent = AgentProc::start(
            &self.lb,
            Source::Kubeconfig(self.kubeconfig.path()),
            &self.bed.cgroup,
            &self.pins,
            NODE_NAME,
        )?;
        Ok(self.agent.insert(agent))
    }

    /// Start the agent and wait until it serves all three backends.
    fn start_ready(&mut self) -> Result<()> {
        self.start_agent()?.wait_ready(READY_TIMEOUT)?;
        let all = self.pod_names();
        self.wait_backends(&all)?;
        for res in Res::PROXY {
            self.rt.block_on(self.server.wait_watching(res, 1, REQUEST));
        }
        Ok(())
    }

    fn agent(&self) -> &AgentProc {
        self.agent.as_ref().expect("agent started")
    }

    fn pod_names(&self) -> Vec<&'static str> {
        PODS.to_vec()
    }

    fn pod_ip(&self, name: &str) -> Result<Ipv4Addr> {
        Ok(self.bed.topo.pod(name)?.ip())
    }

    /// Create or replace slice `web-1` with the pods `names` (ready). Returns the
    /// resourceVersion of the write.
    fn set_slice(&self, names: &[&str]) -> Result<u64> {
        let ips = names
            .iter()
            .map(|n| Ok(self.pod_ip(n)?.to_string()))
            .collect::<Result<Vec<_>>>()?;
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        Ok(self
            .server
            .apply(Res::EndpointSlices, slice(SLICE, SERVICE, &ips, &[])))
    }

    /// Wait until the maps hold exactly the VIP with the pods `names` as backends.
    fn wait_backends(&self, names: &[&str]) -> Result<ServiceEntry> {
        let want = names
            .iter()
            .map(|n| Ok(SocketAddrV4::new(self.pod_ip(n)?, ECHO_TCP_PORT).into()))
            .collect::<Result<BTreeSet<_>>>()?;
        let entries = self.pins.wait_services(
            &format!("the VIP to have backends {names:?}"),
            SYNC,
            |entries| {
                // The whole change, not a prefix of it: while the agent rewrites
                // slots, the old count can still show one address twice.
                entries.len() == 1
                    && find_frontend(entries, VIP, PORT, "TCP").is_some_and(|e| {
                        e.backend_addrs() == want
                            && e.backends.len() == want.len()
                            && e.problems.is_empty()
                    })
            },
        )?;
        Ok(entries[0].clone())
    }

    /// `count` connections through the VIP: all must be answered, by exactly `names`.
    fn traffic_reaches(&self, names: &[&str], count: u32) -> Result<()> {
        let r = self.bed.tcp(0, SocketAddrV4::new(VIP, PORT), count)?;
        let want: BTreeSet<&str> = names.iter().copied().collect();
        ensure!(
            r.tally.answered == count && r.tally.names() == want,
            "expected {count} answers from exactly {want:?}: {r:#?}"
        );
        Ok(())
    }
}

/// Wait until the agent has failed to reach the API server `times` times for each
/// kind (its warnings name the kind): the outage lasted over a retry.
fn wait_retries(kb: &mut KubeBed, times: usize) -> Result<()> {
    for kind in ["Services", "EndpointSlices", "Nodes"] {
        let field = format!("kind={kind}");
        kb.agent.as_mut().expect("agent started").wait_for_lines(
            &format!("{times} failed attempts to reach the API server for {kind}"),
            times,
            RECONNECT,
            |l| l.contains("Kubernetes API:") && l.contains(&field),
        )?;
    }
    Ok(())
}

/// The agent's log so far, for messages.
fn log_of(agent: &AgentProc) -> String {
    agent.log().join("\n")
}

/// Until Services, EndpointSlices and Nodes have each been listed, the agent writes
/// nothing: no `ready and serving`, an empty service table (the hooks are attached,
/// so the VIP is simply not a frontend yet). Once the lists complete, traffic through
/// the VIP reaches every backend.
#[test]
fn nothing_is_served_before_the_initial_lists_then_traffic_flows() -> Result<()> {
    let mut kb = KubeBed::new()?;
    for res in Res::PROXY {
        kb.server.hold_lists(res, true);
    }
    kb.start_agent()?;
    // The maps exist (so `lb services` can read them) once the agent loaded its
    // object; whether the hooks are attached already is the agent's business, the
    // VIP must not be translated either way.
    poll("the agent to create its maps", READY_TIMEOUT, || {
        Ok(kb.pins.services_json().ok())
    })?;
    for res in Res::PROXY {
        kb.rt
            .block_on(kb.server.wait_call(REQUEST, |c| c.res == res && !c.watch));
    }
    let not_serving = |kb: &KubeBed, when: &str| -> Result<()> {
        let agent = kb.agent();
        ensure!(
            !agent.logged("ready and serving"),
            "ready {when}:\n{}",
            log_of(agent)
        );
        let entries = kb.pins.services_json()?;
        ensure!(entries.is_empty(), "service table {when}: {entries:#?}");
        Ok(())
    };
    not_serving(&kb, "while every list is held")?;

    // Services and EndpointSlices listed (their watches are open), Nodes still held.
    kb.server.hold_lists(Res::Services, false);
    kb.server.hold_lists(Res::EndpointSlices, false);
    for res in [Res::Services, Res::EndpointSlices] {
        kb.rt.block_on(kb.server.wait_watching(res, 1, REQUEST));
    }
    // An absence can only be watched for a while: 1 s is ten times the source's
    // debounce and far longer than a sync takes.
    let window = Instant::now();
    for _ in 0..20 {
        not_serving(&kb, "with the Node list still held")?;
        if window.elapsed() >= Duration::from_secs(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(
        kb.server.calls_of(Res::Nodes, true).is_empty(),
        "Nodes are watched although their list is held"
    );
    let r = kb.bed.tcp(0, SocketAddrV4::new(VIP, PORT), 3)?;
    ensure!(
        r.tally.errors_of("EHOSTUNREACH") == 3,
        "the VIP was translated before the agent was ready: {r:#?}"
    );

    kb.server.hold_lists(Res::Nodes, false);
    kb.agent().wait_ready(READY_TIMEOUT)?;
    let all = kb.pod_names();
    kb.wait_backends(&all)?;
    // Missing one of three backends in 60 tries: probability 3 * (2/3)^60.
    kb.traffic_reaches(&all, 60)?;
    Ok(())
}

/// A MODIFIED EndpointSlice event that drops a backend stops new connections to it;
/// an API server outage (connections refused) leaves the datapath as it was, and
/// changes flow again once the server is back.
#[test]
fn slice_modified_removes_a_backend_and_an_outage_keeps_the_datapath() -> Result<()> {
    let mut kb = KubeBed::new()?;
    kb.start_ready()?;
    let all = kb.pod_names();
    kb.traffic_reaches(&all, 60)?;

    let (gone, rest) = (all[0], &all[1..]);
    kb.set_slice(rest)?;
    let entry = kb.wait_backends(rest)?;
    ensure!(
        kb.server.delivered(Res::EndpointSlices, "MODIFIED", SLICE) >= 1,
        "the change did not go out as a MODIFIED event"
    );
    ensure!(
        kb.server.calls_of(Res::EndpointSlices, false).len() == 1,
        "the slices were listed again: {:#?}",
        kb.server.calls_of(Res::EndpointSlices, false)
    );
    // Missing one of two backends in 40 tries: probability 2 * (1/2)^40.
    kb.traffic_reaches(rest, 40)
        .with_context(|| format!("after {gone} was removed"))?;

    // Outage: the server stops listening and breaks its connections.
    kb.rt.block_on(kb.server.stop());
    // Refused within a bounded number of tries: a connect to a just-freed loopback
    // port can, rarely, pick that same port as its own source and connect to itself,
    // and the server's connections wind down asynchronously.
    let refused = lb_tests::util::poll("the fake API server to refuse", REQUEST, || {
        Ok(std::net::TcpStream::connect(kb.server.addr())
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
            .then_some(()))
    });
    ensure!(
        refused.is_ok(),
        "the fake API server still accepts connections"
    );
    // Long enough for a client-go style backoff (0.8 s doubling) to have grown
    // past 10 s: 6 failed attempts per kind.
    wait_retries(&mut kb, 6).context("the agent did not notice the outage")?;
    kb.traffic_reaches(rest, 40)
        .context("during the API server outage")?;
    let during = kb.pins.services_json()?;
    ensure!(
        during == [entry.clone()],
        "the service table changed during the outage: {during:#?}"
    );
    // Written while the server refuses connections: nobody can have seen it yet.
    kb.set_slice(&all)?;
    let still = kb.pins.services_json()?;
    ensure!(still == [entry], "changed during the outage: {still:#?}");
    kb.traffic_reaches(rest, 20)?;

    kb.rt.block_on(kb.server.resume());
    kb.pins
        .wait_services("the change made during the outage", RECOVERY, |e| {
            e.len() == 1 && e[0].backends.len() == 3
        })
        .context("recovery after the outage took longer than 2 s")?;
    kb.wait_backends(&all)?;
    kb.traffic_reaches(&all, 60)?;
    Ok(())
}

/// A watch that ends with 410 Gone makes the agent list again; a change made while it
/// could not watch (and so never sent as an event) is in the table afterwards, and
/// the new watch carries later changes.
#[test]
fn watch_410_gone_relists_and_the_table_is_right_afterwards() -> Result<()> {
    let mut kb = KubeBed::new()?;
    kb.start_ready()?;
    let all = kb.pod_names();
    let before = kb.wait_backends(&all)?;

    // Hold the relist until the gap's change is made, so no watch can carry it.
    kb.server.hold_lists(Res::EndpointSlices, true);
    kb.server.expire_watches(Res::EndpointSlices);
    let lists = |kb: &KubeBed| kb.server.calls_of(Res::EndpointSlices, false).len();
    kb.rt.block_on(kb.server.wait_calls(REQUEST, |calls| {
        calls
            .iter()
            .filter(|c| c.res == Res::EndpointSlices && !c.watch)
            .count()
            == 2
    }));
    let (gone, rest) = (all[2], &all[..2]);
    kb.set_slice(rest)?;
    // The relist is held: the table still has all three.
    let held = kb.pins.services_json()?;
    ensure!(
        held == [before.clone()],
        "changed before the relist: {held:#?}"
    );
    kb.traffic_reaches(&all, 60)?;

    kb.server.hold_lists(Res::EndpointSlices, false);
    let after = kb.wait_backends(rest)?;
    ensure!(
        after.frontend == before.frontend && after.rev_nat_id == before.rev_nat_id,
        "the frontend itself changed: {before:#?} -> {after:#?}"
    );
    ensure!(
        kb.server.delivered(Res::EndpointSlices, "MODIFIED", SLICE) == 0,
        "the gap's change was delivered as an event, not by the relist"
    );
    ensure!(lists(&kb) == 2, "slices listed {} times", lists(&kb));
    ensure!(
        kb.server.calls_of(Res::Services, false).len() == 1
            && kb.server.calls_of(Res::Nodes, false).len() == 1,
        "only the expired kind should be listed again: {:#?}",
        kb.server.calls()
    );
    ensure!(
        kb.agent().logged("410 Gone"),
        "no word of the 410 in the log:\n{}",
        log_of(kb.agent())
    );
    kb.traffic_reaches(rest, 40)
        .with_context(|| format!("after the relist removed {gone}"))?;

    // The new watch carries changes again.
    kb.rt
        .block_on(kb.server.wait_watching(Res::EndpointSlices, 1, REQUEST));
    kb.set_slice(&all)?;
    kb.wait_backends(&all)?;
    ensure!(
        kb.server.delivered(Res::EndpointSlices, "MODIFIED", SLICE) >= 1,
        "the last change did not come as an event"
    );
    kb.traffic_reaches(&all, 60)?;
    Ok(())
}

/// An agent SIGKILLed and started again while the API server is down cannot list:
/// it must leave the table the previous agent wrote alone (traffic keeps flowing),
/// and once the server is back it takes over without changing a thing.
#[test]
fn restart_during_an_api_server_outage_keeps_the_table() -> Result<()> {
    let mut kb = KubeBed::new()?;
    kb.start_ready()?;
    let all = kb.pod_names();
    let before = kb.pins.services_value()?;
    kb.traffic_reaches(&all, 30)?;

    kb.rt.block_on(kb.server.stop());
    kb.agent.as_mut().expect("agent started").kill()?;
    kb.start_agent()?;
    wait_retries(&mut kb, 2).context("the new agent did not try the API server")?;
    ensure!(
        !kb.agent().logged("ready and serving"),
        "ready without an API server:\n{}",
        log_of(kb.agent())
    );
    let during = kb.pins.services_value()?;
    ensure!(
        during == before,
        "the table changed while the new agent could not list:\nbefore: {before:#}\nduring: {during:#}"
    );
    kb.traffic_reaches(&all, 60)
        .context("restarted agent, API server down")?;

    kb.rt.block_on(kb.server.resume());
    kb.agent().wait_ready(RECONNECT)?;
    let after = kb.pins.services_value()?;
    ensure!(
        after == before,
        "the table changed across the restart:\nbefore: {before:#}\nafter: {after:#}"
    );
    check_hooks_once(&kb.pins, &kb.bed.cgroup, &default_hook_pins())?;
    kb.traffic_reaches(&all, 60)?;
    Ok(())
}
