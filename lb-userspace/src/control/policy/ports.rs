//! A rule's `ports` as `LB_POLICY` key tails: (protocol, prefix length, port).

use lb_common::policy::{POLICY_PREFIX_ANY_PORT, POLICY_PREFIX_ANY_PROTO, POLICY_PREFIX_FULL};

use crate::model::policy::{resolve_named, NamedPort, PolicyPort, PortRef};

/// The protocol, port and prefix length of one `LB_POLICY` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortEntry {
    pub proto: u8,
    pub port: u16,
    pub prefix_len: u32,
}

impl PortEntry {
    /// Every protocol and port: a rule without `ports`.
    pub const ANY: PortEntry = PortEntry {
        proto: 0,
        port: 0,
        prefix_len: POLICY_PREFIX_ANY_PROTO,
    };
}

/// `lo..=hi` as the fewest aligned power-of-two blocks, each `(first port, bits
/// fixed)`: 1000..=2000 is 1000/13 (1000-1007), 1008/12, ... The ports of a block
/// share their first `bits` bits, which is what an LPM prefix of `80 + bits` matches.
pub fn split_range(lo: u16, hi: u16) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let (mut lo, hi) = (u32::from(lo), u32::from(hi));
    while lo <= hi {
        // The largest block starting at `lo` (aligned) that ends at or before `hi`.
        let mut size = if lo == 0 {
            1 << 16
        } else {
            1 << lo.trailing_zeros()
        };
        while lo + size - 1 > hi {
            size >>= 1;
        }
        out.push((lo as u16, 16 - size.trailing_zeros()));
        lo += size;
    }
    out
}

/// Which side's named ports a port name resolves on.
#[derive(Clone, Copy)]
pub enum NamedOn<'a> {
    /// Ingress: the local pod's.
    Pod(&'a [NamedPort]),
    /// Egress to a pod peer: that peer identity's.
    Peer(&'a [NamedPort]),
    /// Egress to an address that is no pod's identity (an ipBlock's class, or every
    /// peer): a name resolves to nothing.
    Nothing,
}

/// The entries of `ports` (a rule's whole list; empty: every protocol and port),
/// named ports resolved on `named`. With `named_only`, only the named ports' entries
/// (an egress rule for every peer gets its numeric entries once, for
/// `POLICY_PEER_ANY`, and its named ones per peer identity).
pub fn entries(ports: &[PolicyPort], named: NamedOn, named_only: bool, out: &mut Vec<PortEntry>) {
    if ports.is_empty() {
        if !named_only {
            out.push(PortEntry::ANY);
        }
        return;
    }
    for spec in ports {
        let proto = spec.protocol.number();
        match (&spec.port, spec.end_port) {
            (Some(PortRef::Name(name)), _) => {
                let list = match named {
                    NamedOn::Pod(list) | NamedOn::Peer(list) => list,
                    NamedOn::Nothing => &[],
                };
                for port in resolve_named(list, name, spec.protocol) {
                    out.push(PortEntry {
                        proto,
                        port,
                        prefix_len: POLICY_PREFIX_FULL,
                    });
                }
            }
            _ if named_only => {}
            (None, _) => out.push(PortEntry {
                proto,
                port: 0,
                prefix_len: POLICY_PREFIX_ANY_PORT,
            }),
            (Some(PortRef::Number(port)), None) => out.push(PortEntry {
                proto,
                port: *port,
                prefix_len: POLICY_PREFIX_FULL,
            }),
            (Some(PortRef::Number(lo)), Some(hi)) => {
                for (port, bits) in split_range(*lo, hi.max(*lo)) {
                    out.push(PortEntry {
                        proto,
                        port,
                        prefix_len: POLICY_PREFIX_ANY_PORT + bits,
                    });
                }
            }
        }
    }
}

/// Whether `ports` names a port (only those depend on the peer in egress).
pub fn has_named(ports: &[PolicyPort]) -> bool {
    ports
        .iter()
        .any(|p| matches!(p.port, Some(PortRef::Name(_))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered(blocks: &[(u16, u32)]) -> Vec<u32> {
        let mut ports: Vec<u32> = blocks
            .iter()
            .flat_map(|&(base, bits)| {
                let size = 1u32 << (16 - bits);
                assert_eq!(u32::from(base) % size, 0, "aligned");
                u32::from(base)..u32::from(base) + size
            })
            .collect();
        ports.sort();
        ports
    }

    #[test]
    fn ranges_split_into_exact_aligned_blocks() {
        assert_eq!(split_range(80, 80), [(80, 16)]);
        assert_eq!(split_range(0, 65535), [(0, 0)]);
        assert_eq!(split_range(1024, 2047), [(1024, 6)]);
        assert_eq!(split_range(65535, 65535), [(65535, 16)]);
        for (lo, hi) in [
            (1000u16, 2000u16),
            (1, 65535),
            (3, 17),
            (32768, 65534),
            (5, 6),
        ] {
            let blocks = split_range(lo, hi);
            assert_eq!(
                covered(&blocks),
                (u32::from(lo)..=u32::from(hi)).collect::<Vec<_>>()
            );
            // At most two blocks per bit length: the fewest.
            assert!(blocks.len() <= 32, "{lo}-{hi}: {}", blocks.len());
        }
    }

    proptest::proptest! {
        #[test]
        fn any_range_is_covered_exactly(a: u16, b: u16) {
            let (lo, hi) = (a.min(b), a.max(b));
            let blocks = split_range(lo, hi);
            proptest::prop_assert_eq!(
                covered(&blocks),
                (u32::from(lo)..=u32::from(hi)).collect::<Vec<_>>()
            );
        }
    }
}
