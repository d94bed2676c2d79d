//! Sending a translated packet on without the routing input path. Once its source
//! is one of the node's own addresses (the frontend of a NodePort reply, the SNAT
//! source towards a remote backend), the stack would drop it as a martian; as a
//! router would, we look up the route ourselves, decrement the TTL and hand the
//! packet to the egress device: TC with neighbour resolution (`redirect`), XDP by
//! writing the next hop's addresses itself (`xdp_lb.rs`). The lookups and the TTL
//! are shared.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT,
        BPF_FIB_LOOKUP_SRC,
    },
    helpers::generated::{bpf_fib_lookup as fib_lookup, bpf_redirect_neigh},
    programs::TcContext,
};

use lb_common::IpAddrBe;

use crate::{
    access::Packet,
    packet::{ETH_HLEN, IP6_HOP_LIMIT_OFF, IP_CSUM_OFF},
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IP_TTL_OFF: usize = ETH_HLEN + crate::hdr::IP_TTL;
/// The IPv6 next header, right before the hop limit.
const IP6_NEXT_HDR_OFF: usize = ETH_HLEN + crate::hdr::IP6_NEXT_HDR;
const _: () = assert!(IP6_NEXT_HDR_OFF + 1 == IP6_HOP_LIMIT_OFF);

/// An input route lookup from the device the packet arrived on, as forwarding
/// would do (an output lookup would pin the egress to that same device). With
/// `ip_len` (XDP), a packet longer than the route's MTU is refused
/// (`BPF_FIB_LKUP_RET_FRAG_NEEDED`); 0 skips that check. Returns the helper's
/// answer (`BPF_FIB_LKUP_RET_*`) and what it filled in.
#[inline(always)]
pub fn route<P: Packet>(
    ctx: &P,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
    v6: bool,
    ip_len: u16,
    flags: u32,
) -> (i64, bpf_fib_lookup) {
    // SAFETY: an all-zero bpf_fib_lookup is a valid request to fill in.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let rc = route_into(ctx, saddr, daddr, v6, ip_len, flags, &mut params);
    (rc, params)
}

/// [`route`], answered in `params` (which may be map memory rather than stack).
#[inline(always)]
pub fn route_into<P: Packet>(
    ctx: &P,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
    v6: bool,
    ip_len: u16,
    flags: u32,
    params: &mut bpf_fib_lookup,
) -> i64 {
    // SAFETY: an all-zero bpf_fib_lookup is a valid request to fill in.
    *params = unsafe { core::mem::zeroed() };
    params.ifindex = ctx.ingress_device();
    params.__bindgen_anon_1.tot_len = ip_len;
    if v6 {
        params.family = AF_INET6;
        params.__bindgen_anon_3.ipv6_src = saddr.words;
        params.__bindgen_anon_4.ipv6_dst = daddr.words;
    } else {
        params.family = AF_INET;
        params.__bindgen_anon_3.ipv4_src = saddr.v4();
        params.__bindgen_anon_4.ipv4_dst = daddr.v4();
    }
    // SAFETY: params is a live, writable bpf_fib_lookup for the call.
    unsafe {
        fib_lookup(
            ctx.as_ptr(),
            params,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            flags,
        )
    }
}

/// [`route`] for TC, whose redirect resolves a missing neighbour itself: `None`
/// only without a route.
#[inline(always)]
fn lookup<P: Packet>(
    ctx: &P,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
    v6: bool,
    flags: u32,
) -> Option<bpf_fib_lookup> {
    let (rc, params) = route(ctx, saddr, daddr, v6, 0, flags);
    (rc == BPF_FIB_LKUP_RET_SUCCESS as i64 || rc == BPF_FIB_LKUP_RET_NO_NEIGH as i64)
        .then_some(params)
}

/// `Some(verdict)` when the packet was redirected; `None` leaves it to the stack
/// (no route, TTL exhausted: the stack then answers as it does).
#[inline(always)]
pub fn redirect(ctx: &TcContext, saddr: &IpAddrBe, daddr: &IpAddrBe, v6: bool) -> Option<i32> {
    let route = lookup(ctx, saddr, daddr, v6, 0)?;
    decrement_hops(ctx, v6)?;
    // SAFETY: plain helper; a null nexthop lets the kernel resolve the neighbour of
    // the route it looks up on the egress device.
    let verdict = unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) };
    Some(verdict as i32)
}

