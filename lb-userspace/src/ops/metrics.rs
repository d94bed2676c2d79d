//! The agent's Prometheus metrics, kept and encoded by `prometheus-client` in the
//! OpenMetrics text format.
//!
//! Values the agent reports as they happen (syncs, errors, map usage) are typed
//! metrics; the kernel's counters, read fresh on each scrape and replaced whole,
//! are encoded from their last reading by a collector.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::source::EndpointSlice;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, linear_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the `lb_sync_duration_seconds` buckets (`+Inf` is implicit).
pub const SYNC_DURATION_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// kube-proxy's `kubeproxy_sync_proxy_rules_duration_seconds` buckets: 1 ms
/// doubling to 16.384 s.
fn kube_proxy_sync_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// kube-proxy's `kubeproxy_network_programming_duration_seconds` buckets: 0 (its
/// `merge` starts from a zero bucket), 0.25 s and 0.5 s, every second to 59 s,
/// every 5 s to 115 s, every 30 s to 5 min.
fn network_programming_buckets() -> impl Iterator<Item = f64> {
    std::iter::once(0.0)
        .chain(linear_buckets(0.25, 0.25, 2))
        .chain(linear_buckets(1.0, 1.0, 59))
        .chain(linear_buckets(60.0, 5.0, 12))
        .chain(linear_buckets(120.0, 30.0, 7))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabel {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    path: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProtocolLabel {
    protocol: String,
}

/// The registry and the handles the agent updates.
pub(super) struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    kube_proxy_sync_duration: Histogram,
    pub(super) network_programming: Histogram,
    syncs: Counter,
    pub(super) sync_errors: Counter,
    pub(super) drift_repairs: Counter,
    stale_sockets_closed: Family<ProtocolLabel, Counter>,
    pub(super) object_errors: Gauge,
    files_unreadable: Gauge,
    file_unreadable: Family<PathLabel, Gauge>,
    last_sync: Gauge<f64, AtomicU64>,
    kube_proxy_last_sync: Gauge<f64, AtomicU64>,
    pending: Gauge<f64, AtomicU64>,
    pub(super) initial_sync_done: Gauge,
    frontends: Gauge,
    backends: Gauge,
    map_entries: Family<MapLabel, Gauge>,
    map_capacity: Family<MapLabel, Gauge>,
    kernel: Arc<KernelCounters>,
}

impl Metrics {
    pub(super) fn new() -> Self {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(SYNC_DURATION_BUCKETS);
        registry.register(
            "lb_sync_duration_seconds",
            "Time one reconcile pass of the service table took",
            sync_duration.clone(),
        );
        let kube_proxy_sync_duration = Histogram::new(kube_proxy_sync_buckets());
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds (one successful sync of the service table)",
            kube_proxy_sync_duration.clone(),
        );
        let network_programming = Histogram::new(network_programming_buckets());
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds: from an EndpointSlice's \
             last-change-trigger-time to the end of the sync that applied it",
            network_programming.clone(),
        );
        let syncs = Counter::default();
        registry.register(
            "lb_syncs",
            "Successful reconcile passes of the service table",
            syncs.clone(),
        );
        let sync_errors = Counter::default();
        registry.register(
            "lb_sync_errors",
            "Failed reconcile passes of the service table",
            sync_errors.clone(),
        );
        let drift_repairs = Counter::default();
        registry.register(
            "lb_drift_repairs",
            "Consistency checks that found the kernel maps differing from what the agent \
             wrote (an entry changed behind its back) and rewrote them",
            drift_repairs.clone(),
        );
        let stale_sockets_closed = Family::<ProtocolLabel, Counter>::default();
        registry.register(
            "lb_stale_sockets_closed",
            "Sockets the agent closed because the endpoint the socket hooks had \
             connected them to left its Service (UDP always; TCP with \
             --terminate-tcp-to-removed-endpoints)",
            stale_sockets_closed.clone(),
        );
        let object_errors = Gauge::default();
        registry.register(
            "lb_object_errors",
            "Objects skipped as invalid by the last interpretation",
            object_errors.clone(),
        );
        let files_unreadable = Gauge::default();
        registry.register(
            "lb_manifest_files_unreadable",
            "Manifest files the last read could not read (their last good objects stay)",
            files_unreadable.clone(),
        );
        let file_unreadable = Family::default();
        registry.register(
            "lb_manifest_file_unreadable",
            "1 for each manifest file that cannot be read, by path",
            file_unreadable.clone(),
        );
        let last_sync = Gauge::default();
        registry.register(
            "lb_last_sync_timestamp_seconds",
            "Unix time of the last successful reconcile pass; 0 before the first",
            last_sync.clone(),
        );
        let kube_proxy_last_sync = Gauge::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            kube_proxy_last_sync.clone(),
        );
        let pending = Gauge::default();
        registry.register(
            "lb_sync_pending_seconds",
            "Age of the oldest change not yet applied; 0 when nothing is pending",
            pending.clone(),
        );
        let initial_sync_done = Gauge::default();
        registry.register(
            "lb_initial_sync_done",
            "1 once the first full service table is in the maps",
            initial_sync_done.clone(),
        );
        let frontends = Gauge::default();
        registry.register(
            "lb_frontends",
            "Service frontends (IP, port, protocol) in the last synced table",
            frontends.clone(),
        );
        let backends = Gauge::default();
        registry.register(
            "lb_backends",
            "Backends in the last synced table, counted per frontend",
            backends.clone(),
        );
        let map_entries = Family::default();
        registry.register(
            "lb_map_entries",
            "Entries in use in a pinned BPF map",
            map_entries.clone(),
        );
        let map_capacity = Family::default();
        registry.register(
            "lb_map_capacity",
            "Maximum entries of a pinned BPF map",
            map_capacity.clone(),
        );
        let kernel = Arc::new(KernelCounters::default());
        registry.register_collector(Box::new(kernel.clone()));
        Self {
            registry,
            sync_duration,
            kube_proxy_sync_duration,
            network_programming,
            syncs,
            sync_errors,
            drift_repairs,
            stale_sockets_closed,
            object_errors,
            files_unreadable,
            file_unreadable,
            last_sync,
            kube_proxy_last_sync,
            pending,
            initial_sync_done,
            frontends,
            backends,
            map_entries,
            map_capacity,
            kernel,
        }
    }

    pub(super) fn record_sync(
        &self,
        duration: Duration,
        finished: SystemTime,
        frontends: usize,
        backends: usize,
    ) {
        let seconds = duration.as_secs_f64();
        self.sync_duration.observe(seconds);
        self.kube_proxy_sync_duration.observe(seconds);
        self.syncs.inc();
        let at = unix_seconds(finished);
        self.last_sync.set(at);
        self.kube_proxy_last_sync.set(at);
        self.frontends.set(frontends as i64);
        self.backends.set(backends as i64);
    }

    pub(super) fn record_stale_sockets_closed(&self, protocol: &str, count: u64) {
        self.stale_sockets_closed
            .get_or_create(&ProtocolLabel {
                protocol: protocol.to_owned(),
            })
            .inc_by(count);
    }

    pub(super) fn set_unreadable_files(&self, files: &[(PathBuf, String)]) {
        self.files_unreadable.set(files.len() as i64);
        self.file_unreadable.clear();
        for (path, _) in files {
            let path = path.to_string_lossy().into_owned();
            self.file_unreadable
                .get_or_create(&PathLabel { path })
                .set(1);
        }
    }

    pub(super) fn set_map_usage(&self, map: &str, entries: usize, capacity: u32) {
        let label = MapLabel {
            map: map.to_string(),
        };
        self.map_entries.get_or_create(&label).set(entries as i64);
        self.map_capacity
            .get_or_create(&label)
            .set(i64::from(capacity));
    }

    pub(super) fn set_datapath_counters(&self, counters: &[(&str, u64)]) {
        *self.kernel.datapath.lock() = counters
            .iter()
            .map(|(name, value)| (name.to_string(), *value))
            .collect();
    }

    pub(super) fn set_service_counters(&self, counters: &[(String, u64, u64)]) {
        *self.kernel.services.lock() = counters
            .iter()
            .map(|(frontend, connections, refused)| (frontend.clone(), (*connections, *refused)))
            .collect();
    }

    pub(super) fn set_policy_drops(&self, rows: &[(String, u64, u64)]) {
        *self.kernel.policy_drops.lock() = rows
            .iter()
            .map(|(pod, ingress, egress)| (pod.clone(), (*ingress, *egress)))
            .collect();
    }

    pub(super) fn set_quarantine_counters(&self, rows: &[(String, String, QuarantineCounters)]) {
        *self.kernel.quarantine.lock() = rows
            .iter()
            .map(|(frontend, backend, q)| ((frontend.clone(), backend.clone()), *q))
            .collect();
    }

    /// The exposition, with the pending gauge set to `pending` first.
    pub(super) fn encode(&self, pending: Duration) -> String {
        self.pending.set(pending.as_secs_f64());
        let mut out = String::with_capacity(8192);
        // Only the writer could fail, and a String does not.
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("encoding into a String");
        out
    }
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The kernel's counters as last read. They are totals kept by the kernel
/// programs, so they are encoded as read rather than added to typed counters.
#[derive(Debug, Default)]
struct KernelCounters {
    /// Event -> count, summed over CPUs.
    datapath: Mutex<BTreeMap<String, u64>>,
    /// Frontend (as `lb services` prints it) -> (connections, refused).
    services: Mutex<BTreeMap<String, (u64, u64)>>,
    /// (frontend, backend address) -> passive health's record of the backend.
    quarantine: Mutex<BTreeMap<(String, String), QuarantineCounters>>,
    /// Local pod (`namespace/name`) -> NetworkPolicy drops (ingress, egress).
    policy_drops: Mutex<BTreeMap<String, (u64, u64)>>,
}

