//! Frontend lookup and backend selection, shared by the socket hooks and the
//! per-packet path: slot choice, session affinity, and the reject errno.

use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use lb_common::{
    quarantine as lbq, stat, AffinityKey, AffinityValue, Backend, IpAddrBe, ServiceKey,
    ServiceValue,
};

use crate::{
    maglev,
    maps::{LB_AFFINITY, LB_BACKENDS, LB_SERVICES},
    quarantine, stats,
};

const NSEC_PER_SEC: u64 = 1_000_000_000;

/// The master entry of a frontend, copied out (hash entries may be replaced later).
#[inline(always)]
pub fn frontend(key: &ServiceKey) -> Option<ServiceValue> {
    // SAFETY: copied out at once.
    unsafe { LB_SERVICES.get(key) }.copied()
}

/// How a new connection's slot is chosen when no affinity applies.
#[derive(Clone, Copy)]
pub struct Choice {
    /// Picks the slot at random.
    pub entropy: u32,
    /// The per-packet path's flow hash (`maglev::flow_hash`): a master with a Maglev
    /// table picks the slot its table gives the hash. `None` (the socket hooks):
    /// always at random.
    pub flow_hash: Option<u32>,
}

/// A backend for a new connection to the frontend. `client` yields the affinity
/// identity (`AffinityKey::client` and `client_ip`); it is only asked for when the
/// Service has session affinity, which applies first.
/// `choice` picks the slot when no affinity applies. `None` when the slots stay
/// missing even after a second look at the master: counted, and the caller refuses
/// rather than letting the VIP through to nowhere.
#[inline(always)]
pub fn backend(
    master_key: &ServiceKey,
    master: &ServiceValue,
    client: impl Fn() -> (u64, IpAddrBe),
    choice: Choice,
) -> Option<(u32, Backend)> {
    let mut picked = pick(master_key, master, &client, choice);
    if picked.is_none() {
        // The agent shrank the frontend between our read of the master and of the
        // slot (it lowers the count before deleting the slots): the master it wrote
        // since names only slots that exist.
        stats::bump(stat::SLOT_MISS);
        if let Some(fresh) = frontend(master_key).filter(|m| m.count > 0) {
            picked = pick(master_key, &fresh, &client, choice);
        }
    }
    picked
}

#[inline(always)]
fn pick(
    master_key: &ServiceKey,
    master: &ServiceValue,
    client: &impl Fn() -> (u64, IpAddrBe),
    choice: Choice,
) -> Option<(u32, Backend)> {
    if !master.is_affinity() {
        slot(master_key, master, choice)
    } else {
        with_affinity(master_key, master, client(), choice)
    }
}

#[inline(always)]
fn with_affinity(
    master_key: &ServiceKey,
    master: &ServiceValue,
    (client, client_ip): (u64, IpAddrBe),
    choice: Choice,
) -> Option<(u32, Backend)> {
    // SAFETY: a plain helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let key = AffinityKey {
        client,
        client_ip,
        rev_nat_id: master.rev_nat_id,
        _pad: 0,
    };
    // SAFETY: copied out at once.
    if let Some(remembered) = unsafe { LB_AFFINITY.get(key) }.copied() {
        let timeout_ns = master.affinity_timeout_sec as u64 * NSEC_PER_SEC;
        if now.wrapping_sub(remembered.last_used_ns) <= timeout_ns {
            let id = remembered.backend_id;
            // A quarantined backend is no place for a new connection, affinity or
            // not: the client moves (and stays) where the pick below sends it.
            if quarantine::enabled() && quarantine::is_quarantined(master.rev_nat_id, id, now) {
                quarantine::skipped(master.rev_nat_id, id);
            } else {
                // Backend ids belong to one frontend and vanish with the endpoint, so
                // a hit here is still a live backend of this Service.
                // SAFETY: copied out at once.
                if let Some(backend) = unsafe { LB_BACKENDS.get(id) }.copied() {
                    remember(&key, id, now);
                    return Some((id, backend));
                }
            }
        }
    }
    let (backend_id, backend) = slot(master_key, master, choice)?;
    remember(&key, backend_id, now);
    Some((backend_id, backend))
}

