//! Masquerading's two pinned maps: `LB_MASQ_CIDRS`, the address sets the programs
//! match (this node's pod CIDRs as sources, the exempt destinations, the cluster's
//! pod CIDRs for the Service path's cluster-IP rule), kept
//! equal to what the agent derives; and `LB_MASQ`, the translations, read for
//! `lb masquerade`, `lb stats` (pressure) and the garbage collector, which expires
//! them with their flows as it does conntrack's.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError};
use ipnet::IpNet;
use lb_common::{
    map_names, CtKey, CtValue, MasqCidrKey, CT_DIR_FORWARD, CT_DIR_REPLY, IPPROTO_ICMP,
    IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, MASQ_CIDR_CLUSTER, MASQ_CIDR_EXEMPT,
    MASQ_CIDR_INSIDE, MASQ_CIDR_OUTSIDE, MASQ_CIDR_POD_SOURCE, MASQ_CIDR_PREFIX_BASE,
};

use crate::datapath::maps::{found, ignore_missing, read_in_batches, MapsError};
use crate::datapath::pins::PinLayout;

/// What the programs match a packet against.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MasqCidrs {
    /// This node's pod CIDRs: only packets from them are masqueraded.
    pub pod_sources: BTreeSet<IpNet>,
    /// Destinations never masqueraded.
    pub exempt: BTreeSet<IpNet>,
    /// The cluster's pod CIDRs, for kube-proxy's cluster-IP masquerade rule
    /// (written with or without egress masquerading).
    pub cluster: BTreeSet<IpNet>,
}

/// One trie entry: a set and a range.
type Entry = (u32, IpNet);

/// IPv4 ranges are stored IPv4-mapped: 96 bits of prefix come first.
const V4_MAPPED_PREFIX: u8 = 96;

/// The trie key of `net` in set `kind`.
pub fn cidr_key(kind: u32, net: &IpNet) -> (u32, MasqCidrKey) {
    let bits = match net {
        IpNet::V4(v4) => V4_MAPPED_PREFIX + v4.prefix_len(),
        IpNet::V6(v6) => v6.prefix_len(),
    };
    (
        MASQ_CIDR_PREFIX_BASE + u32::from(bits),
        MasqCidrKey {
            kind,
            address: net.network().into(),
        },
    )
}

/// The entry a trie key stands for; `None` for a key no agent writes.
pub fn cidr_of(prefix_len: u32, key: &MasqCidrKey) -> Option<Entry> {
    let bits = u8::try_from(prefix_len.checked_sub(MASQ_CIDR_PREFIX_BASE)?).ok()?;
    let net = match IpAddr::from(key.address) {
        IpAddr::V4(v4) => IpNet::new(v4.into(), bits.checked_sub(V4_MAPPED_PREFIX)?),
        v6 => IpNet::new(v6, bits),
    }
    .ok()?;
    Some((key.kind, net))
}

/// The cluster set's catch-all: an address in none of its ranges matches this
/// (value `MASQ_CIDR_OUTSIDE`), one in no entry at all means "not known".
fn everything() -> IpNet {
    IpNet::V6(Default::default())
}

fn entries(cidrs: &MasqCidrs) -> BTreeSet<Entry> {
    let sources = cidrs.pod_sources.iter().map(|n| (MASQ_CIDR_POD_SOURCE, *n));
    let exempt = cidrs.exempt.iter().map(|n| (MASQ_CIDR_EXEMPT, *n));
    let known = (!cidrs.cluster.is_empty()).then(everything);
    let cluster = cidrs.cluster.iter().copied().chain(known);
    sources
        .chain(exempt)
        .chain(cluster.map(|n| (MASQ_CIDR_CLUSTER, n)))
        .collect()
}

/// The value an entry is written with.
fn value_of(entry: &Entry) -> u8 {
    if *entry == (MASQ_CIDR_CLUSTER, everything()) {
        MASQ_CIDR_OUTSIDE
    } else {
        MASQ_CIDR_INSIDE
    }
}

/// The pinned masquerade maps.
pub struct MasqMaps {
    cidrs: LpmTrie<MapData, MasqCidrKey, u8>,
    translations: HashMap<MapData, CtKey, CtValue>,
    translations_fd: OwnedFd,
    capacity: u32,
}

