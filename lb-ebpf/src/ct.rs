//! Conntrack for the per-packet path: one LRU entry per flow direction, keyed by the
//! tuple as the packet carries it, valued by the tuple to rewrite it to.

use aya_ebpf::helpers::generated::bpf_ktime_get_ns;
use lb_common::{
    CtKey, CtValue, CT_DIR_REPLY, CT_STATE_ESTABLISHED, CT_STATE_FIN, CT_STATE_RST, CT_STATE_SYN,
    IPPROTO_TCP,
};

use crate::{
    maps::LB_CT,
    nat::Tuple,
    packet::{Flow, TCP_FLAG_ACK, TCP_FLAG_FIN, TCP_FLAG_RST, TCP_FLAG_SYN},
    quarantine,
};

const BPF_NOEXIST: u64 = 1;

#[inline(always)]
pub fn key_of(flow: &Flow) -> CtKey {
    CtKey {
        src_addr: flow.saddr,
        dst_addr: flow.daddr,
        src_port: flow.sport,
        dst_port: flow.dport,
        proto: flow.proto,
        _pad: [0; 3],
    }
}

#[inline(always)]
pub fn key_of_tuple(t: &Tuple, proto: u8) -> CtKey {
    CtKey {
        src_addr: t.saddr,
        dst_addr: t.daddr,
        src_port: t.sport,
        dst_port: t.dport,
        proto,
        _pad: [0; 3],
    }
}

#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: a plain helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// State bits a TCP packet contributes; the agent's GC turns them into timeouts.
#[inline(always)]
pub fn state_of(flow: &Flow) -> u8 {
    if flow.proto != IPPROTO_TCP {
        return CT_STATE_ESTABLISHED;
    }
    let f = flow.tcp_flags;
    let mut state = 0;
    if f & TCP_FLAG_SYN != 0 {
        state |= CT_STATE_SYN;
    }
    if f & TCP_FLAG_ACK != 0 && f & TCP_FLAG_SYN == 0 {
        state |= CT_STATE_ESTABLISHED;
    }
    if f & TCP_FLAG_FIN != 0 {
        state |= CT_STATE_FIN;
    }
    if f & TCP_FLAG_RST != 0 {
        state |= CT_STATE_RST;
    }
    state
}

/// What a known flow's entry says about a packet of it.
#[derive(Clone, Copy)]
pub struct Known {
    /// The tuple the packet leaves with.
    pub to: Tuple,
    /// The entry's `CT_DSR*` bits (read through the predicates below, which are
    /// `CtValue`'s).
    dsr: u8,
    /// The entry is the flow's reply direction.
    pub reply: bool,
}

impl Known {
    #[inline(always)]
    fn flags(&self) -> CtValue {
        CtValue {
            dsr: self.dsr,
            ..CtValue::default()
        }
    }

    /// The flow goes by DSR (`CtValue::is_dsr`).
    #[inline(always)]
    pub fn is_dsr(&self) -> bool {
        self.flags().is_dsr()
    }

    /// Its packets travel inside an outer IP header (`CtValue::is_dsr_ipip`).
    #[inline(always)]
    pub fn is_dsr_ipip(&self) -> bool {
        self.flags().is_dsr_ipip()
    }
}

/// The translation of a known flow, with its entry refreshed for the GC.
///
/// A SYN (or SYN-ACK) on the tuple of a flow that already ended (FIN or RST seen)
/// starts a new connection that reuses the client's port: the old translation must
/// not apply to it. The entry is dropped and `None` returned, so a SYN to a Service
/// is balanced afresh and a SYN-ACK of a connection that never went through a
/// Service (the client reached the pod directly) passes untouched.
// The key by reference on purpose: `forget` rewrites it in place afterwards, and
// a copy per call would cost frames already at the kernel's limit.
#[allow(clippy::needless_borrows_for_generic_args)]
#[inline(always)]
pub fn follow(flow: &Flow) -> Option<Known> {
    let mut key = key_of(flow);
    let entry = LB_CT.get_ptr_mut(&key)?;
    // SAFETY: the pointer is valid for this program run; concurrent updates of the
    // same entry from another CPU only race on the timestamp and state bits, which
    // are monotonic hints for the GC.
    let entry = unsafe { &mut *entry };
    let ended = entry.state & (CT_STATE_FIN | CT_STATE_RST) != 0;
    if ended && flow.proto == IPPROTO_TCP && flow.tcp_flags & TCP_FLAG_SYN != 0 {
        let _ = LB_CT.remove(&key);
        return None;
    }
    let now = now();
    // Rewriting the timestamp on every packet dirties a shared cache line; once per
    // millisecond is plenty for timeouts measured in seconds.
    if now.wrapping_sub(entry.last_seen_ns) > 1_000_000 {
        entry.last_seen_ns = now;
    }
    let state = state_of(flow);
    if entry.state & state != state {
        if entry.dir == CT_DIR_REPLY && quarantine::enabled() && first_answer(entry, flow, now) {
            forget(&mut key, entry);
        }
        entry.state |= state;
    }
    Some(Known {
        to: Tuple {
            saddr: entry.nat_src_addr,
            daddr: entry.nat_dst_addr,
            sport: entry.nat_src_port,
            dport: entry.nat_dst_port,
        },
        dsr: entry.dsr,
        reply: entry.dir == CT_DIR_REPLY,
    })
}

