//! `spec.loadBalancerSourceRanges`: which clients may open flows to a LoadBalancer
//! ingress IP (kube-proxy's KUBE-FW chains).

use aya_ebpf::btf_maps::lpm_trie::Key;
use lb_common::{IpAddrBe, ServiceValue, SourceRangeKey, SOURCE_RANGE_PREFIX_BASE};

use crate::maps::LB_SOURCE_RANGES;

/// Whether a new flow from `saddr` may use the frontend whose
/// internal master is `master`: always, unless the Service restricts its sources;
/// then only from inside one of its ranges.
#[inline(always)]
pub fn admits(master: &ServiceValue, saddr: IpAddrBe) -> bool {
    if !master.has_source_ranges() {
        return true;
    }
    let key = Key::new(
        SOURCE_RANGE_PREFIX_BASE + 128,
        SourceRangeKey {
            rev_nat_id: master.rev_nat_id,
            address: saddr,
        },
    );
    LB_SOURCE_RANGES.get(&key).is_some()
}
