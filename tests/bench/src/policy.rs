//! The `policy` row (issue 27): how long a NetworkPolicy change takes to be
//! enforced, on an agent following 10k pods (100 on its node) in 100 namespaces
//! and 1k policies from manifest files (`--network-policy on`).
//!
//! "Enforced" is read where the kernel programs read it: the pinned map entry the
//! change must rewrite, polled from the moment the changed manifest is renamed
//! into place until the entry holds its new value (the next new flow is judged
//! by it). Three kinds of change, alternating, `CHANGES` of each:
//! - `policy`: a policy's podSelector flips between selecting a local pod and
//!   not (`LB_POLICY_ENDPOINTS[pod]` gains or loses ingress enforcement);
//! - `local pod`: a local pod's label flips in and out of a policy's selector
//!   (the same entry, for another pod);
//! - `remote pod`: a pod on another node takes a label set no pod had (a new
//!   identity: `LB_POLICY_IDENTITY[pod]` changes).
//!
//! The agent's memory (VmRSS, VmHWM) is read when the first state is enforced
//! and after the last change.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use aya::maps::{HashMap as AyaHashMap, Map, MapData};
use lb_common::policy::POLICY_ENFORCE_INGRESS;
use lb_common::{map_names, IpAddrBe, PolicyEndpoint, PIN_LAYOUT_VERSION};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{
    namespace_yaml, network_policy_yaml, ContainerPort, ManifestDir, PodManifest, NODE_NAME,
};
use lb_tests::netns::NetNs;
use lb_tests::util::unique_name;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::run::Config;

const NAMESPACES: u32 = 100;
const PODS: u32 = 10_000;
const POLICIES: u32 = 1_000;
/// Changes of each kind (fewer with `--quick`).
const CHANGES: usize = 400;
/// The longest a change may take before the run is called failed.
const DEADLINE: Duration = Duration::from_secs(10);
/// The namespace of the probed objects: no other policy selects its pods.
const PROBE_NS: &str = "probe";
const L0: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 10);
const L1: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 11);
const R0: Ipv4Addr = Ipv4Addr::new(10, 251, 0, 10);

/// One kind of change: its latencies.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChangeKind {
    pub kind: String,
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

/// The `policy` row, as stored in results.json.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PolicyResult {
    pub pods: u32,
    pub local_pods: u32,
    pub namespaces: u32,
    pub policies: u32,
    pub kinds: Vec<ChangeKind>,
    /// Every change of every kind.
    pub all: ChangeKind,
    /// The agent's memory when the first state was enforced, and after the last
    /// change (KiB).
    pub rss_ready_kib: u64,
    pub hwm_end_kib: u64,
}

fn pod(ns: &str, name: &str, ip: Ipv4Addr, local: bool, labels: &[(&str, &str)]) -> String {
    PodManifest {
        namespace: ns.into(),
        name: name.into(),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        node: if local {
            NODE_NAME.to_owned()
        } else {
            format!("node-{}", 2 + (u32::from(ip) % 99))
        },
        host_ip: IpAddr::V4(Ipv4Addr::new(192, 168, 0, 1)),
        ips: vec![ip.into()],
        ports: vec![ContainerPort {
            name: "http".into(),
            port: 8080,
            protocol: "TCP",
        }],
        host_network: false,
    }
    .to_yaml()
}

