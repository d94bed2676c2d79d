//! Writing one change's plan into the maps and remembering what was written: with
//! a kept table only the changed frontends are planned; without one (start, after
//! a failure or a repair) the kernel's table is read and planned whole, and a start
//! into empty maps is written in pieces.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use super::names::NamesUpdate;
use crate::control::known::KnownTable;
use crate::control::plan;
use crate::datapath::loader::LoadError;
use crate::datapath::maps::{MapsError, PinnedMaps};
use crate::datapath::table;
use crate::model::{DesiredState, Frontend};
use crate::stale_sockets;

/// Why a sync did not complete: the maps (retried with the same objects), or
/// attaching the hooks after the first one (fatal).
#[derive(Debug, thiserror::Error)]
pub(super) enum SyncError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Attach(LoadError),
}

/// The first half of a sync: the desired table planned against what the maps hold
/// and written to the kernel.
pub(super) struct Written {
    /// The table before the plan; `record_table` applies the plan to it.
    table: KnownTable,
    plan: plan::Plan,
    /// Only the changed frontends were planned, against the kept table.
    incremental: bool,
    /// The table was read from the kernel, not remembered.
    read_kernel: bool,
    /// Writes made and recorded in `table` piece by piece (into empty maps), so
    /// `plan` holds none of them.
    written_ahead: usize,
}

/// Frontends planned and written at a time into empty maps: the plan of a start
/// then never holds all its writes (at 100k Services x 10 endpoints, 2.1 million
/// writes, 92 MB); a piece of 1024 frontends is about 21k writes at 10 endpoints.
const START_PIECE: usize = 1024;

/// Writes the difference between `desired` and the maps. With a kept table (`known`,
/// what the last sync left) only the `changed` frontends are planned; without one
/// (start, after a failure or a repair, new options) the kernel's table is read and
/// planned whole. `known` is taken, so a failure makes the next sync read the
/// kernel again.
pub(super) fn write_table(
    maps: &mut PinnedMaps,
    desired: &DesiredState,
    changed: &BTreeSet<Frontend>,
    known: &mut Option<KnownTable>,
) -> Result<Written, MapsError> {
    let started = Instant::now();
    let capacity = maps.capacity();
    let (table, plan, incremental, read_kernel) = match known.take() {
        Some(mut table) => {
            let plan = plan::plan_changes(desired, changed, &mut table, capacity);
            (table, plan, true, false)
        }
        None => {
            let current = maps.snapshot()?;
            if current.services.is_empty() && current.backends.is_empty() {
                return write_in_pieces(maps, desired, KnownTable::new(current, capacity));
            }
            let plan = plan::plan(desired, &current, capacity);
            (KnownTable::new(current, capacity), plan, false, true)
        }
    };
    let planned = started.elapsed();
    for rejected in &plan.rejected {
        warn!("{rejected}");
    }
    if !plan.is_empty() {
        maps.apply(&plan.ops)?;
        let fields = (
            planned.as_micros() as u64,
            (started.elapsed() - planned).as_micros() as u64,
        );
        if incremental {
            debug!(
                plan_us = fields.0,
                apply_us = fields.1,
                operations = plan.ops.len(),
                frontends = changed.len(),
                "changed frontends applied"
            );
        } else {
            info!(
                plan_ms = fields.0 / 1000,
                apply_ms = fields.1 / 1000,
                operations = plan.ops.len(),
                frontends = desired.frontends.len(),
                backends = desired.backend_count(),
                "service table applied"
            );
        }
    }
    Ok(Written {
        table,
        plan,
        incremental,
        read_kernel,
        written_ahead: 0,
    })
}

