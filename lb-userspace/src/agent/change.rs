//! One change, from the objects that changed to the maps: the index derives the
//! Services they touch, the planner writes the difference, and the agent's
//! bookkeeping (health checks, metric names, map usage, stale sockets) follows.
//! A change slower than [`SLOW_CHANGE`] logs the time of each stage, as kube-proxy
//! logs its slow syncs.

use std::time::{Duration, Instant};

use lb_common::map_names;
use tracing::{debug, info, warn};

use super::node_objects::{node_zone, served_addresses};
use super::start::Agent;
use super::writes::{self, SyncError, SyncOutcome};
use crate::control::index::Delta;
use crate::control::SourceOptions;
use crate::datapath::source_ranges;
use crate::source::changes::Changes;

/// Changes slower than this, from reaching the source to being in the kernel, log
/// where they waited.
pub(super) const SLOW_CHANGE: Duration = Duration::from_millis(10);

/// Why a change ran, besides new objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// The source handed on changes.
    Objects,
    /// The node's addresses moved, a repair or a retry: the same objects again.
    Resync,
}

/// When each stage of a change ended, for the slow-change log.
struct Stages {
    /// When the oldest change reached its source.
    arrived: Option<Instant>,
    /// Taken from the source by the loop.
    taken: Instant,
    derived: Duration,
    ranges: Duration,
    written: Duration,
}

impl Agent {
    /// Applies `changes` (none for a resync). `Err` only for what must stop the
    /// agent: hooks that cannot attach. A map write the kernel refused leaves the
    /// change to be retried (the returned flag).
    pub(super) async fn apply(
        &mut self,
        changes: Option<Changes>,
        cause: Cause,
    ) -> Result<bool, crate::datapath::loader::LoadError> {
        let taken = Instant::now();
        self.status.record_pending();
        let arrived = changes.as_ref().and_then(|c| c.since);
        if let Some(changes) = &changes {
            self.take_source_state(changes);
        }
        let mut delta = self.index.set_options(self.options_now());
        if let Some(changes) = &changes {
            delta.absorb(self.index.sync(changes));
        }
        for error in &delta.new_errors {
            warn!("skipped: {error}");
        }
        self.status
            .record_object_errors(self.source_errors.len() + self.index.error_count());
        let derived = taken.elapsed();
        if self.known_table.is_none() || delta.services >= 1000 {
            // Starts, relists and bulk changes; single changes are in the debug line.
            info!(
                desired_ms = derived.as_millis() as u64,
                services = delta.services,
                frontends = self.index.desired().frontends.len(),
                "desired state built"
            );
        }
        let mut stages = Stages {
            arrived,
            taken,
            derived,
            ranges: Duration::ZERO,
            written: Duration::ZERO,
        };
        let first = !self.attached;
        let outcome = self.write(&delta, &mut stages);
        if self.attached {
            self.created_pins.keep();
        }
        match outcome {
            Ok(outcome) => {
                self.recorded(outcome, &delta, &stages, cause, first).await;
                Ok(false)
            }
            Err(SyncError::Attach(e)) => Err(e),
            Err(SyncError::Maps(e)) => {
                self.status.record_sync_error();
                warn!("applying the service table failed, retrying: {e}");
                Ok(true)
            }
        }
    }

    /// Nodes, the source's own problems and unreadable files, when they changed.
    fn take_source_state(&mut self, changes: &Changes) {
        if let Some(nodes) = &changes.nodes {
            self.nodes = nodes.clone();
            self.masquerade.sync(&self.nodes);
        }
        if let Some(policy) = &mut self.policy {
            policy.sync(changes);
        }
        if let Some(errors) = &changes.errors {
            // Reported when the list changes, not on every change.
            for error in errors.iter().filter(|e| !self.source_errors.contains(e)) {
                warn!("skipped: {error}");
            }
            self.source_errors = errors.clone();
        }
        if let Some(unreadable) = &changes.unreadable {
            self.status.set_unreadable_files(
                unreadable
                    .iter()
                    .map(|e| (e.path.clone(), e.problem.to_string()))
                    .collect(),
            );
            self.unreadable = unreadable.clone();
        }
    }

