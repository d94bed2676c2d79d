//! Direct server return (DSR, `lb agent --lb-mode dsr|hybrid`): a new flow that
//! enters a node-facing device for a backend on another node keeps the client's
//! address, and the backend's node answers the client itself, from the frontend,
//! never back through the node the flow entered (the entry node).
//!
//! - Entry node ([`tc::new_flow`], [`tc::forward`], and XDP's [`xdp`]): the packet
//!   is DNATed to the backend and sent to its node by our own route lookup. The
//!   frontend (address and port) travels with the packets the backend's node
//!   needs it from: the flow's TCP SYN and every UDP datagram, in an IPv4 option
//!   or an IPv6 Destination Options header ([`wire`]). With `--dsr-dispatch ipip`
//!   every packet of the flow also travels inside an outer IP header from this
//!   node to the backend's node. The forward conntrack entry is marked
//!   (`CT_DSR`), so later packets go the same way to the same backend.
//! - Backend's node ([`tc::arrive`] on node-facing devices): what the entry node
//!   added is removed, so the pod receives the packet the client sent, DNATed; the
//!   frontend becomes the flow's reply entry (pod -> client is rewritten to
//!   frontend -> client), and the pod's replies, seen where they enter the node
//!   (its veth), leave from the frontend straight to the client ([`tc::reply`]).
//!
//! What cannot take DSR's additions goes by SNAT as in `snat` mode when the flow is
//! new (a packet with IP options or extension headers, a fragment, a UDP datagram
//! that would not fit the MTU, no route), and without them when it is known.

pub mod tc;
mod wire;
pub mod xdp;

use aya_ebpf::{bindings::bpf_fib_lookup, btf_maps::PerCpuArray, macros::btf_map};
use lb_common::{CtKey, CtValue, DsrConfig, IpAddrBe, CT_DSR, CT_DSR_IPIP, IPPROTO_UDP};

use crate::{
    flow::{self, Chosen},
    packet::{Flow, TCP_FLAG_ACK, TCP_FLAG_SYN},
};

/// `--lb-mode` and `--dsr-dispatch`; set by the agent at load time (`snat` until
/// then). A constant to the verifier, which walks only the branches of the mode
/// the programs were loaded with.
#[unsafe(no_mangle)]
static LB_DSR: DsrConfig = DsrConfig {
    mode: lb_common::LB_MODE_SNAT,
    dispatch: lb_common::DSR_DISPATCH_OPT,
    _pad: [0; 2],
};

/// What one DSR packet needs to hold, per CPU (a program runs to its end on one
/// CPU, so no two packets share the entry at once): kept off the stack, which the
/// programs' other paths already fill close to the kernel's 512 bytes.
#[repr(C)]
pub struct Scratch {
    /// The route of the packet being sent, as `bpf_fib_lookup` answered.
    route: bpf_fib_lookup,
    /// `ipip`: the outer header's source and destination.
    outer_source: IpAddrBe,
    outer_destination: IpAddrBe,
    /// Backend's node: the arriving packet, and the reply entry it leaves and
    /// its key.
    arrival: wire::Arrival,
    reply_key: CtKey,
    reply: CtValue,
}

#[btf_map]
static LB_DSR_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// This CPU's scratch entry; `None` only if the map were missing its one entry.
#[inline(always)]
fn scratch() -> Option<&'static mut Scratch> {
    let entry = LB_DSR_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry, used by nothing else until the program ends.
    Some(unsafe { &mut *entry })
}

#[inline(always)]
fn config() -> DsrConfig {
    // SAFETY: a read-only global the loader patches; volatile so the compiler does
    // not fold the value it sees at build time.
    unsafe { core::ptr::read_volatile(&LB_DSR) }
}

/// Whether a new flow under the external scope goes by DSR: the mode takes its
/// protocol and its backend is on another node (a local one needs nothing: its
/// replies pass through this node anyway).
#[inline(always)]
pub fn wanted(flow: &Flow, chosen: &Chosen) -> bool {
    !chosen.backend.is_local() && config().dsr_for(flow.proto)
}