/// One backend's passive-health counters for one frontend (`LB_QUARANTINE`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuarantineCounters {
    /// Quarantines begun (refusals outside a running quarantine).
    pub quarantines: u64,
    /// New connections that skipped the backend for another.
    pub skips: u64,
    /// Quarantined at the time of the scrape.
    pub active: bool,
}

impl Collector for KernelCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let datapath = self.datapath.lock().clone();
        let mut family = encoder.encode_descriptor(
            "lb_datapath_events",
            "Datapath events counted by the kernel programs, summed over CPUs",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (event, value) in &datapath {
            let labels = [("event", event.as_str())];
            ConstCounter::new(*value).encode(family.encode_family(&labels)?)?;
        }
        let services = self.services.lock().clone();
        for (name, help, pick) in [
            (
                "lb_service_connections",
                "Connections sent to a backend of the frontend (socket hooks and per-packet flows)",
                0,
            ),
            (
                "lb_service_rejected",
                "Connections refused or dropped for want of a usable backend",
                1,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (frontend, (connections, refused)) in &services {
                let value = if pick == 0 { *connections } else { *refused };
                let labels = [("frontend", frontend.as_str())];
                ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        let quarantine = self.quarantine.lock().clone();
        for (name, help, pick) in [
            (
                "lb_backend_quarantines",
                "Times a backend refused a new connection of the frontend and was \
                 quarantined (passive health)",
                0,
            ),
            (
                "lb_backend_quarantine_skips",
                "New connections of the frontend that skipped the quarantined backend",
                1,
            ),
        ] {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for ((frontend, backend), q) in &quarantine {
                let value = if pick == 0 { q.quarantines } else { q.skips };
                let labels = [
                    ("frontend", frontend.as_str()),
                    ("backend", backend.as_str()),
                ];
                ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "lb_backend_quarantined",
            "1 while new connections of the frontend skip the backend",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for ((frontend, backend), q) in &quarantine {
            let labels = [
                ("frontend", frontend.as_str()),
                ("backend", backend.as_str()),
            ];
            prometheus_client::metrics::gauge::ConstGauge::new(i64::from(q.active))
                .encode(family.encode_family(&labels)?)?;
        }
        let policy_drops = self.policy_drops.lock().clone();
        if !policy_drops.is_empty() {
            let mut family = encoder.encode_descriptor(
                "lb_policy_drops",
                "Packets NetworkPolicy dropped, per local pod and the direction whose \
                 policy dropped them",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (pod, (ingress, egress)) in &policy_drops {
                for (direction, value) in [("ingress", ingress), ("egress", egress)] {
                    let labels = [("pod", pod.as_str()), ("direction", direction)];
                    ConstCounter::new(*value).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
}

/// kube-proxy's network programming latency bookkeeping: the last trigger time
/// seen per EndpointSlice.
#[derive(Debug, Default)]
pub(super) struct ProgrammingLatency {
    /// Trigger times before this (the agent's start) are not measured: they were
    /// programmed by whatever ran before, and would read as huge latencies.
    started: Option<SystemTime>,
    /// (namespace, name) -> the newest trigger time applied.
    seen: HashMap<(crate::source::intern::Shared, Box<str>), SystemTime>,
}

impl ProgrammingLatency {
    pub(super) fn new(started: SystemTime) -> Self {
        Self {
            started: Some(started),
            seen: HashMap::new(),
        }
    }

    /// Remembers the trigger times of the slices that changed and returns, in
    /// seconds, how long before `now` each new one was; forgets the slices that are
    /// gone. Costs the change: slices not named keep what was remembered.
    pub(super) fn applied(
        &mut self,
        changed: &[Arc<EndpointSlice>],
        gone: &[Arc<EndpointSlice>],
        now: SystemTime,
    ) -> Vec<f64> {
        let key = |slice: &EndpointSlice| {
            (
                slice.metadata.namespace.clone().unwrap_or_default(),
                slice.metadata.name.clone().unwrap_or_default(),
            )
        };
        for slice in gone {
            self.seen.remove(&key(slice));
        }
        let mut latencies = Vec::new();
        for slice in changed {
            let key = key(slice);
            let previous = self.seen.get(&key).copied().or(self.started);
            let trigger = slice
                .trigger_time
                .as_ref()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                .map(SystemTime::from);
            if let Some(trigger) = trigger.filter(|t| previous.is_none_or(|p| *t > p)) {
                latencies.push(
                    now.duration_since(trigger)
                        .unwrap_or(Duration::ZERO)
                        .as_secs_f64(),
                );
                self.seen.insert(key, trigger);
            }
        }
        latencies
    }
}
