//! `LB_SOURCE_RANGES`: the `loadBalancerSourceRanges` of each restricted frontend,
//! keyed by the id its master has in the maps.
//!
//! The trie is kept apart from the reconciler's plan because its keys are frontend
//! ids, which the plan hands out. The agent syncs it twice per change: before the
//! plan runs, adding the ranges of frontends whose id is already known (so a master
//! that gains `SVC_FLAG_SOURCE_RANGES` finds its ranges there), and after it, adding
//! those of new frontends and removing what no flagged master needs any more. A new
//! frontend therefore admits nobody for the moment between the two, never everybody.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use lb_common::{SourceRangeKey, SOURCE_RANGE_PREFIX_BASE};

use crate::model::DesiredState;
use crate::reconcile::{service_key, MapSnapshot};

/// One trie entry: a frontend id and one of its ranges.
pub type SourceRange = (u32, Ipv4Net);

/// The entries `desired` needs, for the frontends `table` holds a master of.
pub fn wanted(desired: &DesiredState, table: &MapSnapshot) -> BTreeSet<SourceRange> {
    desired
        .frontends
        .iter()
        .filter_map(|(frontend, spec)| {
            let ranges = spec.source_ranges.as_ref()?;
            let master = table.services.get(&service_key(frontend, 0))?;
            Some(ranges.iter().map(move |net| (master.rev_nat_id, *net)))
        })
        .flatten()
        .collect()
}

/// The trie key of an entry (see [`lb_common::SourceRangeKey`]).
pub fn key(entry: &SourceRange) -> (u32, SourceRangeKey) {
    let (rev_nat_id, net) = entry;
    (
        SOURCE_RANGE_PREFIX_BASE + u32::from(net.prefix_len()),
        SourceRangeKey {
            rev_nat_id: *rev_nat_id,
            address: u32::from_ne_bytes(net.network().octets()),
        },
    )
}

/// The entry a trie key stands for; `None` for a key no agent writes.
pub fn entry(prefix_len: u32, key: &SourceRangeKey) -> Option<SourceRange> {
    let bits = prefix_len.checked_sub(SOURCE_RANGE_PREFIX_BASE)?;
    let net = Ipv4Net::new(
        Ipv4Addr::from(key.address.to_ne_bytes()),
        u8::try_from(bits).ok()?,
    )
    .ok()?;
    Some((key.rev_nat_id, net))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frontend, FrontendSpec, Protocol};
    use lb_common::ServiceValue;

    #[test]
    fn keys_round_trip_and_carry_the_prefix_after_the_id() {
        let e: SourceRange = (7, "203.0.113.0/24".parse().unwrap());
        let (prefix_len, k) = key(&e);
        assert_eq!(prefix_len, 32 + 24);
        // Network byte order: the first octet is the first byte the trie matches.
        assert_eq!(k.address.to_ne_bytes(), [203, 0, 113, 0]);
        assert_eq!(entry(prefix_len, &k), Some(e));
        assert_eq!(entry(16, &k), None);
    }

    #[test]
    fn only_restricted_frontends_with_a_master_get_entries() {
        let lb = Frontend::internal("198.51.100.7".parse().unwrap(), 80, Protocol::Tcp);
        let open = Frontend::internal("198.51.100.8".parse().unwrap(), 80, Protocol::Tcp);
        let new = Frontend::internal("198.51.100.9".parse().unwrap(), 80, Protocol::Tcp);
        let ranges: BTreeSet<Ipv4Net> = ["10.0.0.0/8".parse().unwrap()].into();
        let spec = |source_ranges: Option<BTreeSet<Ipv4Net>>| FrontendSpec {
            service: "default/web".into(),
            backends: BTreeSet::new(),
            affinity_timeout_sec: None,
            source_ranges,
        };
        let mut desired = DesiredState::default();
        desired.frontends.insert(lb, spec(Some(ranges.clone())));
        desired.frontends.insert(open, spec(None));
        desired.frontends.insert(new, spec(Some(ranges)));
        let mut table = MapSnapshot::default();
        for (f, id) in [(lb, 3), (open, 4)] {
            table.services.insert(
                service_key(&f, 0),
                ServiceValue {
                    rev_nat_id: id,
                    ..ServiceValue::default()
                },
            );
        }
        assert_eq!(
            wanted(&desired, &table),
            [(3, "10.0.0.0/8".parse().unwrap())].into()
        );
    }
}
