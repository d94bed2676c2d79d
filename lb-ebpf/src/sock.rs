//! Access to `struct bpf_sock_addr`: the address the process passed to (or receives
//! from) the socket call, in network byte order.

use aya_ebpf::{
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
    EbpfContext,
};

const AF_INET: u32 = 2;

/// The destination (forward hooks) or peer (reverse hooks) of one socket call.
pub struct SockAddr {
    /// IPv4 address, network byte order.
    pub ip: u32,
    /// Port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP` / `IPPROTO_UDP`.
    pub proto: u8,
}

/// Reads the user address; `None` for anything but AF_INET.
#[inline(always)]
pub fn read(ctx: &SockAddrContext) -> Option<SockAddr> {
    // SAFETY: the kernel hands every cgroup/sock_addr program a valid context.
    let sa = unsafe { &*ctx.sock_addr };
    if sa.user_family != AF_INET {
        return None;
    }
    Some(SockAddr {
        ip: sa.user_ip4,
        // The context stores the network-order port in the low 16 bits of a u32.
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
    })
}

/// Rewrites the user address (context writes must be full 32-bit stores).
#[inline(always)]
pub fn write(ctx: &SockAddrContext, ip: u32, port: u16) {
    // SAFETY: user_ip4/user_port are writable for the hooks this crate attaches.
    unsafe {
        (*ctx.sock_addr).user_ip4 = ip;
        (*ctx.sock_addr).user_port = port as u32;
    }
}

#[inline(always)]
pub fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: helper valid for sock_addr programs; the pointer is the context.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

#[inline(always)]
pub fn netns_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: as above.
    unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}
