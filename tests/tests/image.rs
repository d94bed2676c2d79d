//! The DaemonSet's own pod, from the image users deploy, on a node made of network
//! namespaces: deploy/daemonset.yaml's pod template (tests/src/daemonset.rs turns it
//! into `podman run` flags, field by field) runs `target/image/lb-image.tar` (what
//! `cargo xtask image` built) under a podman of the test's own (tests/src/podman.rs),
//! with the manifest's security context as written: no privilege, exactly its
//! capabilities, a read-only root filesystem, the runtime's default seccomp profile
//! (podman's), its memory limit.
//!
//! What a kubelet would give the pod, the test gives it:
//! - the host network is the testbed's node namespace (`--network ns:`), never the
//!   machine's own: every packet stays in the test's namespaces;
//! - the in-cluster configuration: a service account directory (token, the test's
//!   own certificate authority, namespace) at the service account's path, and
//!   `KUBERNETES_SERVICE_HOST/PORT` naming the fake API server, which serves HTTPS
//!   on 127.0.0.1 *inside the node namespace* (its socket was made there);
//! - `NODE_NAME` through the manifest's own fieldRef.
//!
//! The manifest's hostPaths map onto test-owned paths: the node's `/sys/fs/bpf` onto
//! a fresh directory on the machine's bpffs (so the agent's `--pin-dir
//! /sys/fs/bpf/lb` is `<that directory>/lb` on the host, read by `lb services
//! --pin-dir` from the test and removed by `lb cleanup`), and the node's
//! `/sys/fs/cgroup` (the cgroup v2 root the hooks attach to) onto the testbed's own
//! child cgroup, where its client pod's probes run. Every container, the image, the
//! podman storage, the pins, the cgroup and the namespaces go when a test ends,
//! however it ends.
//!
//! Needs root, podman, runc, bpftool, the image (`cargo xtask image`, which
//! `cargo xtask test` runs first; or `LB_IMAGE_ARCHIVE`) and the lb binary
//! (`cargo xtask test`; or `LB_BIN`) for reading the pins from the test's side.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use lb_fake_apiserver::{node, FakeApiServer, Res, ServingCert};
use lb_tests::agent::{find_frontend, ServiceEntry, SYNC_TIMEOUT};
use lb_tests::agent_proc::PinDir;
use lb_tests::daemonset::{workspace_root, Node, PodTemplate, Probe};
use lb_tests::load::{LoadRun, LoadSpec};
use lb_tests::manifests::NODE_NAME;
use lb_tests::netns::NetNs;
use lb_tests::podman::{Container, Podman};
use lb_tests::topology::{Pod, GATEWAY};
use lb_tests::util::unique_name;
use lb_tests::{cargo_tools, lb_binary, Testbed, ECHO_TCP_PORT, ECHO_UDP_PORT};
use serde_json::{json, Value};
use tokio::runtime::Runtime;

/// Service `web`: a ClusterIP with a TCP and a UDP port.
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const HTTP: u16 = 80;
const DNS: u16 = 53;
/// Service `web-np`: a NodePort, reached on the node's address.
const NP_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const NODE_PORT: u16 = 30080;
/// Rolling updates in a row, each under load (the defect showed in about one
/// handover of thirteen).
const HANDOVERS: usize = 16;
/// A release agent loads and syncs in about a second; generous for a loaded machine.
const READY: Duration = Duration::from_secs(60);
/// The token the service account directory holds.
const TOKEN: &str = "lb-image-test-token";

/// The image archive: `$LB_IMAGE_ARCHIVE`, else `<target dir>/image/lb-image.tar`.
fn image_archive() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("LB_IMAGE_ARCHIVE") {
        return Ok(PathBuf::from(path));
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("target"),
    };
    let path = target.join("image").join("lb-image.tar");
    ensure!(
        path.is_file(),
        "the image archive is missing at {} (run `cargo xtask image`, or `cargo xtask test` \
         which builds it first, or set LB_IMAGE_ARCHIVE)",
        path.display()
    );
    Ok(path)
}