impl MasqMaps {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        let open = |name: &'static str| {
            let path = layout.map_path(name);
            let wrap = |source| MapsError::Open {
                path: path.clone(),
                source,
            };
            let data = MapData::from_pin(&path).map_err(wrap)?;
            let max = data.info().map_err(wrap)?.max_entries();
            let fd = data.fd().as_fd().try_clone_to_owned().map_err(|io_error| {
                wrap(MapError::SyscallError(aya::sys::SyscallError {
                    call: "dup",
                    io_error,
                }))
            })?;
            let map = Map::from_map_data(data).map_err(wrap)?;
            Ok::<_, MapsError>((map, max, fd, path))
        };
        let (cidrs, _, _, cidrs_path) = open(map_names::MASQ_CIDRS)?;
        let (translations, capacity, translations_fd, masq_path) = open(map_names::MASQ)?;
        Ok(Self {
            cidrs: LpmTrie::try_from(cidrs).map_err(|source| MapsError::Open {
                path: cidrs_path,
                source,
            })?,
            translations: HashMap::try_from(translations).map_err(|source| MapsError::Open {
                path: masq_path,
                source,
            })?,
            translations_fd,
            capacity,
        })
    }

    /// What `LB_MASQ_CIDRS` holds (keys no agent writes are left out).
    pub fn cidrs(&self) -> Result<MasqCidrs, MapsError> {
        let mut out = MasqCidrs::default();
        for (kind, net) in self
            .cidr_keys()?
            .iter()
            .filter_map(|k| cidr_of(k.prefix_len(), &k.data()))
        {
            match kind {
                MASQ_CIDR_POD_SOURCE => out.pod_sources.insert(net),
                MASQ_CIDR_EXEMPT => out.exempt.insert(net),
                MASQ_CIDR_CLUSTER if net != everything() => out.cluster.insert(net),
                _ => false,
            };
        }
        Ok(out)
    }

    fn cidr_keys(&self) -> Result<Vec<Key<MasqCidrKey>>, MapsError> {
        self.cidrs
            .keys()
            .collect::<Result<Vec<_>, MapError>>()
            .map_err(|source| MapsError::Read {
                map: map_names::MASQ_CIDRS,
                source,
            })
    }

    /// Makes `LB_MASQ_CIDRS` hold exactly `wanted`: additions first, so a range
    /// that only changes its length is never missing in between. Returns how many
    /// entries changed.
    pub fn sync_cidrs(&mut self, wanted: &MasqCidrs) -> Result<usize, MapsError> {
        let wanted = entries(wanted);
        let present = self.cidr_keys()?;
        let have: BTreeSet<Entry> = present
            .iter()
            .filter_map(|k| cidr_of(k.prefix_len(), &k.data()))
            .collect();
        let mut changed = 0;
        for entry in wanted.difference(&have) {
            let (prefix_len, data) = cidr_key(entry.0, &entry.1);
            self.cidrs
                .insert(&Key::new(prefix_len, data), value_of(entry), 0)
                .map_err(|source| MapsError::Write {
                    map: map_names::MASQ_CIDRS,
                    op: format!("add {} to set {}", entry.1, entry.0),
                    source,
                })?;
            changed += 1;
        }
        for key in present {
            let keep = cidr_of(key.prefix_len(), &key.data()).is_some_and(|e| wanted.contains(&e));
            if keep {
                continue;
            }
            ignore_missing(self.cidrs.remove(&key)).map_err(|source| MapsError::Write {
                map: map_names::MASQ_CIDRS,
                op: "delete a range".to_owned(),
                source,
            })?;
            changed += 1;
        }
        Ok(changed)
    }

    /// `max_entries` of `LB_MASQ`.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Every translation entry (both directions of every flow).
    pub fn translations(&self) -> Result<Vec<(CtKey, CtValue)>, MapsError> {
        let mut out = Vec::new();
        read_in_batches(
            &self.translations,
            self.translations_fd.as_fd(),
            map_names::MASQ,
            |batch| out.extend_from_slice(batch),
        )?;
        Ok(out)
    }

    pub fn translation(&self, key: &CtKey) -> Result<Option<CtValue>, MapsError> {
        found(self.translations.get(key, 0), map_names::MASQ)
    }

    /// Removes one entry; one already gone is fine.
    pub fn remove_translation(&mut self, key: &CtKey) -> Result<(), MapsError> {
        ignore_missing(self.translations.remove(key)).map_err(|source| MapsError::Write {
            map: map_names::MASQ,
            op: format!("delete {key:?}"),
            source,
        })
    }
}

