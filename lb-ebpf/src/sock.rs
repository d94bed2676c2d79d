//! Access to `struct bpf_sock_addr`: the address the process passed to (or receives
//! from) the socket call, in network byte order.
//!
//! The verifier checks each context field against the hook the program is attached
//! to (`user_ip4` only in the IPv4 hooks, `user_ip6` only in the IPv6 ones), even on
//! a path a runtime test would skip; so the family is a const parameter and each
//! program only contains the accesses its hook allows.

use aya_ebpf::{
    helpers::generated::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    programs::SockAddrContext,
    EbpfContext,
};
use lb_common::IpAddrBe;

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// The destination (forward hooks) or peer (reverse hooks) of one socket call.
pub struct SockAddr {
    /// The address; IPv4-mapped for IPv4, also when an AF_INET6 socket names an IPv4
    /// peer as `::ffff:a.b.c.d`.
    pub ip: IpAddrBe,
    /// Port, network byte order.
    pub port: u16,
    /// `IPPROTO_TCP` / `IPPROTO_UDP`.
    pub proto: u8,
}

/// Reads the user address of an IPv4 (`V6 = false`) or IPv6 hook; `None` when the
/// call's family is not the hook's.
#[inline(always)]
pub fn read<const V6: bool>(ctx: &SockAddrContext) -> Option<SockAddr> {
    // SAFETY: the kernel hands every cgroup/sock_addr program a valid context.
    let sa = unsafe { &*ctx.sock_addr };
    let ip = if V6 {
        if sa.user_family != AF_INET6 {
            return None;
        }
        // Word by word: the context allows 4-byte loads of user_ip6.
        IpAddrBe::from_v6([
            sa.user_ip6[0],
            sa.user_ip6[1],
            sa.user_ip6[2],
            sa.user_ip6[3],
        ])
    } else {
        if sa.user_family != AF_INET {
            return None;
        }
        IpAddrBe::from_v4(sa.user_ip4)
    };
    Some(SockAddr {
        ip,
        // The context stores the network-order port in the low 16 bits of a u32.
        port: sa.user_port as u16,
        proto: sa.protocol as u8,
    })
}

/// Rewrites the user address (context writes must be full 32-bit stores). `ip` is of
/// the family the hook read: IPv4-mapped addresses stay mapped on AF_INET6 sockets.
#[inline(always)]
pub fn write<const V6: bool>(ctx: &SockAddrContext, ip: &IpAddrBe, port: u16) {
    // SAFETY: user_ip4/user_ip6/user_port are writable for the hooks this crate
    // attaches, each in its own family's hooks.
    unsafe {
        let sa = &mut *ctx.sock_addr;
        if V6 {
            sa.user_ip6[0] = ip.words[0];
            sa.user_ip6[1] = ip.words[1];
            sa.user_ip6[2] = ip.words[2];
            sa.user_ip6[3] = ip.words[3];
        } else {
            sa.user_ip4 = ip.v4();
        }
        sa.user_port = port as u32;
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
