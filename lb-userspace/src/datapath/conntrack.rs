//! Reading the per-packet path's conntrack: pairing the two entries of each flow,
//! deciding which flows are idle past their timeout. Pure; the agent's garbage
//! collector and `lb conntrack` do the I/O.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use lb_common::{
    CtKey, CtValue, CT_DIR_FORWARD, CT_STATE_ESTABLISHED, CT_STATE_FIN, CT_STATE_RST, IPPROTO_TCP,
};
use serde::Serialize;

use crate::datapath::codec::socket_addr;
use crate::model::Protocol;

/// Idle timeouts, per protocol and TCP state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP flows that never saw an ACK (half-open, or a scan).
    pub tcp_syn: Duration,
    pub tcp_established: Duration,
    /// TCP flows that saw a FIN or RST: the endpoints are done with it.
    pub tcp_closing: Duration,
    pub udp: Duration,
}

impl Default for Timeouts {
    /// Close to Cilium's and the kernel's conntrack defaults.
    fn default() -> Self {
        Timeouts {
            tcp_syn: Duration::from_secs(60),
            tcp_established: Duration::from_secs(6 * 3600),
            tcp_closing: Duration::from_secs(10),
            udp: Duration::from_secs(60),
        }
    }
}

/// One translated flow, as `lb conntrack` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Flow {
    pub protocol: Protocol,
    /// The address the client sent from.
    pub client: SocketAddr,
    /// The address the client sent to (VIP, node IP:nodePort, external IP).
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    /// The source the backend sees when it is not the client (remote backend).
    pub snat: Option<SocketAddr>,
    /// `SYN`, `ESTABLISHED` or `CLOSING`.
    pub state: &'static str,
    /// The flow goes by direct server return: on the entry node the backend sees
    /// the client and answers it directly; on the backend's node (a flow known by
    /// its reply entry alone) the backend's replies leave from the frontend.
    pub dsr: bool,
    pub idle_ms: u64,
    pub backend_id: u32,
    #[serde(skip)]
    keys: [Option<CtKey>; 2],
}

/// The key of the entry that a packet translated by `value` gets answered with.
fn reply_key_of(key: &CtKey, value: &CtValue) -> CtKey {
    CtKey {
        src_addr: value.nat_dst_addr,
        dst_addr: value.nat_src_addr,
        src_port: value.nat_dst_port,
        dst_port: value.nat_src_port,
        proto: key.proto,
        _pad: [0; 3],
    }
}

/// A flow's state as `lb conntrack` and `lb masquerade` name it.
pub(crate) fn state_name(proto: u8, state: u8) -> &'static str {
    if proto != IPPROTO_TCP {
        "ESTABLISHED"
    } else if state & (CT_STATE_FIN | CT_STATE_RST) != 0 {
        "CLOSING"
    } else if state & CT_STATE_ESTABLISHED != 0 {
        "ESTABLISHED"
    } else {
        "SYN"
    }
}

fn timeout_for(protocol: Protocol, state: &str, timeouts: &Timeouts) -> Duration {
    match (protocol, state) {
        (Protocol::Udp, _) => timeouts.udp,
        (Protocol::Tcp, "CLOSING") => timeouts.tcp_closing,
        (Protocol::Tcp, "ESTABLISHED") => timeouts.tcp_established,
        (Protocol::Tcp, _) => timeouts.tcp_syn,
    }
}

/// One flow's entries as read: the forward entry and its reply, or a reply whose
/// forward half is gone (LRU eviction, an interrupted insert).
enum Pair<'a> {
    Forward {
        key: &'a CtKey,
        value: &'a CtValue,
        reply: Option<(CtKey, &'a CtValue)>,
    },
    Orphan {
        key: &'a CtKey,
        value: &'a CtValue,
    },
}

impl Pair<'_> {
    /// The later of the two directions' last packets, and their states together.
    fn seen_and_state(&self) -> (u64, u8) {
        match self {
            Pair::Forward { value, reply, .. } => (
                value
                    .last_seen_ns
                    .max(reply.map_or(0, |(_, r)| r.last_seen_ns)),
                value.state | reply.map_or(0, |(_, r)| r.state),
            ),
            Pair::Orphan { value, .. } => (value.last_seen_ns, value.state),
        }
    }
}

