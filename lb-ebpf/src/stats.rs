//! Per-CPU event counters (`lb stats` sums them).

use crate::maps::LB_STATS;

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(counter) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, only this CPU writes it while the program runs.
        unsafe { *counter += 1 };
    }
}