/// Writes `desired` into empty maps [`START_PIECE`] frontends at a time, each
/// piece planned against what the pieces before it wrote (as one change is), so
/// that every prefix of the writes is a consistent table, as with one plan. A
/// thread of its own writes each piece while the next is planned: at 100k Services
/// x 10 endpoints planning took about 1 s and the kernel writes 2.2-2.8 s, one
/// after the other on one CPU. At most two planned pieces wait for it.
fn write_in_pieces(
    maps: &mut PinnedMaps,
    desired: &DesiredState,
    mut table: KnownTable,
) -> Result<Written, MapsError> {
    let capacity = maps.capacity();
    let started = Instant::now();
    let (planned, written) = std::thread::scope(|scope| {
        let (pieces, arriving) = std::sync::mpsc::sync_channel::<plan::Plan>(2);
        let writer = std::thread::Builder::new()
            .name("lb-start-writes".into())
            .spawn_scoped(scope, move || write_pieces(maps, arriving))
            .expect("a thread can be started");
        // Planning time only: a wait for the writer is not planning.
        let (mut planning, mut piece_started) = (Duration::ZERO, Instant::now());
        let planned = plan::plan_in_pieces(desired, &mut table, capacity, START_PIECE, |plan| {
            planning += piece_started.elapsed();
            for rejected in &plan.rejected {
                warn!("{rejected}");
            }
            // A writer that failed has gone: stop planning; its error is the one
            // to report, below.
            let sent = pieces.send(plan).map_err(drop);
            piece_started = Instant::now();
            sent
        });
        drop(pieces);
        let written = writer.join().expect("the writer does not panic");
        (planned.map(|()| planning), written)
    });
    let (operations, applying) = written?;
    let planning = planned.expect("planning stops only when the writer has failed");
    if operations > 0 {
        info!(
            plan_ms = planning.as_millis() as u64,
            apply_ms = applying.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            operations,
            frontends = desired.frontends.len(),
            backends = desired.backend_count(),
            "service table applied"
        );
    }
    Ok(Written {
        table,
        plan: plan::Plan::default(),
        incremental: false,
        read_kernel: true,
        written_ahead: operations,
    })
}

/// The writer of [`write_in_pieces`]: each piece in order, until the planner is
/// done or a write fails. Returns the writes made and the time spent on them.
fn write_pieces(
    maps: &mut PinnedMaps,
    pieces: std::sync::mpsc::Receiver<plan::Plan>,
) -> Result<(usize, Duration), MapsError> {
    let (mut operations, mut applying) = (0, Duration::ZERO);
    for plan in pieces {
        let started = Instant::now();
        maps.apply(&plan.ops)?;
        applying += started.elapsed();
        operations += plan.ops.len();
    }
    Ok((operations, applying))
}

impl Written {
    /// The entries written, when the plan named every one (an incremental plan
    /// against the kept table); `None` for a table planned or read whole.
    pub(super) fn ops_if_incremental(&self) -> Option<&[crate::datapath::snapshot::MapOp]> {
        (self.incremental && self.written_ahead == 0).then_some(&self.plan.ops[..])
    }
}

/// The second half: remembers what was written and drops the counters of
/// frontends that are gone.
pub(super) fn record_table(
    maps: &mut PinnedMaps,
    written: Written,
    known: &mut Option<KnownTable>,
) -> Result<SyncOutcome, MapsError> {
    let Written {
        mut table,
        plan,
        incremental,
        read_kernel,
        written_ahead,
    } = written;
    let mut frontend_names = NamesUpdate::Unchanged;
    let touched = stale_sockets::Touched::before(table.snapshot(), &plan.ops);
    if incremental {
        let patch = table::frontend_names_patch(table.snapshot(), &plan.ops);
        let gone: Vec<u32> = patch
            .iter()
            .filter(|(_, name)| name.is_none())
            .map(|(id, _)| *id)
            .collect();
        table.apply(&plan.ops);
        maps.remove_service_stats(&gone)?;
        if !patch.is_empty() {
            frontend_names = NamesUpdate::Patch(patch);
        }
    } else {
        if !plan.is_empty() || written_ahead > 0 {
            table.apply(&plan.ops);
            let live = table
                .snapshot()
                .services
                .iter()
                .filter(|(key, _)| key.backend_slot == 0)
                .map(|(_, master)| master.rev_nat_id)
                .collect();
            maps.prune_service_stats(&live)?;
        }
        if !plan.is_empty() || read_kernel {
            frontend_names = NamesUpdate::Replace(table::frontend_names(table.snapshot()));
        }
    }
    let outcome = SyncOutcome {
        services_used: table.snapshot().services.len(),
        backends_used: table.snapshot().backends.len(),
        frontend_names,
        departed: touched.departed(table.snapshot()),
    };
    *known = Some(table);
    Ok(outcome)
}

/// What a successful sync left in the maps.
pub(super) struct SyncOutcome {
    pub(super) services_used: usize,
    pub(super) backends_used: usize,
    pub(super) frontend_names: NamesUpdate,
    /// Backends that left frontends of the socket hooks.
    pub(super) departed: Vec<stale_sockets::Departed>,
}
