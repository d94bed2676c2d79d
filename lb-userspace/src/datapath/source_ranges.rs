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

use crate::datapath::codec::service_key;
pub use crate::datapath::codec::SourceRange;
use crate::datapath::snapshot::MapSnapshot;
use crate::model::{Frontend, FrontendSpec};

/// The entries the restricted frontends need (`frontends`: the desired ones with
/// source ranges, or all of them), for those `table` holds a master of.
pub fn wanted<'a>(
    frontends: impl IntoIterator<Item = (&'a Frontend, &'a FrontendSpec)>,
    table: &MapSnapshot,
) -> BTreeSet<SourceRange> {
    frontends
        .into_iter()
        .filter_map(|(frontend, spec)| {
            let ranges = spec.source_ranges.as_ref()?;
            let master = table.services.get(&service_key(frontend, 0))?;
            Some(ranges.iter().map(move |net| (master.rev_nat_id, *net)))
        })
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DesiredState, Protocol};
    use ipnet::IpNet;
    use lb_common::ServiceValue;

    #[test]
    fn only_restricted_frontends_with_a_master_get_entries() {
        let lb = Frontend::internal("198.51.100.7".parse().unwrap(), 80, Protocol::Tcp);
        let open = Frontend::internal("198.51.100.8".parse().unwrap(), 80, Protocol::Tcp);
        let new = Frontend::internal("198.51.100.9".parse().unwrap(), 80, Protocol::Tcp);
        let ranges: BTreeSet<IpNet> = ["10.0.0.0/8".parse().unwrap()].into();
        let spec = |source_ranges: Option<BTreeSet<IpNet>>| FrontendSpec {
            service: "default/web".into(),
            backends: Default::default(),
            affinity_timeout_sec: None,
            source_ranges,
            maglev: false,
            cluster_ip: false,
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
            wanted(&desired.frontends, &table),
            [(3, "10.0.0.0/8".parse().unwrap())].into()
        );
    }
}
