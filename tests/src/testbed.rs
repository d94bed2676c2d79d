//! Everything one test needs, owned by one value: the network, the cgroup, the
//! manifest dir, the echo servers and the agent. Field order is teardown order.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde::de::DeserializeOwned;

use crate::agent::{Agent, AgentSpec, READY_TIMEOUT};
use crate::cgroup::Cgroup;
use crate::manifests::{ManifestDir, NODE_NAME};
use crate::probe::{FollowEvent, HoldHello, TcpReport, UdpConnectedReport, UdpReport};
use crate::process::{Child, Spawner};
use crate::topology::Topology;
use crate::util::{require_root, unique_name};

/// Port lb-echo serves TCP and UDP on in every pod; Services target these.
pub const ECHO_TCP_PORT: u16 = 8080;
pub const ECHO_UDP_PORT: u16 = 5353;

/// The helper binaries of this crate.
#[derive(Clone, Debug)]
pub struct Tools {
    pub echo: PathBuf,
    pub probe: PathBuf,
}

impl Tools {
    pub fn new(echo: impl Into<PathBuf>, probe: impl Into<PathBuf>) -> Self {
        Tools {
            echo: echo.into(),
            probe: probe.into(),
        }
    }

    /// lb-echo and lb-probe next to the running executable (how the demo finds them:
    /// cargo builds all binaries of the crate into one directory).
    pub fn beside_current_exe() -> Result<Self> {
        let exe = std::env::current_exe()?;
        let dir = exe.parent().context("executable has no directory")?;
        let tools = Tools::new(dir.join("lb-echo"), dir.join("lb-probe"));
        for bin in [&tools.echo, &tools.probe] {
            ensure!(
                bin.is_file(),
                "{} is missing; build it with `cargo build -p lb-tests --bins`",
                bin.display()
            );
        }
        Ok(tools)
    }
}

/// The helper binaries as cargo built them for this integration test
/// (`CARGO_BIN_EXE_*` is only set when compiling tests, hence a macro).
#[macro_export]
macro_rules! cargo_tools {
    () => {
        $crate::Tools::new(
            env!("CARGO_BIN_EXE_lb-echo"),
            env!("CARGO_BIN_EXE_lb-probe"),
        )
    };
}

/// A topology with echo servers, a cgroup, a manifest dir, and (once started) the
/// agent. Dropping it tears everything down in a safe order.
pub struct Testbed {
    /// First: the agent is stopped and its programs detached before anything else.
    agent: Option<Agent>,
    /// Then the servers and namespaces.
    pub topo: Topology,
    /// Then the cgroup (probes have exited by now; any straggler is killed).
    pub cgroup: Cgroup,
    pub manifests: ManifestDir,
    tools: Tools,
}

impl Testbed {
    /// `pods` backend pods running lb-echo on [`ECHO_TCP_PORT`]/[`ECHO_UDP_PORT`] and
    /// `clients` client pods, a fresh cgroup and an empty manifest dir.
    pub fn new(tools: Tools, pods: usize, clients: usize) -> Result<Self> {
        require_root()?;
        let mut topo = Topology::build(pods, clients)?;
        topo.start_echo(&tools.echo, &[ECHO_TCP_PORT, ECHO_UDP_PORT])?;
        let cgroup = Cgroup::create(&unique_name("lb-test"))?;
        let manifests = ManifestDir::create()?;
        Ok(Testbed {
            agent: None,
            topo,
            cgroup,
            manifests,
            tools,
        })
    }

    /// Start the agent on the manifest dir and wait until it is ready.
    pub fn start_agent(&mut self, lb: &Path) -> Result<&Agent> {
        let dir = self.manifests.path().to_path_buf();
        self.start_agent_on(lb, &dir)
    }

    /// Start the agent on the manifest dir with extra flags; wait until it is ready.
    pub fn start_agent_with(&mut self, lb: &Path, args: &[&str]) -> Result<&Agent> {
        let dir = self.manifests.path().to_path_buf();
        let spec = AgentSpec::new(&dir, &self.cgroup, NODE_NAME).args(args.iter().copied());
        let agent = Agent::start_with(lb, &spec)?;
        self.wait_started(agent)
    }

