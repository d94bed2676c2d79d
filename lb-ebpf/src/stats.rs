//! Per-CPU event counters (`lb stats` sums them).

use lb_common::SvcStats;

use crate::maps::{LB_STATS, LB_SVC_STATS};

const BPF_NOEXIST: u64 = 1;

#[inline(always)]
pub fn bump(index: u32) {
    if let Some(counter) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, only this CPU writes it while the program runs.
        unsafe { *counter += 1 };
    }
}

/// Counts one connection of a frontend (`refused`: for want of a backend).
#[inline(always)]
pub fn service(rev_nat_id: u32, refused: bool) {
    if let Some(entry) = LB_SVC_STATS.get_ptr_mut(rev_nat_id) {
        // SAFETY: this CPU's slot of a per-CPU value.
        let entry = unsafe { &mut *entry };
        if refused {
            entry.no_backend += 1;
        } else {
            entry.connections += 1;
        }
        return;
    }
    let first = SvcStats {
        connections: (!refused) as u64,
        no_backend: refused as u64,
        source_range_drops: 0,
    };
    // Another CPU may create the entry at the same time; losing that race loses one
    // count, which a counter of connections can afford.
    let _ = LB_SVC_STATS.insert(rev_nat_id, first, BPF_NOEXIST);
}

/// Counts one new flow of a frontend dropped by its `loadBalancerSourceRanges`.
#[inline(always)]
pub fn source_range_drop(rev_nat_id: u32) {
    if let Some(entry) = LB_SVC_STATS.get_ptr_mut(rev_nat_id) {
        // SAFETY: this CPU's slot of a per-CPU value.
        unsafe { (*entry).source_range_drops += 1 };
        return;
    }
    let first = SvcStats {
        source_range_drops: 1,
        ..SvcStats::default()
    };
    // As in `service`: a lost race loses one count.
    let _ = LB_SVC_STATS.insert(rev_nat_id, first, BPF_NOEXIST);
}
