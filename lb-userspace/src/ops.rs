//! Health and metrics for the agent: `GET /healthz` with kube-proxy's contract and
//! `GET /metrics` in the Prometheus text format 0.0.4.
//!
//! The health rule is kube-proxy's: the agent is healthy once the initial sync is
//! done, as long as no change has been waiting to be applied for longer than the
//! healthz timeout. The agent reports a change that arrived with
//! [`AgentStatus::record_pending`] and a successful apply with
//! [`AgentStatus::record_sync`]; a quiet cluster, where nothing changes for hours,
//! stays healthy.
//!
//! The agent reports into an [`AgentStatus`] shared through an `Arc`; an [`OpsServer`]
//! answers from it. The server is a deliberately small HTTP/1.1 implementation on
//! tokio: one request per connection (`Connection: close`), a request head of at most
//! [`MAX_REQUEST_BYTES`] that must arrive within the request timeout, at most
//! [`MAX_CONNECTIONS`] connections at once, no request bodies.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::model::HealthCheck;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

/// kube-proxy's healthz address (`--healthz-bind-address`).
pub const DEFAULT_HEALTHZ_ADDR: &str = "0.0.0.0:10256";
/// kube-proxy's metrics address (`--metrics-bind-address`): local only by default.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:10249";
/// kube-proxy's default: twice its default sync period of 30 s.
pub const DEFAULT_HEALTHZ_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest request head (request line and headers) accepted; longer ones get 431.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// Connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send its request head, and again to take the response.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bounds of the `lb_sync_duration_seconds` buckets (`+Inf` is implicit).
pub const SYNC_DURATION_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// What `lastUpdated` says before the first sync: Go's zero time, as kube-proxy's
/// clients would see it.
const NEVER: &str = "0001-01-01T00:00:00Z";
/// Bytes of an unread request still taken after the response, so that closing the
/// socket does not reset the connection before the client read the response.
const DRAIN_BYTES: usize = 64 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(1);
/// Pause after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Where [`AgentStatus`] gets the time from; tests substitute a [`ManualClock`].
pub trait Clock: Send + Sync {
    /// For measuring age (of a pending change): never jumps.
    fn monotonic(&self) -> Instant;
    /// For showing times (`lastUpdated`, timestamps).
    fn wall(&self) -> SystemTime;
}

