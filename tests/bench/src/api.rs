//! The API-server source's side of the bench: the project's fake API server (real
//! list/watch JSON over HTTP on loopback, tests/fake-apiserver) holds the bench's
//! S Services and EndpointSlices, and the agent follows it with `--kubeconfig`.
//! The objects are the file source's (same names, addresses and ports), written as
//! the API server returns them.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use lb_fake_apiserver::{FakeApiServer, Res};
use serde_json::{json, Value};

use crate::kubeproxy::SvcPort;
use crate::netio::BULK_PORT;
use crate::run::SVC_PORT;

/// The fake API server, on a runtime of its own (the bench is synchronous), and a
/// kubeconfig naming it. Dropped in field order: the file, then the server with
/// its runtime.
pub struct ApiSource {
    kubeconfig: PathBuf,
    server: FakeApiServer,
    runtime: tokio::runtime::Runtime,
}

impl Drop for ApiSource {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
        self.runtime.block_on(self.server.stop());
    }
}

impl ApiSource {
    /// Starts the server; the kubeconfig goes into `dir`.
    pub fn start(dir: &Path) -> Result<Self> {
        // One worker: the agent and the bench's clients need the other CPU.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the fake API server's runtime")?;
        let server = runtime.block_on(FakeApiServer::start());
        let kubeconfig = dir.join("kubeconfig.yaml");
        std::fs::write(&kubeconfig, server.kubeconfig())
            .with_context(|| format!("writing {}", kubeconfig.display()))?;
        Ok(ApiSource {
            kubeconfig,
            server,
            runtime,
        })
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes (creates or replaces) each Service and its slice; then forgets the
    /// history, so an agent lists them rather than replaying a million events.
    pub fn load(&self, services: &[SvcPort]) {
        for svc in services {
            self.put(svc);
        }
        for res in Res::ALL {
            self.server.compact(res);
        }
    }

    /// Writes one Service and its slice: a change the agent sees as two events
    /// (only the slice's differs when the Service stayed).
    pub fn put(&self, svc: &SvcPort) {
        self.server.apply(Res::Services, service_json(svc));
        self.server.apply(Res::EndpointSlices, slice_json(svc));
    }

    /// Writes only `svc`'s slice (an endpoint change, as the EndpointSlice
    /// controller makes it).
    pub fn put_slice(&self, svc: &SvcPort) {
        self.server.apply(Res::EndpointSlices, slice_json(svc));
    }
}

fn slice_name(svc: &SvcPort) -> String {
    format!("{}-bench", svc.name)
}

/// The Service as the API server returns it; the measured one (it has a NodePort in
/// the file source) gets the bulk port too, so both sources list S + 1 frontends.
fn service_json(svc: &SvcPort) -> Value {
    let mut ports = vec![json!({
        "name": svc.port_name, "port": svc.port, "protocol": "TCP", "targetPort": svc.target_port,
    })];
    if svc.node_port.is_some() {
        ports.push(json!({
            "name": "bulk", "port": SVC_PORT + 1, "protocol": "TCP", "targetPort": BULK_PORT,
        }));
    }
    json!({
        "metadata": {"name": svc.name, "namespace": svc.namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": svc.cluster_ip.to_string(),
            "clusterIPs": [svc.cluster_ip.to_string()],
            "ipFamilies": ["IPv4"],
            "ports": ports,
        },
    })
}

fn slice_json(svc: &SvcPort) -> Value {
    let endpoints: Vec<Value> = svc
        .endpoints
        .iter()
        .enumerate()
        .map(|(j, ip): (usize, &Ipv4Addr)| {
            json!({
                "addresses": [ip.to_string()],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "targetRef": {"kind": "Pod", "namespace": svc.namespace, "name": format!("{}-{j}", svc.name)},
            })
        })
        .collect();
    let mut ports =
        vec![json!({"name": svc.port_name, "port": svc.target_port, "protocol": "TCP"})];
    if svc.node_port.is_some() {
        ports.push(json!({"name": "bulk", "port": BULK_PORT, "protocol": "TCP"}));
    }
    json!({
        "metadata": {
            "name": slice_name(svc),
            "namespace": svc.namespace,
            "labels": {
                "kubernetes.io/service-name": svc.name,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": ports,
    })
}
