//! The periodic check that the kernel's service table is what this agent wrote.
//!
//! The table is read on a thread of its own, and compared on the agent's loop a
//! step of [`STEP`] entries at a time, the loop free for changes for [`PACE`]
//! after each:
//! the agent runs on one thread, and reading and comparing 210k entries in one go
//! (10k Services x 10 endpoints) held every change behind it for 250 ms once a
//! minute (2.2 s at 100k: the p99.9 of the change latency under churn).
//!
//! Changes go on while a check runs, so a batch may have been read before a write
//! the loop made since: entries the agent wrote during the check are not judged
//! (they were just written), and the entry counts are compared only when nothing
//! was written meanwhile. A write the check cannot follow entry by entry (a whole
//! table planned or read back) leaves it inconclusive; the next one judges.

use std::collections::HashSet;
use std::time::Duration;

use lb_common::ServiceKey;
use tokio::sync::mpsc;

use crate::datapath::maps::{MapsError, PinnedMaps, TableBatch};
use crate::datapath::snapshot::{MapOp, MapSnapshot};

/// Entries compared in one step of the loop, between which it yields to changes
/// (about a millisecond of lookups in the agent's table).
const STEP: usize = 1024;
/// The pause after each step: the check then takes a fraction of the CPUs,
/// not all the loop and its reader can get. Steps taken back to back (yielding
/// only to changes already waiting) still held changes 10-45 ms once a minute
/// under churn on 2 CPUs (issue 22's bench): the sources' own work and the
/// reader's system calls share those CPUs with the loop.
pub(super) const PACE: Duration = Duration::from_millis(2);
/// Steps read ahead of the comparison: enough to keep the reader busy while the
/// loop compares, little enough to hold no second copy of the table.
const READ_AHEAD: usize = 16;

/// A check under way: what was compared so far.
pub(super) struct Check {
    services: usize,
    backends: usize,
    same: bool,
    /// Entries written since the check began.
    touched_services: HashSet<ServiceKey>,
    touched_backends: HashSet<u32>,
    /// A write the check could not follow entry by entry happened.
    inconclusive: bool,
}

/// The batches of a check, as the reader thread sends them.
pub(super) type Batches = mpsc::Receiver<Result<TableBatch, MapsError>>;

/// Why a check could not start.
#[derive(Debug, thiserror::Error)]
pub(super) enum CheckError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("cannot start its reader thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// How a finished check came out.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Same,
    Differs,
    Inconclusive,
}

impl Check {
    /// Starts reading the table on a thread of its own.
    pub(super) fn start(maps: &PinnedMaps) -> Result<(Check, Batches), CheckError> {
        let reader = maps.table_reader()?;
        let (tx, rx) = mpsc::channel(READ_AHEAD);
        // A thread of its own (not the blocking pool, whose threads are reused),
        // at the lowest priority: the check can wait, the agent's loop cannot. On a
        // busy 2-CPU node the reader at normal priority still held changes up by
        // tens of ms.
        let spawned = std::thread::Builder::new()
            .name("lb-consistency".into())
            .spawn(move || {
                // Lowering one's own priority needs no privilege; a refusal just leaves it.
                let _ = rustix::process::nice(19);
                // A send fails only when the loop dropped the check: stop reading then.
                let send = |batch| tx.blocking_send(Ok(batch)).is_ok();
                let read = reader.read(|batch| match batch {
                    TableBatch::Services(entries) => entries
                        .chunks(STEP)
                        .all(|step| send(TableBatch::Services(step.to_vec()))),
                    TableBatch::Backends(entries) => entries
                        .chunks(STEP)
                        .all(|step| send(TableBatch::Backends(step.to_vec()))),
                });
                if let Err(e) = read {
                    let _ = tx.blocking_send(Err(e));
                }
            });
        spawned.map_err(CheckError::Thread)?;
        let check = Check {
            services: 0,
            backends: 0,
            same: true,
            touched_services: HashSet::new(),
            touched_backends: HashSet::new(),
            inconclusive: false,
        };
        Ok((check, rx))
    }

    /// Compares one batch with what the agent holds now.
    pub(super) fn compare(&mut self, batch: &TableBatch, known: &MapSnapshot) {
        match batch {
            TableBatch::Services(entries) => {
                self.services += entries.len();
                self.same &= entries.iter().all(|(k, v)| {
                    self.touched_services.contains(k) || known.services.get(k) == Some(v)
                });
            }
            TableBatch::Backends(entries) => {
                self.backends += entries.len();
                self.same &= entries.iter().all(|(id, b)| {
                    self.touched_backends.contains(id) || known.backends.get(id) == Some(b)
                });
            }
        }
    }

