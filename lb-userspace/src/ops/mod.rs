//! Health, metrics and status for the agent, over HTTP on tokio and hyper.
//!
//! - [`status`]: what the agent reports ([`AgentStatus`]) and the health rule;
//! - [`metrics`]: the Prometheus metrics (`prometheus-client`);
//! - [`health_check`]: the per-Service `healthCheckNodePort` listeners;
//! - `http`: the hyper glue shared by all listeners.
//!
//! An [`OpsServer`] answers `GET /healthz` (kube-proxy's contract) and, on the
//! metrics address, `/metrics`, `/proxyMode` (as kube-proxy), `/status` (what
//! `lb status` shows about the agent) and `/policy/NS/NAME` (what `lb policy POD`
//! shows about a pod's NetworkPolicies).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::StatusCode;
use tokio::net::TcpListener;

pub mod health_check;
mod http;
pub mod metrics;
pub mod pod_policy;
pub mod status;

pub use health_check::{stop_all, HealthCheckServers};
pub use http::{GetError, MAX_REQUEST_BYTES};
pub use metrics::SYNC_DURATION_BUCKETS;
pub use status::{
    rfc3339, AgentStatus, Clock, Health, ManualClock, Modes, PodAnswer, StatusReport, SystemClock,
    UnreadableFile,
};

use http::{Limits, Reply};

/// kube-proxy's healthz address (`--healthz-bind-address`).
pub const DEFAULT_HEALTHZ_ADDR: &str = "0.0.0.0:10256";
/// kube-proxy's metrics address (`--metrics-bind-address`): local only by default.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:10249";
/// kube-proxy's default: twice its default sync period of 30 s.
pub const DEFAULT_HEALTHZ_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections held at once by one listener; one more evicts the oldest that has
/// not sent its request head (see `http`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Time a client has to send its request head, and again to take the response.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// What `/proxyMode` answers; kube-proxy answers its mode (`iptables`, `ipvs`, ...).
pub const PROXY_MODE: &str = "ebpf";

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Why `lb status` or `lb policy POD` got no answer from the agent's metrics
/// listener.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Get(#[from] GetError),
    #[error(
        "{addr}{path} answered {status}: {message} (is --metrics-address the agent's \
         --metrics-bind-address?)"
    )]
    Status {
        addr: SocketAddr,
        path: String,
        status: StatusCode,
        /// The answer's text (the agent says why).
        message: String,
    },
    #[error("{addr}{path} answered something that is not what lb asked for: {source}")]
    Body {
        addr: SocketAddr,
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

/// `GET path` from the agent's listener at `addr`, its JSON body decoded.
async fn fetch_json<T: serde::de::DeserializeOwned>(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<T, FetchError> {
    let (status, body) = http::get(addr, path, timeout).await?;
    if status != StatusCode::OK {
        return Err(FetchError::Status {
            addr,
            path: path.to_owned(),
            status,
            message: String::from_utf8_lossy(&body).trim().to_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|source| FetchError::Body {
        addr,
        path: path.to_owned(),
        source,
    })
}

/// Asks the agent whose metrics listener is at `addr` for its `/status`.
pub async fn fetch_status(addr: SocketAddr, timeout: Duration) -> Result<StatusReport, FetchError> {
    fetch_json(addr, "/status", timeout).await
}

/// A listen address flag where the empty string means "off", as kube-proxy's
/// `--healthz-bind-address` and `--metrics-bind-address`: parses `""` or
/// `IP:PORT` (`[IPv6]:PORT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindAddress(pub Option<SocketAddr>);

impl std::str::FromStr for BindAddress {
    type Err = std::net::AddrParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Self(None));
        }
        s.parse().map(|addr| Self(Some(addr)))
    }
}

impl std::fmt::Display for BindAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(addr) => write!(f, "{addr}"),
            None => Ok(()),
        }
    }
}

/// Which endpoints a server answers; the others are 404.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routes {
    pub healthz: bool,
    pub metrics: bool,
}

impl Routes {
    pub const ALL: Routes = Routes {
        healthz: true,
        metrics: true,
    };
    pub const HEALTHZ: Routes = Routes {
        healthz: true,
        metrics: false,
    };
    pub const METRICS: Routes = Routes {
        healthz: false,
        metrics: true,
    };
}

#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// `/healthz` says 503 when a change has been pending for longer than this.
    pub healthz_timeout: Duration,
    pub routes: Routes,
    /// Time a client has to send its request head, and again to take the response.
    pub request_timeout: Duration,
    /// Connections held at once; see [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
}

impl ServeConfig {
    /// Both endpoints, [`DEFAULT_REQUEST_TIMEOUT`], [`DEFAULT_MAX_CONNECTIONS`].
    pub fn new(healthz_timeout: Duration) -> Self {
        Self {
            healthz_timeout,
            routes: Routes::ALL,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }

    pub fn routes(mut self, routes: Routes) -> Self {
        self.routes = routes;
        self
    }

    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }
}

