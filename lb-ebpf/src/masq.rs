//! Egress masquerading (`--masquerade bpf`): a local pod's traffic to a destination
//! outside the exempt set leaves every node-facing device with the address the
//! node's routing uses there (as iptables MASQUERADE does), and the replies get the
//! pod's address back where they enter the node. TCP and UDP by their ports, ICMP
//! and ICMPv6 echo by their identifier; ICMP errors about such a flow are
//! rewritten by `icmp`/`icmp6` from the same entries (PMTU discovery).
//!
//! State: `LB_MASQ`, two entries per flow in conntrack's types: the pod's tuple
//! (`CT_DIR_FORWARD`, what it leaves as) and the tuple the replies carry
//! (`CT_DIR_REPLY`, what they become). The reply entry is the claim of the node's
//! port towards one destination address and port: inserted only if absent, so
//! two flows never share it; exhaustion is per destination.
//!
//! Ports: the pod's own when free, else up to `PORT_TRIES` random ones. A port is
//! not free when another flow holds it towards the same destination (here or as a
//! Service flow's SNAT port in `LB_CT`), when a socket of the node uses it with that
//! peer (or listens on it), or when it lies in the NodePort range (a new flow from
//! the destination to that NodePort would meet the translation). No free port:
//! the packet is dropped and counted, never sent with a shared mapping.

// Map keys and values go by reference on purpose: most live in the per-CPU
// scratch, and by value each would be copied onto a stack the verifier bounds.
#![allow(clippy::needless_borrows_for_generic_args)]

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{__sk_buff, bpf_sock_tuple, BPF_F_CURRENT_NETNS},
    btf_maps::{lpm_trie::Key, PerCpuArray},
    helpers::generated::{
        bpf_get_prandom_u32, bpf_loop, bpf_sk_lookup_udp, bpf_sk_release, bpf_skc_lookup_tcp,
    },
    macros::btf_map,
    programs::TcContext,
    EbpfContext,
};
use lb_common::{
    stat, CtKey, CtValue, IpAddrBe, MasqCidrKey, MasqSettings, CT_DIR_FORWARD, CT_DIR_REPLY,
    CT_STATE_FIN, CT_STATE_RST, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP,
    MASQ_CIDR_CLUSTER, MASQ_CIDR_EXEMPT, MASQ_CIDR_INSIDE, MASQ_CIDR_POD_SOURCE,
    MASQ_CIDR_PREFIX_BASE,
};

use crate::{
    access::{L4Csum, Packet},
    ct, fib, flow, frag,
    hdr::{self, ETH_TYPE_IPV4_RAW, ETH_TYPE_IPV6_RAW},
    maps::{LB_CT, LB_MASQ, LB_MASQ_CIDRS},
    mark,
    nat::{self, Tuple},
    packet::{
        self, Flow, Fragment, Parsed, ETH_HLEN, IP6_DST_OFF, IP6_SRC_OFF, IP_CSUM_OFF, IP_DST_OFF,
        IP_SRC_OFF, TCP_FLAG_SYN,
    },
    stats,
    verdict::{TC_ACT_OK, TC_ACT_SHOT},
};

/// `--masquerade` and the NodePort range, set by the agent at load time; all zero
/// (off) otherwise.
#[unsafe(no_mangle)]
static LB_MASQ_SETTINGS: MasqSettings = MasqSettings {
    enabled: 0,
    masquerade_all: 0,
    nodeport_first_host: 0,
    nodeport_last_host: 0,
    _pad2: 0,
};

/// Ports tried for a new flow: the pod's own, then random ones. Past about 25
/// tries a free port is hardly ever found where the first ones failed (Cilium
/// measured the same and settled on 32).
const PORT_TRIES: u32 = 32;
/// Where random ports come from: every unprivileged port (the NodePort range is
/// skipped when drawn).
const PORT_FIRST: u32 = 1024;
const PORT_SPAN: u32 = 65536 - PORT_FIRST;