/// The cluster: namespaces, 10k pods (one in a hundred on this node) and 1k
/// policies in files of a thousand objects, and the probed objects in files of
/// their own.
fn write_cluster(dir: &ManifestDir) -> Result<()> {
    let mut docs = Vec::new();
    for n in 0..NAMESPACES {
        let name = format!("ns{n}");
        let labels = [
            ("kubernetes.io/metadata.name".to_owned(), name.clone()),
            ("team".to_owned(), format!("t{}", n % 10)),
        ];
        docs.push(namespace_yaml(&name, &labels));
    }
    let probe_labels = [(
        "kubernetes.io/metadata.name".to_owned(),
        PROBE_NS.to_owned(),
    )];
    docs.push(namespace_yaml(PROBE_NS, &probe_labels));
    dir.write("namespaces.yaml", &docs.join("---\n"))?;
    for chunk in 0..PODS / 1000 {
        let docs: Vec<String> = (chunk * 1000..(chunk + 1) * 1000)
            .map(|i| {
                let ip = Ipv4Addr::new(10, 1 + (i / 65536) as u8, (i / 256) as u8, i as u8);
                let app = format!("app{}", (i / 100) % 20);
                pod(
                    &format!("ns{}", i % NAMESPACES),
                    &format!("pod{i}"),
                    ip,
                    i % 100 == (i / 100) % 100,
                    &[("app", &app), ("rev", &format!("r{}", i % 3))],
                )
            })
            .collect();
        dir.write(&format!("pods-{chunk}.yaml"), &docs.join("---\n"))?;
    }
    for chunk in 0..POLICIES / 100 {
        let docs: Vec<String> = (chunk * 100..(chunk + 1) * 100)
            .map(|i| {
                let app = |k: u32| json!({ "matchLabels": { "app": format!("app{}", k % 20) } });
                let spec = match i % 3 {
                    0 => json!({
                        "podSelector": app(i),
                        "ingress": [{ "from": [{ "podSelector": app(i + 1) }],
                                      "ports": [{ "port": "http" }, { "port": 5432 }] }],
                    }),
                    1 => json!({
                        "podSelector": app(i),
                        "ingress": [{ "from": [{ "namespaceSelector":
                                        { "matchLabels": { "team": format!("t{}", i % 10) } } }],
                                      "ports": [{ "port": 8000, "endPort": 8100 }] }],
                    }),
                    _ => json!({
                        "podSelector": app(i),
                        "egress": [{ "to": [{ "ipBlock": { "cidr": format!("172.{}.0.0/16", i % 256),
                                              "except": [format!("172.{}.1.0/24", i % 256)] } }],
                                     "ports": [{ "port": 443 }] }],
                    }),
                };
                network_policy_yaml(&format!("ns{}", i % NAMESPACES), &format!("np{i}"), &spec)
            })
            .collect();
        dir.write(&format!("policies-{chunk}.yaml"), &docs.join("---\n"))?;
    }
    // The probe namespace's second policy selects `sel: a`: L1 flips in and out.
    let by_label = json!({
        "podSelector": { "matchLabels": { "sel": "a" } },
        "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "app1" } } }] }],
    });
    dir.write(
        "probe-by-label.yaml",
        &network_policy_yaml(PROBE_NS, "by-label", &by_label),
    )?;
    dir.write("probe-policy.yaml", &probe_policy(true))?;
    dir.write(
        "probe-l0.yaml",
        &pod(PROBE_NS, "l0", L0, true, &[("probe", "yes")]),
    )?;
    dir.write("probe-l1.yaml", &l1(true))?;
    dir.write("probe-r0.yaml", &r0(0))?;
    Ok(())
}

/// The policy that selects L0 (`probe: yes`) or nothing (`probe: no`).
fn probe_policy(selects: bool) -> String {
    let spec = json!({
        "podSelector": { "matchLabels": { "probe": if selects { "yes" } else { "no" } } },
        "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "app1" } } }],
                      "ports": [{ "port": 5432 }] }],
    });
    network_policy_yaml(PROBE_NS, "probe", &spec)
}

fn l1(selected: bool) -> String {
    pod(
        PROBE_NS,
        "l1",
        L1,
        true,
        &[("sel", if selected { "a" } else { "b" })],
    )
}

/// R0 with a label set of its own at each `generation`: a new identity.
fn r0(generation: usize) -> String {
    pod(
        "ns0",
        "r0",
        R0,
        false,
        &[("app", "app1"), ("gen", &format!("g{generation}"))],
    )
}

struct Maps {
    endpoints: AyaHashMap<MapData, IpAddrBe, PolicyEndpoint>,
    identities: AyaHashMap<MapData, IpAddrBe, u32>,
}

impl Maps {
    fn open(pin_dir: &Path) -> Result<Maps> {
        let dir = pin_dir.join(format!("v{PIN_LAYOUT_VERSION}"));
        let open = |name: &str| -> Result<Map> {
            let path = dir.join(name);
            let data =
                MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
            Ok(Map::from_map_data(data)?)
        };
        Ok(Maps {
            endpoints: AyaHashMap::try_from(open(map_names::POLICY_ENDPOINTS)?)?,
            identities: AyaHashMap::try_from(open(map_names::POLICY_IDENTITY)?)?,
        })
    }

    fn ingress_enforced(&self, pod: Ipv4Addr) -> Option<bool> {
        let key = IpAddrBe::from(IpAddr::from(pod));
        let e = self.endpoints.get(&key, 0).ok()?;
        Some(e.flags & POLICY_ENFORCE_INGRESS != 0)
    }

