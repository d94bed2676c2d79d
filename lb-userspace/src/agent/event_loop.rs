//! The loop: every event becomes at most one change. Objects from the source,
//! the node's devices and addresses, the ip-masq-agent file, the consistency check
//! and the retry of a refused write each wait in one `select!`. (The conntrack
//! collector, masquerade translations included, runs on a thread of its own:
//! `ct_gc`.)

use std::time::Duration;

use tokio::time::{interval, interval_at, Instant, MissedTickBehavior};
use tracing::{debug, info, warn};

use super::change::Cause;
use super::consistency::{self, Check, Verdict};
use super::node_objects::served_addresses;
use super::start::{Agent, Inputs};
use super::AgentError;
use crate::datapath::maps::{MapsError, TableBatch};

/// How long to wait before retrying a service table the kernel refused.
const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// What woke the loop, when it needs a change.
enum Wake {
    // Boxed: with the policy kinds' maps, `Changes` is 288 bytes, the other
    // wakes none.
    Changes(Box<crate::source::changes::Changes>),
    Resync,
    Stop,
}

/// Runs the loop until a signal, the source's end, or a fatal error; hands the
/// agent back for [`Agent::stop`].
pub(super) async fn follow(
    (mut agent, mut inputs): (Agent, Inputs),
) -> (Agent, Result<(), AgentError>) {
    let mut sigterm = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        Ok(s) => s,
        Err(e) => return (agent, Err(AgentError::Signal(e))),
    };
    let every = agent.config.consistency_interval;
    let mut check_every = interval_at(Instant::now() + every, every);
    check_every.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The ip-masq-agent file is looked at once a second (a stat; read only when
    // it changed): a ConfigMap update swaps symlinks, which inotify on the path
    // does not follow reliably.
    let mut masq_file = interval(Duration::from_secs(1));
    masq_file.set_missed_tick_behavior(MissedTickBehavior::Delay);
    agent.masquerade.sync(&agent.nodes);
    let mut net_followed = true;
    // Deadlines, not fresh sleeps: a `sleep` made in the `select!` starts again on
    // every turn of the loop, so under a steady stream of changes it never ends.
    let mut retry_at: Option<Instant> = None;
    let mut devices_retry_at: Option<Instant> = None;
    // The batches of the consistency check under way (its state is the agent's,
    // which notes the writes made meanwhile).
    let mut batches: Option<consistency::Batches> = None;
    // The check's next step waits until then (see `consistency::PACE`).
    let mut check_paused: Option<Instant> = None;
    loop {
        // A device left without its program (set by any sync) is tried again a
        // second after, and not before: whatever else wakes the loop meanwhile.
        devices_retry_at = match (agent.devices_pending && agent.attached, devices_retry_at) {
            (false, _) => None,
            (true, Some(at)) => Some(at),
            (true, None) => Some(Instant::now() + RETRY_INTERVAL),
        };
        let wake = tokio::select! {
            _ = masq_file.tick(), if agent.masquerade.follows_file() => {
                if agent.masquerade.reload() {
                    agent.masquerade.sync(&agent.nodes);
                }
                continue;
            }
            _ = check_every.tick(), if agent.attached && batches.is_none() => {
                batches = agent.start_check();
                continue;
            }
            _ = sleep_until(check_paused), if check_paused.is_some() => {
                check_paused = None;
                continue;
            }
            batch = next_batch(&mut batches), if batches.is_some() && check_paused.is_none() => {
                match agent.check_step(batch) {
                    Step::Going => {
                        check_paused = Some(Instant::now() + consistency::PACE);
                        continue;
                    }
                    Step::Done => {
                        batches = None;
                        continue;
                    }
                    Step::Repair => {
                        batches = None;
                        Wake::Resync
                    }
                }
            }
            changes = inputs.objects.next() => match changes {
                Some(changes) => Wake::Changes(Box::new(changes)),
                None => Wake::Stop,
            },
            changed = inputs.node_net.changed(), if net_followed => {
                if changed.is_err() {
                    // The watcher logged why; what is attached stays attached.
                    net_followed = false;
                    continue;
                }
                agent.net = inputs.node_net.borrow_and_update().clone();
                if let Some(policy) = &mut agent.policy {
                    policy.set_node_addresses(agent.net.addresses());
                }
                if !agent.attached {
                    // No table written yet: the first change reads these addresses.
                    // A resync now would program the objects known so far, none
                    // before the source's first hand-on: a restarted agent wiped
                    // the service table its predecessor left and said it was
                    // serving with 0 frontends (the image's rolling update, 3 of
                    // 5 runs with a slower program load).
                    continue;
                }
                agent.sync_devices();
                // Only a change of the served addresses needs a new table.
                let served = served_addresses(&agent.net, &agent.config, &agent.nodes);
                if served == agent.index.options().node_ips {
                    continue;
                }
                info!(addresses = ?served, "node addresses changed");
                Wake::Resync
            }
            _ = sleep_until(retry_at), if retry_at.is_some() => {
                retry_at = None;
                Wake::Resync
            }
            _ = sleep_until(devices_retry_at), if devices_retry_at.is_some() => {
                devices_retry_at = None;
                agent.sync_devices();
                continue;
            }
            _ = tokio::signal::ctrl_c() => Wake::Stop,
            _ = sigterm.recv() => Wake::Stop,
        };
        let outcome = match wake {
            Wake::Changes(changes) => agent.apply(Some(*changes), Cause::Objects).await,
            Wake::Resync => agent.apply(None, Cause::Resync).await,
            Wake::Stop => break,
        };
        match outcome {
            Ok(failed) => {
                retry_at = match (failed, retry_at) {
                    (false, _) => None,
                    (true, Some(at)) => Some(at),
                    (true, None) => Some(Instant::now() + RETRY_INTERVAL),
                }
            }
            Err(e) => return (agent, Err(e.into())),
        }
    }
    (agent, Ok(()))
}