const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP6_ECHO_REQUEST: u8 = 128;
const ICMP6_ECHO_REPLY: u8 = 129;
/// The echo identifier, behind type, code and checksum.
const ECHO_ID: usize = 4;
const IP_MF_OFFSET_MASK: u16 = 0x3fff;

/// What a new flow's translation needs to hold, per CPU (a program runs to its end
/// on one CPU): the entries and keys it writes and the socket tuple it looks up,
/// off the stack, which the rest of `lb_tc_egress` already fills.
#[repr(C)]
pub struct MasqScratch {
    /// The forward entry's key (the pod's tuple).
    key: CtKey,
    /// The reply entry's key (the tuple the replies carry): the port's claim.
    reply_key: CtKey,
    /// An entry being written.
    value: CtValue,
    /// The node's socket lookup, from the peer's side.
    tuple: bpf_sock_tuple,
    /// The tuple the flow leaves with, as the port search fills it in.
    to: Tuple,
    /// The packet being translated, from the parser to the translation.
    flow: Flow,
}

#[btf_map]
static LB_MASQ_SCRATCH: PerCpuArray<MasqScratch, 1> = PerCpuArray::new();

#[inline(always)]
fn settings() -> MasqSettings {
    let at = &LB_MASQ_SETTINGS;
    // SAFETY: a read-only global the loader patches; volatile so the compiler does
    // not fold the zero it sees at build time. Field by field: a volatile copy of
    // the whole (2-byte aligned) struct crashes the BPF backend's memcpy expansion.
    unsafe {
        MasqSettings {
            enabled: core::ptr::read_volatile(&at.enabled),
            nodeport_first_host: core::ptr::read_volatile(&at.nodeport_first_host),
            nodeport_last_host: core::ptr::read_volatile(&at.nodeport_last_host),
            ..MasqSettings::default()
        }
    }
}

/// `--masquerade bpf`. Only the flag is read: the Service path asks on every
/// packet, and its frame has no room to spare.
#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: as in `settings`.
    let enabled = unsafe { core::ptr::read_volatile(&LB_MASQ_SETTINGS.enabled) };
    MasqSettings {
        enabled,
        ..MasqSettings::default()
    }
    .is_enabled()
}

/// `--masquerade-all`. Read alone, as [`enabled`] is.
#[inline(always)]
pub fn masquerade_all() -> bool {
    // SAFETY: as in `settings`.
    let all = unsafe { core::ptr::read_volatile(&LB_MASQ_SETTINGS.masquerade_all) };
    MasqSettings {
        masquerade_all: all,
        ..MasqSettings::default()
    }
    .is_masquerade_all()
}

/// Whether `addr` lies in the cluster's pod CIDRs (`MASQ_CIDR_CLUSTER`); `None`
/// while the agent knows none of them.
#[inline(always)]
pub fn in_cluster(addr: &IpAddrBe) -> Option<bool> {
    let key = Key::new(
        MASQ_CIDR_PREFIX_BASE + 128,
        MasqCidrKey {
            kind: MASQ_CIDR_CLUSTER,
            address: *addr,
        },
    );
    LB_MASQ_CIDRS.get(&key).map(|v| *v == MASQ_CIDR_INSIDE)
}

/// Whether `addr` lies in the set `kind` of `LB_MASQ_CIDRS`.
#[inline(always)]
fn in_set(kind: u32, addr: &IpAddrBe) -> bool {
    let key = Key::new(
        MASQ_CIDR_PREFIX_BASE + 128,
        MasqCidrKey {
            kind,
            address: *addr,
        },
    );
    LB_MASQ_CIDRS.get(&key).is_some()
}

/// The node holds a masqueraded flow's port towards a peer: `reply_key` is the
/// tuple that peer's packets would carry. For the Service path's SNAT port claim.
#[inline(always)]
pub fn holds(reply_key: &CtKey) -> bool {
    enabled() && LB_MASQ.get_ptr(reply_key).is_some()
}

