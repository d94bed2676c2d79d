//! NetworkPolicy end to end through the API-server source: an agent with
//! `--kubeconfig` and `--network-policy on` follows Pods, Namespaces and
//! NetworkPolicies from the fake API server, and what the test writes there
//! (a policy created or deleted, a Pod's labels changed) decides which pod
//! connections get through.
//!
//! One node of `lb_tests::cluster` (the agent in its namespace, finding the pod
//! veths itself): a server pod serving TCP, and two client pods. The fake API
//! server listens on the node namespace's loopback, where the agent reaches it
//! (plain HTTP, no credentials); the traffic stays between the test's pods.
//!
//! Needs root and the lb binary with its embedded eBPF object (`cargo xtask test`
//! builds it; or set LB_BIN).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use lb_fake_apiserver::{namespace, network_policy, node, pod, FakeApiServer, Res};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::agent_proc::Kubeconfig;
use lb_tests::cluster::{node_name, Cluster, DROP_CONNECT_TIMEOUT};
use lb_tests::probe::TcpReport;
use lb_tests::util::poll;
use lb_tests::{cargo_tools, lb_binary};
use serde_json::json;
use tokio::runtime::Runtime;

/// The Kubernetes namespace of every pod here.
const NS: &str = "x";
/// The server pod (labelled `app: server`), serving TCP on [`PORT`].
const SERVER: &str = "server";
/// A client pod without the admitting label.
const CLIENT: &str = "client";
/// A client pod with the admitting label [`ADMITTED`] from the start.
const FRIEND: &str = "friend";
const PORT: u16 = 80;
/// The label the policy admits clients by.
const ADMITTED: (&str, &str) = ("access", "granted");
const POLICY: &str = "server-ingress";
/// Bound for a change on the fake server to show in which connections succeed
/// (watch, compile, map writes), generous for a loaded machine.
const ENFORCED: Duration = Duration::from_secs(20);
/// Bound for requests to reach the fake server.
const REQUEST: Duration = Duration::from_secs(20);
/// Connections per probe: a denied one waits out its connect timeout.
const TRIES: u32 = 2;

/// The node, its agent and the API server it follows. Field order is teardown
/// order: the agent stops (detaching its programs), then the namespaces go, the
/// kubeconfig file, and the fake server with its runtime last.
struct ApiBed {
    agent: Option<Agent>,
    cluster: Cluster,
    kubeconfig: Kubeconfig,
    server: FakeApiServer,
    rt: Runtime,
}

