//! NetworkPolicy on the host side of each local pod's veth (`--network-policy on`).
//!
//! - To the pod (`lb_tc_to_pod`, TC egress of its veth): the pod's ingress policy,
//!   judged on the packet as the pod receives it (peer: its source).
//! - From the pod (`lb_tc_internal`, TC ingress of its veth): the pod's egress
//!   policy, judged after the Service path translated the packet (peer: the
//!   backend, not the cluster IP), in two steps around it ([`from_pod_first`],
//!   [`from_pod_then`]).
//!
//! An allowed flow gets an `LB_POLICY_CT` entry keyed as the pod sees the flow
//! (its own address and port, the peer's address and port before translation: a
//! cluster IP stays a cluster IP), so the packets of both directions find it on
//! either side of the veth, whichever direction opened it. The verdict for a new
//! flow is `lb_common::policy::verdict`, the rule the agent's tests check the
//! compiled maps against.
//!
//! Always passed: non-IP frames, ICMPv6 neighbour discovery and multicast listener
//! messages (without them IPv6 stops working), ICMP errors about a flow the pod
//! has (PMTU discovery must keep working), later fragments (the pod cannot
//! reassemble them without the first, which was judged). An IPv6 packet's
//! extension headers (hop-by-hop, routing, destination options, authentication,
//! fragment; up to [`V6_MAX_EXT`]) are walked to the upper layer, so such a packet
//! is judged by its real protocol and port; past that many, by the last header
//! reached, without a port (only a rule without ports admits it). ESP hides the
//! upper layer: judged as protocol 50.

use aya_ebpf::{
    bindings::__sk_buff,
    btf_maps::{lpm_trie::Key, PerCpuArray},
    macros::btf_map,
    programs::TcContext,
};
use lb_common::{
    policy::{
        self as rules, Verdict, IPPROTO_SCTP, POLICY_CIDR_PREFIX_FULL, POLICY_DIR_EGRESS,
        POLICY_DIR_INGRESS, POLICY_PREFIX_FULL,
    },
    stat, IpAddrBe, PolicyAllow, PolicyCidrKey, PolicyCtKey, PolicyCtValue, PolicyEndpoint,
    PolicyKey, PolicyLookup, PolicySettings, IPPROTO_TCP, IPPROTO_UDP,
};

use crate::{
    hdr::{self, ETH_HLEN, ETH_TYPE_IPV4_RAW, ETH_TYPE_IPV6_RAW, IPPROTO_ICMP, IPPROTO_ICMPV6},
    maps::{
        LB_POLICY, LB_POLICY_CIDRS, LB_POLICY_CT, LB_POLICY_DROPS, LB_POLICY_ENDPOINTS,
        LB_POLICY_IDENTITY,
    },
    stats,
};

/// `--network-policy`; set by the agent at load time. Off in the object, so a
/// loader that says nothing gets the datapath without policy.
#[unsafe(no_mangle)]
static LB_POLICY_SETTINGS: PolicySettings = PolicySettings { enabled: 0 };

/// Whether the programs enforce NetworkPolicy.
#[inline(always)]
pub fn enabled() -> bool {
    // SAFETY: a read-only global the loader patches; volatile so the compiler does
    // not fold the zero it sees at build time.
    unsafe { core::ptr::read_volatile(&LB_POLICY_SETTINGS) }.is_enabled()
}

/// [`from_pod_first`]'s answers.
pub const PASS: i32 = 0;
/// Judge the packet after the Service path ([`from_pod_then`]).
pub const JUDGE_AFTER: i32 = 1;

const SCTP: u8 = IPPROTO_SCTP;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO: u8 = 8;
const ICMP6_ECHO: u8 = 128;
const ICMP6_ECHO_REPLY: u8 = 129;
/// IPv4 "more fragments" and fragment offset.
const IP_OFFSET_MASK: u16 = 0x1fff;

