//! Restart without disruption: the agent is SIGKILLed and started again on the same
//! pin dir, and the EndpointSlice is rewritten over and over, while `lb-load` keeps
//! opening connections through the VIP and holds long-lived ones open. Not one
//! connection may fail, and no long-lived connection may break.
//!
//! The topology is the socket LB testbed's (three backend pods running lb-echo, one
//! client pod, the test cgroup); the agent runs on a pin dir the test owns
//! (`agent_proc`), so two agents can share it one after the other.
//!
//! Needs root, bpftool, and the lb binary with its embedded eBPF object
//! (`cargo xtask test` builds it; or set LB_BIN).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{find_frontend, ServiceEntry, READY_TIMEOUT, SYNC_TIMEOUT};
use lb_tests::agent_proc::{
    check_hooks_once, default_hook_pins, AgentProc, LinkInfo, PinDir, Source,
};
use lb_tests::load::{LoadReport, LoadRun, LoadSpec};
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, Service, ServicePort, NODE_NAME};
use lb_tests::topology::Pod;
use lb_tests::util::poll;
use lb_tests::{cargo_tools, lb_binary, Testbed, ECHO_TCP_PORT};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const PORT: u16 = 80;

fn web() -> Service {
    Service::new(
        "web",
        VIP,
        vec![ServicePort::tcp("http", PORT.into(), ECHO_TCP_PORT.into())],
    )
}

/// The testbed, the pin dir and the agent on it. Field order is teardown order: the
/// agent is killed, then the pins are removed (detaching the hooks), then the
/// namespaces and the cgroup go.
struct Bed {
    agent: Option<AgentProc>,
    pins: PinDir,
    bed: Testbed,
    lb: PathBuf,
}

impl Bed {
    /// Three backends, one client, Service `web` with all three, the agent started.
    fn new() -> Result<Self> {
        let lb = lb_binary()?;
        let bed = Testbed::new(cargo_tools!(), 3, 1)?;
        let pins = PinDir::create(&lb)?;
        let mut this = Bed {
            agent: None,
            pins,
            bed,
            lb,
        };
        let all: Vec<String> = this
            .bed
            .topo
            .pods()
            .iter()
            .map(|p| p.name().to_string())
            .collect();
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        this.publish(&all)?;
        this.start_agent()?;
        this.wait_backends(&all)?;
        Ok(this)
    }

    fn pod(&self, name: &str) -> Result<&Pod> {
        self.bed.topo.pod(name)
    }

    /// Write `web.yaml`: the Service and its EndpointSlice with the pods `names`.
    fn publish(&self, names: &[&str]) -> Result<()> {
        let svc = web();
        let endpoints = names
            .iter()
            .map(|n| Ok(Endpoint::ready(n, self.pod(n)?.ip())))
            .collect::<Result<Vec<_>>>()?;
        let slice = EndpointSlice::for_service(&svc, endpoints);
        self.bed
            .manifests
            .write("web.yaml", &documents([svc.to_yaml(), slice.to_yaml()]))
    }

    /// Start an agent on the manifests, the test cgroup and the pin dir; wait until it
    /// is ready. Another agent must not be running.
    fn start_agent(&mut self) -> Result<&mut AgentProc> {
        let agent = AgentProc::start(
            &self.lb,
            Source::Files(self.bed.manifests.path()),
            &self.bed.cgroup,
            &self.pins,
            NODE_NAME,
        )?;
        // Stored first, so its log is printed if it does not get ready.
        let agent = self.agent.insert(agent);
        agent.wait_ready(READY_TIMEOUT)?;
        Ok(agent)
    }

    fn agent(&mut self) -> &mut AgentProc {
        self.agent.as_mut().expect("agent started")
    }

    /// Wait until the VIP has exactly the pods `names` as backends.
    fn wait_backends(&self, names: &[&str]) -> Result<ServiceEntry> {
        let want = names
            .iter()
            .map(|n| Ok(SocketAddrV4::new(self.pod(n)?.ip(), ECHO_TCP_PORT).into()))
            .collect::<Result<BTreeSet<_>>>()?;
        let entries = self.pins.wait_services(
            &format!("the VIP to have backends {names:?}"),
            SYNC_TIMEOUT,
            |entries| {
                find_frontend(entries, VIP, PORT, "TCP").is_some_and(|e| e.backend_addrs() == want)
            },
        )?;
        Ok(find_frontend(&entries, VIP, PORT, "TCP")
            .expect("checked by the predicate")
            .clone())
    }

    /// Start lb-load in the client pod and the test cgroup.
    fn load(&self) -> Result<LoadRun> {
        let spec = LoadSpec::new(SocketAddrV4::new(VIP, PORT));
        let run = LoadRun::start(
            env!("CARGO_BIN_EXE_lb-load").as_ref(),
            self.bed.topo.client().netns(),
            &self.bed.cgroup,
            &spec,
        )?;
        let names: BTreeSet<&str> = self.bed.topo.pods().iter().map(Pod::name).collect();
        ensure!(
            run.long_lived.len() == 10
                && run
                    .long_lived
                    .iter()
                    .all(|l| names.contains(l.backend.as_str())),
            "long-lived connections did not all open: {:?}",
            run.long_lived
        );
        Ok(run)
    }

