//! Maglev on the per-packet path: a new flow to a frontend whose master carries a
//! table (`SVC_FLAG_MAGLEV`) takes the slot that table names for the flow's hash,
//! so every node that builds the same table sends the flow to the same backend.
//! The socket hooks never come here: they keep the random pick and affinity.

use lb_common::{maglev, quarantine, IpAddrBe, ServiceValue, MAGLEV_SLOTS_PER_ENTRY};

use crate::maps::LB_MAGLEV;

/// The seed of the tables and the flow hash (`--maglev-seed`, the same on every
/// node); set by the agent at load time.
#[unsafe(no_mangle)]
static LB_MAGLEV_SEED: u64 = 0;

/// The flow's hash for Maglev: client address and port, frontend port, protocol,
/// not the frontend address (see `lb_common::maglev`).
#[inline(always)]
pub fn flow_hash(saddr: &IpAddrBe, sport_be: u16, dport_be: u16, proto: u8) -> u32 {
    // SAFETY: a read-only global the loader patches; volatile so the compiler does
    // not fold the zero it sees at build time.
    let seed = unsafe { core::ptr::read_volatile(&LB_MAGLEV_SEED) };
    maglev::flow_hash(saddr, sport_be, dport_be, proto, seed)
}

/// What a master's Maglev table says for one flow.
pub enum Answer {
    /// The master has no table: a random frontend.
    NoTable,
    /// The backend in this slot (1-based, as `ServiceKey::backend_slot`).
    Slot(u16),
    /// The table did not answer: its entry lies past the array, or holds a
    /// position that names no slot of this master (a damaged arena).
    Miss,
}

/// The slot the master's table gives a flow of hash `hash`.
#[inline(always)]
pub fn slot(master: &ServiceValue, hash: u32) -> Answer {
    probe(master, hash, 0)
}

/// The slot of probe `i` of the flow's walk down the table (0: [`slot`]'s; see
/// `lb_common::quarantine::maglev_probe`): where the flow goes when the backends
/// of the probes before it are quarantined.
#[inline(always)]
pub fn probe(master: &ServiceValue, hash: u32, i: u32) -> Answer {
    let Some((first, size)) = master.maglev() else {
        return Answer::NoTable;
    };
    let count = master.count;
    let at = first.wrapping_add(quarantine::maglev_probe(hash, size, i));
    // Copied out at once: the agent may rewrite the entry meanwhile, and a torn
    // read is still a position, checked below like any other.
    let Some(entry) = LB_MAGLEV.get(at / MAGLEV_SLOTS_PER_ENTRY).copied() else {
        return Answer::Miss;
    };
    // The lane by shifting the entry as one word: indexing the copy on the stack
    // by a variable compiled to an OR on the frame pointer, which the verifier
    // refuses.
    let [a, b, c, d] = entry.positions.map(u64::from);
    let word = a | b << 16 | c << 32 | d << 48;
    let position = (word >> ((at % MAGLEV_SLOTS_PER_ENTRY) * 16)) as u16;
    if position < count {
        Answer::Slot(position + 1)
    } else {
        Answer::Miss
    }
}
