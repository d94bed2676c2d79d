//! The socket hooks' translation: connect/sendmsg rewrite a frontend to a backend
//! once per socket; recvmsg/getpeername show the frontend again.

use aya_ebpf::{
    helpers::generated::{bpf_get_prandom_u32, bpf_set_retval},
    programs::SockAddrContext,
};
use lb_common::{
    stat, IpAddrBe, ServiceKey, SockRevNatKey, SockRevNatValue, IPPROTO_TCP, IPPROTO_UDP,
    SCOPE_INTERNAL,
};

use crate::{maps::LB_SOCK_REVNAT, select, sock, stats};

const SYS_REJECT: i32 = 0;
const SYS_PROCEED: i32 = 1;
const ECONNREFUSED: i32 = 111;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// `connect()`: TCP, or UDP that fixes its peer.
    Connect,
    /// `sendmsg()`/`sendto()` with an address on an unconnected UDP socket.
    SendMsg,
}

/// connect/sendmsg (IPv4 hooks, or IPv6 ones with `V6`): rewrite a frontend address to one of its backends.
#[inline(always)]
pub fn translate_forward<const V6: bool>(ctx: &SockAddrContext, hook: Hook) -> i32 {
    let Some(dst) = sock::read::<V6>(ctx) else {
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
        scope: SCOPE_INTERNAL,
        _pad: [0; 2],
    };
    let Some(master) = select::frontend(&master_key) else {
        // Not a frontend (or a port the Service does not expose): leave it alone.
        return SYS_PROCEED;
    };
    if master.count == 0 {
        return refuse(master.rev_nat_id);
    }

    let cookie = sock::socket_cookie(ctx);
    // Random for connect (like kube-proxy's `statistic --mode random`); for
    // unconnected UDP a hash of the socket cookie, so one socket keeps talking to one
    // backend and its replies keep matching one reverse-NAT entry.
    let entropy = match hook {
        // SAFETY: a plain helper without arguments.
        Hook::Connect => unsafe { bpf_get_prandom_u32() },
        // Fibonacci hashing: cookies are sequential, the high bits of the product
        // spread them.
        Hook::SendMsg => ((cookie ^ (cookie >> 32)) as u32).wrapping_mul(0x9E37_79B1) >> 16,
    };
    let client = || (sock::netns_cookie(ctx), IpAddrBe::default());
    // Never Maglev here: a socket is translated once, on its own node, so there is
    // no other node whose choice it must agree with.
    let choice = select::Choice {
        entropy,
        flow_hash: None,
    };
    let Some((backend_id, backend)) = select::backend(&master_key, &master, client, choice) else {
        return refuse(master.rev_nat_id);
    };

    let revnat_key = SockRevNatKey {
        cookie,
        address: backend.address,
        port: backend.port,
        _pad: 0,
        _pad2: 0,
    };
    let revnat = SockRevNatValue {
        address: dst.ip,
        port: dst.port,
        _pad: 0,
        rev_nat_id: master.rev_nat_id,
        backend_id,
    };
    if LB_SOCK_REVNAT.insert(revnat_key, revnat, 0).is_err() {
        stats::bump(stat::REVNAT_UPDATE_FAILED);
    }

    sock::write::<V6>(ctx, &backend.address, backend.port);
    stats::bump(stat::TRANSLATED);
    stats::service(master.rev_nat_id, false);
    SYS_PROCEED
}

/// recvmsg/getpeername (either family): show the frontend the socket asked for, not the pod.
#[inline(always)]
pub fn translate_reverse<const V6: bool>(ctx: &SockAddrContext) {
    let Some(peer) = sock::read::<V6>(ctx) else {
        return;
    };
    let key = SockRevNatKey {
        cookie: sock::socket_cookie(ctx),
        address: peer.ip,
        port: peer.port,
        _pad: 0,
        _pad2: 0,
    };
    // SAFETY: copied out at once.
    if let Some(frontend) = unsafe { LB_SOCK_REVNAT.get(key) }.copied() {
        sock::write::<V6>(ctx, &frontend.address, frontend.port);
        stats::bump(stat::REVERSE_TRANSLATED);
    }
}

/// kube-proxy answers a Service without endpoints with REJECT; the socket
/// equivalent is failing the call with ECONNREFUSED right away.
#[inline(always)]
fn refuse(rev_nat_id: u32) -> i32 {
    stats::bump(stat::NO_BACKEND);
    stats::service(rev_nat_id, true);
    // SAFETY: plain helper call; connect4/sendmsg4 may set the syscall's return value.
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    SYS_REJECT
}