/// A directory this test created, removed on drop.
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    fn create(path: PathBuf) -> Result<Self> {
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ScratchDir { path })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            eprintln!("warning: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// The node and everything the pod gets from it. Field order is teardown order: the
/// containers go (podman rm), then podman's storage with the loaded image, then the
/// pins (lb cleanup detaches the hooks), the bpffs directory, the API server with
/// its runtime, the service account, and last the namespaces and the cgroup.
struct ImageNode {
    containers: Vec<Container>,
    podman: Podman,
    pins: PinDir,
    bpffs: ScratchDir,
    server: FakeApiServer,
    /// Runs the fake API server's tasks.
    _rt: Runtime,
    service_account: ScratchDir,
    bed: Testbed,
    template: PodTemplate,
    api: SocketAddr,
    /// The node namespace's file: the pod's host network.
    netns: PathBuf,
}

impl ImageNode {
    /// A testbed with `pods` backends and one client, the fake API server (HTTPS,
    /// in the node namespace) holding Services `web` and `web-np` with every pod
    /// and this node's Node, podman with the image loaded. No container yet.
    fn new(pods: usize) -> Result<Self> {
        let lb = lb_binary()?;
        let archive = image_archive()?;
        let template = PodTemplate::read()?;
        let bed = Testbed::new(cargo_tools!(), pods, 1)?;
        let service_account = ScratchDir::create(std::env::temp_dir().join(unique_name("lb-sa")))?;
        let cert = ServingCert::for_ip(Ipv4Addr::LOCALHOST.into());
        for (file, text) in [
            ("token", TOKEN),
            ("ca.crt", cert.ca_pem.as_str()),
            ("namespace", "kube-system"),
        ] {
            std::fs::write(service_account.path.join(file), text)?;
        }
        let listener = bed
            .topo
            .node()
            .run_in(|| Ok(std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?))?;
        let api = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let server = rt.block_on(FakeApiServer::start_tls(listener, &cert));
        let bpffs = ScratchDir::create(Path::new("/sys/fs/bpf").join(unique_name("lb-test-img")))?;
        let netns = bed.topo.node().path();
        // The agent's pin dir, as the manifest names it, on the test's side.
        let pin_dir = template
            .arg("--pin-dir")
            .context("the manifest passes no --pin-dir")?;
        let host_pins = template.host_path(
            &node_view(
                &netns,
                &bpffs.path,
                bed.cgroup.path(),
                &service_account.path,
                api,
            ),
            &pin_dir,
        )?;
        let this = ImageNode {
            containers: Vec::new(),
            podman: Podman::create()?,
            pins: PinDir::at(&lb, &host_pins),
            bpffs,
            server,
            _rt: rt,
            service_account,
            bed,
            template,
            api,
            netns,
        };
        let loaded = this.podman.load(&archive)?;
        eprintln!("loaded {loaded:?} from {}", archive.display());
        this.publish(&this.pod_names())?;
        this.server.apply(Res::Nodes, node(NODE_NAME));
        Ok(this)
    }

    /// What this node gives the pod; see the module doc.
    fn node(&self) -> Node<'_> {
        node_view(
            &self.netns,
            &self.bpffs.path,
            self.bed.cgroup.path(),
            &self.service_account.path,
            self.api,
        )
    }

    fn pod_names(&self) -> Vec<String> {
        self.bed
            .topo
            .pods()
            .iter()
            .map(|p| p.name().to_string())
            .collect()
    }

    fn pod_ip(&self, name: &str) -> Result<Ipv4Addr> {
        Ok(self.bed.topo.pod(name)?.ip())
    }

    /// Services `web` and `web-np` with the pods `names` as ready endpoints on this
    /// node.
    fn publish(&self, names: &[String]) -> Result<()> {
        let endpoints = names
            .iter()
            .map(|n| {
                Ok(json!({
                    "addresses": [self.pod_ip(n)?.to_string()],
                    "conditions": {"ready": true},
                    "nodeName": NODE_NAME,
                }))
            })
            .collect::<Result<Vec<Value>>>()?;
        let http = json!({"name": "http", "port": ECHO_TCP_PORT, "protocol": "TCP"});
        let dns = json!({"name": "dns", "port": ECHO_UDP_PORT, "protocol": "UDP"});
        self.server.apply(
            Res::Services,
            json!({
                "metadata": {"name": "web", "namespace": "default"},
                "spec": {
                    "type": "ClusterIP",
                    "clusterIP": VIP.to_string(),
                    "clusterIPs": [VIP.to_string()],
                    "ports": [
                        {"name": "http", "port": HTTP, "protocol": "TCP", "targetPort": ECHO_TCP_PORT},
                        {"name": "dns", "port": DNS, "protocol": "UDP", "targetPort": ECHO_UDP_PORT},
                    ],
                },
            }),
        );
        self.server.apply(
            Res::Services,
            json!({
                "metadata": {"name": "web-np", "namespace": "default"},
                "spec": {
                    "type": "NodePort",
                    "clusterIP": NP_VIP.to_string(),
                    "clusterIPs": [NP_VIP.to_string()],
                    "ports": [{
                        "name": "http", "port": HTTP, "protocol": "TCP",
                        "targetPort": ECHO_TCP_PORT, "nodePort": NODE_PORT,
                    }],
                },
            }),
        );
        for (slice, service, ports) in [
            ("web-1", "web", json!([http, dns])),
            ("web-np-1", "web-np", json!([http])),
        ] {
            self.server.apply(
                Res::EndpointSlices,
                json!({
                    "metadata": {
                        "name": slice,
                        "namespace": "default",
                        "labels": {"kubernetes.io/service-name": service},
                    },
                    "addressType": "IPv4",
                    "endpoints": endpoints,
                    "ports": ports,
                }),
            );
        }
        Ok(())
    }

    /// Starts the manifest's pod as container `name` (without `drop` among its
    /// capabilities); does not wait for anything.
    fn start(&mut self, name: &str, drop: &[&str]) -> Result<usize> {
        let args = self.template.podman_args(&self.node(), drop)?;
        let container = self.podman.run(name, &args)?;
        self.containers.push(container);
        Ok(self.containers.len() - 1)
    }

    /// The service table (from the test's side, through the pins) holds the three
    /// frontends, each with exactly the pods `names` as backends.
    fn wait_table(&self, names: &[String]) -> Result<Vec<ServiceEntry>> {
        let backends = |port: u16| -> Result<BTreeSet<SocketAddr>> {
            names
                .iter()
                .map(|n| Ok(SocketAddrV4::new(self.pod_ip(n)?, port).into()))
                .collect()
        };
        let (tcp, udp) = (backends(ECHO_TCP_PORT)?, backends(ECHO_UDP_PORT)?);
        self.pins.wait_services(
            &format!("web and web-np with backends {names:?}"),
            SYNC_TIMEOUT,
            |entries| {
                let has = |ip: Ipv4Addr, port, protocol, want: &BTreeSet<SocketAddr>| {
                    find_frontend(entries, ip, port, protocol).is_some_and(|e| {
                        e.backend_addrs() == *want && e.backends.len() == want.len()
                    })
                };
                has(VIP, HTTP, "TCP", &tcp)
                    && has(VIP, DNS, "UDP", &udp)
                    && has(NP_VIP, HTTP, "TCP", &tcp)
                    && has(GATEWAY, NODE_PORT, "TCP", &tcp)
            },
        )
    }

    /// `count` connections from the client pod to `to`, every one answered, by all
    /// of `names`.
    fn traffic_reaches(&self, to: SocketAddrV4, names: &[String], count: u32) -> Result<()> {
        let r = self.bed.tcp(0, to, count)?;
        let want: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        ensure!(
            r.tally.answered == count && r.tally.names() == want,
            "{to}: expected {count} answers from exactly {want:?}: {r:#?}"
        );
        Ok(())
    }

    /// Every probe the manifest declares answers as a kubelet requires.
    fn probes_answer(&self) -> Result<()> {
        let probes = self.template.probes()?;
        ensure!(!probes.is_empty(), "the manifest declares no probe");
        for probe in &probes {
            let code = probe_once(self.bed.topo.node(), probe)?;
            ensure!(
                (200..400).contains(&code),
                "{} GET {}:{}{} answered {code}",
                probe.kind,
                GATEWAY,
                probe.port,
                probe.path
            );
        }
        Ok(())
    }
}

