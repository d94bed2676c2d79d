//! What the agent has done, as `/healthz`, `/metrics` and `/status` report it.
//!
//! The health rule is kube-proxy's: the agent is healthy once the initial sync is
//! done, as long as no change has been waiting to be applied for longer than the
//! healthz timeout. The agent reports a change that arrived with
//! [`AgentStatus::record_pending`] and a successful apply with
//! [`AgentStatus::record_sync`]; a quiet cluster, where nothing changes for hours,
//! stays healthy.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::control::policy::view::PodPolicies;
use crate::datapath::device_links::XdpReport;
use crate::source::EndpointSlice;

use super::metrics::{Metrics, ProgrammingLatency};

/// What `lastUpdated` says before the first sync: Go's zero time, as kube-proxy's
/// clients would see it.
const NEVER: &str = "0001-01-01T00:00:00Z";

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
        *self.elapsed.lock() += by;
    }
}

impl Clock for ManualClock {
    fn monotonic(&self) -> Instant {
        self.monotonic + *self.elapsed.lock()
    }
    fn wall(&self) -> SystemTime {
        self.wall + *self.elapsed.lock()
    }
}

type ScrapeHook = Arc<dyn Fn(&AgentStatus) + Send + Sync>;

/// What the agent answers about a pod's NetworkPolicies.
pub enum PodAnswer {
    /// `--network-policy` is off: nothing is known.
    PolicyOff,
    /// No pod of that name among the objects NetworkPolicy follows.
    Unknown,
    Found(Box<PodPolicies>),
}

/// Answers `/policy/NS/NAME`: the pod's policies (`lb policy POD`), `None` when
/// NetworkPolicy knows no such pod.
type PolicyQuery = Arc<dyn Fn(&str, &str) -> Option<PodPolicies> + Send + Sync>;

#[derive(Default)]
struct State {
    initial_sync_done: bool,
    /// Last successful sync, for display (`lastUpdated`).
    last_sync: Option<(Instant, SystemTime)>,
    /// When the oldest change not yet applied arrived; `None` when nothing waits.
    pending_since: Option<Instant>,
    /// Manifest files that could not be read: (path, why), in file name order.
    unreadable_files: Vec<(PathBuf, String)>,
    xdp: Vec<XdpReport>,
    modes: Modes,
    programming: ProgrammingLatency,
}