/// The system's clocks.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn monotonic(&self) -> Instant {
        Instant::now()
    }
    fn wall(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to; both of its readings move together.
#[derive(Debug)]
pub struct ManualClock {
    monotonic: Instant,
    wall: SystemTime,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    /// Starts at wall-clock time `wall`.
    pub fn new(wall: SystemTime) -> Self {
        Self {
            monotonic: Instant::now(),
            wall,
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    pub fn advance(&self, by: Duration) {
        *lock(&self.elapsed) += by;
    }
}

impl Clock for ManualClock {
    fn monotonic(&self) -> Instant {
        self.monotonic + *lock(&self.elapsed)
    }
    fn wall(&self) -> SystemTime {
        self.wall + *lock(&self.elapsed)
    }
}

/// A lock that a panic elsewhere does not poison for good: the state is plain
/// numbers, consistent after every statement.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

type ScrapeHook = Arc<dyn Fn(&AgentStatus) + Send + Sync>;

#[derive(Default)]
struct State {
    initial_sync_done: bool,
    /// Last successful sync, for display (`lastUpdated`, the timestamp metric).
    last_sync: Option<(Instant, SystemTime)>,
    /// When the oldest change not yet applied arrived; `None` when nothing waits.
    pending_since: Option<Instant>,
    syncs: u64,
    sync_errors: u64,
    /// Observations per bucket of `SYNC_DURATION_BUCKETS`, not cumulative; the ones
    /// above the last bound are only in `syncs`.
    duration_buckets: [u64; SYNC_DURATION_BUCKETS.len()],
    duration_sum: f64,
    frontends: u64,
    backends: u64,
    object_errors: u64,
    /// Manifest files that could not be read: (path, why), in file name order.
    unreadable_files: Vec<(PathBuf, String)>,
    /// Map name -> (entries, capacity).
    maps: BTreeMap<String, (u64, u64)>,
    datapath: BTreeMap<String, u64>,
    /// Frontend (as `lb services` prints it) -> (connections, refused).
    services: BTreeMap<String, (u64, u64)>,
}

/// What the agent has done, for `/healthz` and `/metrics`. Share it as
/// `Arc<AgentStatus>`; every method takes `&self`.
pub struct AgentStatus {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    scrape_hook: Mutex<Option<ScrapeHook>>,
}

/// The answer of `/healthz`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Health {
    /// The initial sync is done and no change has been pending for longer than the
    /// timeout.
    pub healthy: bool,
    /// The last successful sync, if any.
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
}

impl Default for AgentStatus {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentStatus {
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: Mutex::new(State::default()),
            scrape_hook: Mutex::new(None),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The first full service table is in the maps: from now on `/healthz` can say 200.
    pub fn mark_initial_sync(&self) {
        self.state().initial_sync_done = true;
    }

    pub fn initial_sync_done(&self) -> bool {
        self.state().initial_sync_done
    }

    /// New objects arrived: a change waits to be applied (kube-proxy's
    /// `QueuedUpdate`). Starts the pending clock unless a change is pending already;
    /// the oldest one counts.
    pub fn record_pending(&self) {
        let now = self.clock.monotonic();
        self.state().pending_since.get_or_insert(now);
    }

    /// A reconcile pass succeeded: it applied a plan, or it checked the maps and
    /// found nothing to change (kube-proxy's `Updated`). Sets `lastUpdated` and
    /// clears the pending change.
    ///
    /// A change that arrives while a pass runs, after the pass took its input, is
    /// cleared too; call [`AgentStatus::record_pending`] again after this if such a
    /// change is still queued.
    pub fn record_sync(&self, duration: Duration, frontends: usize, backends: usize) {
        let now = (self.clock.monotonic(), self.clock.wall());
        let seconds = duration.as_secs_f64();
        let mut state = self.state();
        state.last_sync = Some(now);
        state.pending_since = None;
        state.syncs += 1;
        state.duration_sum += seconds;
        if let Some(bucket) = SYNC_DURATION_BUCKETS.iter().position(|le| seconds <= *le) {
            state.duration_buckets[bucket] += 1;
        }
        state.frontends = frontends as u64;
        state.backends = backends as u64;
    }

    /// A reconcile pass failed (the kernel refused a write, a map could not be read).
    /// A pending change stays pending, so failures that last longer than the
    /// healthz timeout make `/healthz` say 503.
    pub fn record_sync_error(&self) {
        self.state().sync_errors += 1;
    }

    /// Objects skipped by the last interpretation (invalid Services, slices, files).
    pub fn record_object_errors(&self, count: usize) {
        self.state().object_errors = count as u64;
    }

    /// The manifest files the last read could not read, each with the reason,
    /// replacing the previous list (empty: every file was read).
    pub fn set_unreadable_files(&self, files: Vec<(PathBuf, String)>) {
        self.state().unreadable_files = files;
    }

    /// The manifest files that cannot be read right now, (path, reason), in file
    /// name order: reported until the file is fixed or removed.
    pub fn unreadable_files(&self) -> Vec<(PathBuf, String)> {
        self.state().unreadable_files.clone()
    }

    /// Entries in use and the size of one pinned map, e.g. `LB_SERVICES`.
    pub fn set_map_usage(&self, map: &str, entries: usize, capacity: u32) {
        self.state()
            .maps
            .insert(map.to_string(), (entries as u64, u64::from(capacity)));
    }

    /// The datapath counters (`PinnedMaps::stats()`), replacing the previous ones.
    pub fn set_datapath_counters(&self, counters: &[(&str, u64)]) {
        self.state().datapath = counters
            .iter()
            .map(|(name, value)| (name.to_string(), *value))
            .collect();
    }

    /// Per-frontend counters: (frontend, connections, refused for want of a
    /// backend), replacing the previous ones.
    pub fn set_service_counters(&self, counters: &[(String, u64, u64)]) {
        self.state().services = counters
            .iter()
            .map(|(frontend, connections, refused)| (frontend.clone(), (*connections, *refused)))
            .collect();
    }

    /// Runs `hook` before each `/metrics` answer, e.g. to read fresh datapath
    /// counters with [`AgentStatus::set_datapath_counters`]. Replaces an earlier hook.
    pub fn on_scrape(&self, hook: impl Fn(&AgentStatus) + Send + Sync + 'static) {
        *lock(&self.scrape_hook) = Some(Arc::new(hook));
    }

    /// Healthy when the initial sync is done and either no change is pending or the
    /// oldest pending change is at most `timeout` old. How long ago the last sync was
    /// does not matter: a quiet cluster stays healthy.
    pub fn health(&self, timeout: Duration) -> Health {
        let (now, current_time) = (self.clock.monotonic(), self.clock.wall());
        let state = self.state();
        let pending_ok = state
            .pending_since
            .is_none_or(|since| now.saturating_duration_since(since) <= timeout);
        Health {
            healthy: state.initial_sync_done && pending_ok,
            last_updated: state.last_sync.map(|(_, wall)| wall),
            current_time,
        }
    }

    /// The `/healthz` body: kube-proxy's fields, times in RFC 3339 (UTC).
    pub fn healthz_json(&self, timeout: Duration) -> (Health, String) {
        let health = self.health(timeout);
        let last = health
            .last_updated
            .map_or_else(|| NEVER.to_string(), rfc3339);
        let body = format!(
            "{{\"lastUpdated\": \"{last}\", \"currentTime\": \"{}\", \"nodeEligible\": true}}\n",
            rfc3339(health.current_time)
        );
        (health, body)
    }

    /// The `/metrics` body, after running the scrape hook.
    pub fn render_metrics(&self) -> String {
        let hook = lock(&self.scrape_hook).clone();
        if let Some(hook) = hook {
            hook(self);
        }
        let now = self.clock.monotonic();
        let state = self.state();
        let mut out = String::with_capacity(4096);

        family(
            &mut out,
            "lb_sync_duration_seconds",
            "histogram",
            "Time one reconcile pass of the service table took.",
        );
        let mut cumulative = 0;
        for (le, count) in SYNC_DURATION_BUCKETS.iter().zip(state.duration_buckets) {
            cumulative += count;
            sample(
                &mut out,
                "lb_sync_duration_seconds_bucket",
                &[("le", &le.to_string())],
                cumulative,
            );
        }
        sample(
            &mut out,
            "lb_sync_duration_seconds_bucket",
            &[("le", "+Inf")],
            state.syncs,
        );
        sample(
            &mut out,
            "lb_sync_duration_seconds_sum",
            &[],
            state.duration_sum,
        );
        sample(&mut out, "lb_sync_duration_seconds_count", &[], state.syncs);

        family(
            &mut out,
            "lb_syncs_total",
            "counter",
            "Successful reconcile passes of the service table.",
        );
        sample(&mut out, "lb_syncs_total", &[], state.syncs);
        family(
            &mut out,
            "lb_sync_errors_total",
            "counter",
            "Failed reconcile passes of the service table.",
        );
        sample(&mut out, "lb_sync_errors_total", &[], state.sync_errors);
        family(
            &mut out,
            "lb_object_errors",
            "gauge",
            "Objects skipped as invalid by the last interpretation.",
        );
        sample(&mut out, "lb_object_errors", &[], state.object_errors);
        family(
            &mut out,
            "lb_manifest_files_unreadable",
            "gauge",
            "Manifest files the last read could not read (their last good objects stay).",
        );
        sample(
            &mut out,
            "lb_manifest_files_unreadable",
            &[],
            state.unreadable_files.len() as u64,
        );
        family(
            &mut out,
            "lb_manifest_file_unreadable",
            "gauge",
            "1 for each manifest file that cannot be read, by path.",
        );
        for (path, _) in &state.unreadable_files {
            let path = path.to_string_lossy();
            sample(
                &mut out,
                "lb_manifest_file_unreadable",
                &[("path", &path)],
                1u64,
            );
        }
        family(
            &mut out,
            "lb_last_sync_timestamp_seconds",
            "gauge",
            "Unix time of the last successful reconcile pass; 0 before the first.",
        );
        let last = state.last_sync.map_or(0.0, |(_, wall)| unix_seconds(wall));
        sample(&mut out, "lb_last_sync_timestamp_seconds", &[], last);
        family(
            &mut out,
            "lb_sync_pending_seconds",
            "gauge",
            "Age of the oldest change not yet applied; 0 when nothing is pending.",
        );
        let pending = state.pending_since.map_or(0.0, |since| {
            now.saturating_duration_since(since).as_secs_f64()
        });
        sample(&mut out, "lb_sync_pending_seconds", &[], pending);
        family(
            &mut out,
            "lb_initial_sync_done",
            "gauge",
            "1 once the first full service table is in the maps.",
        );
        sample(
            &mut out,
            "lb_initial_sync_done",
            &[],
            u64::from(state.initial_sync_done),
        );
        family(
            &mut out,
            "lb_frontends",
            "gauge",
            "Service frontends (IP, port, protocol) in the last synced table.",
        );
        sample(&mut out, "lb_frontends", &[], state.frontends);
        family(
            &mut out,
            "lb_backends",
            "gauge",
            "Backends in the last synced table, counted per frontend.",
        );
        sample(&mut out, "lb_backends", &[], state.backends);

        family(
            &mut out,
            "lb_map_entries",
            "gauge",
            "Entries in use in a pinned BPF map.",
        );
        for (map, (entries, _)) in &state.maps {
            sample(&mut out, "lb_map_entries", &[("map", map)], *entries);
        }
        family(
            &mut out,
            "lb_map_capacity",
            "gauge",
            "Maximum entries of a pinned BPF map.",
        );
        for (map, (_, capacity)) in &state.maps {
            sample(&mut out, "lb_map_capacity", &[("map", map)], *capacity);
        }
        family(
            &mut out,
            "lb_datapath_events_total",
            "counter",
            "Datapath events counted by the kernel programs, summed over CPUs.",
        );
        for (event, value) in &state.datapath {
            sample(
                &mut out,
                "lb_datapath_events_total",
                &[("event", event)],
                *value,
            );
        }
        for (name, help, pick) in [
            (
                "lb_service_connections_total",
                "Connections sent to a backend of the frontend (socket hooks and per-packet flows).",
                0,
            ),
            (
                "lb_service_rejected_total",
                "Connections refused or dropped for want of a usable backend.",
                1,
            ),
        ] {
            family(&mut out, name, "counter", help);
            for (frontend, (connections, refused)) in &state.services {
                let value = if pick == 0 { *connections } else { *refused };
                sample(&mut out, name, &[("frontend", frontend)], value);
            }
        }
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    // Help texts here have no backslashes or newlines to escape.
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A sample value: integers print as integers, floats in Rust's shortest
/// round-trip form (never exponent notation), both valid in the text format.
trait SampleValue {
    fn write_to(&self, out: &mut String);
}

impl SampleValue for u64 {
    fn write_to(&self, out: &mut String) {
        let _ = write!(out, "{self}");
    }
}

impl SampleValue for f64 {
    fn write_to(&self, out: &mut String) {
        if self.is_finite() {
            let _ = write!(out, "{self}");
        } else if self.is_nan() {
            out.push_str("NaN");
        } else if *self > 0.0 {
            out.push_str("+Inf");
        } else {
            out.push_str("-Inf");
        }
    }
}

fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: impl SampleValue) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (key, value)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(key);
            out.push_str("=\"");
            escape_label_value(out, value);
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    value.write_to(out);
    out.push('\n');
}

fn escape_label_value(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `time` in RFC 3339, UTC, whole seconds (`2024-05-01T10:00:00Z`). Times before
/// 1970 print as the epoch.
pub fn rfc3339(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for non-negative counts).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
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
}

impl ServeConfig {
    /// Both endpoints, [`DEFAULT_REQUEST_TIMEOUT`].
    pub fn new(healthz_timeout: Duration) -> Self {
        Self {
            healthz_timeout,
            routes: Routes::ALL,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
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
}

/// A bound listener; [`OpsServer::run`] serves it.
pub struct OpsServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    status: Arc<AgentStatus>,
    config: Arc<ServeConfig>,
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
            config: Arc::new(config),
        })
    }

    /// The address actually bound (the port chosen for `:0`).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until the future is dropped; failed accepts are logged and retried.
    pub async fn run(self) -> Result<(), OpsError> {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                unreachable!("the semaphore is never closed");
            };
            let stream = match self.listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    warn!(addr = %self.local_addr, "accepting a connection failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let status = self.status.clone();
            let config = self.config.clone();
            tokio::spawn(async move {
                let answer = |path: &str| ops_answer(path, &status, &config);
                handle(stream, config.request_timeout, &answer).await;
                drop(slot);
            });
        }
    }
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

/// kube-proxy's `healthCheckNodePort` servers: one listener per port of an
/// `externalTrafficPolicy: Local` Service, answering 200 while this node has usable
/// endpoints of it and 503 otherwise, so external load balancers skip the node.
/// They listen on all addresses of the agent's network namespace, as kube-proxy's do.
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
            let task = tokio::spawn(serve_health_check(listener, shared.clone()));
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
fn health_check_answer(check: &HealthCheck) -> Response {
    let body = serde_json::json!({
        "service": {"namespace": check.namespace, "name": check.name},
        "localEndpoints": check.local_endpoints,
        "serviceProxyHealthy": true,
    })
    .to_string();
    let code = if check.local_endpoints > 0 { 200 } else { 503 };
    Response::new(code, "application/json", body)
}

async fn serve_health_check(listener: TcpListener, check: Arc<Mutex<HealthCheck>>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(ACCEPT_BACKOFF).await;
            continue;
        };
        let check = check.clone();
        tokio::spawn(async move {
            let answer = |_: &str| Some(health_check_answer(&lock(&check)));
            handle(stream, DEFAULT_REQUEST_TIMEOUT, &answer).await;
            drop(slot);
        });
    }
}

