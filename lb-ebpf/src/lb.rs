//! Frontend lookup, backend selection and session affinity for the socket hooks.

use aya_ebpf::{
    helpers::generated::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_set_retval},
    programs::SockAddrContext,
};
use lb_common::{
    stat, AffinityKey, AffinityValue, Backend, ServiceKey, ServiceValue, SockRevNatKey,
    SockRevNatValue, IPPROTO_TCP, IPPROTO_UDP, SVC_FLAG_AFFINITY,
};

use crate::{
    maps::{LB_AFFINITY, LB_BACKENDS, LB_SERVICES, LB_SOCK_REVNAT},
    sock, stats,
};

const SYS_REJECT: i32 = 0;
const SYS_PROCEED: i32 = 1;
const ECONNREFUSED: i32 = 111;
const NSEC_PER_SEC: u64 = 1_000_000_000;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// `connect()`: TCP, or UDP that fixes its peer.
    Connect,
    /// `sendmsg()`/`sendto()` with an address on an unconnected UDP socket.
    SendMsg,
}

/// connect4/sendmsg4: rewrite a frontend address to one of its backends.
#[inline(always)]
pub fn translate_forward(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let Some(dst) = sock::read(ctx) else {
        return SYS_PROCEED;
    };
    if dst.proto != IPPROTO_TCP && dst.proto != IPPROTO_UDP {
        return SYS_PROCEED;
    }
    let master_key = ServiceKey {
        address: dst.ip,
        port: dst.port,
        backend_slot: 0,
        proto: dst.proto,
        _pad: [0; 3],
    };
    // SAFETY: the value is copied out at once; hash entries may be replaced later.
    let Some(master) = (unsafe { LB_SERVICES.get(&master_key) }).copied() else {
        // Not a frontend (or a port the Service does not expose): leave it alone.
        return SYS_PROCEED;
    };
    if master.count == 0 {
        return refuse();
    }

    let cookie = sock::socket_cookie(ctx);
    let Some(backend) = select_backend(ctx, &master_key, &master, hook, cookie) else {
        // The master promised slots the agent has not finished writing or has just
        // removed. Refusing is what a client can retry; letting the VIP through
        // would send it nowhere.
        stats::bump(stat::SLOT_MISS);
        return refuse();
    };
    let revnat_key = SockRevNatKey {
        cookie,
        address: backend.address,
        port: backend.port,
        _pad: 0,
    };
    let revnat = SockRevNatValue {
        address: dst.ip,
        port: dst.port,
        rev_nat_id: master.rev_nat_id,
    };
    if LB_SOCK_REVNAT.insert(&revnat_key, &revnat, 0).is_err() {
        stats::bump(stat::REVNAT_UPDATE_FAILED);
    }

    sock::write(ctx, backend.address, backend.port);
    stats::bump(stat::TRANSLATED);
    SYS_PROCEED
}

/// recvmsg4/getpeername4: show the frontend the socket asked for, not the pod.
#[inline(always)]
pub fn translate_reverse(ctx: &SockAddrContext) {
    let Some(peer) = sock::read(ctx) else {
        return;
    };
    let key = SockRevNatKey {
        cookie: sock::socket_cookie(ctx),
        address: peer.ip,
        port: peer.port,
        _pad: 0,
    };
    // SAFETY: copied out at once.
    if let Some(frontend) = unsafe { LB_SOCK_REVNAT.get(&key) }.copied() {
        sock::write(ctx, frontend.address, frontend.port);
        stats::bump(stat::REVERSE_TRANSLATED);
    }
}

/// kube-proxy answers a Service without endpoints with REJECT; the socket
/// equivalent is failing the call with ECONNREFUSED right away.
#[inline(always)]
fn refuse() -> i32 {
    stats::bump(stat::NO_BACKEND);
    // SAFETY: plain helper call; connect4/sendmsg4 may set the syscall's return value.
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    SYS_REJECT
}

#[inline(always)]
fn select_backend(
    ctx: &SockAddrContext,
    master_key: &ServiceKey,
    master: &ServiceValue,
    hook: Hook,
    cookie: u64,
) -> Option<Backend> {
    if master.flags & SVC_FLAG_AFFINITY == 0 {
        return pick_slot(master_key, master, hook, cookie).map(|(_, backend)| backend);
    }

    let now = unsafe { bpf_ktime_get_ns() };
    let affinity_key = AffinityKey {
        netns_cookie: sock::netns_cookie(ctx),
        rev_nat_id: master.rev_nat_id,
        _pad: [0; 6],
    };
    // SAFETY: copied out at once.
    if let Some(remembered) = unsafe { LB_AFFINITY.get(&affinity_key) }.copied() {
        let timeout_ns = master.affinity_timeout_sec as u64 * NSEC_PER_SEC;
        if now.wrapping_sub(remembered.last_used_ns) <= timeout_ns {
            // Backend ids belong to one frontend and vanish with the endpoint, so a
            // hit here is still a live backend of this Service.
            // SAFETY: copied out at once.
            if let Some(backend) = unsafe { LB_BACKENDS.get(&remembered.backend_id) }.copied() {
                remember(&affinity_key, remembered.backend_id, now);
                return Some(backend);
            }
        }
    }
    let (backend_id, backend) = pick_slot(master_key, master, hook, cookie)?;
    remember(&affinity_key, backend_id, now);
    Some(backend)
}

#[inline(always)]
fn remember(key: &AffinityKey, backend_id: u32, now: u64) {
    let value = AffinityValue {
        last_used_ns: now,
        backend_id,
        _pad: 0,
    };
    if LB_AFFINITY.insert(key, &value, 0).is_err() {
        stats::bump(stat::AFFINITY_UPDATE_FAILED);
    }
}

/// Random for connect (like kube-proxy's `statistic --mode random`); for unconnected
/// UDP a hash of the socket cookie, so one socket keeps talking to one backend and
/// its replies keep matching one reverse-NAT entry.
#[inline(always)]
fn pick_slot(
    master_key: &ServiceKey,
    master: &ServiceValue,
    hook: Hook,
    cookie: u64,
) -> Option<(u32, Backend)> {
    let entropy = match hook {
        Hook::Connect => unsafe { bpf_get_prandom_u32() },
        // Fibonacci hashing: cookies are sequential, the high bits of the product
        // spread them.
        Hook::SendMsg => ((cookie ^ (cookie >> 32)) as u32).wrapping_mul(0x9E37_79B1) >> 16,
    };
    let slot_key = ServiceKey {
        backend_slot: (entropy % master.count as u32) as u16 + 1,
        ..*master_key
    };
    // SAFETY: copied out at once.
    let slot = unsafe { LB_SERVICES.get(&slot_key) }.copied()?;
    // SAFETY: copied out at once.
    let backend = unsafe { LB_BACKENDS.get(&slot.backend_id) }.copied()?;
    Some((slot.backend_id, backend))
}
