//! Running the `lb` agent under test, and reading its view of the maps back with
//! `lb services --json`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::cgroup::Cgroup;
use crate::netns::NetNs;
use crate::process::{Child, Spawner};
use crate::util::{poll, run, unique_name};

/// Loading and attaching the programs and the first sync of a debug build.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// The agent polls its manifests; a change must show in the maps within this.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(15);

/// Where bpffs is mounted; pin dirs must be below it.
pub const BPFFS: &str = "/sys/fs/bpf";

/// The `lb` binary: `$LB_BIN`, else `<target dir>/debug/lb` where the target dir is
/// `$CARGO_TARGET_DIR` or the workspace's `target/`.
pub fn lb_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("LB_BIN") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("LB_BIN={} does not exist", path.display());
        }
        return Ok(path);
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("tests/ is inside the workspace")
            .join("target"),
    };
    let path = target.join("debug").join("lb");
    if !path.is_file() {
        bail!(
            "the lb binary is missing at {} (run `cargo xtask test`, which builds the eBPF \
             object and the agent, or set LB_BIN)",
            path.display()
        );
    }
    Ok(path)
}

/// Mount bpffs at /sys/fs/bpf if it is not mounted (a fresh machine has none).
pub fn ensure_bpffs() -> Result<()> {
    // Tests run in parallel threads: mount at most once per process.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap();
    let mounts = fs::read_to_string("/proc/mounts")?;
    let mounted = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 2 && f[1] == BPFFS && f[2] == "bpf"
    });
    if !mounted {
        run(std::process::Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))
            .context("mounting bpffs")?;
    }
    Ok(())
}

/// One element of `lb services --json`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct ServiceEntry {
    pub frontend: FrontendJson,
    pub rev_nat_id: u32,
    pub affinity_timeout_sec: Option<u32>,
    /// How the per-packet path picks a backend: `random` or `maglev`.
    #[serde(default)]
    pub algorithm: String,
    pub backends: Vec<BackendJson>,
    #[serde(default)]
    pub problems: Vec<serde_json::Value>,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct FrontendJson {
    pub ip: std::net::IpAddr,
    pub port: u16,
    pub protocol: String,
    /// `internal` or `external` (the entry for traffic from outside the cluster
    /// under `externalTrafficPolicy: Local`).
    #[serde(default)]
    pub scope: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct BackendJson {
    pub slot: u32,
    pub id: u32,
    pub ip: std::net::IpAddr,
    pub port: u16,
    /// The endpoint runs on the agent's node.
    #[serde(default)]
    pub local: bool,
    /// Passive health's record of it (`LB_QUARANTINE`), once it refused.
    #[serde(default)]
    pub quarantine: Option<QuarantineJson>,
}

/// A backend's quarantine as `lb services --json` shows it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct QuarantineJson {
    pub active: bool,
    pub remaining_ms: u64,
    pub strikes: u32,
    pub quarantines: u64,
    pub skips: u64,
    pub seen_by: String,
}

impl ServiceEntry {
    pub fn is(&self, vip: impl Into<std::net::IpAddr>, port: u16, protocol: &str) -> bool {
        self.frontend.ip == vip.into()
            && self.frontend.port == port
            && self.frontend.protocol.eq_ignore_ascii_case(protocol)
    }

    pub fn backend_addrs(&self) -> BTreeSet<std::net::SocketAddr> {
        self.backends
            .iter()
            .map(|b| std::net::SocketAddr::new(b.ip, b.port))
            .collect()
    }
}

/// Find a frontend in a `lb services` listing.
pub fn find_frontend<'a>(
    entries: &'a [ServiceEntry],
    vip: impl Into<std::net::IpAddr>,
    port: u16,
    protocol: &str,
) -> Option<&'a ServiceEntry> {
    let vip = vip.into();
    entries.iter().find(|e| e.is(vip, port, protocol))
}

/// `lb` subcommands on one pin directory (`lb SUBCOMMAND --pin-dir DIR ...`), run in
/// the test's own namespace: they only read and write pinned objects. Shared by every
/// handle that owns a pin directory.
pub struct LbCli {
    lb: PathBuf,
    pin_dir: PathBuf,
}