    /// The loop wrote `ops` (None: a write not described entry by entry).
    pub(super) fn written(&mut self, ops: Option<&[MapOp]>) {
        let Some(ops) = ops else {
            self.inconclusive = true;
            return;
        };
        for op in ops {
            match *op {
                MapOp::PutService { key, .. } | MapOp::DeleteService { key } => {
                    self.touched_services.insert(key);
                }
                MapOp::PutBackend { id, .. } | MapOp::DeleteBackend { id } => {
                    self.touched_backends.insert(id);
                }
                // The Maglev arena is not part of the check (its tables are trusted,
                // not read back: see control::maglev_tables).
                MapOp::PutMaglev { .. } | MapOp::PutMaglevSeed { .. } => {}
            }
        }
    }

    /// The verdict once the reader is done.
    pub(super) fn finish(&self, known: &MapSnapshot) -> Verdict {
        if !self.same {
            return Verdict::Differs;
        }
        if self.inconclusive {
            return Verdict::Inconclusive;
        }
        let quiet = self.touched_services.is_empty() && self.touched_backends.is_empty();
        // Every entry read is known and none twice (keys are unique), so equal
        // counts leave no known entry missing. With writes meanwhile, the counts
        // of a table read while it changed say nothing.
        if quiet && (self.services != known.services.len() || self.backends != known.backends.len())
        {
            return Verdict::Differs;
        }
        Verdict::Same
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{Backend, ServiceValue};

    fn key(port: u16) -> ServiceKey {
        ServiceKey {
            port: port.to_be(),
            ..ServiceKey::default()
        }
    }

    fn known() -> MapSnapshot {
        let mut snapshot = MapSnapshot::default();
        snapshot.services.insert(key(80), ServiceValue::default());
        snapshot.services.insert(key(81), ServiceValue::default());
        snapshot.backends.insert(1, Backend::default());
        snapshot
    }

    fn check() -> Check {
        Check {
            services: 0,
            backends: 0,
            same: true,
            touched_services: HashSet::new(),
            touched_backends: HashSet::new(),
            inconclusive: false,
        }
    }

    fn services(keys: &[u16], count: u16) -> TableBatch {
        TableBatch::Services(
            keys.iter()
                .map(|p| {
                    (
                        key(*p),
                        ServiceValue {
                            count,
                            ..ServiceValue::default()
                        },
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn a_table_read_whole_and_equal_is_the_same() {
        let known = known();
        let mut c = check();
        c.compare(&services(&[80], 0), &known);
        c.compare(&services(&[81], 0), &known);
        c.compare(&TableBatch::Backends(vec![(1, Backend::default())]), &known);
        assert_eq!(c.finish(&known), Verdict::Same);
    }

    #[test]
    fn a_changed_or_missing_entry_differs() {
        let known = known();
        let mut c = check();
        c.compare(&services(&[80, 81], 3), &known);
        assert_eq!(
            c.finish(&known),
            Verdict::Differs,
            "a value changed behind us"
        );
        let mut c = check();
        c.compare(&services(&[80], 0), &known);
        c.compare(&TableBatch::Backends(vec![(1, Backend::default())]), &known);
        assert_eq!(c.finish(&known), Verdict::Differs, "an entry went missing");
        let mut c = check();
        c.compare(&services(&[80, 81, 82], 0), &known);
        assert_eq!(c.finish(&known), Verdict::Differs, "an entry nobody wrote");
    }

    /// A batch read before the agent wrote an entry shows the old value: not drift.
    #[test]
    fn entries_written_during_the_check_are_not_judged() {
        let known = known();
        let mut c = check();
        c.written(Some(&[MapOp::PutService {
            key: key(81),
            value: ServiceValue::default(),
        }]));
        c.compare(&services(&[80], 0), &known);
        c.compare(&services(&[81], 7), &known);
        // The count is not judged either (the table changed under the reader).
        assert_eq!(c.finish(&known), Verdict::Same);
        // An untouched entry that differs still does.
        c.compare(&services(&[80], 7), &known);
        assert_eq!(c.finish(&known), Verdict::Differs);
    }

    #[test]
    fn a_whole_table_write_meanwhile_leaves_it_inconclusive() {
        let known = known();
        let mut c = check();
        c.written(None);
        c.compare(&services(&[80, 81], 0), &known);
        assert_eq!(c.finish(&known), Verdict::Inconclusive);
    }
}