impl ApiBed {
    /// The node with the three pods, the fake server (in the node namespace)
    /// holding the node, namespace `x` and the three Pods, and the agent
    /// following it, ready and watching every kind.
    fn start() -> Result<Self> {
        let lb = lb_binary()?;
        let cluster = Cluster::builder()
            .nodes(1)
            .echo_server(SERVER, 0, &[PORT])
            .client_pod(CLIENT, 0)
            .client_pod(FRIEND, 0)
            .build(cargo_tools!())?;
        let listener = cluster
            .node(0)
            .netns()
            .run_in(|| Ok(std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let server = rt.block_on(FakeApiServer::start_on(listener));
        let kubeconfig = Kubeconfig::write(&server.kubeconfig())?;
        let mut bed = ApiBed {
            agent: None,
            cluster,
            kubeconfig,
            server,
            rt,
        };
        bed.server.apply(Res::Nodes, node(&node_name(0)));
        bed.server.apply(Res::Namespaces, namespace(NS, &[]));
        bed.set_pod(SERVER, &[("app", "server")])?;
        bed.set_pod(CLIENT, &[("app", "client")])?;
        bed.set_pod(FRIEND, &[("app", "client"), ADMITTED])?;

        let node = bed.cluster.node(0);
        let name = node.name();
        let spec = AgentSpec::new(bed.cluster.manifests.path(), node.cgroup(), &name)
            .netns(node.netns())
            .kubeconfig(bed.kubeconfig.path())
            .args(["--network-policy", "on"]);
        let agent = bed.agent.insert(Agent::start_with(&lb, &spec)?);
        agent.wait_ready(READY_TIMEOUT)?;
        for res in Res::ALL {
            bed.rt.block_on(bed.server.wait_watching(res, 1, REQUEST));
        }
        Ok(bed)
    }

    /// Create or replace the Pod object of cluster pod `name`, with `labels`.
    fn set_pod(&self, name: &str, labels: &[(&str, &str)]) -> Result<()> {
        let ip = self.cluster.pod(name)?.ip().to_string();
        let object = pod(NS, name, labels, &node_name(0), &ip, PORT);
        self.server.apply(Res::Pods, object);
        Ok(())
    }

    /// Ingress to the server only from pods labelled [`ADMITTED`].
    fn create_policy(&self) {
        let (key, value) = ADMITTED;
        let spec = json!({
            "podSelector": {"matchLabels": {"app": "server"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {key: value}}}]}],
        });
        self.server
            .apply(Res::NetworkPolicies, network_policy(NS, POLICY, spec));
    }

    fn server_addr(&self) -> Result<SocketAddr> {
        Ok(SocketAddrV4::new(self.cluster.pod(SERVER)?.ip(), PORT).into())
    }

    /// [`TRIES`] new TCP connections from pod `from` to the server pod.
    fn connect(&self, from: &str) -> Result<TcpReport> {
        let ns = self.cluster.pod(from)?.netns();
        self.cluster
            .tcp(ns, self.server_addr()?, TRIES, DROP_CONNECT_TIMEOUT)
    }

    /// Wait until each client's new connections are all answered by the server
    /// (`true`) or all time out, dropped (`false`), as `want` says.
    fn wait_reach(&self, what: &str, want: &[(&str, bool)]) -> Result<()> {
        let mut last = Vec::new();
        let done = poll(what, ENFORCED, || {
            last.clear();
            for &(from, reached) in want {
                let r = self.connect(from)?;
                let ok = if reached {
                    r.tally.answered == TRIES && r.tally.names() == [SERVER].into()
                } else {
                    r.tally.answered == 0 && r.tally.errors_of("ETIMEDOUT") == TRIES
                };
                last.push((from, r));
                if !ok {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        });
        done.with_context(|| format!("last probes: {last:#?}"))
    }
}

/// Before any policy a client reaches the server; a NetworkPolicy created through
/// the API (ingress to the server only from pods labelled `access: granted`)
/// drops the unlabelled client's new connections while the labelled one's are
/// answered; deleting it through the API lets the client in again.
#[test]
fn policy_created_then_deleted_through_the_api() -> Result<()> {
    let bed = ApiBed::start()?;
    bed.wait_reach(
        "both clients to reach the server before any policy",
        &[(CLIENT, true), (FRIEND, true)],
    )?;

    bed.create_policy();
    bed.wait_reach(
        "the policy to drop the unlabelled client only",
        &[(CLIENT, false), (FRIEND, true)],
    )?;
    ensure!(
        bed.server.delivered(Res::NetworkPolicies, "ADDED", POLICY) >= 1,
        "the policy did not reach the agent as an ADDED event"
    );

    bed.server.delete(Res::NetworkPolicies, NS, POLICY);
    bed.wait_reach(
        "the deleted policy to let the client in again",
        &[(CLIENT, true), (FRIEND, true)],
    )?;
    ensure!(
        bed.server
            .delivered(Res::NetworkPolicies, "DELETED", POLICY)
            >= 1,
        "the deletion did not reach the agent as a DELETED event"
    );
    Ok(())
}

/// Under that policy, the client Pod gaining the admitting label through the API
/// is let in; losing it again, it is dropped again.
#[test]
fn pod_label_changed_through_the_api_admits_the_client() -> Result<()> {
    let bed = ApiBed::start()?;
    bed.create_policy();
    bed.wait_reach(
        "the policy to drop the unlabelled client only",
        &[(CLIENT, false), (FRIEND, true)],
    )?;

    bed.set_pod(CLIENT, &[("app", "client"), ADMITTED])?;
    bed.wait_reach(
        "the client to be admitted once labelled",
        &[(CLIENT, true), (FRIEND, true)],
    )?;
    ensure!(
        bed.server.delivered(Res::Pods, "MODIFIED", CLIENT) >= 1,
        "the label change did not reach the agent as a MODIFIED event"
    );

    bed.set_pod(CLIENT, &[("app", "client")])?;
    bed.wait_reach(
        "the client to be dropped once the label is gone",
        &[(CLIENT, false), (FRIEND, true)],
    )?;
    Ok(())
}