    /// Start the agent on another services file or dir and wait until it is ready.
    pub fn start_agent_on(&mut self, lb: &Path, services: &Path) -> Result<&Agent> {
        let agent = Agent::start(lb, services, &self.cgroup, NODE_NAME)?;
        self.wait_started(agent)
    }

    fn wait_started(&mut self, agent: Agent) -> Result<&Agent> {
        // Stored before waiting, so a failed start is still cleaned up by Drop.
        let agent = self.agent.insert(agent);
        if let Err(e) = agent.wait_ready(READY_TIMEOUT) {
            return Err(match agent.exit_status() {
                Some(status) => e.context(format!("lb agent exited ({status})")),
                None => e,
            });
        }
        Ok(agent)
    }

    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("agent not started")
    }

    pub fn agent_mut(&mut self) -> &mut Agent {
        self.agent.as_mut().expect("agent not started")
    }

    /// A `lb-probe` command in client pod `client` and in the test cgroup.
    fn probe_cmd(&self, client: usize) -> Result<Spawner> {
        let pod = &self.topo.clients()[client];
        Spawner::new(&self.tools.probe)
            .label(format!("lb-probe in {}", pod.name()))
            .cgroup(&self.cgroup)?
            .netns(pod.netns())
    }

    /// Run `lb-probe ARGS` in client pod `client`; parse its JSON report.
    pub fn probe<T: DeserializeOwned>(
        &self,
        client: usize,
        args: &[String],
        count: u32,
    ) -> Result<T> {
        // Generous but bounded: every attempt may hit the probe's 2 s timeout.
        let timeout = Duration::from_secs(30) + Duration::from_millis(2500) * count;
        let out = self
            .probe_cmd(client)?
            .args(args)
            .output(timeout)?
            .checked_stdout()?;
        serde_json::from_str(out.trim())
            .with_context(|| format!("lb-probe {args:?} printed unexpected output:\n{out}"))
    }

    /// `count` TCP connections to `to` from client `client`.
    pub fn tcp(&self, client: usize, to: impl Into<SocketAddr>, count: u32) -> Result<TcpReport> {
        self.probe(client, &probe_args("tcp", to.into(), count, &[]), count)
    }

    /// `count` unconnected UDP requests, a new socket every `per_socket` datagrams.
    pub fn udp(
        &self,
        client: usize,
        to: impl Into<SocketAddr>,
        count: u32,
        per_socket: u32,
    ) -> Result<UdpReport> {
        let extra = ["--per-socket".to_string(), per_socket.to_string()];
        self.probe(client, &probe_args("udp", to.into(), count, &extra), count)
    }

    /// `count` connected UDP requests, one socket each.
    pub fn udp_connected(
        &self,
        client: usize,
        to: impl Into<SocketAddr>,
        count: u32,
    ) -> Result<UdpConnectedReport> {
        self.probe(
            client,
            &probe_args("udp-connected", to.into(), count, &[]),
            count,
        )
    }

    /// TCP connections to `to` from client `client`, one every `interval`, each
    /// reported; at most `count`, and with `window` only for that long after the
    /// first failure.
    pub fn tcp_seq(
        &self,
        client: usize,
        to: impl Into<SocketAddr>,
        count: u32,
        interval: Duration,
        window: Option<Duration>,
    ) -> Result<crate::probe::SeqReport> {
        let mut extra = vec![
            "--interval-ms".to_string(),
            interval.as_millis().to_string(),
        ];
        if let Some(window) = window {
            extra.extend(["--window-ms".to_string(), window.as_millis().to_string()]);
        }
        self.probe(
            client,
            &probe_args("tcp-seq", to.into(), count, &extra),
            count,
        )
    }

    /// Stops backend pod `name`'s lb-echo: its ports refuse from now on.
    pub fn stop_backend(&mut self, name: &str) -> Result<()> {
        self.topo.pod_mut(name)?.stop_echo();
        Ok(())
    }

    /// Starts backend pod `name`'s lb-echo again on the testbed's ports; returns
    /// once it listens.
    pub fn start_backend(&mut self, name: &str) -> Result<()> {
        let echo = self.tools.echo.clone();
        self.topo
            .pod_mut(name)?
            .start_echo(&echo, &[ECHO_TCP_PORT, ECHO_UDP_PORT])
    }

    /// Open a long-lived TCP connection to `to` from client `client`.
    pub fn hold(&self, client: usize, to: impl Into<SocketAddr>) -> Result<Hold> {
        let child = self
            .probe_cmd(client)?
            .args(["hold", "--to", &to.into().to_string()])
            .stdin_piped()
            .spawn()?;
        Hold::new(child)
    }
}

