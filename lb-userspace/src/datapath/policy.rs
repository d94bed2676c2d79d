//! NetworkPolicy's pinned maps (`lb_common::policy`): the four the agent writes
//! (local pods' endpoints, every pod's identity, the CIDR classes, the allows)
//! and the per-pod drop counters it reads. What goes in them is the compiler's
//! (`control::policy`); this is only the writing and reading, one entry at a
//! time, so a change touches exactly the entries it names.

use std::collections::BTreeSet;
use std::path::PathBuf;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray};
use lb_common::policy::{PolicyLookup, POLICY_CIDR_PREFIX_FULL, POLICY_PREFIX_FULL};
use lb_common::{
    map_names, IpAddrBe, PolicyAllow, PolicyCidrKey, PolicyCounters, PolicyEndpoint, PolicyKey,
};

use crate::datapath::maps::{found, ignore_missing, MapsError};
use crate::datapath::pins::PinLayout;

/// The pinned policy maps.
pub struct PolicyMaps {
    endpoints: HashMap<MapData, IpAddrBe, PolicyEndpoint>,
    identities: HashMap<MapData, IpAddrBe, u32>,
    cidrs: LpmTrie<MapData, PolicyCidrKey, u32>,
    allows: LpmTrie<MapData, PolicyKey, PolicyAllow>,
    drops: PerCpuArray<MapData, PolicyCounters>,
}