/// One masqueraded flow, as `lb masquerade` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Translation {
    /// `TCP`, `UDP`, `ICMP` or `ICMPv6` (echo: the port is the identifier).
    pub protocol: &'static str,
    /// The pod's address and port.
    pub pod: SocketAddr,
    /// Where it sends to.
    pub destination: SocketAddr,
    /// What the destination sees: the node's address and the port it got.
    pub node: SocketAddr,
    /// `SYN`, `ESTABLISHED` or `CLOSING` (TCP); `ESTABLISHED` otherwise, as `lb conntrack` says.
    pub state: &'static str,
    /// Since the last packet either way.
    pub idle_ms: u64,
    /// The reply entry is missing (the flow's replies would not come back).
    pub half: bool,
}

fn protocol_name(proto: u8) -> &'static str {
    match proto {
        IPPROTO_TCP => "TCP",
        IPPROTO_UDP => "UDP",
        IPPROTO_ICMP => "ICMP",
        IPPROTO_ICMPV6 => "ICMPv6",
        _ => "?",
    }
}

/// The flows of `LB_MASQ`'s entries, by their forward entries (each with its reply
/// entry's state and time); `now_ns` is CLOCK_MONOTONIC.
pub fn translations(entries: &[(CtKey, CtValue)], now_ns: u64) -> Vec<Translation> {
    let replies: std::collections::HashMap<CtKey, &CtValue> = entries
        .iter()
        .filter(|(_, v)| v.dir == CT_DIR_REPLY)
        .map(|(k, v)| (*k, v))
        .collect();
    let mut out: Vec<Translation> = entries
        .iter()
        .filter(|(_, v)| v.dir == CT_DIR_FORWARD)
        .map(|(key, value)| {
            let reply_key = CtKey {
                src_addr: value.nat_dst_addr,
                dst_addr: value.nat_src_addr,
                src_port: value.nat_dst_port,
                dst_port: value.nat_src_port,
                proto: key.proto,
                _pad: [0; 3],
            };
            let reply = replies.get(&reply_key);
            let seen = value.last_seen_ns.max(reply.map_or(0, |r| r.last_seen_ns));
            let state =
                super::conntrack::state_name(key.proto, value.state | reply.map_or(0, |r| r.state));
            Translation {
                protocol: protocol_name(key.proto),
                pod: socket_addr(key.src_addr, key.src_port),
                destination: socket_addr(key.dst_addr, key.dst_port),
                node: socket_addr(value.nat_src_addr, value.nat_src_port),
                state,
                idle_ms: now_ns.saturating_sub(seen) / 1_000_000,
                half: reply.is_none(),
            }
        })
        .collect();
    out.sort_by_key(|t| (t.pod, t.destination));
    out
}

fn socket_addr(ip: lb_common::IpAddrBe, port_be: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from(ip), u16::from_be(port_be))
}