/// What policy reads of a packet: the addresses, the protocol and the two
/// "ports" a flow is known by (ICMP echo: the identifier on the requester's side,
/// 0 on the responder's, so request and reply find the same entry).
#[derive(Clone, Copy)]
struct Seen {
    saddr: IpAddrBe,
    daddr: IpAddrBe,
    sport: [u8; 2],
    dport: [u8; 2],
    proto: u8,
    /// Not a flow of its own: an ICMP error quoting `related` (as the quoted packet
    /// went), a neighbour discovery message, a later fragment.
    kind: u8,
}

const KIND_FLOW: u8 = 0;
const KIND_ALWAYS: u8 = 1;
const KIND_ERROR: u8 = 2;

/// The packet being judged: its flow as the pod sees it, and the pod's endpoint
/// entry as read once for it.
#[repr(C)]
struct Judged {
    key: PolicyCtKey,
    endpoint: PolicyEndpoint,
}

/// [`Judged`] per CPU: off the stack of programs near the kernel's 512 bytes,
/// and carried from [`from_pod_first`] to [`from_pod_then`] across the Service
/// path (a program runs to its end on one CPU, so no two packets share it at
/// once).
#[btf_map]
static LB_POLICY_SCRATCH: PerCpuArray<Judged, 1> = PerCpuArray::new();

/// The maps behind `lb_common::policy::verdict`.
struct Maps;

impl PolicyLookup for Maps {
    #[inline(always)]
    fn endpoint(&self, addr: &IpAddrBe) -> Option<PolicyEndpoint> {
        // SAFETY: copied out at once.
        unsafe { LB_POLICY_ENDPOINTS.get(addr) }.copied()
    }

    #[inline(always)]
    fn identity(&self, addr: &IpAddrBe) -> Option<u32> {
        // SAFETY: copied out at once.
        unsafe { LB_POLICY_IDENTITY.get(addr) }.copied()
    }

    #[inline(always)]
    fn cidr_class(&self, addr: &IpAddrBe) -> Option<u32> {
        let key = Key::new(POLICY_CIDR_PREFIX_FULL, PolicyCidrKey { address: *addr });
        LB_POLICY_CIDRS.get(&key).copied()
    }

    #[inline(always)]
    fn allow(&self, key: &PolicyKey) -> Option<PolicyAllow> {
        LB_POLICY.get(&Key::new(POLICY_PREFIX_FULL, *key)).copied()
    }
}

/// `lb_tc_to_pod`: the pod's ingress policy.
#[inline(never)]
pub fn to_pod(skb: *mut __sk_buff) -> bool {
    let ctx = TcContext::new(skb);
    let Some((seen, judged)) = flow_of_pod(&ctx, true) else {
        return true;
    };
    if known(&judged.key) {
        return true;
    }
    if seen.kind == KIND_ERROR {
        // About no flow the pod has: only an enforced pod refuses it.
        return !judged.endpoint.enforces_ingress();
    }
    let verdict = rules::verdict_of(
        &Maps,
        Some(judged.endpoint),
        POLICY_DIR_INGRESS,
        &seen.saddr,
        seen.proto,
        seen.dport,
    );
    decided(&judged.key, verdict, POLICY_DIR_INGRESS)
}

/// `lb_tc_internal`, before the Service path: [`PASS`] when the packet needs no
/// verdict (no policy selects its pod, a flow the pod has, or one of the
/// always-passed kinds); else [`JUDGE_AFTER`], with the flow's key as the pod
/// sees it kept in this CPU's scratch entry for [`from_pod_then`] (which admits
/// it when egress is not enforced, remembering the flow for its replies).
#[inline(never)]
pub fn from_pod_first(skb: *mut __sk_buff) -> i32 {
    let ctx = TcContext::new(skb);
    match flow_of_pod(&ctx, false) {
        Some((_, judged)) if !known(&judged.key) => JUDGE_AFTER,
        _ => PASS,
    }
}