/// What the agent has done, for `/healthz`, `/metrics` and `/status`. Share it as
/// `Arc<AgentStatus>`; every method takes `&self`.
pub struct AgentStatus {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    metrics: Metrics,
    scrape_hooks: Mutex<Vec<ScrapeHook>>,
    policy_query: Mutex<Option<PolicyQuery>>,
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
        let state = State {
            programming: ProgrammingLatency::new(clock.wall()),
            ..State::default()
        };
        Self {
            clock,
            state: Mutex::new(state),
            metrics: Metrics::new(),
            scrape_hooks: Mutex::new(Vec::new()),
            policy_query: Mutex::new(None),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The first full service table is in the maps: from now on `/healthz` can say 200.
    pub fn mark_initial_sync(&self) {
        self.state().initial_sync_done = true;
        self.metrics.initial_sync_done.set(1);
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
        {
            let mut state = self.state();
            state.last_sync = Some(now);
            state.pending_since = None;
        }
        self.metrics
            .record_sync(duration, now.1, frontends, backends);
    }

    /// The sync that just succeeded applied these EndpointSlices: each one whose
    /// `endpoints.kubernetes.io/last-change-trigger-time` is newer than the one
    /// seen before for it (or, seen first, newer than the agent's start) adds the
    /// time from that change to now to `kubeproxy_network_programming_duration_seconds`,
    /// as kube-proxy measures network programming latency.
    pub fn record_programmed(&self, changed: &[Arc<EndpointSlice>], gone: &[Arc<EndpointSlice>]) {
        let now = self.clock.wall();
        let latencies = self.state().programming.applied(changed, gone, now);
        for latency in latencies {
            self.metrics.network_programming.observe(latency);
        }
    }

    /// A reconcile pass failed (the kernel refused a write, a map could not be read).
    /// A pending change stays pending, so failures that last longer than the
    /// healthz timeout make `/healthz` say 503.
    pub fn record_sync_error(&self) {
        self.metrics.sync_errors.inc();
    }

    /// A consistency check found the maps changed behind the agent's back.
    pub fn record_drift_repair(&self) {
        self.metrics.drift_repairs.inc();
    }

    /// Sockets of `protocol` closed because their endpoint left its Service.
    pub fn record_stale_sockets_closed(&self, protocol: crate::model::Protocol, count: u64) {
        self.metrics
            .record_stale_sockets_closed(&protocol.to_string(), count);
    }

    /// Objects skipped by the last interpretation (invalid Services, slices, files).
    pub fn record_object_errors(&self, count: usize) {
        self.metrics.object_errors.set(count as i64);
    }

    /// The manifest files the last read could not read, each with the reason,
    /// replacing the previous list (empty: every file was read).
    pub fn set_unreadable_files(&self, files: Vec<(PathBuf, String)>) {
        self.metrics.set_unreadable_files(&files);
        self.state().unreadable_files = files;
    }

    /// The manifest files that cannot be read right now, (path, reason), in file
    /// name order: reported until the file is fixed or removed.
    pub fn unreadable_files(&self) -> Vec<(PathBuf, String)> {
        self.state().unreadable_files.clone()
    }

    /// The datapath modes the agent was started with, as their flags spell them.
    pub fn set_modes(&self, modes: Modes) {
        self.state().modes = modes;
    }

    /// `lb_xdp` on each node-facing device: attached, or refused and why.
    pub fn set_xdp(&self, devices: Vec<XdpReport>) {
        self.state().xdp = devices;
    }

    /// Entries in use and the size of one pinned map, e.g. `LB_SERVICES`.
    pub fn set_map_usage(&self, map: &str, entries: usize, capacity: u32) {
        self.metrics.set_map_usage(map, entries, capacity);
    }

    /// The datapath counters (`PinnedMaps::stats()`), replacing the previous ones.
    pub fn set_datapath_counters(&self, counters: &[(&str, u64)]) {
        self.metrics.set_datapath_counters(counters);
    }

    /// Per-frontend counters: (frontend, connections, refused for want of a
    /// backend), replacing the previous ones.
    /// Passive health's per-backend counters: (frontend, backend address,
    /// counters), replacing the last scrape's.
    /// Each local pod's NetworkPolicy drops: (namespace/name, ingress, egress).
    pub fn set_policy_drops(&self, rows: &[(String, u64, u64)]) {
        self.metrics.set_policy_drops(rows);
    }

    pub fn set_quarantine_counters(
        &self,
        rows: &[(String, String, super::metrics::QuarantineCounters)],
    ) {
        self.metrics.set_quarantine_counters(rows);
    }

    pub fn set_service_counters(&self, counters: &[(String, u64, u64)]) {
        self.metrics.set_service_counters(counters);
    }

    /// Runs `hook` before each `/metrics` answer, e.g. to read fresh datapath
    /// counters with [`AgentStatus::set_datapath_counters`]. Hooks run in the order
    /// they were added.
    pub fn on_scrape(&self, hook: impl Fn(&AgentStatus) + Send + Sync + 'static) {
        self.scrape_hooks.lock().push(Arc::new(hook));
    }

    /// Answers `/policy/NS/NAME` with `query` (set when NetworkPolicy is on).
    pub fn on_policy_query(
        &self,
        query: impl Fn(&str, &str) -> Option<PodPolicies> + Send + Sync + 'static,
    ) {
        *self.policy_query.lock() = Some(Arc::new(query));
    }

    /// Pod `namespace/name` as NetworkPolicy knows it.
    pub fn pod_policies(&self, namespace: &str, name: &str) -> PodAnswer {
        let Some(query) = self.policy_query.lock().clone() else {
            return PodAnswer::PolicyOff;
        };
        match query(namespace, name) {
            Some(pod) => PodAnswer::Found(Box::new(pod)),
            None => PodAnswer::Unknown,
        }
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

    /// What `/status` answers: what an operator asks `lb status` about the agent.
    pub fn report(&self) -> StatusReport {
        let initial_sync_done = self.initial_sync_done();
        // One guard: a second `state()` in the same expression would wait for the
        // first, held until the expression ends.
        let state = self.state();
        StatusReport {
            initial_sync_done,
            unreadable_files: state
                .unreadable_files
                .iter()
                .map(|(path, reason)| UnreadableFile {
                    path: path.clone(),
                    reason: reason.clone(),
                })
                .collect(),
            modes: state.modes.clone(),
            xdp: state.xdp.clone(),
        }
    }

    /// The `/status` body: [`AgentStatus::report`] in JSON.
    pub fn status_json(&self) -> String {
        let mut body = serde_json::to_string(&self.report()).expect("plain data serializes");
        body.push('\n');
        body
    }

    /// The `/metrics` body in the OpenMetrics text format, after running the
    /// scrape hook.
    pub fn encode_metrics(&self) -> String {
        // Cloned out, so a hook may take the lock (add a hook) without a deadlock.
        let hooks = self.scrape_hooks.lock().clone();
        for hook in hooks {
            hook(self);
        }
        let now = self.clock.monotonic();
        let pending = self
            .state()
            .pending_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        self.metrics.encode(pending)
    }
}

/// The agent's own view, as `/status` serves it and `lb status` prints it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusReport {
    pub initial_sync_done: bool,
    /// Manifest files the agent cannot read, in file name order.
    pub unreadable_files: Vec<UnreadableFile>,
    /// The datapath modes in force (empty strings from an agent that predates them).
    #[serde(default)]
    pub modes: Modes,
    /// `lb_xdp` on each node-facing device (none with `--xdp off`).
    #[serde(default)]
    pub xdp: Vec<XdpReport>,
}

/// The datapath modes an agent runs with, each the value of its flag: what an
/// operator checks first when a Service behaves unlike its neighbour node's.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Modes {
    /// `--xdp`: off, native or generic.
    pub xdp: String,
    /// `--lb-mode`: snat, dsr or hybrid.
    pub lb_mode: String,
    /// `--dsr-dispatch`: opt or ipip (used by dsr and hybrid only).
    pub dsr_dispatch: String,
    /// `--lb-algorithm`: the default of Services without the annotation.
    pub lb_algorithm: String,
    /// `--masquerade`: off or bpf.
    pub masquerade: String,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnreadableFile {
    pub path: PathBuf,
    pub reason: String,
}

/// `time` in RFC 3339, UTC, whole seconds (`2024-05-01T10:00:00Z`). Times before
/// 1970 print as the epoch.
pub fn rfc3339(time: SystemTime) -> String {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let whole = i64::try_from(secs)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .unwrap_or(jiff::Timestamp::MAX);
    whole.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the sample `name{labels}` exactly as written, if present.
    pub(crate) fn value_of(text: &str, sample: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' '))
            .map(|v| v.parse().unwrap_or_else(|e| panic!("{sample} {v}: {e}")))
    }

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
            .encode_metrics()
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
        let text = status.encode_metrics();
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
            .encode_metrics()
            .contains("lb_manifest_file_unreadable{"));
    }

    #[test]
    fn pending_gauge_is_the_age_of_the_oldest_change() {
        let timeout = Duration::from_secs(10);
        let (clock, status) = synced_status(timeout);
        let gauge = |status: &AgentStatus| {
            let text = status.encode_metrics();
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix("lb_sync_pending_seconds "))
                .unwrap_or_else(|| panic!("gauge missing in\n{text}"))
                .to_string();
            line
        };
        assert_eq!(gauge(&status).parse::<f64>().unwrap(), 0.0);
        status.record_pending();
        clock.advance(Duration::from_millis(1500));
        status.record_pending();
        clock.advance(Duration::from_millis(1000));
        assert_eq!(gauge(&status).parse::<f64>().unwrap(), 2.5);
        status.record_sync(Duration::from_millis(1), 1, 2);
        assert_eq!(gauge(&status).parse::<f64>().unwrap(), 0.0);
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
        let text = status.encode_metrics();
        assert!(text.contains("lb_service_connections_total{frontend=\"10.96.0.10:80/TCP\"} 12"));
        assert!(text.contains("lb_service_rejected_total{frontend=\"10.96.0.11:80/TCP\"} 3"));
        // Replaced, not accumulated.
        status.set_service_counters(&[]);
        assert!(!status.encode_metrics().contains("frontend=\"10.96.0.10"));
    }

    #[test]
    fn quarantine_counters_are_labelled_by_frontend_and_backend() {
        let status = AgentStatus::new();
        let q = super::super::metrics::QuarantineCounters {
            quarantines: 2,
            skips: 17,
            active: true,
        };
        status.set_quarantine_counters(&[(
            "10.96.0.10:80/TCP".to_owned(),
            "10.244.1.13:8080".to_owned(),
            q,
        )]);
        let text = status.encode_metrics();
        let labels = "{frontend=\"10.96.0.10:80/TCP\",backend=\"10.244.1.13:8080\"}";
        assert!(
            text.contains(&format!("lb_backend_quarantines_total{labels} 2")),
            "{text}"
        );
        assert!(text.contains(&format!("lb_backend_quarantine_skips_total{labels} 17")));
        assert!(text.contains(&format!("lb_backend_quarantined{labels} 1")));
        status.set_quarantine_counters(&[]);
        assert!(!status.encode_metrics().contains("10.244.1.13"));
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let status = AgentStatus::new();
        for ms in [0, 1, 2, 700, 20_000] {
            status.record_sync(Duration::from_millis(ms), 0, 0);
        }
        let text = status.encode_metrics();
        for (sample, value) in [
            ("lb_sync_duration_seconds_bucket{le=\"0.001\"}", 2.0),
            ("lb_sync_duration_seconds_bucket{le=\"0.0025\"}", 3.0),
            ("lb_sync_duration_seconds_bucket{le=\"0.5\"}", 3.0),
            ("lb_sync_duration_seconds_bucket{le=\"1.0\"}", 4.0),
            ("lb_sync_duration_seconds_bucket{le=\"10.0\"}", 4.0),
            ("lb_sync_duration_seconds_bucket{le=\"+Inf\"}", 5.0),
            ("lb_sync_duration_seconds_count", 5.0),
            ("lb_sync_duration_seconds_sum", 20.703),
        ] {
            assert_eq!(value_of(&text, sample), Some(value), "{sample} in\n{text}");
        }
    }

    /// The `le` bounds and counts of one histogram's buckets, in order.
    fn buckets(text: &str, histogram: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{histogram}_bucket{{le=\"");
        text.lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(|rest| {
                let (le, count) = rest.split_once("\"} ").unwrap();
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, count.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn kube_proxy_sync_histogram_has_its_buckets() {
        let status = AgentStatus::new();
        for duration in [
            Duration::from_micros(500),
            Duration::from_millis(3),
            Duration::from_secs(20),
        ] {
            status.record_sync(duration, 0, 0);
        }
        let text = status.encode_metrics();
        let name = "kubeproxy_sync_proxy_rules_duration_seconds";
        let got = buckets(&text, name);
        // kube-proxy's ExponentialBuckets(0.001, 2, 15), then +Inf.
        let bounds: Vec<f64> = got.iter().map(|(le, _)| *le).collect();
        let mut expected: Vec<f64> = (0..15).map(|i| 0.001 * f64::from(1u32 << i)).collect();
        expected.push(f64::INFINITY);
        assert_eq!(bounds.len(), expected.len(), "{text}");
        for (got, want) in bounds.iter().zip(&expected) {
            assert!(got == want || (got - want).abs() < 1e-9, "{got} != {want}");
        }
        let count = |le: f64| {
            let bucket = got.iter().find(|b| b.0 == le || (b.0 - le).abs() < 1e-9);
            bucket.unwrap().1
        };
        assert_eq!(count(0.001), 1.0);
        assert_eq!(count(0.002), 1.0);
        assert_eq!(count(0.004), 2.0);
        assert_eq!(count(16.384), 2.0);
        assert_eq!(count(f64::INFINITY), 3.0);
        assert_eq!(value_of(&text, &format!("{name}_count")), Some(3.0));
        // The lb histogram is kept next to it.
        assert_eq!(value_of(&text, "lb_sync_duration_seconds_count"), Some(3.0));
        assert_eq!(
            value_of(&text, "kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
            value_of(&text, "lb_last_sync_timestamp_seconds"),
        );
    }

    fn slice(name: &str, trigger: Option<&str>) -> Arc<EndpointSlice> {
        Arc::new(EndpointSlice {
            metadata: crate::source::lean::Meta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            trigger_time: trigger.map(str::to_owned),
            address_type: "IPv4".into(),
            ..EndpointSlice::default()
        })
    }

    #[test]
    fn network_programming_latency_counts_each_trigger_time_once() {
        // START is 2024-05-01T10:00:00Z.
        let clock = Arc::new(ManualClock::new(at(START)));
        let status = AgentStatus::with_clock(clock.clone());
        let name = "kubeproxy_network_programming_duration_seconds";
        let count = |status: &AgentStatus| {
            value_of(&status.encode_metrics(), &format!("{name}_count")).unwrap()
        };

        // A change from before the agent started is not the agent's latency.
        status.record_programmed(&[slice("web-1", Some("2024-05-01T09:59:50Z"))], &[]);
        assert_eq!(count(&status), 0.0);

        clock.advance(Duration::from_secs(5));
        let web = slice("web-1", Some("2024-05-01T10:00:02Z"));
        let api = slice("api-1", Some("2024-05-01T10:00:04.5Z"));
        let bad = slice("bad-1", Some("yesterday"));
        let none = slice("plain-1", None);
        status.record_programmed(&[web.clone(), api.clone(), bad.clone(), none.clone()], &[]);
        assert_eq!(count(&status), 2.0);

        // Unchanged slices in later syncs are not measured again; an older time
        // (a stale cache) neither.
        clock.advance(Duration::from_secs(30));
        let older = slice("api-1", Some("2024-05-01T10:00:03Z"));
        status.record_programmed(&[web.clone(), older, bad, none], &[]);
        assert_eq!(count(&status), 2.0);

        let text = status.encode_metrics();
        // 3 s (web-1) and 0.5 s (api-1), in kube-proxy's buckets.
        assert_eq!(value_of(&text, &format!("{name}_sum")), Some(3.5));
        let got = buckets(&text, name);
        let bounds: Vec<f64> = got.iter().map(|(le, _)| *le).collect();
        assert_eq!(bounds.len(), 1 + 2 + 59 + 12 + 7 + 1, "{bounds:?}");
        assert_eq!(&bounds[..5], &[0.0, 0.25, 0.5, 1.0, 2.0]);
        assert_eq!(bounds[bounds.len() - 2], 300.0);
        let at_most = |le: f64| got.iter().find(|b| b.0 == le).unwrap().1;
        assert_eq!(at_most(0.25), 0.0);
        assert_eq!(at_most(0.5), 1.0);
        assert_eq!(at_most(2.0), 1.0);
        assert_eq!(at_most(3.0), 2.0);

        // A newer change of a known slice is measured from its own trigger time.
        let web = slice("web-1", Some("2024-05-01T10:00:30Z"));
        status.record_programmed(&[web], &[]);
        assert_eq!(count(&status), 3.0);
        let text = status.encode_metrics();
        assert_eq!(value_of(&text, &format!("{name}_sum")), Some(3.5 + 5.0));
    }

    #[test]
    fn status_json_lists_unreadable_files() {
        let status = AgentStatus::new();
        let json = |status: &AgentStatus| -> serde_json::Value {
            serde_json::from_str(&status.status_json()).unwrap()
        };
        assert_eq!(json(&status)["unreadableFiles"], serde_json::json!([]));
        status.set_unreadable_files(vec![(PathBuf::from("/m/a.yaml"), "a FIFO".into())]);
        assert_eq!(
            json(&status)["unreadableFiles"],
            serde_json::json!([{"path": "/m/a.yaml", "reason": "a FIFO"}])
        );
    }

    #[test]
    fn status_json_names_the_modes() {
        let status = AgentStatus::new();
        status.set_modes(Modes {
            xdp: "native".into(),
            lb_mode: "dsr".into(),
            dsr_dispatch: "ipip".into(),
            lb_algorithm: "maglev".into(),
            masquerade: "off".into(),
        });
        let json: serde_json::Value = serde_json::from_str(&status.status_json()).unwrap();
        assert_eq!(
            json["modes"],
            serde_json::json!({"xdp": "native", "lbMode": "dsr", "dsrDispatch": "ipip",
                "lbAlgorithm": "maglev", "masquerade": "off"})
        );
        // An older agent's answer, without modes, still reads.
        let old: StatusReport =
            serde_json::from_str(r#"{"initialSyncDone": true, "unreadableFiles": []}"#).unwrap();
        assert_eq!(old.modes, Modes::default());
    }
}
