//! Passive health in the kernel: `LB_QUARANTINE` read by the backend choice
//! (`select`), written where a new connection's fate is seen: `sock_ops` for the
//! sockets the hooks translated, the reply direction of conntrack (`ct`) for the
//! per-packet path. The rules (backoff, what a repeat does, the order of the
//! fall-through) are `lb_common::quarantine`'s, shared with the agent's tests.

// Keys and values go to the map helpers by reference throughout: these run inside
// `lb_tc_external`'s frame, a few bytes under the kernel's 512, and passed by value
// they were copied for the call and pushed it past (the linker says so).
#![allow(clippy::needless_borrows_for_generic_args)]

use lb_common::{stat, QuarantineKey, QuarantineSettings, QuarantineValue};

use crate::{maps::LB_QUARANTINE, stats};

const BPF_NOEXIST: u64 = 1;

/// `--backend-quarantine`; set by the agent at load time. Off in the object, so a
/// loader that says nothing (the packet fixtures) gets the datapath as before.
#[unsafe(no_mangle)]
static LB_QUARANTINE_SETTINGS: QuarantineSettings = QuarantineSettings { enabled: 0 };

/// Whether the programs quarantine refusing backends.
#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a read-only global the loader patches; volatile so the compiler does
    // not fold the zero it sees at build time.
    unsafe { core::ptr::read_volatile(&LB_QUARANTINE_SETTINGS) }.is_enabled()
}

/// The backend `backend_id` of frontend `rev_nat_id` is quarantined at `now`.
#[inline(always)]
pub fn is_quarantined(rev_nat_id: u32, backend_id: u32, now: u64) -> bool {
    let key = QuarantineKey {
        rev_nat_id,
        backend_id,
    };
    // SAFETY: read at once; a torn read against a concurrent writer is still a
    // time, and a wrong answer costs one connection its best pick.
    unsafe { LB_QUARANTINE.get(&key) }.is_some_and(|q| q.is_active(now))
}

/// A new connection passed over the quarantined `backend_id` for another backend.
#[inline(always)]
pub fn skipped(rev_nat_id: u32, backend_id: u32) {
    stats::bump(stat::QUARANTINE_SKIP);
    let key = QuarantineKey {
        rev_nat_id,
        backend_id,
    };
    if let Some(entry) = LB_QUARANTINE.get_ptr_mut(&key) {
        // SAFETY: a valid entry for this program run; a lost increment between
        // CPUs loses one count.
        unsafe { (*entry).skips += 1 };
    }
}

/// The backend refused a new connection of the frontend at `now` (`flags`:
/// `QUARANTINE_FLAG_*`, who saw it).
#[inline(always)]
pub fn refused(rev_nat_id: u32, backend_id: u32, now: u64, flags: u32) {
    let key = QuarantineKey {
        rev_nat_id,
        backend_id,
    };
    if let Some(entry) = LB_QUARANTINE.get_ptr_mut(&key) {
        // SAFETY: a valid entry for this program run. Two CPUs marking the same
        // backend at once may both count a quarantine; the times they write agree.
        if unsafe { (*entry).refused(now, flags) } {
            stats::bump(stat::QUARANTINED);
        }
        return;
    }
    let mut first = QuarantineValue::default();
    first.refused(now, flags);
    // NOEXIST: another CPU that created it meanwhile has marked the same outage.
    if LB_QUARANTINE.insert(&key, &first, BPF_NOEXIST).is_ok() {
        stats::bump(stat::QUARANTINED);
    }
}

/// The backend accepted a new connection of the frontend: clears its quarantine.
/// Only a backend that has an entry (refused at some time) costs a write.
#[inline(always)]
pub fn accepted(rev_nat_id: u32, backend_id: u32) {
    let key = QuarantineKey {
        rev_nat_id,
        backend_id,
    };
    if let Some(entry) = LB_QUARANTINE.get_ptr_mut(&key) {
        // SAFETY: a valid entry for this program run.
        if unsafe { (*entry).accepted() } {
            stats::bump(stat::QUARANTINE_CLEARED);
        }
    }
}