/// The packets that carry the frontend: a TCP SYN (a connection's first packet,
/// or its retransmission) and every UDP datagram, so the backend's node learns
/// the flow again should it have forgotten it.
#[inline(always)]
fn carries_frontend(flow: &Flow) -> bool {
    flow.proto == IPPROTO_UDP
        || (flow.tcp_flags & TCP_FLAG_SYN != 0 && flow.tcp_flags & TCP_FLAG_ACK == 0)
}

/// The `CT_DSR*` bits of a DSR flow's forward entry.
#[inline(always)]
fn entry_bits(ipip: bool) -> u8 {
    if ipip {
        CT_DSR | CT_DSR_IPIP
    } else {
        CT_DSR
    }
}

/// The IP length a route's MTU is checked against: a UDP datagram with what DSR
/// adds to it; 0 (no check) for TCP, whose segments the MSS keeps small enough
/// (and which TC may see merged by GRO, larger than any MTU).
#[inline(always)]
fn checked_len(flow: &Flow, carry: bool, ipip: bool) -> u16 {
    if flow.proto != IPPROTO_UDP {
        return 0;
    }
    flow.ip_len
        .saturating_add(wire::overhead(flow.v6, carry, ipip))
}

/// Looks up the route of a DSR packet of `flow` to `backend` into `s.route` (the
/// FIB's answer from the device it came in on, as forwarding would find it),
/// checking `len` bytes against its MTU (0: no check); with `ipip`, also the outer
/// header's addresses. Returns the helper's answer (`BPF_FIB_LKUP_RET_*`), or
/// `None` when `ipip` finds no gateway naming the backend's node.
#[inline(always)]
fn lookup<P: crate::access::Packet>(
    ctx: &P,
    flow: &Flow,
    backend: &IpAddrBe,
    ipip: bool,
    len: u16,
    s: &mut Scratch,
) -> Option<i64> {
    let rc = crate::fib::route_into(
        ctx,
        &flow.saddr,
        backend,
        flow.v6,
        len,
        lookup_flags(ipip, flow.v6),
        &mut s.route,
    );
    if ipip {
        let (source, destination) = outer_addresses(&s.route, backend, flow.v6)?;
        s.outer_source = source;
        s.outer_destination = destination;
    }
    Some(rc)
}

/// The outer header `s` holds, with `ipip`.
#[inline(always)]
fn outer(s: &Scratch, ipip: bool) -> Option<(&IpAddrBe, &IpAddrBe)> {
    ipip.then_some((&s.outer_source, &s.outer_destination))
}

/// The outer header's addresses for `--dsr-dispatch ipip`, from a route lookup
/// towards `backend` (made with `BPF_FIB_LOOKUP_SRC` unless `--node-ip` is set):
/// from this node (`--node-ip`, else the route's source) to the route's gateway,
/// which on a routed pod network is the backend's node. `None` without a gateway
/// (the pod is on-link, and nothing names its node) or without a source.
#[inline(always)]
fn outer_addresses(
    route: &bpf_fib_lookup,
    backend: &IpAddrBe,
    v6: bool,
) -> Option<(IpAddrBe, IpAddrBe)> {
    // SAFETY: the kernel filled the union members of the family it was asked about.
    let (source, gateway) = unsafe {
        if v6 {
            (
                IpAddrBe::from_v6(route.__bindgen_anon_3.ipv6_src),
                IpAddrBe::from_v6(route.__bindgen_anon_4.ipv6_dst),
            )
        } else {
            (
                IpAddrBe::from_v4(route.__bindgen_anon_3.ipv4_src),
                IpAddrBe::from_v4(route.__bindgen_anon_4.ipv4_dst),
            )
        }
    };
    let source = flow::node_ip(v6).unwrap_or(source);
    let unset = if v6 {
        IpAddrBe::default()
    } else {
        IpAddrBe::from_v4(0)
    };
    if gateway == *backend || source == unset {
        return None;
    }
    Some((source, gateway))
}

/// `bpf_fib_lookup` flags for a DSR route: the source is asked for only when the
/// outer header needs one and `--node-ip` gave none.
#[inline(always)]
fn lookup_flags(ipip: bool, v6: bool) -> u32 {
    if ipip && flow::node_ip(v6).is_none() {
        aya_ebpf::bindings::BPF_FIB_LOOKUP_SRC
    } else {
        0
    }
}