/// A bound listener; [`OpsServer::run`] serves it.
pub struct OpsServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    status: Arc<AgentStatus>,
    config: ServeConfig,
}

impl OpsServer {
    pub async fn bind(
        addr: SocketAddr,
        status: Arc<AgentStatus>,
        config: ServeConfig,
    ) -> Result<Self, OpsError> {
        let wrap = |source| OpsError::Bind { addr, source };
        let listener = TcpListener::bind(addr).await.map_err(wrap)?;
        let local_addr = listener.local_addr().map_err(wrap)?;
        Ok(Self {
            listener,
            local_addr,
            status,
            config,
        })
    }

    /// The address actually bound (the port chosen for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until the future is dropped; failed accepts are logged and retried.
    pub async fn run(self) -> Result<(), OpsError> {
        let limits = Limits {
            request_timeout: self.config.request_timeout,
            max_connections: self.config.max_connections,
        };
        let (status, config) = (self.status, self.config);
        let answer: http::Answer = Arc::new(move |path: &str| route(path, &status, &config));
        http::serve(self.listener, limits, answer).await;
        Ok(())
    }
}

/// The agent's own endpoints.
fn route(path: &str, status: &AgentStatus, config: &ServeConfig) -> Option<Reply> {
    match path {
        "/healthz" if config.routes.healthz => {
            let (health, body) = status.healthz_json(config.healthz_timeout);
            let code = if health.healthy {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            Some(Reply::new(code, "application/json", body))
        }
        "/metrics" if config.routes.metrics => Some(Reply::new(
            StatusCode::OK,
            metrics::CONTENT_TYPE,
            status.encode_metrics(),
        )),
        "/proxyMode" if config.routes.metrics => Some(Reply::new(
            StatusCode::OK,
            "text/plain; charset=utf-8",
            PROXY_MODE.to_string(),
        )),
        "/status" if config.routes.metrics => Some(Reply::new(
            StatusCode::OK,
            "application/json",
            status.status_json(),
        )),
        _ if config.routes.metrics && path.starts_with(POLICY_PATH) => {
            Some(pod_policies(&path[POLICY_PATH.len()..], status))
        }
        _ => None,
    }
}

/// Where `/policy/NS/NAME` starts.
const POLICY_PATH: &str = "/policy/";

/// `/policy/NS/NAME`'s answer for `rest` (`NS/NAME`).
fn pod_policies(rest: &str, status: &AgentStatus) -> Reply {
    let Some((namespace, name)) = rest
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
    else {
        return Reply::text(StatusCode::BAD_REQUEST, "ask for /policy/NAMESPACE/NAME");
    };
    match status.pod_policies(namespace, name) {
        PodAnswer::PolicyOff => Reply::text(
            StatusCode::NOT_FOUND,
            "NetworkPolicy is off on this agent (lb agent --network-policy on)",
        ),
        PodAnswer::Unknown => Reply::text(
            StatusCode::NOT_FOUND,
            &format!("NetworkPolicy knows no pod {namespace}/{name}"),
        ),
        PodAnswer::Found(pod) => {
            let mut body = serde_json::to_string(&pod).expect("plain data serializes");
            body.push('\n');
            Reply::new(StatusCode::OK, "application/json", body)
        }
    }
}

/// Asks the agent whose metrics listener is at `addr` about pod
/// `namespace/name`'s NetworkPolicies.
pub async fn fetch_pod_policies(
    addr: SocketAddr,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<crate::control::policy::view::PodPolicies, FetchError> {
    fetch_json(addr, &format!("{POLICY_PATH}{namespace}/{name}"), timeout).await
}

/// Binds `addr` and serves both endpoints on it until the future is dropped.
pub async fn serve(
    addr: SocketAddr,
    status: Arc<AgentStatus>,
    healthz_timeout: Duration,
) -> Result<(), OpsError> {
    OpsServer::bind(addr, status, ServeConfig::new(healthz_timeout))
        .await?
        .run()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_parse_and_empty_is_off() {
        let parse = |s: &str| s.parse::<BindAddress>();
        assert_eq!(parse("").unwrap(), BindAddress(None));
        assert_eq!(
            parse(DEFAULT_HEALTHZ_ADDR).unwrap().0,
            Some(SocketAddr::from(([0, 0, 0, 0], 10256)))
        );
        assert_eq!(
            parse(DEFAULT_METRICS_ADDR).unwrap().to_string(),
            "127.0.0.1:10249"
        );
        assert_eq!(parse("[::1]:80").unwrap().0.unwrap().port(), 80);
        assert!(parse("0.0.0.0").is_err());
        assert!(parse("localhost:80").is_err());
    }
}