enum HeadError {
    TooLarge,
    /// The peer closed or reset before a full head arrived.
    Gone,
}

/// Reads up to the blank line ending the request head; the head without it.
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, HeadError> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Err(HeadError::Gone),
            Ok(n) => n,
        };
        let searched = head.len().saturating_sub(3);
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_head_end(&head[searched..]) {
            let end = searched + end;
            if end > MAX_REQUEST_BYTES {
                return Err(HeadError::TooLarge);
            }
            head.truncate(end);
            return Ok(head);
        }
        if head.len() > MAX_REQUEST_BYTES {
            return Err(HeadError::TooLarge);
        }
    }
}

/// Offset of the blank line (`\r\n\r\n`, or a bare `\n\n` as RFC 9112 tolerates).
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len())
        .find(|&i| bytes[i..].starts_with(b"\r\n\r\n") || bytes[i..].starts_with(b"\n\n"))
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    allow: bool,
}

impl Response {
    fn new(status: u16, content_type: &'static str, body: String) -> Self {
        Self {
            status,
            content_type,
            body,
            allow: false,
        }
    }

    fn text(status: u16, body: &str) -> Self {
        Self::new(status, "text/plain; charset=utf-8", format!("{body}\n"))
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// Answers the path of a GET/HEAD request, `None` for 404.
type Answer<'a> = &'a (dyn Fn(&str) -> Option<Response> + Sync);

async fn handle(mut stream: TcpStream, request_timeout: Duration, answer: Answer<'_>) {
    let head = tokio::time::timeout(request_timeout, read_head(&mut stream)).await;
    let (response, head_only) = match head {
        Err(_) => (
            Response::text(408, "request head not received in time"),
            false,
        ),
        Ok(Err(HeadError::TooLarge)) => (
            Response::text(
                431,
                &format!("request head longer than {MAX_REQUEST_BYTES} bytes"),
            ),
            false,
        ),
        Ok(Err(HeadError::Gone)) => return,
        Ok(Ok(head)) => route(&head, answer),
    };
    debug!(status = response.status, "ops request answered");
    let written =
        tokio::time::timeout(request_timeout, respond(&mut stream, &response, head_only)).await;
    if matches!(written, Ok(Ok(()))) {
        drain(&mut stream).await;
    }
}

/// Parses the request line and picks the answer; `true` for HEAD.
fn route(head: &[u8], answer: Answer<'_>) -> (Response, bool) {
    let Ok(head) = std::str::from_utf8(head) else {
        return (Response::text(400, "request head is not UTF-8"), false);
    };
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return (Response::text(400, "malformed request line"), false);
    };
    if !version.starts_with("HTTP/1.") {
        return (Response::text(505, "only HTTP/1.x is served"), false);
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    let Some(response) = answer(path) else {
        return (Response::text(404, "not found"), method == "HEAD");
    };
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            let mut response = Response::text(405, "only GET and HEAD are allowed");
            response.allow = true;
            return (response, false);
        }
    };
    (response, head_only)
}