/// The source address the node would use towards `daddr` (what MASQUERADE picks):
/// the route's preferred source, else the egress device's address. `None` when
/// there is no route, or the kernel predates `BPF_FIB_LOOKUP_SRC` (6.7).
#[inline(always)]
pub fn source_towards<P: Packet>(
    ctx: &P,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
    v6: bool,
) -> Option<IpAddrBe> {
    let route = lookup(ctx, saddr, daddr, v6, BPF_FIB_LOOKUP_SRC)?;
    source_of(&route, v6)
}

/// At TC egress: the source address the node's routing gives a packet to `daddr`
/// leaving through this device (what MASQUERADE picks: the route's preferred
/// source, else the device's address). An output lookup on the device the packet
/// leaves by, so the route is the one it is taking. `None` as for
/// [`source_towards`].
#[inline(always)]
pub fn source_on_egress<P: Packet>(
    ctx: &P,
    saddr: &IpAddrBe,
    daddr: &IpAddrBe,
    v6: bool,
) -> Option<IpAddrBe> {
    let route = lookup(
        ctx,
        saddr,
        daddr,
        v6,
        BPF_FIB_LOOKUP_SRC | BPF_FIB_LOOKUP_OUTPUT,
    )?;
    source_of(&route, v6)
}

/// The source address a `BPF_FIB_LOOKUP_SRC` lookup filled in, if any.
#[inline(always)]
pub fn source_of(route: &bpf_fib_lookup, v6: bool) -> Option<IpAddrBe> {
    if v6 {
        // SAFETY: the kernel filled the member of the union it was asked about.
        let source = IpAddrBe::from_v6(unsafe { route.__bindgen_anon_3.ipv6_src });
        return (source != IpAddrBe::default()).then_some(source);
    }
    // SAFETY: as above.
    let source = unsafe { route.__bindgen_anon_3.ipv4_src };
    (source != 0).then_some(IpAddrBe::from_v4(source))
}

/// Whether the packet may be forwarded: its TTL (hop limit) outlives this hop.
#[inline(always)]
pub fn hops_left<P: Packet>(ctx: &P, v6: bool) -> bool {
    // Read with the byte beside it (see `Packet::read`): TTL and protocol, next
    // header and hop limit.
    let hops = if v6 {
        ctx.read::<[u8; 2]>(IP6_NEXT_HDR_OFF).map(|[_, hops]| hops)
    } else {
        ctx.read::<[u8; 2]>(IP_TTL_OFF).map(|[ttl, _]| ttl)
    };
    hops.is_ok_and(|hops| hops > 1)
}

/// Decrements the TTL (IPv4, with its header checksum) or the hop limit (IPv6,
/// which has none); `None` when it would expire, or a write failed.
#[inline(always)]
pub fn decrement_hops<P: Packet>(ctx: &P, v6: bool) -> Option<()> {
    if v6 {
        decrement_hop_limit(ctx)
    } else {
        decrement_ttl(ctx)
    }
}

#[inline(always)]
fn decrement_hop_limit<P: Packet>(ctx: &P) -> Option<()> {
    // The next header and the hop limit, as one field (see `Packet::read`).
    let [next, hops]: [u8; 2] = ctx.read(IP6_NEXT_HDR_OFF).ok()?;
    if hops <= 1 {
        return None;
    }
    ctx.write(IP6_NEXT_HDR_OFF, &[next, hops - 1]).ok()
}

#[inline(always)]
fn decrement_ttl<P: Packet>(ctx: &P) -> Option<()> {
    // TTL and protocol form one 16-bit word of the header checksum.
    let old: u16 = ctx.read(IP_TTL_OFF).ok()?;
    let ttl = old.to_ne_bytes()[0];
    if ttl <= 1 {
        return None;
    }
    let new = u16::from_ne_bytes([ttl - 1, old.to_ne_bytes()[1]]);
    ctx.ip_csum_update(IP_CSUM_OFF, old as u32, new as u32, 2)
        .ok()?;
    ctx.write(IP_TTL_OFF, &new).ok()
}