/// The packet, and its flow as the local pod at one end sees it with the pod's
/// endpoint entry, written into this CPU's scratch entry; `None` when policy has nothing to say (not IP, a kind
/// always passed, a pod no policy selects). `to_pod`: the packet goes to the
/// pod, else it leaves it; an ICMP error's quoted packet went the other way.
#[inline(always)]
fn flow_of_pod(ctx: &TcContext, to_pod: bool) -> Option<(Seen, &'static mut Judged)> {
    let seen = read(ctx)?;
    if seen.kind == KIND_ALWAYS {
        return None;
    }
    let pod_is_destination = to_pod != (seen.kind == KIND_ERROR);
    let (pod, peer, pod_port, peer_port) = if pod_is_destination {
        (seen.daddr, seen.saddr, seen.dport, seen.sport)
    } else {
        (seen.saddr, seen.daddr, seen.sport, seen.dport)
    };
    let endpoint = tracked(&pod)?;
    let s = LB_POLICY_SCRATCH.get_ptr_mut(0)?;
    // SAFETY: this CPU's entry, used by nothing else until the program ends (or,
    // for `from_pod_then`, until the same program run reads it back).
    let judged = unsafe { &mut *s };
    pod_side(
        &mut judged.key,
        &pod,
        &peer,
        pod_port,
        peer_port,
        seen.proto,
    );
    judged.endpoint = endpoint;
    Some((seen, judged))
}

/// `lb_tc_internal`, after the Service path let the packet on: the pod's egress
/// verdict on the translated packet (its destination is the backend), for the
/// pod and flow [`from_pod_first`] kept. Whether the packet may leave.
#[inline(never)]
pub fn from_pod_then(skb: *mut __sk_buff) -> bool {
    let ctx = TcContext::new(skb);
    let Some(s) = LB_POLICY_SCRATCH.get_ptr_mut(0) else {
        return true;
    };
    // SAFETY: this CPU's entry, written by `from_pod_first` in this program run.
    let judged = unsafe { &*s };
    let Some(seen) = read(&ctx) else {
        return true;
    };
    // The Service path answered the pod itself (a reject for a Service without
    // endpoints): nothing leaves.
    if seen.daddr == judged.key.pod {
        return true;
    }
    let (proto, dport) = if seen.kind == KIND_FLOW {
        (seen.proto, seen.dport)
    } else {
        // An unrelated error the pod sends is judged as its protocol alone.
        (
            if seen.daddr.is_v4() {
                IPPROTO_ICMP
            } else {
                IPPROTO_ICMPV6
            },
            [0; 2],
        )
    };
    let endpoint = Some(judged.endpoint);
    let verdict = rules::verdict_of(
        &Maps,
        endpoint,
        POLICY_DIR_EGRESS,
        &seen.daddr,
        proto,
        dport,
    );
    decided(&judged.key, verdict, POLICY_DIR_EGRESS)
}

/// A policy selects the local pod at `addr` in either direction. Its flows are
/// then remembered whichever direction opened them, enforced or not: a pod whose
/// ingress alone is enforced must still get the replies of the connections it
/// opens, and the other way round.
/// The pod's endpoint entry when it is so selected.
#[inline(always)]
fn tracked(addr: &IpAddrBe) -> Option<PolicyEndpoint> {
    Maps.endpoint(addr)
        .filter(|e| e.enforces_ingress() || e.enforces_egress())
}

/// Writes the flow's key as the pod sees it into `key`.
#[inline(always)]
fn pod_side(
    key: &mut PolicyCtKey,
    pod: &IpAddrBe,
    peer: &IpAddrBe,
    pod_port: [u8; 2],
    peer_port: [u8; 2],
    proto: u8,
) {
    key.pod = *pod;
    key.peer = *peer;
    key.pod_port_be = pod_port;
    key.peer_port_be = peer_port;
    key.proto = proto;
    key._pad = [0; 3];
}

/// A flow the pod has (allowed before, either direction).
#[inline(always)]
fn known(key: &PolicyCtKey) -> bool {
    // SAFETY: only tested for presence.
    unsafe { LB_POLICY_CT.get(key) }.is_some()
}

