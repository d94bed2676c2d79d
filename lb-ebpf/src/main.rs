//! Kernel side of the load balancer: cgroup socket hooks that translate a Service VIP
//! to a backend once per socket (so those packets never need NAT), and a per-packet
//! path for traffic no socket hook sees (NodePort, LoadBalancer IPs, externalIPs,
//! pods outside the hooked cgroup): DNAT, SNAT, conntrack, reverse NAT, at TC, and
//! for the external scope also at XDP, in front of TC.
//!
//! Both families share the maps (IPv4 addresses stored IPv4-mapped, see `lb_common`).
//!
//! Entry points stay thin. Socket hooks: `sock` (context access), `sock_lb`
//! (translation). Per-packet path, shared by TC and XDP: `access` (reading and
//! writing the packet, one trait for both hooks), `packet` (parsing), `flow` (a new
//! flow's frontend, backend and conntrack entries), `ct` (conntrack), `nat`
//! (rewrite + checksums), `fib` (routes, TTL), `source_ranges`
//! (loadBalancerSourceRanges), `maglev` (a Maglev frontend's slot for a flow);
//! TC's own: `tc_lb` (its entry flow), `frag` (later
//! fragments follow their first), `icmp`/`icmp6` (errors about flows), `reject`;
//! XDP's own: `xdp_lb` (its entry flow and sending), `mark` (the hand-over to TC).
//! Egress masquerading: `masq` (TC egress on node-facing devices; at TC ingress
//! there, the replies, ahead of the Service path, and the ICMP errors
//! `icmp`/`icmp6` hand it).
//! Shared with the hooks: `select` (frontend lookup, backend choice, affinity,
//! skipping quarantined backends), `stats`. Passive health: `quarantine` (the
//! map), written by `sock_ops` (the fate of the hooks' connects) and by the
//! per-packet path's reply direction (`ct`). Direct server return, both programs: `dsr`.
#![no_std]
#![no_main]

mod access;
mod csum;
mod ct;
mod dsr;
mod fib;
mod flow;
mod frag;
mod hdr;
mod icmp;
mod icmp6;
mod maglev;
mod maps;
mod mark;
mod masq;
mod nat;
mod packet;
mod policy;
mod quarantine;
mod reject;
mod select;
mod sock;
mod sock_lb;
mod sock_ops;
mod source_ranges;
mod stats;
mod tc_lb;
mod traffic_gen;
mod verdict;
mod xdp_lb;

use aya_ebpf::{
    macros::{cgroup_sock_addr, classifier, sock_ops, xdp},
    programs::{SockAddrContext, SockOpsContext, TcContext, XdpContext},
};
use lb_common::SCOPE_INTERNAL;
use verdict::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};

/// cgroup hooks: 1 lets the call proceed, 0 rejects it with the errno set via
/// `bpf_set_retval` (EPERM if none was set).
const SYS_PROCEED: i32 = 1;

const V4: bool = false;
const V6: bool = true;

#[cgroup_sock_addr(connect4)]
pub fn lb_connect4(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_forward::<V4>(&ctx, sock_lb::Hook::Connect)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn lb_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_forward::<V4>(&ctx, sock_lb::Hook::SendMsg)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn lb_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_reverse::<V4>(&ctx);
    SYS_PROCEED
}

#[cgroup_sock_addr(getpeername4)]
pub fn lb_getpeername4(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_reverse::<V4>(&ctx);
    SYS_PROCEED
}

/// The IPv6 twins. An AF_INET6 socket naming an IPv4 peer (`::ffff:a.b.c.d`) comes
/// here too, and finds the IPv4 Service: maps store IPv4 addresses in that form.
#[cgroup_sock_addr(connect6)]
pub fn lb_connect6(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_forward::<V6>(&ctx, sock_lb::Hook::Connect)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn lb_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_forward::<V6>(&ctx, sock_lb::Hook::SendMsg)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn lb_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_reverse::<V6>(&ctx);
    SYS_PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn lb_getpeername6(ctx: SockAddrContext) -> i32 {
    sock_lb::translate_reverse::<V6>(&ctx);
    SYS_PROCEED
}

/// sockops on the hooks' cgroup: whether the connects they translated were
/// refused or accepted, for passive health (`sock_ops.rs`). Its return value
/// answers only the callbacks that ask for one (none of ours): 1, as "ok".
#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    sock_ops::handle(&ctx);
    1
}

/// TC ingress on node-facing devices: NodePort, LoadBalancer, externalIPs and
/// ClusterIP traffic from other nodes.
#[classifier]
pub fn lb_tc_external(ctx: TcContext) -> i32 {
    tc_lb::handle_external(&ctx)
}

/// TC ingress on pod-facing devices: pods whose sockets the cgroup hooks do not see,
/// and the replies of local backends.
#[classifier]
pub fn lb_tc_internal(ctx: TcContext) -> i32 {
    if !policy::enabled() {
        return tc_lb::handle::<SCOPE_INTERNAL>(&ctx);
    }
    // The pod's egress policy, judged on the packet the Service path lets on.
    let judge = policy::from_pod_first(ctx.skb.skb);
    let verdict = tc_lb::handle::<SCOPE_INTERNAL>(&ctx);
    let leaves = verdict == TC_ACT_OK || verdict == TC_ACT_REDIRECT;
    if judge == policy::JUDGE_AFTER && leaves && !policy::from_pod_then(ctx.skb.skb) {
        return TC_ACT_SHOT;
    }
    verdict
}

/// TC egress on pod-facing devices (`--network-policy on`): the pod's ingress
/// policy, on what is about to reach it.
#[classifier]
pub fn lb_tc_to_pod(ctx: TcContext) -> i32 {
    if !policy::enabled() || policy::to_pod(ctx.skb.skb) {
        return TC_ACT_OK;
    }
    TC_ACT_SHOT
}

/// TC egress on node-facing devices (`--masquerade bpf` only): local pods' traffic
/// to destinations outside the cluster leaves with the node's address.
#[classifier]
pub fn lb_tc_egress(ctx: TcContext) -> i32 {
    masq::egress(&ctx)
}

/// XDP on node-facing devices, in front of `lb_tc_external`: the external scope's
/// known and new flows, sent on from the driver when their next hop allows it.
/// `frags`: runs on multi-buffer (jumbo) frames too, touching only their headers.
#[xdp(frags)]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    xdp_lb::handle(&ctx)
}

/// Passes every frame. For the far end of a veth that `lb_xdp` transmits into
/// (`XDP_TX`, or a redirect): a veth delivers such frames only when its peer runs
/// an XDP program. The agent never attaches it (that end is another node's or a
/// switch's device); veth-based lab networks and the tests do.
#[xdp(frags)]
pub fn lb_xdp_pass(_ctx: XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_PASS
}

/// Drops every frame: the benchmark's sink, where a wire would take the frames
/// away (never attached by the agent).
#[xdp]
pub fn lb_xdp_drop(_ctx: XdpContext) -> u32 {
    aya_ebpf::bindings::xdp_action::XDP_DROP
}

/// The benchmark's packet generator (`traffic_gen.rs`); never attached by the agent.
#[xdp]
pub fn lb_xdp_gen(ctx: XdpContext) -> u32 {
    traffic_gen::handle(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