/// A refused flow is forgotten on the client's side: its forward entry (keyed by
/// what the client sent, which the reply entry `entry` rewrites back to) is
/// removed, so a later packet on the same tuple is balanced afresh, past the
/// quarantined backend, rather than following the dead pick. A new socket that
/// happens to get the refused one's port (a random ephemeral port repeats about
/// once in a few hundred) and a resolver retrying on the same socket both need
/// that. The reply entry stays until the GC takes it: the packet at hand is still
/// translated from it, and a backend has nothing more to send on a refused flow.
///
/// `key`, the reply entry's key, is rewritten into the forward one in place: the
/// callers' frames are at the kernel's stack limit (`lb_xdp`'s within 8 bytes),
/// with no room for a second key.
#[inline(always)]
fn forget(key: &mut CtKey, entry: &CtValue) {
    key.src_addr = entry.nat_dst_addr;
    key.dst_addr = entry.nat_src_addr;
    key.src_port = entry.nat_dst_port;
    key.dst_port = entry.nat_src_port;
    // By reference on purpose, as everywhere on these paths.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let _ = LB_CT.remove(&*key);
}

/// Passive health on the per-packet path: a backend's first answer to a new flow
/// (its reply entry has seen nothing yet) says whether it took it. A RST refuses
/// (the port is closed: quarantined for the frontend); a SYN-ACK, or a UDP
/// datagram, accepts (any quarantine is cleared). Reached only when the reply entry's
/// state bits change, so an established flow never comes here. Returns whether the
/// backend refused (the flow is then to be forgotten).
#[inline(always)]
fn first_answer(entry: &CtValue, flow: &Flow, now: u64) -> bool {
    if !unanswered(entry) {
        return false;
    }
    // A UDP backend's first datagram back is its acceptance.
    if flow.proto != IPPROTO_TCP {
        quarantine::accepted(entry.rev_nat_id, entry.backend_id);
        return false;
    }
    let f = flow.tcp_flags;
    if f & TCP_FLAG_RST != 0 {
        quarantine::refused(entry.rev_nat_id, entry.backend_id, now, 0);
        return true;
    }
    if f & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN | TCP_FLAG_ACK {
        quarantine::accepted(entry.rev_nat_id, entry.backend_id);
    }
    false
}

/// A reply entry that has seen nothing from its backend yet, of a flow a frontend
/// pick made (frontend id 0: one no pick made, such as a DSR flow's reply entry on
/// the backend's node, with no backend to judge).
#[inline(always)]
fn unanswered(entry: &CtValue) -> bool {
    let answered = CT_STATE_SYN | CT_STATE_ESTABLISHED | CT_STATE_RST | CT_STATE_FIN;
    entry.dir == CT_DIR_REPLY && entry.state & answered == 0 && entry.rev_nat_id != 0
}

/// Passive health from an ICMP error about a flow's packet (`entry`: the flow's
/// reply entry): a host or port unreachable (`lb_common::quarantine::icmp_refuses`)
/// before the backend answered anything refuses the new flow, TCP or UDP, and the
/// flow is forgotten (see [`forget`]; `key` is the reply entry's, and is
/// overwritten).
#[inline(always)]
pub fn refused_by_error(key: &mut CtKey, entry: &CtValue) {
    if quarantine::enabled() && unanswered(entry) {
        quarantine::refused(entry.rev_nat_id, entry.backend_id, now(), 0);
        forget(key, entry);
    }
}

/// A new entry rewriting to `to`, without DSR (see [`CtValue::dsr`] for that).
#[inline(always)]
pub fn entry(to: &Tuple, backend_id: u32, rev_nat_id: u32, state: u8, dir: u8) -> CtValue {
    CtValue {
        last_seen_ns: now(),
        nat_src_addr: to.saddr,
        nat_dst_addr: to.daddr,
        nat_src_port: to.sport,
        nat_dst_port: to.dport,
        backend_id,
        rev_nat_id,
        state,
        dir,
        dsr: 0,
        _pad2: 0,
    }
}

/// Inserts only if the tuple is free: the atomic claim of a SNAT port.
#[inline(always)]
pub fn claim(key: &CtKey, value: &CtValue) -> Result<(), i32> {
    LB_CT.insert(key, value, BPF_NOEXIST)
}

#[inline(always)]
pub fn put(key: &CtKey, value: &CtValue) -> Result<(), i32> {
    LB_CT.insert(key, value, 0)
}