    /// The eight hooks and lb_sock_ops are attached to the test cgroup once each, by the links pinned
    /// under the pin dir (see [`check_hooks_once`]).
    fn check_single_attachment(&self) -> Result<BTreeMap<String, LinkInfo>> {
        check_hooks_once(&self.pins, &self.bed.cgroup, &default_hook_pins())
    }
}

fn summary(report: &LoadReport) -> String {
    format!(
        "{} attempts, {} failed, backends {:?}, max connect {:.1} ms, long-lived: {} open, {} broken, {} exchanges",
        report.attempts,
        report.failed(),
        report.backends,
        report.max_connect_ms,
        report.long_lived.len(),
        report.broken().count(),
        report.long_lived.iter().map(|l| l.exchanges).sum::<u64>(),
    )
}

/// Exactly one agent per pin dir. A second one started while the first runs is
/// refused (non-zero exit, the holder's pid named, the fix given) and changes
/// nothing; one started with --wait-for-lock waits and takes over when the first
/// is stopped (a DaemonSet rolling update), under load, with no failed connection.
#[test]
fn a_second_agent_on_the_pin_dir_is_refused_or_waits_its_turn() -> Result<()> {
    let mut bed = Bed::new()?;
    let before = bed.pins.services_value()?;
    let holder = bed.agent().pid();
    let start = |bed: &Bed, extra: &[&str]| {
        AgentProc::start_with(
            &bed.lb,
            Source::Files(bed.bed.manifests.path()),
            &bed.bed.cgroup,
            &bed.pins,
            NODE_NAME,
            extra,
        )
    };
    let mut second = start(&bed, &[])?;
    let status = second.wait_exit(READY_TIMEOUT)?;
    let log = second.log().join("\n");
    ensure!(
        !status.success(),
        "the second agent ran beside the first:\n{log}"
    );
    ensure!(
        log.contains(&format!("is in use by another lb agent (pid {holder})"))
            && log.contains("--wait-for-lock"),
        "the refusal must name the holder and the fix:\n{log}"
    );
    ensure!(!log.contains("ready and serving"), "{log}");
    ensure!(
        bed.pins.services_value()? == before,
        "the refused agent changed the table"
    );
    drop(second);

    let load = bed.load()?;
    load.run_for(Duration::from_secs(1))?;
    let next = start(&bed, &["--wait-for-lock"])?;
    next.wait_for_line(
        "waiting for the agent holding the pin directory",
        READY_TIMEOUT,
    )?;
    load.run_for(Duration::from_millis(500))?;
    ensure!(
        !next.logged("ready and serving"),
        "the waiting agent started serving beside the first"
    );
    bed.agent().terminate()?;
    // The new agent owns the testbed's teardown from here on.
    let next = bed.agent.insert(next);
    next.wait_ready(READY_TIMEOUT)?;
    load.run_for(Duration::from_secs(1))?;
    let report = load.stop()?;
    eprintln!("handover under load: {}", summary(&report));
    report.check_clean(300)?;
    let after = bed.pins.services_value()?;
    ensure!(after == before, "the table changed across the handover");
    Ok(())
}

/// SIGKILL the agent under load, start a new one on the same pin dir, cgroup and
/// manifests: no connection fails, no long-lived connection breaks, the service
/// table is the same, and the hooks are attached once (the new links replaced the
/// old ones).
#[test]
fn sigkill_and_restart_under_load() -> Result<()> {
    let mut bed = Bed::new()?;
    let before = bed.pins.services_value()?;
    let links_before = bed
        .check_single_attachment()
        .context("before the restart")?;

    let load = bed.load()?;
    load.run_for(Duration::from_secs(1))?;

    let status = bed.agent().kill()?;
    eprintln!("agent killed: {status}");
    // No agent at all for a while: the pinned datapath carries the traffic alone.
    let at_kill = load.run_for(Duration::from_millis(500))?;
    ensure!(
        at_kill.failures == 0 && at_kill.broken == 0,
        "traffic failed while no agent ran: {at_kill:?}"
    );

    bed.start_agent().context("the second agent")?;
    load.run_for(Duration::from_secs(1))?;
    let report = load.stop()?;
    eprintln!("restart under load: {}", summary(&report));
    report.check_clean(300)?;
    ensure!(
        report.backends.len() == 3,
        "not every backend got connections: {report:#?}"
    );

    let after = bed.pins.services_value()?;
    ensure!(
        after == before,
        "`lb services --json` changed across the restart:\nbefore: {before:#}\nafter: {after:#}"
    );
    let links_after = bed.check_single_attachment().context("after the restart")?;
    for (name, old) in &links_before {
        let new = &links_after[name];
        ensure!(
            new.id != old.id && new.prog_id != old.prog_id,
            "{name}: the link was not replaced by the new agent ({old:?} -> {new:?})"
        );
    }
    // The old links are gone from the kernel, not just unpinned.
    let old_ids: Vec<u32> = links_before.values().map(|l| l.id).collect();
    poll(
        "the old agent's links to be released",
        Duration::from_secs(5),
        || {
            let alive: Vec<u32> = old_ids
                .iter()
                .copied()
                .filter(|id| link_exists(*id))
                .collect();
            Ok(alive.is_empty().then_some(()))
        },
    )?;
    bed.agent().ensure_running()?;
    Ok(())
}