/// Hands each flow of `entries` to `each`: forward entries with their replies in
/// table order, then the replies left over. Only the replies are held by key (a
/// map of every entry, with the table full at 262k, was tens of MB per GC pass).
fn each_pair<'a>(entries: &'a [(CtKey, CtValue)], mut each: impl FnMut(Pair<'a>)) {
    let mut replies: HashMap<CtKey, (&CtValue, bool)> = entries
        .iter()
        .filter(|(_, v)| v.dir != CT_DIR_FORWARD)
        .map(|(k, v)| (*k, (v, false)))
        .collect();
    for (key, value) in entries.iter().filter(|(_, v)| v.dir == CT_DIR_FORWARD) {
        let reply_key = reply_key_of(key, value);
        let reply = replies.get_mut(&reply_key).map(|(r, paired)| {
            *paired = true;
            (reply_key, *r)
        });
        each(Pair::Forward { key, value, reply });
    }
    for (key, value) in entries
        .iter()
        .filter(|(k, v)| v.dir != CT_DIR_FORWARD && replies.get(k).is_some_and(|(_, p)| !p))
    {
        each(Pair::Orphan { key, value });
    }
}

/// Pairs forward and reply entries into flows. `now_ns` is CLOCK_MONOTONIC, the
/// clock of `bpf_ktime_get_ns`. Entries whose partner is gone (LRU eviction, an
/// interrupted insert) still appear, with what is known.
pub fn flows(entries: &[(CtKey, CtValue)], now_ns: u64) -> Vec<Flow> {
    let mut out = Vec::new();
    each_pair(entries, |pair| {
        let (last_seen, state) = pair.seen_and_state();
        let idle_ms = now_ns.saturating_sub(last_seen) / 1_000_000;
        out.push(match pair {
            Pair::Forward { key, value, reply } => {
                let client = socket_addr(key.src_addr, key.src_port);
                let source_seen = socket_addr(value.nat_src_addr, value.nat_src_port);
                Flow {
                    protocol: Protocol::from_number(key.proto).unwrap_or(Protocol::Tcp),
                    client,
                    frontend: socket_addr(key.dst_addr, key.dst_port),
                    backend: socket_addr(value.nat_dst_addr, value.nat_dst_port),
                    snat: (source_seen != client).then_some(source_seen),
                    state: state_name(key.proto, state),
                    dsr: value.is_dsr(),
                    idle_ms,
                    backend_id: value.backend_id,
                    keys: [Some(*key), reply.map(|(k, _)| k)],
                }
            }
            // Described from the reply's side.
            Pair::Orphan { key, value } => Flow {
                protocol: Protocol::from_number(key.proto).unwrap_or(Protocol::Tcp),
                client: socket_addr(value.nat_dst_addr, value.nat_dst_port),
                frontend: socket_addr(value.nat_src_addr, value.nat_src_port),
                backend: socket_addr(key.src_addr, key.src_port),
                snat: None,
                state: state_name(key.proto, state),
                dsr: value.is_dsr(),
                idle_ms,
                backend_id: value.backend_id,
                keys: [None, Some(*key)],
            },
        });
    });
    out.sort_by_key(|f| (f.frontend, f.client));
    out
}

/// The entries of flows idle past their timeout, each with the `last_seen_ns` it
/// was read with (the GC deletes it only if that has not moved), forward entries
/// first so that a straggling reply still finds its way back while the GC runs.
/// Pairs the directions as [`flows`] does, without describing each flow.
pub fn expired(
    entries: &[(CtKey, CtValue)],
    now_ns: u64,
    timeouts: &Timeouts,
) -> Vec<(CtKey, u64)> {
    let mut forward = Vec::new();
    let mut reply = Vec::new();
    each_pair(entries, |pair| {
        let (last_seen, state) = pair.seen_and_state();
        let (key, value) = match &pair {
            Pair::Forward { key, value, .. } | Pair::Orphan { key, value } => (*key, *value),
        };
        // Everything but TCP (UDP, and masqueraded ICMP echo) by UDP's timeout.
        let protocol = if key.proto == IPPROTO_TCP {
            Protocol::Tcp
        } else {
            Protocol::Udp
        };
        let idle = Duration::from_millis(now_ns.saturating_sub(last_seen) / 1_000_000);
        if idle <= timeout_for(protocol, state_name(key.proto, state), timeouts) {
            return;
        }
        match pair {
            Pair::Forward { reply: partner, .. } => {
                forward.push((*key, value.last_seen_ns));
                reply.extend(partner.map(|(k, r)| (k, r.last_seen_ns)));
            }
            Pair::Orphan { .. } => reply.push((*key, value.last_seen_ns)),
        }
    });
    forward.extend(reply);
    forward
}

