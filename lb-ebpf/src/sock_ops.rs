//! The fate of the TCP connects the socket hooks translated, for passive health
//! (`quarantine`): a `sockops` program on the hooks' cgroup sees each active
//! connect start, and asks for its socket's state changes only when the hooks
//! sent it to a backend (its `LB_SOCK_REVNAT` entry, by socket cookie), so other
//! sockets cost one lookup at connect and nothing after.
//!
//! - `SYN_SENT -> CLOSE`: the connect failed. The kernel gets there on a RST to the
//!   SYN (ECONNREFUSED), an ICMP error (EHOSTUNREACH, ...), the SYN's retries
//!   running out (ETIMEDOUT), and also when the owner closes a socket that is
//!   still connecting; the state change does not say which, so all of them count
//!   as a refusal (a client that gives up on a backend that has not answered is a
//!   fair sign). The one cost: a happy-eyeballs loser closed mid-connect
//!   quarantines its backend for a second, until that backend's next success.
//! - `ACTIVE_ESTABLISHED`: the backend accepted; its quarantine (if any) is cleared
//!   and the socket's state changes are not asked for any more.

use aya_ebpf::{helpers::generated::bpf_get_socket_cookie, programs::SockOpsContext, EbpfContext};
use lb_common::{IpAddrBe, SockRevNatKey, SockRevNatValue, QUARANTINE_FLAG_BY_SOCKET};

use crate::{ct, maps::LB_SOCK_REVNAT, quarantine};

const BPF_SOCK_OPS_TCP_CONNECT_CB: u32 = aya_ebpf::bindings::BPF_SOCK_OPS_TCP_CONNECT_CB;
const BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB: u32 =
    aya_ebpf::bindings::BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB;
const BPF_SOCK_OPS_STATE_CB: u32 = aya_ebpf::bindings::BPF_SOCK_OPS_STATE_CB;
const BPF_SOCK_OPS_STATE_CB_FLAG: u32 = aya_ebpf::bindings::BPF_SOCK_OPS_STATE_CB_FLAG;
/// `enum tcp_state` (include/net/tcp_states.h).
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// `lb_sock_ops`: one callback of a socket in the hooked cgroup.
#[inline(always)]
pub fn handle(ctx: &SockOpsContext) {
    if !quarantine::enabled() {
        return;
    }
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            if translated(ctx).is_some() {
                let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
            }
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            if let Some(sent) = translated(ctx) {
                quarantine::accepted(sent.rev_nat_id, sent.backend_id);
                let _ = ctx.set_cb_flags((ctx.cb_flags() & !BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
            }
        }
        BPF_SOCK_OPS_STATE_CB if ctx.arg(0) == TCP_SYN_SENT && ctx.arg(1) == TCP_CLOSE => {
            if let Some(sent) = translated(ctx) {
                quarantine::refused(
                    sent.rev_nat_id,
                    sent.backend_id,
                    ct::now(),
                    QUARANTINE_FLAG_BY_SOCKET,
                );
            }
        }
        _ => {}
    }
}

/// The frontend and backend the hooks sent this socket to, if they did.
#[inline(always)]
fn translated(ctx: &SockOpsContext) -> Option<SockRevNatValue> {
    let ops = ctx.ops;
    // SAFETY: the kernel hands every sockops program a valid context; each field
    // is read with a 4-byte load, the only size the context allows for them. All
    // are read before the family is looked at: read in the branches, the compiler
    // chose the field's offset by the family and loaded through the sum, a
    // context access the verifier refuses.
    let (family, port_word, v4, v6) = unsafe {
        (
            core::ptr::read_volatile(&(*ops).family),
            core::ptr::read_volatile(&(*ops).remote_port),
            core::ptr::read_volatile(&(*ops).remote_ip4),
            [
                core::ptr::read_volatile(&(*ops).remote_ip6[0]),
                core::ptr::read_volatile(&(*ops).remote_ip6[1]),
                core::ptr::read_volatile(&(*ops).remote_ip6[2]),
                core::ptr::read_volatile(&(*ops).remote_ip6[3]),
            ],
        )
    };
    let address = match family {
        AF_INET => IpAddrBe::from_v4(v4),
        AF_INET6 => IpAddrBe::from_v6(v6),
        _ => return None,
    };
    // The network-order port sits in the upper half of the word on little-endian
    // kernels (the context's conversion shifts it there) and in the lower half
    // where it does not: whichever half is set holds it (a port is never 0).
    let port = if port_word >> 16 != 0 {
        (port_word >> 16) as u16
    } else {
        port_word as u16
    };
    let key = SockRevNatKey {
        // SAFETY: the helper is valid for sockops programs; the pointer is the
        // context.
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        address,
        port,
        _pad: 0,
        _pad2: 0,
    };
    // SAFETY: copied out at once.
    unsafe { LB_SOCK_REVNAT.get(key) }.copied()
}