/// The node as the pod sees it: its network namespace, the test-owned paths the
/// manifest's hostPaths stand for (the node's bpffs and cgroup v2 root), the
/// service account and the API server.
fn node_view<'a>(
    netns: &'a Path,
    bpffs: &Path,
    cgroup: &Path,
    service_account: &'a Path,
    api_server: SocketAddr,
) -> Node<'a> {
    Node {
        netns,
        node_name: NODE_NAME,
        host_paths: BTreeMap::from([
            ("/sys/fs/bpf".to_string(), bpffs.to_path_buf()),
            ("/sys/fs/cgroup".to_string(), cgroup.to_path_buf()),
        ]),
        service_account,
        api_server,
    }
}

/// One kubelet probe: `GET path` to the pod's address (the node's, on the host
/// network) from the node's network namespace, within the probe's timeout. The
/// status code.
fn probe_once(node_ns: &NetNs, probe: &Probe) -> Result<u16> {
    use std::io::{Read, Write};
    let to = SocketAddr::from((GATEWAY, probe.port));
    let (path, timeout) = (probe.path.clone(), probe.timeout);
    node_ns.run_in(move || {
        let mut stream = std::net::TcpStream::connect_timeout(&to, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {to}\r\nUser-Agent: kube-probe\r\nConnection: close\r\n\r\n"
        )?;
        let mut text = String::new();
        stream.read_to_string(&mut text)?;
        text.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("no status line in {text:?}"))
    })
}

