//! Kernel side of the load balancer: cgroup socket hooks that translate a Service VIP
//! to a backend once per socket, so packets themselves never need NAT.
//!
//! Entry points stay thin; the logic lives in `sock` (context access), `lb`
//! (frontend lookup, backend selection, affinity) and `stats` (counters).
#![no_std]
#![no_main]

mod lb;
mod maps;
mod sock;
mod stats;

use aya_ebpf::{macros::cgroup_sock_addr, programs::SockAddrContext};

/// cgroup hooks: 1 lets the call proceed, 0 rejects it with the errno set via
/// `bpf_set_retval` (EPERM if none was set).
const SYS_PROCEED: i32 = 1;

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    lb::translate_forward(&ctx, lb::Hook::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    lb::translate_forward(&ctx, lb::Hook::SendMsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    lb::translate_reverse(&ctx);
    SYS_PROCEED
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    lb::translate_reverse(&ctx);
    SYS_PROCEED
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