/// Acts on a new flow's verdict: an allowed one gets its entry, a denied one is
/// counted for its pod. Whether the packet passes.
#[inline(always)]
fn decided(key: &PolicyCtKey, verdict: Verdict, direction: u8) -> bool {
    let rule = match verdict {
        Verdict::Open | Verdict::Host => 0,
        Verdict::Allowed { rule } => rule,
        Verdict::Denied { endpoint } => {
            let egress = direction == POLICY_DIR_EGRESS;
            stats::bump(if egress {
                stat::POLICY_EGRESS_DROP
            } else {
                stat::POLICY_INGRESS_DROP
            });
            if let Some(c) = LB_POLICY_DROPS.get_ptr_mut(endpoint) {
                // SAFETY: this CPU's counters.
                let c = unsafe { &mut *c };
                if egress {
                    c.egress_drops += 1;
                } else {
                    c.ingress_drops += 1;
                }
            }
            return false;
        }
    };
    let value = PolicyCtValue {
        opened: direction,
        _pad: [0; 3],
        rule,
    };
    if LB_POLICY_CT.insert(key, value, 0).is_ok() {
        stats::bump(stat::POLICY_ALLOWED);
    } else {
        stats::bump(stat::POLICY_CT_FULL);
    }
    true
}

/// The packet as policy sees it; `None` for frames policy never looks at (not IP,
/// too short to tell).
#[inline(always)]
fn read(ctx: &TcContext) -> Option<Seen> {
    let ethertype: u16 = ctx.load(hdr::ETH_TYPE_OFF).ok()?;
    if ethertype == ETH_TYPE_IPV4_RAW {
        return read4(ctx);
    }
    if ethertype == ETH_TYPE_IPV6_RAW {
        return read6(ctx);
    }
    None
}

#[inline(always)]
fn read4(ctx: &TcContext) -> Option<Seen> {
    let version_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    let ihl = ((version_ihl & 0x0f) as usize) * 4;
    if version_ihl >> 4 != 4 || ihl < hdr::IP_HLEN {
        return None;
    }
    let proto: u8 = ctx.load(ETH_HLEN + hdr::IP_PROTO).ok()?;
    let frag: u16 = u16::from_be(ctx.load(ETH_HLEN + hdr::IP_FRAG_OFF).ok()?);
    let saddr = IpAddrBe::from_v4(ctx.load(ETH_HLEN + hdr::IP_SRC).ok()?);
    let daddr = IpAddrBe::from_v4(ctx.load(ETH_HLEN + hdr::IP_DST).ok()?);
    let mut seen = Seen {
        saddr,
        daddr,
        sport: [0; 2],
        dport: [0; 2],
        proto,
        kind: KIND_FLOW,
    };
    if frag & IP_OFFSET_MASK != 0 {
        seen.kind = KIND_ALWAYS;
        return Some(seen);
    }
    let l4 = ETH_HLEN + ihl;
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | SCTP => {
            let ports: [[u8; 2]; 2] = ctx.load(l4).ok()?;
            (seen.sport, seen.dport) = (ports[0], ports[1]);
        }
        IPPROTO_ICMP => {
            let head: [u8; 8] = ctx.load(l4).ok()?;
            match head[0] {
                ICMP_ECHO => seen.sport = [head[4], head[5]],
                ICMP_ECHO_REPLY => seen.dport = [head[4], head[5]],
                3 | 11 | 12 => return quoted4(ctx, l4 + 8),
                _ => {}
            }
        }
        _ => {}
    }
    Some(seen)
}

/// An ICMP error: the packet it quotes, at `off`.
#[inline(always)]
fn quoted4(ctx: &TcContext, off: usize) -> Option<Seen> {
    let version_ihl: u8 = ctx.load(off).ok()?;
    let ihl = ((version_ihl & 0x0f) as usize) * 4;
    if version_ihl >> 4 != 4 || ihl < hdr::IP_HLEN {
        return None;
    }
    let proto: u8 = ctx.load(off + hdr::IP_PROTO).ok()?;
    let ports: [[u8; 2]; 2] = if proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == SCTP {
        ctx.load(off + ihl).ok()?
    } else {
        [[0; 2]; 2]
    };
    Some(Seen {
        saddr: IpAddrBe::from_v4(ctx.load(off + hdr::IP_SRC).ok()?),
        daddr: IpAddrBe::from_v4(ctx.load(off + hdr::IP_DST).ok()?),
        sport: ports[0],
        dport: ports[1],
        proto,
        kind: KIND_ERROR,
    })
}