/// Until `at` (never, without one).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next batch of the check under way (never, without one).
async fn next_batch(
    batches: &mut Option<consistency::Batches>,
) -> Option<Result<TableBatch, MapsError>> {
    match batches {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Where the consistency check stands after a step.
enum Step {
    Going,
    Done,
    Repair,
}

impl Agent {
    /// The agent plans against what it remembers writing; an entry changed behind
    /// its back (bpftool, another tool, a bug) would stay wrong until the Service
    /// changed. A check compares the kernel's table with that memory (see
    /// `consistency.rs`); on a difference the memory is forgotten, so the next
    /// change reads the kernel's table.
    fn start_check(&mut self) -> Option<consistency::Batches> {
        self.known_table.as_ref()?;
        match Check::start(&self.maps) {
            Ok((check, batches)) => {
                self.check = Some(check);
                Some(batches)
            }
            Err(e) => {
                warn!("consistency check not run: {e}");
                None
            }
        }
    }

    /// One batch of the check, or its end (`None`).
    fn check_step(&mut self, batch: Option<Result<TableBatch, MapsError>>) -> Step {
        let (Some(check), Some(known)) = (&mut self.check, &self.known_table) else {
            // The memory was dropped meanwhile (a failed write): nothing to judge.
            self.check = None;
            return Step::Done;
        };
        match batch {
            Some(Ok(batch)) => {
                check.compare(&batch, known.snapshot());
                return Step::Going;
            }
            Some(Err(e)) => warn!("consistency check could not read the maps: {e}"),
            None => match check.finish(known.snapshot()) {
                Verdict::Same => {}
                Verdict::Inconclusive => {
                    debug!("consistency check overtaken by a whole-table write")
                }
                Verdict::Differs => {
                    warn!(
                        "the service table in the kernel differs from what this agent wrote; repairing"
                    );
                    self.status.record_drift_repair();
                    self.known_table = None;
                    self.check = None;
                    return Step::Repair;
                }
            },
        }
        self.check = None;
        Step::Done
    }
}