/// Whether a protocol is echo (its "ports" are the identifier).
#[inline(always)]
fn is_echo(proto: u8) -> bool {
    proto == IPPROTO_ICMP || proto == IPPROTO_ICMPV6
}

/// TC egress on node-facing devices.
#[inline(always)]
pub fn egress(ctx: &TcContext) -> i32 {
    if !enabled() {
        return TC_ACT_OK;
    }
    // Parsing and translating are subprograms one after the other, the parsed
    // packet handed over in the scratch: the parser's frame then never adds to the
    // deepest chain of frames (translate, commit, its port tries), which must stay
    // within the kernel's 512 bytes.
    let skb = ctx.skb.skb;
    match egress_parse(skb) {
        PARSED_FLOW => egress_flow(skb),
        verdict => verdict as i32,
    }
}

/// [`egress_parse`] put a pod's flow in the scratch (any other answer is the
/// verdict).
const PARSED_FLOW: i64 = -1;

/// Parses a packet leaving the node: a TCP/UDP/echo packet from a local pod goes
/// to the scratch (`PARSED_FLOW`); a later fragment is dealt with here; anything
/// else passes.
#[inline(never)]
fn egress_parse(skb: *mut __sk_buff) -> i64 {
    let ctx = TcContext::new(skb);
    let flow = match packet::parse(&ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Ignored => match parse_echo(&ctx) {
            Some(flow) => flow,
            None => return TC_ACT_OK as i64,
        },
        Parsed::Fragment(fragment) => return egress_fragment(&ctx, &fragment) as i64,
        _ => return TC_ACT_OK as i64,
    };
    if !in_set(MASQ_CIDR_POD_SOURCE, &flow.saddr) {
        return TC_ACT_OK as i64;
    }
    let Some(s) = LB_MASQ_SCRATCH.get_ptr_mut(0) else {
        return TC_ACT_OK as i64;
    };
    // SAFETY: this CPU's entry, used by nothing else until the program ends.
    unsafe { (*s).flow = flow };
    PARSED_FLOW
}

/// A local pod's packet leaving the node (in the scratch): translated as its flow
/// is, or as a new flow.
#[inline(never)]
fn egress_flow(skb: *mut __sk_buff) -> i32 {
    let Some(s) = LB_MASQ_SCRATCH.get_ptr(0) else {
        return TC_ACT_OK;
    };
    // SAFETY: this CPU's entry, filled by `egress_parse` in this program run.
    let flow = unsafe { (*s).flow };
    frag::forget(&flow);
    let mut to = Tuple {
        saddr: flow.saddr,
        daddr: flow.daddr,
        sport: flow.sport,
        dport: flow.dport,
    };
    if !known(&flow, &mut to) {
        if prepare(skb, &flow) != NEW_TRANSLATED {
            return TC_ACT_OK;
        }
        match commit(skb, &flow, &mut to) {
            NEW_TRANSLATED => {}
            _ => return TC_ACT_SHOT,
        }
    }
    finish(skb, &flow, &to)
}

/// The translation of a pod's known flow, into `to`.
#[inline(never)]
fn known(flow: &Flow, to: &mut Tuple) -> bool {
    match follow(flow, CT_DIR_FORWARD) {
        Some(known) => {
            *to = known;
            true
        }
        None => false,
    }
}