/// What `GET /proxyMode` answers, as kube-proxy answers `iptables` or `ipvs`.
pub const PROXY_MODE: &str = "ebpf";

/// The agent's own endpoints.
fn ops_answer(path: &str, status: &AgentStatus, config: &ServeConfig) -> Option<Response> {
    match path {
        "/healthz" if config.routes.healthz => {
            let (health, body) = status.healthz_json(config.healthz_timeout);
            let code = if health.healthy { 200 } else { 503 };
            Some(Response::new(code, "application/json", body))
        }
        "/metrics" if config.routes.metrics => Some(Response::new(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            status.render_metrics(),
        )),
        // kube-proxy answers its mode next to its metrics; monitoring and the
        // Kubernetes e2e framework read it to tell proxies apart.
        "/proxyMode" if config.routes.metrics => Some(Response::new(
            200,
            "text/plain; charset=utf-8",
            PROXY_MODE.to_owned(),
        )),
        _ => None,
    }
}

async fn respond(
    stream: &mut TcpStream,
    response: &Response,
    head_only: bool,
) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\
         X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\nConnection: close\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    if response.allow {
        out.push_str("Allow: GET, HEAD\r\n");
    }
    out.push_str("\r\n");
    if !head_only {
        out.push_str(&response.body);
    }
    stream.write_all(out.as_bytes()).await?;
    stream.shutdown().await
}