/// `lb masquerade`'s table, with the map's pressure on top.
pub fn render_text(flows: &[Translation], entries: usize, capacity: u32) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "LB_MASQ: {entries} of {capacity} entries ({:.1}%), {} flows\n",
        entries as f64 * 100.0 / f64::from(capacity.max(1)),
        flows.len()
    );
    let width = |f: &dyn Fn(&Translation) -> String| {
        flows.iter().map(|t| f(t).len()).max().unwrap_or(0).max(21)
    };
    let (wp, wd, wn) = (
        width(&|t| t.pod.to_string()),
        width(&|t| t.destination.to_string()),
        width(&|t| t.node.to_string()),
    );
    let _ = writeln!(
        out,
        "{:<6} {:<wp$} {:<wd$} {:<wn$} {:<11} IDLE",
        "PROTO", "POD", "DESTINATION", "AS", "STATE"
    );
    for t in flows {
        let _ = writeln!(
            out,
            "{:<6} {:<wp$} {:<wd$} {:<wn$} {:<11} {}.{:03}s{}",
            t.protocol,
            t.pod.to_string(),
            t.destination.to_string(),
            t.node.to_string(),
            t.state,
            t.idle_ms / 1000,
            t.idle_ms % 1000,
            if t.half { " (no reply entry)" } else { "" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flow_is_listed_once_with_its_reply_s_time_and_the_pressure() {
        let ip = |s: &str| -> lb_common::IpAddrBe { s.parse::<IpAddr>().unwrap().into() };
        let (pod, dst, node) = (ip("10.244.1.11"), ip("11.0.0.1"), ip("192.168.50.1"));
        let value = |s, sp: u16, d, dp: u16, seen, dir| CtValue {
            last_seen_ns: seen,
            nat_src_addr: s,
            nat_dst_addr: d,
            nat_src_port: sp.to_be(),
            nat_dst_port: dp.to_be(),
            state: lb_common::CT_STATE_ESTABLISHED,
            dir,
            ..CtValue::default()
        };
        let key = |s, sp: u16, d, dp: u16| CtKey {
            src_addr: s,
            dst_addr: d,
            src_port: sp.to_be(),
            dst_port: dp.to_be(),
            proto: IPPROTO_TCP,
            _pad: [0; 3],
        };
        let entries = [
            (
                key(pod, 40000, dst, 80),
                value(node, 41000, dst, 80, 1_000_000_000, CT_DIR_FORWARD),
            ),
            (
                key(dst, 80, node, 41000),
                value(dst, 80, pod, 40000, 3_000_000_000, CT_DIR_REPLY),
            ),
        ];
        let flows = translations(&entries, 4_000_000_000);
        assert_eq!(flows.len(), 1);
        assert_eq!(flows[0].node, "192.168.50.1:41000".parse().unwrap());
        assert_eq!(flows[0].idle_ms, 1000);
        assert_eq!(flows[0].state, "ESTABLISHED");
        assert!(!flows[0].half);
        let text = render_text(&flows, 2, 100);
        assert!(
            text.starts_with("LB_MASQ: 2 of 100 entries (2.0%), 1 flows"),
            "{text}"
        );
        assert!(text.contains("10.244.1.11:40000"), "{text}");
        assert!(translations(&entries[..1], 0)[0].half);
    }

    #[test]
    fn keys_round_trip_with_the_set_before_the_address() {
        for (kind, text, bits) in [
            (MASQ_CIDR_EXEMPT, "10.0.0.0/8", 32 + 96 + 8),
            (MASQ_CIDR_POD_SOURCE, "fd00:244:1::/64", 32 + 64),
            (MASQ_CIDR_EXEMPT, "0.0.0.0/0", 32 + 96),
        ] {
            let net: IpNet = text.parse().unwrap();
            let (prefix_len, key) = cidr_key(kind, &net);
            assert_eq!(prefix_len, bits, "{text}");
            assert_eq!(key.kind, kind);
            assert_eq!(cidr_of(prefix_len, &key), Some((kind, net)));
        }
        // Shorter than the set itself: written by no agent.
        assert_eq!(cidr_of(8, &MasqCidrKey::default()), None);
    }

    #[test]
    fn the_cluster_set_gets_its_catch_all_only_once_a_range_is_known() {
        let none = entries(&MasqCidrs::default());
        assert!(none.is_empty());
        let cidrs = MasqCidrs {
            cluster: ["10.244.1.0/24".parse().unwrap()].into(),
            ..MasqCidrs::default()
        };
        let written = entries(&cidrs);
        let values: Vec<(IpNet, u8)> = written.iter().map(|e| (e.1, value_of(e))).collect();
        assert_eq!(
            values,
            [
                ("10.244.1.0/24".parse().unwrap(), MASQ_CIDR_INSIDE),
                ("::/0".parse().unwrap(), MASQ_CIDR_OUTSIDE),
            ]
        );
        // The catch-all's key reads back as itself, and is no range of the set.
        let (prefix_len, key) = cidr_key(MASQ_CIDR_CLUSTER, &everything());
        assert_eq!(prefix_len, MASQ_CIDR_PREFIX_BASE);
        assert_eq!(
            cidr_of(prefix_len, &key),
            Some((MASQ_CIDR_CLUSTER, everything()))
        );
    }
}