/// CLOCK_MONOTONIC in nanoseconds, the clock `bpf_ktime_get_ns` reads.
pub fn monotonic_now_ns() -> u64 {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// An aligned table for people; the address columns are as wide as their
/// longest entry (an IPv6 address takes up to 47 characters, IPv4 at most 21).
pub fn render_text(flows: &[Flow]) -> String {
    use std::fmt::Write as _;
    let rows: Vec<[String; 4]> = flows
        .iter()
        .map(|f| {
            [
                f.client.to_string(),
                f.frontend.to_string(),
                f.backend.to_string(),
                // A DSR flow has no SNAT: the backend sees the client.
                f.snat.map_or_else(
                    || if f.dsr { "dsr" } else { "-" }.to_string(),
                    |s| s.to_string(),
                ),
            ]
        })
        .collect();
    let width = |i: usize| rows.iter().map(|r| r[i].len()).max().unwrap_or(0).max(21);
    let (wc, wf, wb, ws) = (width(0), width(1), width(2), width(3));
    let mut out = format!(
        "{:<6} {:<wc$} {:<wf$} {:<wb$} {:<ws$} {:<12} IDLE\n",
        "PROTO", "CLIENT", "FRONTEND", "BACKEND", "SNAT", "STATE"
    );
    for (f, r) in flows.iter().zip(&rows) {
        let _ = writeln!(
            out,
            "{:<6} {:<wc$} {:<wf$} {:<wb$} {:<ws$} {:<12} {}.{:03}s",
            f.protocol.to_string(),
            r[0],
            r[1],
            r[2],
            r[3],
            f.state,
            f.idle_ms / 1000,
            f.idle_ms % 1000
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{CT_DIR_REPLY, CT_STATE_SYN, IPPROTO_UDP};

    const SEC: u64 = 1_000_000_000;

    fn ip(a: [u8; 4]) -> lb_common::IpAddrBe {
        std::net::IpAddr::from(a).into()
    }

    /// The two entries the TC program writes for client -> frontend, translated to
    /// `src` -> backend (src = client unless SNAT).
    fn flow_entries(
        proto: u8,
        client: ([u8; 4], u16),
        frontend: ([u8; 4], u16),
        src: ([u8; 4], u16),
        backend: ([u8; 4], u16),
        seen: (u64, u8, u64, u8),
    ) -> Vec<(CtKey, CtValue)> {
        let key = |s: ([u8; 4], u16), d: ([u8; 4], u16)| CtKey {
            src_addr: ip(s.0),
            dst_addr: ip(d.0),
            src_port: s.1.to_be(),
            dst_port: d.1.to_be(),
            proto,
            _pad: [0; 3],
        };
        let value = |s: ([u8; 4], u16), d: ([u8; 4], u16), last, state, dir| CtValue {
            last_seen_ns: last,
            nat_src_addr: ip(s.0),
            nat_dst_addr: ip(d.0),
            nat_src_port: s.1.to_be(),
            nat_dst_port: d.1.to_be(),
            backend_id: 7,
            rev_nat_id: 1,
            state,
            dir,
            dsr: 0,
            _pad2: 0,
        };
        vec![
            (
                key(client, frontend),
                value(src, backend, seen.0, seen.1, CT_DIR_FORWARD),
            ),
            (
                key(backend, src),
                value(frontend, client, seen.2, seen.3, CT_DIR_REPLY),
            ),
        ]
    }

    const CLIENT: ([u8; 4], u16) = ([203, 0, 113, 5], 40000);
    const FRONTEND: ([u8; 4], u16) = ([192, 168, 50, 1], 30080);
    const BACKEND: ([u8; 4], u16) = ([10, 244, 2, 11], 8080);
    const NODE: ([u8; 4], u16) = ([192, 168, 50, 1], 40000);

    #[test]
    fn pairs_the_two_directions_of_a_snat_flow() {
        let entries = flow_entries(
            IPPROTO_TCP,
            CLIENT,
            FRONTEND,
            NODE,
            BACKEND,
            (
                10 * SEC,
                CT_STATE_SYN | CT_STATE_ESTABLISHED,
                12 * SEC,
                CT_STATE_SYN,
            ),
        );
        let flows = flows(&entries, 15 * SEC);
        assert_eq!(flows.len(), 1);
        let f = &flows[0];
        assert_eq!(f.client, "203.0.113.5:40000".parse().unwrap());
        assert_eq!(f.frontend, "192.168.50.1:30080".parse().unwrap());
        assert_eq!(f.backend, "10.244.2.11:8080".parse().unwrap());
        assert_eq!(f.snat, Some("192.168.50.1:40000".parse().unwrap()));
        assert_eq!(f.state, "ESTABLISHED");
        // Idle since the later of the two directions.
        assert_eq!(f.idle_ms, 3000);
    }

    #[test]
    fn ipv6_flows_are_listed_bracketed_and_aligned() {
        let v6 = |s: &str| -> lb_common::IpAddrBe { s.parse::<std::net::IpAddr>().unwrap().into() };
        let (client, node, pod) = (v6("fd00:50::100"), v6("fd00:50::1"), v6("fd00:244:2::11"));
        let key = |src, sport: u16, dst, dport: u16| CtKey {
            src_addr: src,
            dst_addr: dst,
            src_port: sport.to_be(),
            dst_port: dport.to_be(),
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let value = |src, sport: u16, dst, dport: u16, dir| CtValue {
            last_seen_ns: SEC,
            nat_src_addr: src,
            nat_dst_addr: dst,
            nat_src_port: sport.to_be(),
            nat_dst_port: dport.to_be(),
            backend_id: 1,
            rev_nat_id: 1,
            state: CT_STATE_SYN,
            dir,
            dsr: 0,
            _pad2: 0,
        };
        let entries = [
            (
                key(client, 40000, node, 30080),
                value(node, 40000, pod, 8080, CT_DIR_FORWARD),
            ),
            (
                key(pod, 8080, node, 40000),
                value(node, 30080, client, 40000, CT_DIR_REPLY),
            ),
        ];
        let flows = flows(&entries, 2 * SEC);
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].client, "[fd00:50::100]:40000".parse().unwrap());
        assert_eq!(flows[0].snat, Some("[fd00:50::1]:40000".parse().unwrap()));
        let text = render_text(&flows);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].contains("[fd00:244:2::11]:8080"), "{text}");
        // Every column starts where its heading does.
        for heading in ["FRONTEND", "BACKEND", "SNAT", "STATE"] {
            let at = lines[0].find(heading).unwrap();
            assert_eq!(&lines[1][at - 1..at], " ", "{heading} in\n{text}");
            assert_ne!(&lines[1][at..at + 1], " ", "{heading} in\n{text}");
        }
    }

    #[test]
    fn local_backend_flow_has_no_snat() {
        let entries = flow_entries(
            IPPROTO_UDP,
            CLIENT,
            FRONTEND,
            CLIENT,
            BACKEND,
            (SEC, 0, SEC, 0),
        );
        assert_eq!(flows(&entries, SEC)[0].snat, None);
    }

    #[test]
    fn timeouts_follow_protocol_and_state() {
        let t = Timeouts {
            tcp_syn: Duration::from_secs(60),
            tcp_established: Duration::from_secs(3600),
            tcp_closing: Duration::from_secs(10),
            udp: Duration::from_secs(30),
        };
        let cases = [
            (IPPROTO_TCP, CT_STATE_SYN, 59, false),
            (IPPROTO_TCP, CT_STATE_SYN, 61, true),
            (IPPROTO_TCP, CT_STATE_ESTABLISHED, 61, false),
            (IPPROTO_TCP, CT_STATE_ESTABLISHED, 3601, true),
            (IPPROTO_TCP, CT_STATE_ESTABLISHED | CT_STATE_FIN, 11, true),
            (IPPROTO_TCP, CT_STATE_ESTABLISHED | CT_STATE_RST, 9, false),
            (IPPROTO_UDP, 0, 29, false),
            (IPPROTO_UDP, 0, 31, true),
        ];
        for (proto, state, idle_s, gone) in cases {
            let entries = flow_entries(proto, CLIENT, FRONTEND, NODE, BACKEND, (0, state, 0, 0));
            let expired = expired(&entries, idle_s * SEC, &t);
            assert_eq!(
                expired.len(),
                if gone { 2 } else { 0 },
                "proto {proto} state {state} idle {idle_s}s"
            );
            if gone {
                assert_eq!(expired[0].0, entries[0].0, "forward entry first");
            }
        }
    }

    #[test]
    fn a_fresh_reply_keeps_the_flow_alive() {
        // Forward direction idle for long, replies still flowing: not expired.
        let entries = flow_entries(
            IPPROTO_UDP,
            CLIENT,
            FRONTEND,
            NODE,
            BACKEND,
            (0, 0, 100 * SEC, 0),
        );
        assert!(expired(&entries, 101 * SEC, &Timeouts::default()).is_empty());
    }

    #[test]
    fn orphaned_reply_entries_are_listed_and_expire() {
        let mut entries = flow_entries(IPPROTO_UDP, CLIENT, FRONTEND, NODE, BACKEND, (0, 0, 0, 0));
        entries.remove(0);
        let f = flows(&entries, SEC);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].backend, "10.244.2.11:8080".parse().unwrap());
        assert_eq!(
            expired(&entries, 61 * SEC, &Timeouts::default()),
            vec![(entries[0].0, entries[0].1.last_seen_ns)]
        );
    }
}