/// Reads what the client still sends (bounded in bytes and time) after our FIN:
/// closing with unread data makes the kernel send a reset, which can destroy the
/// response before the client reads it.
async fn drain(stream: &mut TcpStream) {
    let mut sink = [0u8; 4096];
    let mut left = DRAIN_BYTES;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(at(0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(at(951_782_400)), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(at(1_709_251_199)), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(at(1_714_557_600)), "2024-05-01T10:00:00Z");
        assert_eq!(rfc3339(at(4_102_444_799)), "2099-12-31T23:59:59Z");
        assert_eq!(
            rfc3339(at(1_714_557_600) + Duration::from_millis(999)),
            "2024-05-01T10:00:00Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(5)),
            "1970-01-01T00:00:00Z"
        );
    }

    const START: u64 = 1_714_557_600;

    fn synced_status(timeout: Duration) -> (Arc<ManualClock>, AgentStatus) {
        let clock = Arc::new(ManualClock::new(at(START)));
        let status = AgentStatus::with_clock(clock.clone());
        status.record_sync(Duration::from_millis(3), 1, 2);
        status.mark_initial_sync();
        assert!(status.health(timeout).healthy);
        (clock, status)
    }

    #[test]
    fn health_needs_the_initial_sync() {
        let clock = Arc::new(ManualClock::new(at(START)));
        let status = AgentStatus::with_clock(clock.clone());
        let timeout = Duration::from_secs(10);
        let health = status.health(timeout);
        assert!(!health.healthy);
        assert_eq!(health.last_updated, None);
        status.record_pending();
        status.record_sync(Duration::from_millis(3), 1, 2);
        assert!(!status.health(timeout).healthy, "initial sync not marked");
        status.mark_initial_sync();
        let health = status.health(timeout);
        assert!(health.healthy);
        assert_eq!(health.last_updated, Some(at(START)));
    }

    #[test]
    fn a_quiet_cluster_stays_healthy() {
        let timeout = Duration::from_secs(10);
        let (clock, status) = synced_status(timeout);
        clock.advance(timeout * 1000);
        let health = status.health(timeout);
        assert!(
            health.healthy,
            "no change pending, however old the last sync"
        );
        assert_eq!(health.last_updated, Some(at(START)));
        assert_eq!(health.current_time, at(START + 10_000));
    }

    #[test]
    fn a_change_pending_past_the_timeout_is_unhealthy() {
        let timeout = Duration::from_secs(10);
        let (clock, status) = synced_status(timeout);
        clock.advance(Duration::from_secs(3600));
        status.record_pending();
        clock.advance(Duration::from_secs(4));
        // A later change does not restart the pending clock.
        status.record_pending();
        status.record_sync_error();
        clock.advance(timeout - Duration::from_secs(4));
        assert!(
            status.health(timeout).healthy,
            "exactly the timeout is fine"
        );
        clock.advance(Duration::from_millis(1));
        let health = status.health(timeout);
        assert!(!health.healthy);
        assert_eq!(health.last_updated, Some(at(START)));

        // Failed passes leave the change pending; a successful one clears it.
        status.record_sync_error();
        clock.advance(Duration::from_secs(5));
        assert!(!status.health(timeout).healthy);
        status.record_sync(Duration::from_millis(1), 1, 2);
        let health = status.health(timeout);
        assert!(health.healthy);
        let synced = at(START + 3600 + 15) + Duration::from_millis(1);
        assert_eq!(health.last_updated, Some(synced));
        clock.advance(timeout * 10);
        assert!(status.health(timeout).healthy);
    }

    #[test]
    fn unreadable_manifest_files_are_listed_and_counted() {
        let status = AgentStatus::new();
        assert!(status
            .render_metrics()
            .contains("\nlb_manifest_files_unreadable 0\n"));
        let files = vec![
            (
                PathBuf::from("/m/a.yaml"),
                "a FIFO, not a regular file".into(),
            ),
            (PathBuf::from("/m/b \"x\".yaml"), "not UTF-8 text".into()),
        ];
        status.set_unreadable_files(files.clone());
        assert_eq!(status.unreadable_files(), files);
        let text = status.render_metrics();
        assert!(
            text.contains("\nlb_manifest_files_unreadable 2\n"),
            "{text}"
        );
        assert!(
            text.contains("\nlb_manifest_file_unreadable{path=\"/m/b \\\"x\\\".yaml\"} 1\n"),
            "{text}"
        );
        status.set_unreadable_files(Vec::new());
        assert!(status.unreadable_files().is_empty());
        assert!(!status
            .render_metrics()
            .contains("lb_manifest_file_unreadable{"));
    }

    #[test]
    fn pending_gauge_is_the_age_of_the_oldest_change() {
        let timeout = Duration::from_secs(10);
        let (clock, status) = synced_status(timeout);
        let gauge = |status: &AgentStatus| {
            let text = status.render_metrics();
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix("lb_sync_pending_seconds "))
                .unwrap_or_else(|| panic!("gauge missing in\n{text}"))
                .to_string();
            line
        };
        assert_eq!(gauge(&status), "0");
        status.record_pending();
        clock.advance(Duration::from_millis(1500));
        status.record_pending();
        clock.advance(Duration::from_millis(1000));
        assert_eq!(gauge(&status), "2.5");
        status.record_sync(Duration::from_millis(1), 1, 2);
        assert_eq!(gauge(&status), "0");
    }

    #[test]
    fn healthz_json_before_the_first_sync() {
        let status = AgentStatus::with_clock(Arc::new(ManualClock::new(at(0))));
        let (_, body) = status.healthz_json(Duration::from_secs(1));
        assert_eq!(
            body,
            "{\"lastUpdated\": \"0001-01-01T00:00:00Z\", \"currentTime\": \
             \"1970-01-01T00:00:00Z\", \"nodeEligible\": true}\n"
        );
    }

    #[test]
    fn per_service_counters_are_labelled_by_frontend() {
        let status = AgentStatus::new();
        status.set_service_counters(&[
            ("10.96.0.10:80/TCP".to_owned(), 12, 0),
            ("10.96.0.11:80/TCP".to_owned(), 0, 3),
        ]);
        let text = status.render_metrics();
        assert!(text.contains("lb_service_connections_total{frontend=\"10.96.0.10:80/TCP\"} 12"));
        assert!(text.contains("lb_service_rejected_total{frontend=\"10.96.0.11:80/TCP\"} 3"));
        // Replaced, not accumulated.
        status.set_service_counters(&[]);
        assert!(!status.render_metrics().contains("frontend=\"10.96.0.10"));
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let status = AgentStatus::new();
        for ms in [0, 1, 2, 700, 20_000] {
            status.record_sync(Duration::from_millis(ms), 0, 0);
        }
        let text = status.render_metrics();
        for line in [
            "lb_sync_duration_seconds_bucket{le=\"0.001\"} 2",
            "lb_sync_duration_seconds_bucket{le=\"0.0025\"} 3",
            "lb_sync_duration_seconds_bucket{le=\"0.5\"} 3",
            "lb_sync_duration_seconds_bucket{le=\"1\"} 4",
            "lb_sync_duration_seconds_bucket{le=\"10\"} 4",
            "lb_sync_duration_seconds_bucket{le=\"+Inf\"} 5",
            "lb_sync_duration_seconds_count 5",
            "lb_sync_duration_seconds_sum 20.703",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

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

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        sample(&mut out, "m", &[("map", "a\"b\\c\nd")], 1u64);
        assert_eq!(out, "m{map=\"a\\\"b\\\\c\\nd\"} 1\n");
    }

    #[test]
    fn head_end_is_found_with_either_line_ending() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
    }
}