/// The manifest's pod runs from the image with least privilege: the in-cluster
/// configuration reaches the API server (HTTPS, the service account's token), a
/// pod reaches the ClusterIP and the NodePort Service it serves, the probes
/// answer, `podman exec ... lb services` shows the table, a UDP socket connected to
/// an endpoint that leaves is closed in the client pod's namespace (the
/// capabilities for entering it), sixteen rolling updates in a row (a new container
/// started while the old one runs, then the old one stopped) hand over under load
/// with no failed connection and no crashed agent, and stopping the last container
/// leaves the datapath serving.
#[test]
fn the_daemonsets_pod_serves_from_the_image_and_hands_over_under_load() -> Result<()> {
    let mut n = ImageNode::new(3)?;
    let security = n.template.security_context().clone();
    ensure!(
        security["privileged"] != true && security["capabilities"]["drop"] == json!(["ALL"]),
        "the manifest's container is not least-privilege: {security:#}"
    );
    let all = n.pod_names();

    let first = n.start("lb-agent-0", &[])?;
    n.containers[first]
        .wait_for_line("ready and serving", READY)
        .context("the first container")?;
    n.wait_table(&all)?;
    let token_used = n
        .server
        .calls()
        .iter()
        .any(|c| c.authorization.as_deref() == Some(&format!("Bearer {TOKEN}")));
    ensure!(
        token_used,
        "the agent did not use the service account token: {:#?}",
        n.server.calls()
    );
    n.probes_answer()?;

    // Missing one of three backends in 60 tries: probability 3 * (2/3)^60.
    n.traffic_reaches(SocketAddrV4::new(VIP, HTTP), &all, 60)?;
    n.traffic_reaches(SocketAddrV4::new(GATEWAY, NODE_PORT), &all, 60)?;
    n.traffic_reaches(SocketAddrV4::new(NP_VIP, HTTP), &all, 60)?;

    let listing = n.containers[first].exec(&["lb", "services"])?;
    ensure!(
        listing.status.success(),
        "podman exec lb services: {listing:#?}"
    );
    for frontend in [
        format!("{VIP}:{HTTP}/TCP"),
        format!("{VIP}:{DNS}/UDP"),
        format!("{NP_VIP}:{HTTP}/TCP"),
        format!("{GATEWAY}:{NODE_PORT}/TCP"),
    ] {
        ensure!(
            listing.stdout.contains(&frontend),
            "`lb services` in the container does not list {frontend}:\n{}",
            listing.stdout
        );
    }
    for pod in &all {
        let backend = format!("{}:{ECHO_TCP_PORT}", n.pod_ip(pod)?);
        ensure!(
            listing.stdout.contains(&backend),
            "`lb services` in the container does not list backend {backend}:\n{}",
            listing.stdout
        );
    }
    let links = n.pins.status_links()?;
    ensure!(
        links
            .iter()
            .any(|l| l.name == "br0" && l.role == "node-facing")
            && links.iter().any(|l| l.role == "pod-facing"),
        "the per-packet programs are not on the node's devices: {links:#?}"
    );

    // A connected UDP socket whose endpoint leaves is closed in the client's own
    // namespace: the agent reached it through /proc/<pid>/ns/net (CAP_SYS_PTRACE),
    // entered it (CAP_SYS_ADMIN) and destroyed the socket (CAP_NET_ADMIN).
    let mut follow = n.bed.udp_follow(0, SocketAddrV4::new(VIP, DNS))?;
    let gone = follow
        .next(Duration::from_secs(5))?
        .answer
        .context("udp-follow's first line is an answer")?;
    let rest: Vec<String> = all.iter().filter(|p| **p != gone).cloned().collect();
    n.publish(&rest)?;
    let closed = follow.next(Duration::from_secs(10))?;
    let errno = closed.error.as_deref().unwrap_or_default();
    ensure!(
        closed.socket == 0 && (errno.ends_with("ECONNABORTED") || errno.ends_with("EDESTADDRREQ")),
        "the UDP socket connected to {gone} was not closed when it left: {closed:?}\n{}",
        n.containers[first].log()
    );
    follow.close()?;
    n.wait_table(&rest)?;
    n.publish(&all)?;
    n.wait_table(&all)?;

    // Rolling updates under load: the short connections and the long-lived ones
    // go through the socket hooks of the pinned datapath throughout.
    let load = LoadRun::start(
        env!("CARGO_BIN_EXE_lb-load").as_ref(),
        n.bed.topo.client().netns(),
        &n.bed.cgroup,
        &LoadSpec {
            max_duration: Duration::from_secs(600),
            ..LoadSpec::new(SocketAddrV4::new(VIP, HTTP))
        },
    )?;
    let names: BTreeSet<&str> = n.bed.topo.pods().iter().map(Pod::name).collect();
    ensure!(
        load.long_lived
            .iter()
            .all(|l| names.contains(l.backend.as_str())),
        "long-lived connections did not all open: {:?}",
        load.long_lived
    );
    load.run_for(Duration::from_millis(500))?;
    let grace = n.template.termination_grace();
    let mut current = first;
    for i in 1..=HANDOVERS {
        let next = n.start(&format!("lb-agent-{i}"), &[])?;
        n.containers[next]
            .wait_for_line("waiting for the agent holding the pin directory", READY)
            .with_context(|| format!("handover {i}: the new container"))?;
        ensure!(
            !n.containers[next].logged("ready and serving"),
            "handover {i}: the new agent served beside the old one"
        );
        let status = n.containers[current].stop(grace)?;
        ensure!(
            status.success(),
            "handover {i}: the old container exited with {status}:\n{}",
            n.containers[current].log()
        );
        n.containers[next]
            .wait_for_line("ready and serving", READY)
            .with_context(|| format!("handover {i}: the new agent did not take over"))?;
        ensure!(
            n.containers[next].try_wait()?.is_none(),
            "handover {i}: the new container ended:\n{}",
            n.containers[next].log()
        );
        n.probes_answer()
            .with_context(|| format!("after handover {i}"))?;
        let progress = load.run_for(Duration::from_millis(200))?;
        if progress.failures != 0 || progress.broken != 0 {
            // What failed, how, and what both agents said around it.
            let report = load.stop()?;
            let tail = |log: String| {
                let lines: Vec<&str> = log.lines().collect();
                lines[lines.len().saturating_sub(40)..].join("\n")
            };
            bail!(
                "handover {i}: connections failed: {progress:?}\nby error: {:?}\nsamples: {:?}\n\
                 old agent:\n{}\nnew agent:\n{}",
                report.failures,
                report.failure_samples,
                tail(n.containers[current].log()),
                tail(n.containers[next].log())
            );
        }
        // The stopped container is removed, as the kubelet removes the old pod.
        let old = n.containers.remove(current);
        drop(old);
        current = n.containers.len() - 1;
    }
    load.run_for(Duration::from_millis(500))?;
    let report = load.stop()?;
    eprintln!(
        "{HANDOVERS} handovers under load: {} attempts, {} failed, {} long-lived broken, max connect {:.1} ms",
        report.attempts,
        report.failed(),
        report.broken().count(),
        report.max_connect_ms
    );
    report.check_clean(500)?;
    n.wait_table(&all)?;

    // The last container stops; the datapath stays, with nobody to run it.
    let status = n.containers[current].stop(grace)?;
    ensure!(status.success(), "the last container exited with {status}");
    n.traffic_reaches(SocketAddrV4::new(VIP, HTTP), &all, 60)?;
    n.traffic_reaches(SocketAddrV4::new(GATEWAY, NODE_PORT), &all, 60)?;
    let running: Vec<String> = n
        .podman
        .output(["ps", "--format", "{{.Names}}"])?
        .lines()
        .map(str::to_string)
        .collect();
    ensure!(running.is_empty(), "containers still running: {running:?}");
    Ok(())
}