/// One pinned map, of the kind `T` wraps.
fn open<T: TryFrom<Map, Error = MapError>>(
    layout: &PinLayout,
    name: &'static str,
) -> Result<T, MapsError> {
    let path: PathBuf = layout.map_path(name);
    let wrap = |source| MapsError::Open {
        path: path.clone(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(wrap)?;
    let map = Map::from_map_data(data).map_err(wrap)?;
    T::try_from(map).map_err(wrap)
}

fn write_error(map: &'static str, op: String) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Write { map, op, source }
}

impl PolicyMaps {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        Ok(Self {
            endpoints: open(layout, map_names::POLICY_ENDPOINTS)?,
            identities: open(layout, map_names::POLICY_IDENTITY)?,
            cidrs: open(layout, map_names::POLICY_CIDRS)?,
            allows: open(layout, map_names::POLICY)?,
            drops: open(layout, map_names::POLICY_DROPS)?,
        })
    }

    pub fn put_endpoint(&mut self, addr: IpAddrBe, value: PolicyEndpoint) -> Result<(), MapsError> {
        self.endpoints.insert(addr, value, 0).map_err(write_error(
            map_names::POLICY_ENDPOINTS,
            format!("write the endpoint of {}", std::net::IpAddr::from(addr)),
        ))
    }

    pub fn delete_endpoint(&mut self, addr: IpAddrBe) -> Result<(), MapsError> {
        ignore_missing(self.endpoints.remove(&addr)).map_err(write_error(
            map_names::POLICY_ENDPOINTS,
            format!("delete the endpoint of {}", std::net::IpAddr::from(addr)),
        ))
    }

    pub fn put_identity(&mut self, addr: IpAddrBe, identity: u32) -> Result<(), MapsError> {
        self.identities
            .insert(addr, identity, 0)
            .map_err(write_error(
                map_names::POLICY_IDENTITY,
                format!(
                    "write identity {identity} of {}",
                    std::net::IpAddr::from(addr)
                ),
            ))
    }

    pub fn delete_identity(&mut self, addr: IpAddrBe) -> Result<(), MapsError> {
        ignore_missing(self.identities.remove(&addr)).map_err(write_error(
            map_names::POLICY_IDENTITY,
            format!("delete the identity of {}", std::net::IpAddr::from(addr)),
        ))
    }

    pub fn put_cidr(
        &mut self,
        prefix_len: u32,
        key: PolicyCidrKey,
        class: u32,
    ) -> Result<(), MapsError> {
        self.cidrs
            .insert(&Key::new(prefix_len, key), class, 0)
            .map_err(write_error(
                map_names::POLICY_CIDRS,
                format!("write CIDR class {class:#x}"),
            ))
    }

    pub fn delete_cidr(&mut self, prefix_len: u32, key: PolicyCidrKey) -> Result<(), MapsError> {
        ignore_missing(self.cidrs.remove(&Key::new(prefix_len, key))).map_err(write_error(
            map_names::POLICY_CIDRS,
            "delete a CIDR class range".to_owned(),
        ))
    }

    pub fn put_allow(
        &mut self,
        prefix_len: u32,
        key: PolicyKey,
        allow: PolicyAllow,
    ) -> Result<(), MapsError> {
        self.allows
            .insert(&Key::new(prefix_len, key), allow, 0)
            .map_err(write_error(
                map_names::POLICY,
                format!(
                    "write an allow of endpoint {} (rule {}); a full map needs a larger \
                     --policy-map-size",
                    key.endpoint, allow.rule
                ),
            ))
    }

    pub fn delete_allow(&mut self, prefix_len: u32, key: PolicyKey) -> Result<(), MapsError> {
        ignore_missing(self.allows.remove(&Key::new(prefix_len, key))).map_err(write_error(
            map_names::POLICY,
            format!("delete an allow of endpoint {}", key.endpoint),
        ))
    }

    /// The drops of endpoint `id`, summed over CPUs; `None` past the array.
    pub fn drops(&self, id: u32) -> Result<Option<PolicyCounters>, MapsError> {
        let per_cpu = found(self.drops.get(&id, 0), map_names::POLICY_DROPS)?;
        Ok(per_cpu.map(|values| {
            values
                .iter()
                .fold(PolicyCounters::default(), |sum, c| PolicyCounters {
                    ingress_drops: sum.ingress_drops + c.ingress_drops,
                    egress_drops: sum.egress_drops + c.egress_drops,
                })
        }))
    }

    /// The endpoint entry of `addr`, as the programs read it.
    pub fn endpoint(&self, addr: IpAddrBe) -> Result<Option<PolicyEndpoint>, MapsError> {
        found(self.endpoints.get(&addr, 0), map_names::POLICY_ENDPOINTS)
    }

    /// Every endpoint entry (for the consistency check and `lb policy`).
    pub fn endpoints(&self) -> Result<Vec<(IpAddrBe, PolicyEndpoint)>, MapsError> {
        self.endpoints
            .iter()
            .collect::<Result<_, _>>()
            .map_err(|source| MapsError::Read {
                map: map_names::POLICY_ENDPOINTS,
                source,
            })
    }
}

/// What the policy maps should hold, by key only: every entry outside it is
/// stale (see [`PolicyMaps::remove_others`]). LPM keys as (prefix length, data).
#[derive(Default)]
pub struct PolicyKeys {
    pub endpoints: BTreeSet<IpAddrBe>,
    pub identities: BTreeSet<IpAddrBe>,
    pub cidrs: BTreeSet<(u32, PolicyCidrKey)>,
    pub allows: BTreeSet<(u32, PolicyKey)>,
}

impl PolicyMaps {
    /// Removes every entry whose key `keep` lacks, in the order that never opens
    /// a flow on the way: endpoints first (a pod no longer enforced would be open
    /// anyway), then allows, CIDR classes and identities. After a failed write the
    /// maps may hold entries of a state that was never fully written (a removal
    /// that did not happen would otherwise leave an allow behind for good). How
    /// many were removed.
    pub fn remove_others(&mut self, keep: &PolicyKeys) -> Result<usize, MapsError> {
        let read = |map: &'static str| move |source| MapsError::Read { map, source };
        let endpoints: Vec<IpAddrBe> = self
            .endpoints
            .keys()
            .collect::<Result<_, _>>()
            .map_err(read(map_names::POLICY_ENDPOINTS))?;
        let allows: Vec<Key<PolicyKey>> = self
            .allows
            .keys()
            .collect::<Result<_, _>>()
            .map_err(read(map_names::POLICY))?;
        let cidrs: Vec<Key<PolicyCidrKey>> = self
            .cidrs
            .keys()
            .collect::<Result<_, _>>()
            .map_err(read(map_names::POLICY_CIDRS))?;
        let identities: Vec<IpAddrBe> = self
            .identities
            .keys()
            .collect::<Result<_, _>>()
            .map_err(read(map_names::POLICY_IDENTITY))?;
        let mut removed = 0;
        for addr in endpoints
            .into_iter()
            .filter(|a| !keep.endpoints.contains(a))
        {
            self.delete_endpoint(addr)?;
            removed += 1;
        }
        for key in allows {
            if !keep.allows.contains(&(key.prefix_len(), key.data())) {
                self.delete_allow(key.prefix_len(), key.data())?;
                removed += 1;
            }
        }
        for key in cidrs {
            if !keep.cidrs.contains(&(key.prefix_len(), key.data())) {
                self.delete_cidr(key.prefix_len(), key.data())?;
                removed += 1;
            }
        }
        for addr in identities
            .into_iter()
            .filter(|a| !keep.identities.contains(a))
        {
            self.delete_identity(addr)?;
            removed += 1;
        }
        Ok(removed)
    }
}

/// The kernel programs' rule (`lb_common::policy::verdict`) run over the pinned
/// maps, for `lb policy POD --from/--to`: the verdict the datapath gives a new
/// flow now. A map that cannot be read counts as holding nothing (these are
/// lookups of maps `open` just opened).
impl PolicyLookup for PolicyMaps {
    fn endpoint(&self, addr: &IpAddrBe) -> Option<PolicyEndpoint> {
        self.endpoints.get(addr, 0).ok()
    }

    fn identity(&self, addr: &IpAddrBe) -> Option<u32> {
        self.identities.get(addr, 0).ok()
    }

    fn cidr_class(&self, addr: &IpAddrBe) -> Option<u32> {
        let key = Key::new(POLICY_CIDR_PREFIX_FULL, PolicyCidrKey { address: *addr });
        self.cidrs.get(&key, 0).ok()
    }

    fn allow(&self, key: &PolicyKey) -> Option<PolicyAllow> {
        self.allows.get(&Key::new(POLICY_PREFIX_FULL, *key), 0).ok()
    }
}

/// One local pod address as the policy maps hold it, for `lb policy`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointRow {
    pub address: std::net::IpAddr,
    /// The pod's endpoint id (the index of its drop counters).
    pub endpoint: u32,
    pub ingress_enforced: bool,
    pub egress_enforced: bool,
    pub ingress_drops: u64,
    pub egress_drops: u64,
}