fn link_exists(id: u32) -> bool {
    std::process::Command::new("bpftool")
        .args(["link", "show", "id", &id.to_string()])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Rewrite the EndpointSlice 20 times under load (remove a backend, add it back,
/// swap one for another; never without a ready endpoint), each time until the maps
/// show it: no connection fails, and no long-lived connection breaks — neither those
/// whose backend stayed in the Service throughout nor (the socket LB's contract)
/// those whose backend was removed for a while.
#[test]
fn endpoint_churn_under_load() -> Result<()> {
    let bed = Bed::new()?;
    let load = bed.load()?;
    load.run_for(Duration::from_millis(500))?;

    // pod-a stays throughout; pod-b and pod-c come and go and replace each other.
    let steps: [&[&str]; 20] = [
        &["pod-a", "pod-b"],
        &["pod-a", "pod-b", "pod-c"],
        &["pod-a", "pod-c"],
        &["pod-a", "pod-b", "pod-c"],
        &["pod-a"],
        &["pod-a", "pod-b"],
        &["pod-a", "pod-c"],
        &["pod-a", "pod-b"],
        &["pod-a", "pod-b", "pod-c"],
        &["pod-a", "pod-c"],
        &["pod-a"],
        &["pod-a", "pod-c"],
        &["pod-a", "pod-b"],
        &["pod-a", "pod-c"],
        &["pod-a", "pod-b", "pod-c"],
        &["pod-a", "pod-b"],
        &["pod-a"],
        &["pod-a", "pod-b", "pod-c"],
        &["pod-a", "pod-c"],
        &["pod-a", "pod-b", "pod-c"],
    ];
    let mut stayed: BTreeSet<&str> = ["pod-a", "pod-b", "pod-c"].into();
    for (i, step) in steps.iter().enumerate() {
        bed.publish(step)?;
        bed.wait_backends(step)
            .with_context(|| format!("churn step {i}: {step:?}"))?;
        stayed.retain(|p| step.contains(p));
    }
    load.run_for(Duration::from_millis(500))?;
    let report = load.stop()?;
    eprintln!("endpoint churn under load: {}", summary(&report));

    ensure!(
        report.failed() == 0 && report.successes == report.attempts,
        "connections failed during the churn: {report:#?}"
    );
    let broken_stayed: Vec<_> = report
        .broken()
        .filter(|l| stayed.contains(l.backend.as_str()))
        .collect();
    ensure!(
        broken_stayed.is_empty(),
        "long-lived connections to backends that never left ({stayed:?}) broke: {broken_stayed:#?}"
    );
    report.check_clean(300)?;

    // The last step has all three; only a final removal tells whether new connections
    // follow the table.
    bed.publish(&["pod-b"])?;
    bed.wait_backends(&["pod-b"])?;
    let r = bed.bed.tcp(0, SocketAddrV4::new(VIP, PORT), 30)?;
    ensure!(
        r.tally.answered == 30 && r.tally.names() == ["pod-b"].into(),
        "after the churn: {r:#?}"
    );
    Ok(())
}

/// The EndpointSlice changes while no agent runs (SIGKILLed): the datapath keeps
/// the old table meanwhile, and the new agent applies the change on its first sync,
/// all under load without a failed or broken connection.
#[test]
fn restart_applies_a_change_made_while_no_agent_ran() -> Result<()> {
    let mut bed = Bed::new()?;
    let load = bed.load()?;
    load.run_for(Duration::from_millis(500))?;

    bed.agent().kill()?;
    bed.publish(&["pod-a", "pod-b"])?;
    load.run_for(Duration::from_millis(500))?;
    // Nobody applied it: all three are still there.
    bed.wait_backends(&["pod-a", "pod-b", "pod-c"])
        .context("the table changed without an agent")?;

    bed.start_agent().context("the second agent")?;
    bed.wait_backends(&["pod-a", "pod-b"])?;
    load.run_for(Duration::from_secs(1))?;
    let report = load.stop()?;
    eprintln!(
        "change while down, restart under load: {}",
        summary(&report)
    );
    report.check_clean(300)?;
    bed.check_single_attachment()?;

    let r = bed.bed.tcp(0, SocketAddrV4::new(VIP, PORT), 40)?;
    ensure!(
        r.tally.answered == 40 && r.tally.names() == ["pod-a", "pod-b"].into(),
        "after the restart: {r:#?}"
    );
    Ok(())
}