/// Without CAP_SYS_ADMIN, under podman's default seccomp profile (the manifest's
/// RuntimeDefault), bpf() itself is refused: the agent stops at its first map,
/// says which capability and profile it needs, leaves nothing pinned and never
/// reports ready.
#[test]
fn without_cap_sys_admin_the_agent_says_what_it_lacks() -> Result<()> {
    let mut n = ImageNode::new(1)?;
    let added = n.template.added_capabilities();
    ensure!(
        added.iter().any(|c| c == "SYS_ADMIN"),
        "the manifest does not add SYS_ADMIN any more ({added:?}): choose another \
         capability for this test"
    );
    let c = n.start("lb-agent-no-sys-admin", &["SYS_ADMIN"])?;
    let status = n.containers[c].wait_exit(READY)?;
    let log = n.containers[c].log();
    ensure!(
        !status.success(),
        "the agent ran without CAP_SYS_ADMIN:\n{log}"
    );
    for needle in [
        "the kernel refused to create the maps",
        "CAP_SYS_ADMIN",
        "seccomp",
        "deploy/daemonset.yaml",
    ] {
        ensure!(
            log.contains(needle),
            "the error does not say `{needle}`:\n{log}"
        );
    }
    ensure!(!log.contains("ready and serving"), "{log}");
    let left = pinned_files(n.pins.path())?;
    ensure!(left.is_empty(), "the failed start left pins: {left:?}");
    Ok(())
}