impl Testbed {
    /// Start `lb-probe udp-follow` to `to` from client `client`; waits for its first
    /// answer.
    pub fn udp_follow(&self, client: usize, to: impl Into<SocketAddr>) -> Result<Follow> {
        let child = self
            .probe_cmd(client)?
            .args(["udp-follow", "--to", &to.into().to_string()])
            .stdin_piped()
            .spawn()?;
        let mut follow = Follow {
            child,
            next_line: 0,
        };
        let first = follow.next(HOLD_TIMEOUT)?;
        ensure!(first.answer.is_some(), "udp-follow began with {first:?}");
        follow.next_line = 0;
        Ok(follow)
    }
}

/// A running `lb-probe udp-follow`: its events, line by line.
pub struct Follow {
    child: Child,
    next_line: usize,
}

impl Follow {
    /// The next event, waiting at most `timeout` for it.
    pub fn next(&mut self, timeout: Duration) -> Result<FollowEvent> {
        let line = self.child.stdout.wait_line(self.next_line, timeout)?;
        self.next_line += 1;
        serde_json::from_str(&line)
            .with_context(|| format!("unexpected line from lb-probe udp-follow: {line}"))
    }

    /// Stops the probe (stdin EOF) and checks it ended cleanly.
    pub fn close(self) -> Result<()> {
        close_probe(self.child, "udp-follow")
    }
}

/// Ends an interactive `lb-probe MODE` the orderly way (stdin EOF) and checks that
/// it exits cleanly in time.
fn close_probe(mut child: Child, mode: &str) -> Result<()> {
    child.close_stdin();
    match child.wait_timeout(HOLD_TIMEOUT)? {
        Some(status) if status.success() => Ok(()),
        Some(status) => anyhow::bail!(
            "lb-probe {mode} exited with {status}: {}",
            child.stderr.text()
        ),
        None => anyhow::bail!("lb-probe {mode} did not exit within {HOLD_TIMEOUT:?}"),
    }
}

fn probe_args(mode: &str, to: SocketAddr, count: u32, extra: &[String]) -> Vec<String> {
    let mut args = vec![
        mode.to_string(),
        "--to".into(),
        to.to_string(),
        "--count".into(),
        count.to_string(),
    ];
    args.extend_from_slice(extra);
    args
}

/// A `lb-probe hold` connection: one established TCP connection, driven line by line.
pub struct Hold {
    child: Child,
    /// The backend that greeted the connection.
    pub backend: String,
    /// The connection's local address ("ip:port"), as the probe reported it.
    pub local: Option<String>,
    /// stdout lines consumed so far (the greeting is line 0).
    next_line: usize,
}

const HOLD_TIMEOUT: Duration = Duration::from_secs(10);

impl Hold {
    /// Wrap a running `lb-probe hold` (spawned with a stdin pipe); waits for its
    /// greeting line.
    pub fn new(child: Child) -> Result<Self> {
        let hello = child.stdout.wait_line(0, HOLD_TIMEOUT)?;
        let hello: HoldHello = serde_json::from_str(&hello)
            .with_context(|| format!("unexpected first line from lb-probe hold: {hello}"))?;
        Ok(Hold {
            child,
            backend: hello.backend,
            local: hello.local,
            next_line: 1,
        })
    }

    /// Close the connection the orderly way (the probe sees EOF on stdin, closes its
    /// socket and exits); fails if the probe does not exit cleanly in time.
    pub fn close(self) -> Result<()> {
        close_probe(self.child, "hold")
    }

    /// Send `line` over the held connection; return the backend's reply line.
    pub fn echo(&mut self, line: &str) -> Result<String> {
        self.child.write_stdin(&format!("{line}\n"))?;
        let reply = self.child.stdout.wait_line(self.next_line, HOLD_TIMEOUT)?;
        self.next_line += 1;
        Ok(reply)
    }
}