    /// The options the objects are read with now: this node's served addresses and
    /// zone.
    pub(super) fn options_now(&self) -> SourceOptions {
        let config = &self.config;
        let zone = node_zone(&self.nodes, &config.node_name)
            .or_else(|| config.zone.clone())
            .unwrap_or_default();
        if zone != self.index.options().zone {
            info!(zone = %zone, "node zone for topology-aware routing");
        }
        SourceOptions {
            node_name: config.node_name.clone(),
            node_ips: served_addresses(&self.net, config, &self.nodes),
            node_port_range: config.node_port_range,
            zone,
            lb_algorithm: config.lb_algorithm,
        }
    }

    /// Source ranges, the table, the first attach, then the bookkeeping of what was
    /// written. The hooks attach as soon as the first table is in the kernel.
    fn write(&mut self, delta: &Delta, stages: &mut Stages) -> Result<SyncOutcome, SyncError> {
        if let Some(table) = &self.known_table {
            let wanted = source_ranges::wanted(self.index.restricted(), table.snapshot());
            self.maps.sync_source_ranges(&wanted, false)?;
        }
        stages.ranges = stages.taken.elapsed();
        let written = writes::write_table(
            &mut self.maps,
            self.index.desired(),
            &delta.frontends,
            &mut self.known_table,
        )?;
        stages.written = stages.taken.elapsed();
        if !self.attached {
            self.attach().map_err(SyncError::Attach)?;
            info!(
                frontends = self.index.desired().frontends.len(),
                backends = self.index.backend_count(),
                "ready and serving"
            );
        }
        if let Some(check) = &mut self.check {
            check.written(written.ops_if_incremental());
        }
        let outcome = writes::record_table(&mut self.maps, written, &mut self.known_table)?;
        if let Some(table) = &self.known_table {
            let wanted = source_ranges::wanted(self.index.restricted(), table.snapshot());
            self.maps.sync_source_ranges(&wanted, true)?;
        }
        Ok(outcome)
    }

    /// After a successful write: health checks, metric names, map usage, the
    /// programming latency and the sockets of departed backends.
    async fn recorded(
        &mut self,
        outcome: SyncOutcome,
        delta: &Delta,
        stages: &Stages,
        cause: Cause,
        first: bool,
    ) {
        let total = stages.taken.elapsed();
        let waited = stages
            .arrived
            .map(|a| stages.taken.saturating_duration_since(a));
        let fields = (
            waited.map_or(0, |w| w.as_micros() as u64),
            stages.derived.as_micros() as u64,
            (stages.ranges - stages.derived).as_micros() as u64,
            (stages.written - stages.ranges).as_micros() as u64,
            (total - stages.written).as_micros() as u64,
        );
        // The first sync is the start, which logs its own stages.
        if !first && waited.unwrap_or_default() + total > SLOW_CHANGE {
            info!(
                queued_us = fields.0,
                derive_us = fields.1,
                ranges_us = fields.2,
                write_us = fields.3,
                record_us = fields.4,
                services = delta.services,
                frontends = delta.frontends.len(),
                ?cause,
                "slow change"
            );
        } else {
            debug!(
                queued_us = fields.0,
                derive_us = fields.1,
                ranges_us = fields.2,
                write_us = fields.3,
                record_us = fields.4,
                services = delta.services,
                frontends = delta.frontends.len(),
                "change applied"
            );
        }
        let desired = self.index.desired();
        for e in self.health_checks.update(&desired.health_checks).await {
            warn!("healthCheckNodePort not served: {e}");
        }
        self.names.update(outcome.frontend_names);
        let capacity = self.maps.capacity();
        self.status.set_map_usage(
            map_names::SERVICES,
            outcome.services_used,
            capacity.services,
        );
        self.status.set_map_usage(
            map_names::BACKENDS,
            outcome.backends_used,
            capacity.backends,
        );
        self.status.record_sync(
            total,
            self.index.desired().frontends.len(),
            self.index.backend_count(),
        );
        self.status
            .record_programmed(&delta.slices, &delta.gone_slices);
        self.reaper.send(outcome.departed);
    }
}