#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        last_used_ns: now,
        backend_id,
        _pad: 0,
    };
    if LB_AFFINITY.insert(key, value, 0).is_err() {
        stats::bump(stat::AFFINITY_UPDATE_FAILED);
    }
}

/// The slot a new connection gets: its Maglev table's when the caller hashed the
/// flow and the master has a table that answers, else a random one.
#[inline(always)]
fn slot_number(master: &ServiceValue, choice: Choice) -> u16 {
    if let Some(hash) = choice.flow_hash {
        match maglev::slot(master, hash) {
            maglev::Answer::Slot(slot) => return slot,
            maglev::Answer::Miss => stats::bump(stat::MAGLEV_MISS),
            maglev::Answer::NoTable => {}
        }
    }
    random_slot(master, choice)
}

#[inline(always)]
fn random_slot(master: &ServiceValue, choice: Choice) -> u16 {
    (choice.entropy % master.count as u32) as u16 + 1
}

/// The backend id in slot `slot` of the frontend.
#[inline(always)]
fn backend_in(master_key: &ServiceKey, slot: u16) -> Option<u32> {
    let slot_key = ServiceKey {
        backend_slot: slot,
        ..*master_key
    };
    // SAFETY: copied out at once.
    unsafe { LB_SERVICES.get(slot_key) }.map(|slot| slot.backend_id)
}

#[inline(always)]
fn slot(master_key: &ServiceKey, master: &ServiceValue, choice: Choice) -> Option<(u32, Backend)> {
    let first = slot_number(master, choice);
    let mut backend_id = backend_in(master_key, first)?;
    if quarantine::enabled() {
        backend_id = healthy(master_key, master, choice, backend_id);
    }
    // SAFETY: copied out at once.
    let backend = unsafe { LB_BACKENDS.get(backend_id) }.copied()?;
    Some((backend_id, backend))
}

/// `picked`, unless the frontend has it quarantined: then the first candidate of
/// the fall-through that is not (Maglev: further down the flow's probe sequence,
/// then the random scan; random: the scan from the random start), and when every
/// candidate is quarantined `picked` after all, so a Service whose every backend
/// refuses behaves as without quarantine. Bounded (`MAGLEV_PROBES + SCAN_TRIES`).
#[inline(always)]
fn healthy(master_key: &ServiceKey, master: &ServiceValue, choice: Choice, picked: u32) -> u32 {
    // SAFETY: a plain helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let rev_nat_id = master.rev_nat_id;
    if !quarantine::is_quarantined(rev_nat_id, picked, now) {
        return picked;
    }
    let count = master.count;
    let start = random_slot(master, choice);
    let stride = lbq::scan_stride(count, choice.entropy);
    let scanned = if (count as u32) < lbq::SCAN_TRIES {
        count as u32
    } else {
        lbq::SCAN_TRIES
    };
    let hash = match choice.flow_hash {
        Some(hash) if master.maglev().is_some() => Some(hash),
        _ => None,
    };
    for i in 1..lbq::MAGLEV_PROBES + lbq::SCAN_TRIES {
        let slot = match hash {
            Some(hash) if i < lbq::MAGLEV_PROBES => match maglev::probe(master, hash, i) {
                maglev::Answer::Slot(slot) => slot,
                _ => continue,
            },
            _ => {
                // Random picks scan from candidate 1 on (0 was the pick); Maglev's
                // scan starts at 0, the random start, after its probes.
                let n = if hash.is_some() {
                    i - lbq::MAGLEV_PROBES
                } else {
                    i
                };
                if n >= scanned {
                    continue;
                }
                lbq::scan_slot(start, stride, n, count)
            }
        };
        let Some(candidate) = backend_in(master_key, slot) else {
            continue;
        };
        if !quarantine::is_quarantined(rev_nat_id, candidate, now) {
            quarantine::skipped(rev_nat_id, picked);
            return candidate;
        }
    }
    stats::bump(stat::QUARANTINE_ALL);
    picked
}