/// Rewrites a pod's packet to `to` and remembers it for its later fragments.
#[inline(never)]
fn finish(skb: *mut __sk_buff, flow: &Flow, to: &Tuple) -> i32 {
    let ctx = TcContext::new(skb);
    if rewrite(&ctx, flow, to).is_err() {
        // A half-rewritten packet would carry a wrong checksum.
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    frag::remember(flow, to);
    stats::bump(stat::MASQ_EGRESS);
    TC_ACT_OK
}

/// A later fragment of a pod's datagram whose first fragment was masqueraded gets
/// the same source; the rest pass.
#[inline(always)]
fn egress_fragment(ctx: &TcContext, fragment: &Fragment) -> i32 {
    if !in_set(MASQ_CIDR_POD_SOURCE, &fragment.saddr) {
        return TC_ACT_OK;
    }
    let Some((saddr, daddr)) = frag::translation(fragment) else {
        return TC_ACT_OK;
    };
    let from = (&fragment.saddr, &fragment.daddr);
    if nat::rewrite_l3(ctx, fragment.v6, from, (&saddr, &daddr)).is_err() {
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    stats::bump(stat::MASQ_EGRESS);
    TC_ACT_OK
}

/// `lb_tc_external`, before the Service path: a reply to a masqueraded flow (TCP,
/// UDP, echo), arriving where the flow left, given back its pod's address and
/// port. The verdict, or `None` when masquerading is off or the packet is no such
/// reply (the Service path goes on with it). The pod is routed to by the stack, as
/// the reply's source stays the peer's. A Service flow's packet never matches
/// here: a masquerade port is never one `LB_CT` holds with that peer, nor the
/// other way round.
///
/// A subprogram with a parse of its own, which a thin `lb_tc_external` calls
/// before the Service path's subprograms (`tc_lb::handle`): inlined into
/// the Service path, as it was before DSR grew that path, it pushed the frame past
/// the kernel's 512 bytes; called from inside the path, its frame would add to
/// the path's.
#[inline(always)]
pub fn ingress(ctx: &TcContext) -> Option<i32> {
    if !enabled() {
        return None;
    }
    match ingress_reply(ctx.skb.skb) {
        NOT_A_REPLY => None,
        verdict => Some(verdict),
    }
}

/// [`ingress_reply`]'s answer for a packet that is no reply to a masqueraded flow
/// (any other answer is the verdict).
const NOT_A_REPLY: i32 = -1;

#[inline(never)]
fn ingress_reply(skb: *mut __sk_buff) -> i32 {
    let ctx = TcContext::new(skb);
    // What XDP translated is a Service flow's: for the Service path to count.
    if mark::is_marked(&ctx) {
        return NOT_A_REPLY;
    }
    let flow = match packet::parse(&ctx) {
        Parsed::Flow(flow) => flow,
        Parsed::Ignored => match parse_echo(&ctx) {
            Some(flow) => flow,
            None => return NOT_A_REPLY,
        },
        _ => return NOT_A_REPLY,
    };
    let Some(to) = follow(&flow, CT_DIR_REPLY) else {
        return NOT_A_REPLY;
    };
    stats::bump(stat::MASQ_INGRESS);
    if rewrite(&ctx, &flow, &to).is_err() {
        // A half-rewritten packet would carry a wrong checksum.
        stats::bump(stat::TC_MALFORMED);
        return TC_ACT_SHOT;
    }
    frag::remember(&flow, &to);
    TC_ACT_OK
}

/// The reply-direction entry an ICMP error about a masqueraded flow names
/// (`key`: the quoted packet's tuple reversed), for `icmp`/`icmp6` to rewrite it
/// as they do for Service flows; counted here.
#[inline(always)]
pub fn error_entry(key: &CtKey) -> Option<&'static CtValue> {
    if !enabled() {
        return None;
    }
    // SAFETY: a pointer into the map's value, valid for this program run.
    let entry = unsafe { LB_MASQ.get(key) }?;
    stats::bump(stat::MASQ_ICMP_ERROR);
    Some(entry)
}

/// The translation of a known flow in direction `dir`, its entry refreshed for the
/// collector. A TCP SYN on a flow that ended (FIN or RST seen) is a new connection
/// reusing the tuple: the old entries go and it is translated afresh (most often
/// to the same port, now free again).
#[inline(always)]
fn follow(flow: &Flow, dir: u8) -> Option<Tuple> {
    let key = ct::key_of(flow);
    let entry = LB_MASQ.get_ptr_mut(&key)?;
    // SAFETY: valid for this program run; another CPU touching the same entry only
    // races on the timestamp and state bits, monotonic hints for the collector.
    let entry = unsafe { &mut *entry };
    if entry.dir != dir {
        return None;
    }
    let ended = entry.state & (CT_STATE_FIN | CT_STATE_RST) != 0;
    if ended && flow.proto == IPPROTO_TCP && flow.tcp_flags & TCP_FLAG_SYN != 0 {
        let partner = ct::key_of_tuple(&reply_of(&tuple_of(entry)), flow.proto);
        let _ = LB_MASQ.remove(&key);
        let _ = LB_MASQ.remove(&partner);
        return None;
    }
    let now = ct::now();
    if now.wrapping_sub(entry.last_seen_ns) > 1_000_000 {
        entry.last_seen_ns = now;
    }
    let state = ct::state_of(flow);
    if entry.state & state != state {
        entry.state |= state;
    }
    Some(tuple_of(entry))
}

#[inline(always)]
fn tuple_of(entry: &CtValue) -> Tuple {
    Tuple {
        saddr: entry.nat_src_addr,
        daddr: entry.nat_dst_addr,
        sport: entry.nat_src_port,
        dport: entry.nat_dst_port,
    }
}

/// The tuple of a packet answering one sent with `t`.
#[inline(always)]
fn reply_of(t: &Tuple) -> Tuple {
    Tuple {
        saddr: t.daddr,
        daddr: t.saddr,
        sport: t.dport,
        dport: t.sport,
    }
}

/// The new-flow steps' answers (a plain number: a subprogram returns in a
/// register).
const NEW_TRANSLATED: u32 = 0;
const NEW_PASS: u32 = 1;
const NEW_DROP: u32 = 2;

/// A local pod's first packet towards `flow.daddr`, first step: `NEW_PASS`
/// leaves it as it is (an exempt destination, or no node address to give it);
/// `NEW_TRANSLATED` has the scratch ready for [`commit`]: the tuple to leave with
/// (the node's address, the pod's port), and the reply entry.
///
/// `new_flow` was one subprogram; split in two (each with its own frame, called
/// one after the other) the deepest chain of frames stays under the kernel's 512
/// bytes.
#[inline(never)]
fn prepare(skb: *mut __sk_buff, flow: &Flow) -> u32 {
    let ctx = TcContext::new(skb);
    if in_set(MASQ_CIDR_EXEMPT, &flow.daddr) {
        stats::bump(stat::MASQ_EXEMPT);
        return NEW_PASS;
    }
    let node = fib::source_on_egress(&ctx, &flow.saddr, &flow.daddr, flow.v6)
        .or_else(|| flow::node_ip(flow.v6));
    let Some(node) = node else {
        stats::bump(stat::MASQ_NO_SOURCE);
        return NEW_PASS;
    };
    let Some(s) = LB_MASQ_SCRATCH.get_ptr_mut(0) else {
        return NEW_PASS;
    };
    // SAFETY: this CPU's entry, used by nothing else until the program ends.
    let s = unsafe { &mut *s };
    // The replies become the reverse of what the pod sent.
    s.to = Tuple {
        saddr: flow.daddr,
        daddr: flow.saddr,
        sport: flow.dport,
        dport: flow.sport,
    };
    s.value = ct::entry(&s.to, 0, 0, 0, CT_DIR_REPLY);
    s.to = Tuple {
        saddr: node,
        daddr: flow.daddr,
        sport: flow.sport,
        dport: flow.dport,
    };
    NEW_TRANSLATED
}

/// The second step: a port claimed, both entries written, `to` set (`NEW_DROP`:
/// no free port, or the map is full; counted).
#[inline(never)]
fn commit(skb: *mut __sk_buff, flow: &Flow, to: &mut Tuple) -> u32 {
    let Some(s) = LB_MASQ_SCRATCH.get_ptr_mut(0) else {
        return NEW_DROP;
    };
    // SAFETY: this CPU's entry, filled by `prepare` in this program run.
    let s = unsafe { &mut *s };
    s.key = ct::key_of(flow);
    if !claim_port(skb, flow, s) {
        return NEW_DROP;
    }
    *to = s.to;
    s.value = ct::entry(to, 0, 0, ct::state_of(flow), CT_DIR_FORWARD);
    if let Err(e) = LB_MASQ.insert(&s.key, &s.value, BPF_NOEXIST) {
        let _ = LB_MASQ.remove(&s.reply_key);
        if e == -EEXIST {
            // Another CPU translated this flow's first packet meanwhile: use its.
            return match follow(flow, CT_DIR_FORWARD) {
                Some(known) => {
                    *to = known;
                    NEW_TRANSLATED
                }
                None => NEW_DROP,
            };
        }
        stats::bump(stat::MASQ_MAP_FULL);
        return NEW_DROP;
    }
    stats::bump(stat::MASQ_NEW_FLOW);
    NEW_TRANSLATED
}

/// One port search's state: the context `bpf_loop` hands [`try_port`].
#[repr(C)]
struct PortSearch {
    skb: *mut __sk_buff,
    scratch: *mut MasqScratch,
    /// The pod's port (network byte order), tried first.
    pod_port: u16,
    proto: u8,
    v6: u8,
    /// The NodePort range, host byte order.
    node_ports: (u16, u16),
    /// `SEARCHING`, `CLAIMED` or `MAP_FULL`.
    outcome: u32,
}

const SEARCHING: u32 = 0;
const CLAIMED: u32 = 1;
const MAP_FULL: u32 = 2;

/// The port of a new flow, set in `s.to` (the echo identifier for ICMP: always the
/// source "port" of a request), claimed by writing its reply entry (`s.value`) at
/// `s.reply_key`; false (counted) when none could be had. The tries run under
/// `bpf_loop`, so the verifier checks one try, not every path through 32 of them
/// (unrolled, they passed its million-instruction budget).
#[inline(always)]
fn claim_port(skb: *mut __sk_buff, flow: &Flow, s: &mut MasqScratch) -> bool {
    let range = settings();
    let mut search = PortSearch {
        skb,
        scratch: s,
        pod_port: flow.sport,
        proto: flow.proto,
        v6: u8::from(flow.v6),
        node_ports: (range.nodeport_first_host, range.nodeport_last_host),
        outcome: SEARCHING,
    };
    // SAFETY: the callback is a function of this program taking the context
    // given, which lives on this frame for the call.
    unsafe {
        bpf_loop(
            PORT_TRIES,
            try_port as *const () as *mut c_void,
            (&mut search as *mut PortSearch).cast(),
            0,
        );
    }
    match search.outcome {
        CLAIMED => true,
        MAP_FULL => {
            stats::bump(stat::MASQ_MAP_FULL);
            false
        }
        _ => {
            stats::bump(stat::MASQ_PORT_EXHAUSTED);
            false
        }
    }
}

/// One try of [`claim_port`]: 0 to go on, 1 to stop (claimed, or the map is full).
extern "C" fn try_port(index: u64, context: *mut c_void) -> i64 {
    // SAFETY: `bpf_loop` hands back the context `claim_port` gave it.
    let search = unsafe { &mut *context.cast::<PortSearch>() };
    // SAFETY: this CPU's scratch entry, as `new_flow` took it.
    let s = unsafe { &mut *search.scratch };
    let port = if index == 0 {
        u16::from_be(search.pod_port)
    } else {
        // SAFETY: a plain helper without arguments.
        let r = unsafe { bpf_get_prandom_u32() };
        (PORT_FIRST + r % PORT_SPAN) as u16
    };
    if port >= search.node_ports.0 && port <= search.node_ports.1 {
        return 0;
    }
    s.to.sport = port.to_be();
    s.reply_key = ct::key_of_tuple(&reply_of(&s.to), search.proto);
    let ctx = TcContext::new(search.skb);
    if used_by_node(&ctx, search.proto, search.v6 != 0, s) {
        return 0;
    }
    match LB_MASQ.insert(&s.reply_key, &s.value, BPF_NOEXIST) {
        Ok(()) => {
            search.outcome = CLAIMED;
            1
        }
        Err(e) if e == -EEXIST => 0,
        Err(_) => {
            search.outcome = MAP_FULL;
            1
        }
    }
}

/// Whether the node itself uses `to`'s source port with `to`'s destination: a
/// Service flow's SNAT port (`LB_CT`), or a socket of the node's own (connected to
/// that peer, or bound or listening there), which the replies would otherwise
/// reach instead of the pod or the other way round.
#[inline(always)]
fn used_by_node(ctx: &TcContext, proto: u8, v6: bool, s: &mut MasqScratch) -> bool {
    if LB_CT.get_ptr(&s.reply_key).is_some() {
        return true;
    }
    if is_echo(proto) {
        return false;
    }
    node_socket(ctx, &s.to, proto, v6, &mut s.tuple)
}

/// A socket of the node's network namespace that a packet from `to`'s destination
/// to its source would reach (established, time-wait, bound or listening).
#[inline(always)]
fn node_socket(
    ctx: &TcContext,
    to: &Tuple,
    proto: u8,
    v6: bool,
    tuple: &mut bpf_sock_tuple,
) -> bool {
    // From the peer's side: as the replies would arrive. The member written is
    // the one whose size is passed.
    let size = if v6 {
        // SAFETY: writing the member of a plain union.
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
        t.saddr = to.daddr.words;
        t.daddr = to.saddr.words;
        t.sport = to.dport;
        t.dport = to.sport;
        core::mem::size_of_val(t)
    } else {
        // SAFETY: as above.
        let t = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
        t.saddr = to.daddr.v4();
        t.daddr = to.saddr.v4();
        t.sport = to.dport;
        t.dport = to.sport;
        core::mem::size_of_val(t)
    };
    let netns = BPF_F_CURRENT_NETNS as u64;
    // SAFETY: the tuple is scratch memory of its full size; a socket found holds
    // a reference that is released at once.
    unsafe {
        let sk = if proto == IPPROTO_UDP {
            bpf_sk_lookup_udp(ctx.as_ptr(), tuple, size as u32, netns, 0)
        } else {
            bpf_skc_lookup_tcp(ctx.as_ptr(), tuple, size as u32, netns, 0)
        };
        if sk.is_null() {
            return false;
        }
        bpf_sk_release(sk.cast());
    }
    true
}

/// Rewrites a packet of a masqueraded flow to `to`: TCP/UDP as the Service path
/// does, echo here (its identifier and, for ICMPv6, the pseudo header).
#[inline(always)]
fn rewrite(ctx: &TcContext, flow: &Flow, to: &Tuple) -> Result<(), ()> {
    if !is_echo(flow.proto) {
        return nat::rewrite(ctx, flow, to);
    }
    let csum = L4Csum {
        off: flow.l4_off + hdr::ICMP_CSUM,
        udp: false,
    };
    echo_address(
        ctx,
        flow.v6,
        &csum,
        &flow.saddr,
        &to.saddr,
        (IP_SRC_OFF, IP6_SRC_OFF),
    )?;
    echo_address(
        ctx,
        flow.v6,
        &csum,
        &flow.daddr,
        &to.daddr,
        (IP_DST_OFF, IP6_DST_OFF),
    )?;
    // A request carries the identifier as its source "port", a reply as its
    // destination one.
    let (old_id, new_id) = if flow.sport != to.sport {
        (flow.sport, to.sport)
    } else {
        (flow.dport, to.dport)
    };
    if old_id != new_id {
        ctx.l4_csum_update(&csum, old_id as u32, new_id as u32, 2, false)?;
        ctx.write(flow.l4_off + ECHO_ID, &new_id)?;
    }
    Ok(())
}

/// One address of an echo packet: `offsets` are the IPv4 and IPv6 fields.
#[inline(always)]
fn echo_address(
    ctx: &TcContext,
    v6: bool,
    csum: &L4Csum,
    from: &IpAddrBe,
    to: &IpAddrBe,
    (off4, off6): (usize, usize),
) -> Result<(), ()> {
    if from == to {
        return Ok(());
    }
    if v6 {
        // ICMPv6's checksum covers the pseudo header; ICMP's does not.
        ctx.l4_csum_update6(csum, from, to)?;
        ctx.write(off6, &to.words)
    } else {
        ctx.ip_csum_update(IP_CSUM_OFF, from.v4(), to.v4(), 4)?;
        ctx.write(off4, &to.v4())
    }
}

/// An ICMP or ICMPv6 echo request or reply right behind its IP header (not a
/// fragment), as a flow whose "port" is the identifier: a request's source port,
/// a reply's destination port, so a reply's tuple is the reverse of its
/// request's.
#[inline(always)]
fn parse_echo(ctx: &TcContext) -> Option<Flow> {
    let ethertype: u16 = ctx.read(hdr::ETH_TYPE_OFF).ok()?;
    let (saddr, daddr, l4_off, proto, ip_len, v6) = if ethertype == ETH_TYPE_IPV4_RAW {
        let [version_ihl, _tos]: [u8; 2] = ctx.read(ETH_HLEN).ok()?;
        let total_len = u16::from_be(ctx.read(ETH_HLEN + hdr::IP_TOT_LEN).ok()?);
        let frag_off = u16::from_be(ctx.read(ETH_HLEN + hdr::IP_FRAG_OFF).ok()?);
        let [_ttl, proto]: [u8; 2] = ctx.read(ETH_HLEN + hdr::IP_TTL).ok()?;
        if proto != IPPROTO_ICMP || frag_off & IP_MF_OFFSET_MASK != 0 {
            return None;
        }
        let ihl = ((version_ihl & 0x0f) as usize) * 4;
        if version_ihl >> 4 != 4 || ihl < hdr::IP_HLEN || (total_len as usize) < ihl {
            return None;
        }
        let saddr = IpAddrBe::from_v4(ctx.read(IP_SRC_OFF).ok()?);
        let daddr = IpAddrBe::from_v4(ctx.read(IP_DST_OFF).ok()?);
        (saddr, daddr, ETH_HLEN + ihl, proto, total_len, false)
    } else if ethertype == ETH_TYPE_IPV6_RAW {
        let [next, _hops]: [u8; 2] = ctx.read(ETH_HLEN + hdr::IP6_NEXT_HDR).ok()?;
        if next != IPPROTO_ICMPV6 {
            return None;
        }
        let payload = u16::from_be(ctx.read(ETH_HLEN + hdr::IP6_PAYLOAD_LEN).ok()?);
        let saddr = IpAddrBe::from_v6(ctx.read(IP6_SRC_OFF).ok()?);
        let daddr = IpAddrBe::from_v6(ctx.read(IP6_DST_OFF).ok()?);
        let ip_len = payload.saturating_add(hdr::IP6_HLEN as u16);
        (saddr, daddr, ETH_HLEN + hdr::IP6_HLEN, next, ip_len, true)
    } else {
        return None;
    };
    let [icmp_type, _code]: [u8; 2] = ctx.read(l4_off).ok()?;
    let id: u16 = ctx.read(l4_off + ECHO_ID).ok()?;
    let (request, reply) = if v6 {
        (ICMP6_ECHO_REQUEST, ICMP6_ECHO_REPLY)
    } else {
        (ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY)
    };
    let (sport, dport) = if icmp_type == request {
        (id, 0)
    } else if icmp_type == reply {
        (0, id)
    } else {
        return None;
    };
    Some(Flow {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        tcp_flags: 0,
        l4_off,
        ip_len,
        first_fragment_id: None,
        v6,
    })
}