/// Without CAP_SYS_PTRACE the agent runs and serves, but cannot open the network
/// namespace of the client pod's process (root with every capability): a UDP socket
/// connected to an endpoint that leaves stays open, and the agent says which
/// capability that needs.
#[test]
fn without_cap_sys_ptrace_sockets_of_removed_endpoints_stay_and_the_agent_says_why() -> Result<()> {
    let mut n = ImageNode::new(2)?;
    let all = n.pod_names();
    let c = n.start("lb-agent-no-sys-ptrace", &["SYS_PTRACE"])?;
    n.containers[c].wait_for_line("ready and serving", READY)?;
    n.wait_table(&all)?;
    let mut follow = n.bed.udp_follow(0, SocketAddrV4::new(VIP, DNS))?;
    let gone = follow
        .next(Duration::from_secs(5))?
        .answer
        .context("udp-follow's first line is an answer")?;
    let rest: Vec<String> = all.iter().filter(|p| **p != gone).cloned().collect();
    n.publish(&rest)?;
    n.wait_table(&rest)?;
    n.containers[c]
        .wait_for_line("closing their sockets needs CAP_SYS_PTRACE", SYNC_TIMEOUT)
        .with_context(|| format!("the agent's log:\n{}", n.containers[c].log()))?;
    // The agent has given up on that namespace by now: the socket still talks to
    // the endpoint that left (udp-follow prints nothing while the answers do not
    // change).
    let event = follow.next(Duration::from_millis(500));
    ensure!(
        event.is_err(),
        "the socket connected to {gone} changed although its namespace was out of reach: {event:?}"
    );
    follow.close()?;
    Ok(())
}

/// Files (pins) anywhere below `dir`; none when it does not exist.
fn pinned_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => bail!("listing {}: {e}", d.display()),
        };
        for entry in entries {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                dirs.push(entry.path());
            } else {
                files.push(entry.path());
            }
        }
    }
    Ok(files)
}
