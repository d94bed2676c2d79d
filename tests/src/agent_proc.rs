//! `lb agent` processes on a pin dir the test owns, for tests where one datapath
//! outlives several agents (kill, restart) or the agent follows an API server
//! (`--kubeconfig`) instead of manifest files.
//!
//! [`PinDir`] owns the pins (and runs `lb cleanup` on drop); [`AgentProc`] is one
//! agent process on it (killed on drop). Declare the `PinDir` before the agents, so
//! the agents are gone before the pins are removed.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::ExitStatus;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

use crate::agent::{ensure_bpffs, LbCli, BPFFS};
use crate::cgroup::Cgroup;
use crate::process::{Child, Spawner};
use crate::util::{poll, run, unique_name};

/// A kubeconfig file (the text a fake API server gives), removed on drop.
pub struct Kubeconfig {
    path: std::path::PathBuf,
}

impl Kubeconfig {
    pub fn write(text: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!("{}.yaml", unique_name("lb-kubeconfig")));
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(Kubeconfig { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// A fresh `/sys/fs/bpf/lb-test-<unique>`; on drop `lb cleanup` detaches and unpins
/// everything below it and the directory is removed.
pub struct PinDir {
    cli: LbCli,
}

impl std::ops::Deref for PinDir {
    type Target = LbCli;

    fn deref(&self) -> &LbCli {
        &self.cli
    }
}

impl PinDir {
    pub fn create(lb: &Path) -> Result<Self> {
        ensure_bpffs()?;
        let path = Path::new(BPFFS).join(unique_name("lb-test"));
        fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(PinDir {
            cli: LbCli::new(lb, &path),
        })
    }

    /// The pin dir at `path`, which an agent creates (one in a container, whose pin
    /// dir lies in a directory the test mounted there); removed on drop like
    /// [`PinDir::create`]'s.
    pub fn at(lb: &Path, path: &Path) -> Self {
        PinDir {
            cli: LbCli::new(lb, path),
        }
    }

    pub fn path(&self) -> &Path {
        self.cli.pin_dir()
    }

    /// `lb services --json` as raw JSON (to compare listings field by field, including
    /// fields [`ServiceEntry`] does not name).
    pub fn services_value(&self) -> Result<serde_json::Value> {
        let out = self.lb_command(&["services", "--json"])?;
        serde_json::from_str(&out)
            .with_context(|| format!("`lb services --json` printed unexpected output:\n{out}"))
    }

    /// The names pinned in `<pin-dir>/links`, sorted.
    pub fn link_pins(&self) -> Result<Vec<String>> {
        let dir = self.path().join("links");
        let mut names = Vec::new();
        for entry in fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    /// `bpftool link show pinned <pin-dir>/links/NAME` for every link pin.
    pub fn pinned_links(&self) -> Result<BTreeMap<String, LinkInfo>> {
        let mut links = BTreeMap::new();
        for name in self.link_pins()? {
            let pin = self.path().join("links").join(&name);
            let out = run(std::process::Command::new("bpftool")
                .args(["-j", "link", "show", "pinned"])
                .arg(&pin))?;
            let info: LinkInfo = serde_json::from_str(&out)
                .with_context(|| format!("bpftool link show printed unexpected output:\n{out}"))?;
            links.insert(name, info);
        }
        Ok(links)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        self.cli.remove_pins();
    }
}

/// One pinned bpf_link, as `bpftool -j link show` describes it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct LinkInfo {
    pub id: u32,
    #[serde(rename = "type")]
    pub link_type: String,
    pub prog_id: u32,
    #[serde(default)]
    pub attach_type: String,
}

/// One program attached to a cgroup, as `bpftool -j cgroup show` lists it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct CgroupProg {
    /// The program id.
    pub id: u32,
    pub attach_type: String,
    pub name: String,
}

/// `bpftool -j cgroup show CGROUP`: the programs attached to it (not inherited ones).
pub fn cgroup_programs(cgroup: &Cgroup) -> Result<Vec<CgroupProg>> {
    let out = run(std::process::Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(cgroup.path()))?;
    if out.trim().is_empty() {
        return Ok(Vec::new());
    }
    serde_json::from_str(&out)
        .with_context(|| format!("bpftool cgroup show printed unexpected output:\n{out}"))
}

/// The attach types of the eight socket hooks (both families) and of
/// `lb_sock_ops` (passive health, on by default), as bpftool names them.
pub const HOOK_ATTACH_TYPES: [&str; 9] = [
    "cgroup_inet4_connect",
    "cgroup_udp4_sendmsg",
    "cgroup_udp4_recvmsg",
    "cgroup_inet4_getpeername",
    "cgroup_inet6_connect",
    "cgroup_udp6_sendmsg",
    "cgroup_udp6_recvmsg",
    "cgroup_inet6_getpeername",
    "cgroup_sock_ops",
];

/// The pin names of the links a default agent attaches to its cgroup: the eight
/// socket hooks and `lb_sock_ops`.
pub fn default_hook_pins() -> Vec<&'static str> {
    let mut pins = lb_common::program_names::ALL.to_vec();
    pins.push(lb_common::program_names::SOCK_OPS);
    pins
}

/// The eight socket hooks and `lb_sock_ops` are attached to `cgroup` exactly once
/// each, they are the programs of the links pinned under `<pin-dir>/links`, and
/// nothing else is pinned there (`hook_pins`: the expected pin names, see
/// [`default_hook_pins`]). Returns the pinned links.
pub fn check_hooks_once(
    pins: &PinDir,
    cgroup: &Cgroup,
    hook_pins: &[&str],
) -> Result<BTreeMap<String, LinkInfo>> {
    let names = pins.link_pins()?;
    let mut want: Vec<String> = hook_pins.iter().map(|s| s.to_string()).collect();
    want.sort();
    ensure!(names == want, "links pinned under the pin dir: {names:?}");
    let links = pins.pinned_links()?;
    let progs = cgroup_programs(cgroup)?;
    let mut types: Vec<&str> = progs.iter().map(|p| p.attach_type.as_str()).collect();
    types.sort_unstable();
    let mut want_types = HOOK_ATTACH_TYPES.to_vec();
    want_types.sort_unstable();
    ensure!(
        types == want_types,
        "`bpftool cgroup show {}`: {progs:#?}",
        cgroup.path().display()
    );
    let attached: std::collections::BTreeSet<u32> = progs.iter().map(|p| p.id).collect();
    let pinned: std::collections::BTreeSet<u32> = links.values().map(|l| l.prog_id).collect();
    ensure!(
        attached == pinned,
        "attached programs {progs:#?} are not those of the pinned links {links:#?}"
    );
    Ok(links)
}

/// Where an agent reads Services and EndpointSlices from.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// `--services-file PATH` (file or directory).
    Files(&'a Path),
    /// `--kubeconfig PATH`.
    Kubeconfig(&'a Path),
}

/// A running `lb agent`. Dropping it kills it (SIGKILL, reaped) and prints its log
/// (shown by the test harness only for failed tests); the pins stay for the
/// [`PinDir`] to remove.
pub struct AgentProc {
    child: Child,
}

impl AgentProc {
    /// Start `lb agent` on `source`, attaching to `cgroup`, pinning under `pins`.
    pub fn start(
        lb: &Path,
        source: Source<'_>,
        cgroup: &Cgroup,
        pins: &PinDir,
        node_name: &str,
    ) -> Result<Self> {
        Self::start_with(lb, source, cgroup, pins, node_name, &[])
    }

    /// [`AgentProc::start`] with more flags.
    pub fn start_with(
        lb: &Path,
        source: Source<'_>,
        cgroup: &Cgroup,
        pins: &PinDir,
        node_name: &str,
        extra: &[&str],
    ) -> Result<Self> {
        let spawner = Spawner::new(lb).label("lb agent").arg("agent");
        let spawner = match source {
            Source::Files(path) => spawner.arg("--services-file").arg(path),
            Source::Kubeconfig(path) => spawner.arg("--kubeconfig").arg(path),
        };
        let child = spawner
            .arg("--cgroup")
            .arg(cgroup.path())
            .arg("--pin-dir")
            .arg(pins.path())
            .args(["--node-name", node_name])
            // Several agents share the machine: no fixed ports.
            .args(["--healthz-bind-address", "127.0.0.1:0"])
            .args(["--metrics-bind-address", ""])
            // It runs in the test's own (the host's) namespace: socket hooks only,
            // never a program on the host's devices.
            .args(["--tc-attach", "off"])
            .args(extra)
            .env("NO_COLOR", "1")
            .spawn()?;
        Ok(AgentProc { child })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> Vec<String> {
        self.child.stderr.snapshot()
    }

    /// Whether some line logged so far contains `needle`.
    pub fn logged(&self, needle: &str) -> bool {
        self.log().iter().any(|l| l.contains(needle))
    }

    /// Wait for a stderr line containing `needle` (fails early if the agent exits).
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> Result<String> {
        self.child
            .stderr
            .wait_for(timeout, |l| l.contains(needle))
            .with_context(|| format!("waiting for `{needle}` from the agent"))
    }

    /// Wait until at least `count` lines logged so far satisfy `pred` (described by
    /// `what` in errors); fails early if the agent exits.
    pub fn wait_for_lines(
        &mut self,
        what: &str,
        count: usize,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<()> {
        poll(what, timeout, || {
            self.ensure_running()?;
            Ok((self.log().iter().filter(|l| pred(l)).count() >= count).then_some(()))
        })
        .with_context(|| format!("agent log:\n{}", self.child.stderr.text()))
    }

    /// Wait for `ready and serving`.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        self.wait_for_line("ready and serving", timeout).map(drop)
    }

    /// The agent has not exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("lb agent exited ({status}):\n{}", self.child.stderr.text());
        }
        Ok(())
    }

    /// Waits for the agent to exit on its own; its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        self.child
            .wait_timeout(timeout)?
            .with_context(|| format!("lb agent still running after {timeout:?}"))
    }

    /// SIGTERM (a pod being stopped) and reap; it must exit cleanly.
    pub fn terminate(&mut self) -> Result<()> {
        let status = self.child.terminate(Duration::from_secs(10))?;
        ensure!(
            status.success(),
            "lb agent exited with {status} after SIGTERM"
        );
        Ok(())
    }

    /// SIGKILL (no chance to clean anything up) and reap.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.child.signal(libc::SIGKILL)?;
        let status = self
            .child
            .wait_timeout(Duration::from_secs(10))?
            .context("lb agent still running 10 s after SIGKILL")?;
        ensure!(!status.success(), "lb agent exited cleanly despite SIGKILL");
        Ok(status)
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.child.kill();
        if !crate::interrupt::requested() {
            eprintln!(
                "--- lb agent (pid {}) log ---\n{}\n---",
                self.child.pid(),
                self.child.stderr.text()
            );
        }
    }
}