impl LbCli {
    pub fn new(lb: &Path, pin_dir: &Path) -> Self {
        LbCli {
            lb: lb.to_path_buf(),
            pin_dir: pin_dir.to_path_buf(),
        }
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// `lb services --pin-dir DIR --json`.
    pub fn services_json(&self) -> Result<Vec<ServiceEntry>> {
        let out = self.lb_command(&["services", "--json"])?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb services --json` printed unexpected output:\n{out}"))
    }

    /// `lb services --pin-dir DIR` in its human form.
    pub fn services_text(&self) -> Result<String> {
        self.lb_command(&["services"])
    }

    /// `lb stats --pin-dir DIR --json`: counter name -> value.
    pub fn stats(&self) -> Result<BTreeMap<String, u64>> {
        let out = self.lb_command(&["stats", "--json"])?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb stats --json` printed unexpected output:\n{out}"))
    }

    /// `lb policy --pin-dir DIR --json`: each local pod address NetworkPolicy is
    /// enforced on (`address`, `endpoint`, `ingress_enforced`, `egress_enforced`,
    /// `ingress_drops`, `egress_drops`).
    pub fn policy(&self) -> Result<Vec<serde_json::Value>> {
        let out = self.lb_command(&["policy", "--json"])?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb policy --json` printed unexpected output:\n{out}"))
    }

    /// `lb policy NAMESPACE/NAME --json ARGS...` run in `ns`, the agent's network
    /// namespace (its metrics listener is on that namespace's loopback): the
    /// pod's policies, drops and (with `--from`/`--to PEER --port N`) verdict.
    pub fn pod_policy(&self, ns: &NetNs, pod: &str, args: &[&str]) -> Result<serde_json::Value> {
        let out = Spawner::new(&self.lb)
            .label(format!("lb policy {pod}"))
            .netns(ns)?
            .arg("policy")
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .arg(pod)
            .arg("--json")
            .args(args)
            .output(Duration::from_secs(20))?
            .checked_stdout()?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb policy {pod} --json` printed unexpected output:\n{out}"))
    }

    /// `lb stats --per-service --pin-dir DIR --json`: one row per frontend
    /// (`frontend`, `connections`, `no_backend`, `source_range_drops`).
    pub fn per_service_stats(&self) -> Result<Vec<serde_json::Value>> {
        let out = self.lb_command(&["stats", "--per-service", "--json"])?;
        serde_json::from_str(&out).with_context(|| {
            format!("`lb stats --per-service --json` printed unexpected output:\n{out}")
        })
    }

    /// `lb conntrack --pin-dir DIR --json`: the flows of the per-packet path.
    pub fn conntrack(&self) -> Result<Vec<CtFlow>> {
        let out = self.lb_command(&["conntrack", "--json"])?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb conntrack --json` printed unexpected output:\n{out}"))
    }

    /// `lb status --pin-dir DIR --json`: the devices the per-packet programs are on.
    pub fn status_links(&self) -> Result<Vec<LinkStatus>> {
        #[derive(Deserialize)]
        struct Status {
            links: Vec<LinkStatus>,
        }
        let out = self.lb_command(&["status", "--json"])?;
        let status: Status = serde_json::from_str(&out)
            .with_context(|| format!("`lb status --json` printed unexpected output:\n{out}"))?;
        Ok(status.links)
    }

    /// `lb SUBCOMMAND --pin-dir DIR ARGS...` (run in the test's own namespace: it only
    /// reads and writes pinned objects); its stdout.
    pub fn lb_command(&self, args: &[&str]) -> Result<String> {
        let mut cmd = std::process::Command::new(&self.lb);
        cmd.args(&args[..1])
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .args(&args[1..]);
        run(&mut cmd)
    }

    /// `lb cleanup --pin-dir DIR`: detach the hooks and unpin everything (Drop does
    /// this too; tests call it to check what happens after).
    pub fn cleanup(&self) -> Result<()> {
        self.lb_command(&["cleanup"]).map(drop)
    }

    /// Poll `lb services --json` until `pred` holds; returns that listing.
    pub fn wait_services(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[ServiceEntry]) -> bool,
    ) -> Result<Vec<ServiceEntry>> {
        let mut last = None;
        let result = poll(what, timeout, || {
            let entries = self.services_json()?;
            if pred(&entries) {
                return Ok(Some(entries));
            }
            last = Some(entries);
            Ok(None)
        });
        result.with_context(|| format!("last `lb services --json`: {last:#?}"))
    }

    /// `lb cleanup`, then removal of whatever it left (removing the last pin of a
    /// link detaches it) and of the directory; problems are printed, not raised,
    /// since this runs in `Drop`.
    pub(crate) fn remove_pins(&self) {
        if let Err(e) = self.cleanup() {
            eprintln!("warning: lb cleanup failed: {e:#}");
        }
        if self.pin_dir.exists() {
            if let Err(e) = fs::remove_dir_all(&self.pin_dir) {
                eprintln!("warning: cannot remove {}: {e}", self.pin_dir.display());
            }
        }
    }
}

/// One device of `lb status --json`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct LinkStatus {
    pub ifindex: u32,
    pub name: String,
    /// `node-facing` or `pod-facing`.
    pub role: String,
    pub program: String,
    /// `auto` or `flag`.
    pub reason: String,
    /// `tcx` or `netlink`.
    pub mode: String,
    /// `lb_xdp` in front: `native`, `generic`, `refused (...)`, or `-`.
    #[serde(default)]
    pub xdp: String,
}

/// One flow of `lb conntrack --json`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct CtFlow {
    pub protocol: String,
    pub client: std::net::SocketAddr,
    pub frontend: std::net::SocketAddr,
    pub backend: std::net::SocketAddr,
    /// The source the backend sees when it is not the client (remote backend).
    pub snat: Option<std::net::SocketAddr>,
    pub state: String,
    pub idle_ms: u64,
}

/// How to start an agent: what [`Agent::start`] takes, plus the network namespace to
/// run in (interface names of `--iface`/`--pod-iface` are resolved there) and extra
/// flags.
#[derive(Clone)]
pub struct AgentSpec<'a> {
    pub services: &'a Path,
    pub cgroup: &'a Cgroup,
    pub node_name: &'a str,
    pub netns: Option<&'a NetNs>,
    pub extra_args: Vec<String>,
    /// Follow the API server this kubeconfig names instead of `services`.
    pub kubeconfig: Option<&'a Path>,
    /// Pin under this (existing) directory, an earlier agent's, instead of a new one.
    pub pin_dir: Option<&'a Path>,
}

impl<'a> AgentSpec<'a> {
    pub fn new(services: &'a Path, cgroup: &'a Cgroup, node_name: &'a str) -> Self {
        AgentSpec {
            services,
            cgroup,
            node_name,
            netns: None,
            pin_dir: None,
            extra_args: Vec::new(),
            kubeconfig: None,
        }
    }

    pub fn kubeconfig(mut self, path: &'a Path) -> Self {
        self.kubeconfig = Some(path);
        self
    }

    /// Take over the pin directory of an agent stopped with
    /// [`Agent::stop_keeping_pins`]: a restart on the same node.
    pub fn pin_dir(mut self, dir: &'a Path) -> Self {
        self.pin_dir = Some(dir);
        self
    }

    pub fn netns(mut self, ns: &'a NetNs) -> Self {
        self.netns = Some(ns);
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }
}

/// An agent in the test's own (the host's) namespace must not attach the
/// per-packet programs to the host's devices: unless the spec says otherwise it
/// runs the socket hooks only. Agents in a test namespace keep the default (every
/// device of that namespace, found by the agent).
fn tc_default(spec: &AgentSpec<'_>) -> Vec<String> {
    let chosen = spec.extra_args.iter().any(|a| a == "--tc-attach");
    if spec.netns.is_none() && !chosen {
        vec!["--tc-attach".into(), "off".into()]
    } else {
        Vec::new()
    }
}

/// A running `lb agent`. Dropping it stops the agent, runs `lb cleanup` (detach and
/// unpin), removes the pin dir, and prints the agent's log (shown by the test harness
/// only when the test fails).
pub struct Agent {
    child: Child,
    cli: LbCli,
    log_on_drop: bool,
    /// Stopped for a restart: the pins stay for the next agent.
    keep_pins: bool,
}

/// The agent's pin directory is read and cleaned with the same `lb` commands as any.
impl std::ops::Deref for Agent {
    type Target = LbCli;

    fn deref(&self) -> &LbCli {
        &self.cli
    }
}

impl Agent {
    /// Start `lb agent` on `services` (file or dir), attaching to `cgroup`, pinning
    /// under a fresh `/sys/fs/bpf/lb-test-<unique>`.
    pub fn start(lb: &Path, services: &Path, cgroup: &Cgroup, node_name: &str) -> Result<Self> {
        Self::start_with(lb, &AgentSpec::new(services, cgroup, node_name))
    }

    /// Start `lb agent` as `spec` says (network namespace, extra flags).
    pub fn start_with(lb: &Path, spec: &AgentSpec<'_>) -> Result<Self> {
        ensure_bpffs()?;
        let pin_dir = match spec.pin_dir {
            Some(dir) => dir.to_path_buf(),
            None => {
                let dir = Path::new(BPFFS).join(unique_name("lb-test"));
                fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
                dir
            }
        };
        // From here on the pin dir belongs to a guard-less local: build the Agent right
        // away so Drop covers it, or remove it if the spawn fails.
        let spawned = (|| {
            let mut spawner = Spawner::new(lb).label(match spec.netns {
                Some(_) => format!("lb agent {}", spec.node_name),
                None => "lb agent".to_string(),
            });
            if let Some(ns) = spec.netns {
                // Only the network namespace changes: bpffs and the cgroup mounts stay
                // visible (see process.rs for why not `ip netns exec`).
                spawner = spawner.netns(ns)?;
            }
            spawner = spawner.arg("agent");
            spawner = match spec.kubeconfig {
                Some(kubeconfig) => spawner.arg("--kubeconfig").arg(kubeconfig),
                None => spawner.arg("--services-file").arg(spec.services),
            };
            spawner
                .arg("--cgroup")
                .arg(spec.cgroup.path())
                .arg("--pin-dir")
                .arg(&pin_dir)
                .args(["--node-name", spec.node_name])
                // Agents run side by side here: kube-proxy's fixed ports would
                // clash, so health goes to an ephemeral loopback port and metrics
                // are off.
                .args(["--healthz-bind-address", "127.0.0.1:0"])
                .args(["--metrics-bind-address", ""])
                .args(tc_default(spec))
                .args(&spec.extra_args)
                // Plain log lines (see also lines::strip_ansi).
                .env("NO_COLOR", "1")
                .spawn()
        })();
        match spawned {
            Ok(child) => Ok(Agent {
                child,
                cli: LbCli::new(lb, &pin_dir),
                log_on_drop: true,
                keep_pins: false,
            }),
            Err(e) => {
                let _ = fs::remove_dir_all(&pin_dir);
                Err(e)
            }
        }
    }

    /// The agent's process id (for its memory in /proc).
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Whether dropping the agent prints its log (default: yes; the test harness only
    /// shows it for failed tests, but the demo prints it only on error).
    pub fn set_log_on_drop(&mut self, print: bool) {
        self.log_on_drop = print;
    }

    /// The agent's exit status, if it has exited or exits within a moment (a closed
    /// stderr usually means it is exiting right now).
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .wait_timeout(Duration::from_secs(1))
            .ok()
            .flatten()
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> Vec<String> {
        self.child.stderr.snapshot()
    }

    /// Wait for `ready and serving` on stderr.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.wait_for_line("ready and serving", timeout).map(drop)
    }

    /// Wait for a stderr line containing `needle` (fails early if the agent exits).
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> Result<String> {
        self.wait_for_log(&format!("`{needle}`"), timeout, |l| l.contains(needle))
    }

    /// Wait for a stderr line matching `pred`, described by `what` in errors.
    pub fn wait_for_log(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        self.child
            .stderr
            .wait_for(timeout, pred)
            .with_context(|| format!("waiting for {what} from the agent"))
    }

    /// SIGTERM and wait for the agent to exit; it must exit cleanly.
    pub fn stop(&mut self) -> Result<()> {
        let status = self.child.terminate(Duration::from_secs(10))?;
        if !status.success() {
            bail!("lb agent exited with {status} after SIGTERM");
        }
        Ok(())
    }

    /// Stops the agent and leaves its programs and maps pinned (as a node's agent
    /// leaves them on a restart): the pin directory, for the next agent
    /// ([`AgentSpec::pin_dir`]), which then owns it.
    pub fn stop_keeping_pins(mut self) -> Result<PathBuf> {
        self.stop()?;
        self.keep_pins = true;
        Ok(self.cli.pin_dir().to_path_buf())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.terminate(Duration::from_secs(5));
        if !self.keep_pins {
            self.cli.remove_pins();
        }
        if self.log_on_drop && !crate::interrupt::requested() {
            eprintln!("--- lb agent log ---\n{}\n---", self.child.stderr.text());
        }
    }
}