/// Most IPv6 extension headers walked to find the upper layer.
const V6_MAX_EXT: usize = 4;

#[inline(always)]
fn read6(ctx: &TcContext) -> Option<Seen> {
    let version: u8 = ctx.load(ETH_HLEN).ok()?;
    if version >> 4 != 6 {
        return None;
    }
    let mut proto: u8 = ctx.load(ETH_HLEN + hdr::IP6_NEXT_HDR).ok()?;
    let mut l4 = ETH_HLEN + hdr::IP6_HLEN;
    let mut later_fragment = false;
    for _ in 0..V6_MAX_EXT {
        match proto {
            hdr::NEXTHDR_HOP | hdr::NEXTHDR_ROUTING | hdr::NEXTHDR_DEST => {
                let h: [u8; 2] = ctx.load(l4).ok()?;
                proto = h[0];
                l4 += (h[1] as usize + 1) * 8;
            }
            hdr::NEXTHDR_AUTH => {
                let h: [u8; 2] = ctx.load(l4).ok()?;
                proto = h[0];
                l4 += (h[1] as usize + 2) * 4;
            }
            hdr::NEXTHDR_FRAGMENT => {
                let h: [u8; 4] = ctx.load(l4).ok()?;
                proto = h[0];
                later_fragment = u16::from_be_bytes([h[2], h[3]]) >> 3 != 0;
                l4 += 8;
            }
            _ => break,
        }
    }
    let mut seen = Seen {
        saddr: IpAddrBe {
            words: ctx.load(ETH_HLEN + hdr::IP6_SRC).ok()?,
        },
        daddr: IpAddrBe {
            words: ctx.load(ETH_HLEN + hdr::IP6_DST).ok()?,
        },
        sport: [0; 2],
        dport: [0; 2],
        proto,
        kind: KIND_FLOW,
    };
    if later_fragment {
        seen.kind = KIND_ALWAYS;
        return Some(seen);
    }
    match proto {
        IPPROTO_TCP | IPPROTO_UDP | SCTP => {
            let ports: [[u8; 2]; 2] = ctx.load(l4).ok()?;
            (seen.sport, seen.dport) = (ports[0], ports[1]);
        }
        IPPROTO_ICMPV6 => {
            let head: [u8; 8] = ctx.load(l4).ok()?;
            match head[0] {
                ICMP6_ECHO => seen.sport = [head[4], head[5]],
                ICMP6_ECHO_REPLY => seen.dport = [head[4], head[5]],
                1..=4 => return quoted6(ctx, l4 + 8),
                // Multicast listener and neighbour discovery (RFC 4443 2.1:
                // informational, 130-143): the link's own business.
                130..=143 => seen.kind = KIND_ALWAYS,
                _ => {}
            }
        }
        _ => {}
    }
    Some(seen)
}

/// An ICMPv6 error: the packet it quotes, at `off` (its first header only).
#[inline(always)]
fn quoted6(ctx: &TcContext, off: usize) -> Option<Seen> {
    let proto: u8 = ctx.load(off + hdr::IP6_NEXT_HDR).ok()?;
    let ports: [[u8; 2]; 2] = if proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == SCTP {
        ctx.load(off + hdr::IP6_HLEN).ok()?
    } else {
        [[0; 2]; 2]
    };
    Some(Seen {
        saddr: IpAddrBe {
            words: ctx.load(off + hdr::IP6_SRC).ok()?,
        },
        daddr: IpAddrBe {
            words: ctx.load(off + hdr::IP6_DST).ok()?,
        },
        sport: ports[0],
        dport: ports[1],
        proto,
        kind: KIND_ERROR,
    })
}