    fn identity(&self, pod: Ipv4Addr) -> Option<u32> {
        self.identities
            .get(&IpAddrBe::from(IpAddr::from(pod)), 0)
            .ok()
    }
}

/// Polls `done` from now until it holds: how long that took. Every 50 µs, not
/// through `lb_tests::util::poll` (50 ms between looks): the figure is the wait.
fn until(what: &str, mut done: impl FnMut() -> bool) -> Result<Duration> {
    let start = Instant::now();
    loop {
        if done() {
            return Ok(start.elapsed());
        }
        if start.elapsed() > DEADLINE {
            bail!("{what}: not enforced within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn kind_of(kind: &str, mut ms: Vec<f64>) -> ChangeKind {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q).ceil() as usize).clamp(1, ms.len()) - 1];
    ChangeKind {
        kind: kind.to_owned(),
        count: ms.len(),
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        p999_ms: at(0.999),
        max_ms: ms[ms.len() - 1],
    }
}

fn status_kib(pid: u32, field: &str) -> Result<u64> {
    crate::run::proc_status_kib(pid.into(), field)
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

pub fn run(lb: &Path, cfg: &Config) -> Result<PolicyResult> {
    let changes = if cfg.quick { 40 } else { CHANGES };
    let dir = ManifestDir::create()?;
    write_cluster(&dir)?;
    let ns = NetNs::create(&unique_name("lb-bench-policy"))?;
    let cgroup = Cgroup::create(&unique_name("lb-bench-policy"))?;
    let spec = AgentSpec::new(dir.path(), &cgroup, NODE_NAME)
        .netns(&ns)
        .args(["--network-policy", "on"]);
    // Its log is printed if the run fails (the agent is dropped on the way out).
    let mut agent = Agent::start_with(lb, &spec)?;
    agent.wait_ready(READY_TIMEOUT)?;
    let maps = Maps::open(agent.pin_dir())?;
    let first = until("the first state", || {
        maps.ingress_enforced(L0) == Some(true)
            && maps.ingress_enforced(L1) == Some(true)
            && maps.identity(R0).is_some()
    })?;
    println!(
        "  policy: first state enforced {:.0} ms after ready",
        ms(first)
    );
    let pid = agent.pid();
    let rss_ready_kib = status_kib(pid, "VmRSS:")?;

    let (mut policy, mut local, mut remote) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..changes {
        lb_tests::interrupt::check()?;
        // Odd i: back to the first state.
        let on = i % 2 == 1;
        dir.write("probe-policy.yaml", &probe_policy(on))?;
        policy.push(ms(until("the probe policy", || {
            maps.ingress_enforced(L0) == Some(on)
        })?));
        dir.write("probe-l1.yaml", &l1(on))?;
        local.push(ms(until("l1's label", || {
            maps.ingress_enforced(L1) == Some(on)
        })?));
        let before = maps.identity(R0);
        dir.write("probe-r0.yaml", &r0(i + 1))?;
        remote.push(ms(until("r0's identity", || {
            maps.identity(R0).is_some_and(|id| Some(id) != before)
        })?));
    }
    let hwm_end_kib = status_kib(pid, "VmHWM:")?;
    let all = [policy.clone(), local.clone(), remote.clone()].concat();
    let result = PolicyResult {
        pods: PODS + 3,
        local_pods: PODS / 100 + 2,
        namespaces: NAMESPACES + 1,
        policies: POLICIES + 2,
        kinds: vec![
            kind_of("policy", policy),
            kind_of("local pod", local),
            kind_of("remote pod", remote),
        ],
        all: kind_of("all", all),
        rss_ready_kib,
        hwm_end_kib,
    };
    for k in result.kinds.iter().chain([&result.all]) {
        println!(
            "  policy {:<10} n={} p50 {:.2} ms p99 {:.2} ms p99.9 {:.2} ms max {:.2} ms",
            k.kind, k.count, k.p50_ms, k.p99_ms, k.p999_ms, k.max_ms
        );
    }
    println!(
        "  policy agent memory: VmRSS {:.1} MiB when enforced, VmHWM {:.1} MiB at the end",
        result.rss_ready_kib as f64 / 1024.0,
        result.hwm_end_kib as f64 / 1024.0
    );
    ensure!(result.all.count == 3 * changes, "every change was timed");
    agent.set_log_on_drop(false);
    drop(agent);
    drop((ns, cgroup, dir));
    Ok(result)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