impl PolicyMaps {
    /// Every local pod address the maps hold (enforced in either direction, or
    /// open), with its drops, sorted by address.
    pub fn rows(&self) -> Result<Vec<EndpointRow>, MapsError> {
        let mut rows = Vec::new();
        for (addr, endpoint) in self.endpoints()? {
            let drops = self.drops(endpoint.id)?.unwrap_or_default();
            rows.push(EndpointRow {
                address: addr.into(),
                endpoint: endpoint.id,
                ingress_enforced: endpoint.enforces_ingress(),
                egress_enforced: endpoint.enforces_egress(),
                ingress_drops: drops.ingress_drops,
                egress_drops: drops.egress_drops,
            });
        }
        rows.sort_by_key(|r| r.address);
        Ok(rows)
    }
}

/// `lb policy`'s table.
pub fn render_text(rows: &[EndpointRow]) -> String {
    if rows.is_empty() {
        return "no local pod known to NetworkPolicy (is --network-policy on?)\n".to_owned();
    }
    let mut out = format!(
        "{:<40} {:>8} {:<15} {:>13} {:>12}\n",
        "POD ADDRESS", "ENDPOINT", "ENFORCED", "INGRESS DROPS", "EGRESS DROPS"
    );
    for r in rows {
        let enforced = match (r.ingress_enforced, r.egress_enforced) {
            (true, true) => "ingress,egress",
            (true, false) => "ingress",
            (false, true) => "egress",
            (false, false) => "-",
        };
        out += &format!(
            "{:<40} {:>8} {:<15} {:>13} {:>12}\n",
            r.address.to_string(),
            r.endpoint,
            enforced,
            r.ingress_drops,
            r.egress_drops
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_pod_its_directions_and_drops() {
        let rows = [EndpointRow {
            address: "10.244.1.11".parse().unwrap(),
            endpoint: 3,
            ingress_enforced: true,
            egress_enforced: false,
            ingress_drops: 7,
            egress_drops: 0,
        }];
        let text = render_text(&rows);
        let line = text.lines().nth(1).unwrap();
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields, ["10.244.1.11", "3", "ingress", "7", "0"]);
        assert!(render_text(&[]).contains("no local pod"));
    }
}
