//! kube-proxy's `healthCheckNodePort` servers: one listener per port of an
//! `externalTrafficPolicy: Local` Service, answering 200 while this node has usable
//! endpoints of it and 503 otherwise, so external load balancers skip the node.
//! They listen on all addresses of the agent's network namespace, as kube-proxy's do.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use hyper::StatusCode;
use tokio::net::TcpListener;

use super::http::{self, Limits, Reply};
use super::status::lock;
use super::{OpsError, DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT};
use crate::model::HealthCheck;

/// The running listeners; dropping this stops them.
#[derive(Default)]
pub struct HealthCheckServers {
    running: BTreeMap<u16, (Arc<Mutex<HealthCheck>>, tokio::task::JoinHandle<()>)>,
}

impl HealthCheckServers {
    /// Starts, updates and stops listeners to match `checks`. A port that cannot
    /// be bound is reported and retried on the next update.
    pub async fn update(&mut self, checks: &BTreeMap<u16, HealthCheck>) -> Vec<OpsError> {
        let stale: Vec<u16> = self
            .running
            .keys()
            .filter(|port| !checks.contains_key(port))
            .copied()
            .collect();
        for port in stale {
            if let Some((_, task)) = self.running.remove(&port) {
                task.abort();
            }
        }
        let mut errors = Vec::new();
        for (&port, check) in checks {
            if let Some((shared, _)) = self.running.get(&port) {
                *lock(shared) = check.clone();
                continue;
            }
            let addr = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port);
            let listener = match TcpListener::bind(addr).await {
                Ok(listener) => listener,
                Err(source) => {
                    errors.push(OpsError::Bind { addr, source });
                    continue;
                }
            };
            let shared = Arc::new(Mutex::new(check.clone()));
            let current = shared.clone();
            let answer: http::Answer = Arc::new(move |_: &str| Some(answer(&lock(&current))));
            let limits = Limits {
                request_timeout: DEFAULT_REQUEST_TIMEOUT,
                max_connections: DEFAULT_MAX_CONNECTIONS,
            };
            let task = tokio::spawn(http::serve(listener, limits, answer));
            self.running.insert(port, (shared, task));
        }
        errors
    }
}

impl Drop for HealthCheckServers {
    fn drop(&mut self) {
        for (_, task) in self.running.values() {
            task.abort();
        }
    }
}

/// kube-proxy's body: the Service and its local endpoint count.
fn answer(check: &HealthCheck) -> Reply {
    let body = serde_json::json!({
        "service": {"namespace": check.namespace, "name": check.name},
        "localEndpoints": check.local_endpoints,
        "serviceProxyHealthy": true,
    })
    .to_string();
    let code = if check.local_endpoints > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Reply::new(code, "application/json", body)
}
