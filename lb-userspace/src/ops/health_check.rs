//! kube-proxy's `healthCheckNodePort` servers: one listener per port of an
//! `externalTrafficPolicy: Local` Service, answering 200 while this node has usable
//! endpoints of it and 503 otherwise, so external load balancers skip the node.
//! They listen on all addresses of the agent's network namespace, of both families,
//! as kube-proxy's do (its per-family proxiers each serve the port).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use hyper::StatusCode;
use tokio::net::TcpListener;

use super::http::{self, Limits, Reply};
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
                *shared.lock() = check.clone();
                continue;
            }
            let listener = match bind_any(port) {
                Ok(listener) => listener,
                Err((addr, source)) => {
                    errors.push(OpsError::Bind { addr, source });
                    continue;
                }
            };
            let shared = Arc::new(Mutex::new(check.clone()));
            let current = shared.clone();
            let answer: http::Answer = Arc::new(move |_: &str| Some(answer(&current.lock())));
            let limits = Limits {
                request_timeout: DEFAULT_REQUEST_TIMEOUT,
                max_connections: DEFAULT_MAX_CONNECTIONS,
            };
            let task = tokio::spawn(http::serve(listener, limits, answer));
            self.running.insert(port, (shared, task));
        }
        errors
    }

    /// Stops every listener and returns once their sockets are closed: the port is
    /// free for the next agent when this returns (an abort alone only asks the task
    /// to stop at its next poll).
    pub async fn shutdown(mut self) {
        let tasks: Vec<_> = std::mem::take(&mut self.running)
            .into_values()
            .map(|(_, task)| task)
            .collect();
        stop_all(tasks).await;
    }
}

/// Aborts `tasks` and waits until each has been dropped, with whatever it owned
/// (its listener among them).
pub async fn stop_all(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for task in &tasks {
        task.abort();
    }
    for task in tasks {
        // A cancelled task's error is the expected outcome; a panic was logged.
        let _ = task.await;
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
/// A listener on every address of both families: `[::]` with IPV6_V6ONLY off
/// (whatever `net.ipv6.bindv6only` says), or `0.0.0.0` on a node without IPv6.
fn bind_any(port: u16) -> Result<TcpListener, (SocketAddr, std::io::Error)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let v6 = SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), port);
    let v4 = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port);
    let socket = |addr: SocketAddr| -> std::io::Result<TcpListener> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        if addr.is_ipv6() {
            socket.set_only_v6(false)?;
        }
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        TcpListener::from_std(socket.into())
    };
    match socket(v6) {
        Ok(listener) => Ok(listener),
        // No IPv6 in this namespace (disabled, or no kernel support).
        Err(e)
            if e.raw_os_error() == Some(libc::EAFNOSUPPORT)
                || e.raw_os_error() == Some(libc::EADDRNOTAVAIL) =>
        {
            socket(v4).map_err(|source| (v4, source))
        }
        Err(source) => Err((v6, source)),
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// One listener takes clients of both families (loopback only).
    #[tokio::test]
    async fn the_listener_serves_both_families() {
        let listener = bind_any(0).expect("bind");
        let port = listener.local_addr().unwrap().port();
        let accept = tokio::spawn(async move {
            for _ in 0..2 {
                listener.accept().await.expect("accept");
            }
        });
        for client in ["127.0.0.1", "::1"] {
            let addr = SocketAddr::new(client.parse().unwrap(), port);
            tokio::net::TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        }
        tokio::time::timeout(std::time::Duration::from_secs(5), accept)
            .await
            .expect("both accepted")
            .unwrap();
    }
}
