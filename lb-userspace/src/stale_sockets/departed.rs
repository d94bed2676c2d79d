//! Which backends left which frontends in one write, and which sockets that makes
//! stale: pure functions over the service table and `LB_SOCK_REVNAT` entries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;

use lb_common::{SockRevNatKey, SockRevNatValue, SCOPE_INTERNAL};

use crate::datapath::codec::{socket_addr, FrontendKey};
use crate::datapath::snapshot::{MapOp, MapSnapshot};
use crate::model::Protocol;

/// A backend that left a frontend of the socket hooks: sockets the hooks connected
/// to it through that frontend now talk to an endpoint the Service no longer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Departed {
    /// The frontend's id, as `LB_SOCK_REVNAT` values record it.
    pub rev_nat_id: u32,
    pub protocol: Protocol,
    pub backend: SocketAddr,
}

/// The backends of the frontends a plan is about to take backends from, as the
/// table has them before the plan.
#[derive(Debug, Default)]
pub struct Touched(BTreeMap<FrontendKey, (u32, BTreeSet<SocketAddr>)>);

impl Touched {
    /// Reads `before` (the table `ops` apply to). Only internal frontends matter
    /// (the socket hooks look nothing else up), and only those losing a slot that
    /// exists: a backend leaves by its slot being deleted or overwritten, so a plan
    /// of fresh entries (a cold start) costs one lookup per op.
    pub fn before(before: &MapSnapshot, ops: &[MapOp]) -> Self {
        let keys: BTreeSet<FrontendKey> = ops
            .iter()
            .filter_map(|op| match op {
                MapOp::PutService { key, .. } | MapOp::DeleteService { key } => Some(key),
                _ => None,
            })
            .filter(|key| {
                key.backend_slot != 0
                    && key.scope == SCOPE_INTERNAL
                    && before.services.contains_key(key)
            })
            .map(FrontendKey::of_key)
            .collect();
        Touched(
            keys.into_iter()
                .filter_map(|key| Some((key, backends_of(before, key)?)))
                .collect(),
        )
    }

    /// Each backend a touched frontend had and no longer has in `after`.
    pub fn departed(self, after: &MapSnapshot) -> Vec<Departed> {
        let mut departed = Vec::new();
        for (key, (rev_nat_id, before)) in self.0 {
            let Some(protocol) = Protocol::from_number(key.proto) else {
                continue;
            };
            let now = backends_of(after, key)
                .map(|(_, backends)| backends)
                .unwrap_or_default();
            departed.extend(before.difference(&now).map(|&backend| Departed {
                rev_nat_id,
                protocol,
                backend,
            }));
        }
        departed
    }
}

/// A frontend's id and the backends its master counts (those the hooks choose from).
fn backends_of(table: &MapSnapshot, key: FrontendKey) -> Option<(u32, BTreeSet<SocketAddr>)> {
    let master = table.services.get(&key.slot(0))?;
    let backends = (1..=master.count)
        .filter_map(|slot| {
            let value = table.services.get(&key.slot(slot))?;
            let backend = table.backends.get(&value.backend_id)?;
            Some(socket_addr(backend.address, backend.port))
        })
        .collect();
    Some((master.rev_nat_id, backends))
}

/// Departed backends, looked up by the backend a socket was sent to and the
/// frontend it asked for (what `LB_SOCK_REVNAT` records).
#[derive(Debug, Default)]
pub struct Departures(HashMap<(u32, SocketAddr), Protocol>);

impl Departures {
    pub fn new(departed: &[Departed]) -> Self {
        Departures(
            departed
                .iter()
                .map(|d| ((d.rev_nat_id, d.backend), d.protocol))
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The protocols whose sockets are to be closed: UDP, and TCP with `close_tcp`.
    pub fn protocols(&self, close_tcp: bool) -> BTreeSet<Protocol> {
        self.0
            .values()
            .copied()
            .filter(|p| *p == Protocol::Udp || close_tcp)
            .collect()
    }

    /// Whether any departed backend is `backend` (a cheap filter before lookups).
    pub fn has_backend(&self, backend: SocketAddr) -> bool {
        self.0.keys().any(|(_, b)| *b == backend)
    }

    /// Whether a socket of `protocol` the hooks sent to `backend` through frontend
    /// `rev_nat_id` is stale: that backend left that frontend. TCP counts only with
    /// `close_tcp`: an open connection still needs its entry for `getpeername`.
    pub fn is_stale(
        &self,
        rev_nat_id: u32,
        backend: SocketAddr,
        protocol: Protocol,
        close_tcp: bool,
    ) -> bool {
        self.0
            .get(&(rev_nat_id, backend))
            .is_some_and(|p| *p == protocol && (protocol == Protocol::Udp || close_tcp))
    }

    /// Merges more departures in (a later pass takes both).
    pub fn extend(&mut self, departed: &[Departed]) {
        self.0.extend(
            departed
                .iter()
                .map(|d| ((d.rev_nat_id, d.backend), d.protocol)),
        );
    }
}

/// The `LB_SOCK_REVNAT` entries left stale by `departures`, to delete: those of UDP
/// sockets (a connected one is closed; an unconnected one picks among the remaining
/// backends on its next send), and of TCP sockets only when they are closed too.
pub fn stale_entries(
    entries: &[(SockRevNatKey, SockRevNatValue)],
    departures: &Departures,
    close_tcp: bool,
) -> Vec<SockRevNatKey> {
    entries
        .iter()
        .filter(|(key, value)| {
            let backend = socket_addr(key.address, key.port);
            [Protocol::Udp, Protocol::Tcp]
                .into_iter()
                .any(|p| departures.is_stale(value.rev_nat_id, backend, p, close_tcp))
        })
        .map(|(key, _)| *key)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use lb_common::{Backend, IpAddrBe, ServiceValue};

    use super::*;
    use crate::datapath::codec::{master_value, service_key, slot_value, Be16};
    use crate::model::{BackendAddr, Frontend, FrontendSpec, Scope};

    const VIP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10));

    fn pod(last: u8) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 244, 0, last)), 5353)
    }

    /// A table with one frontend of `protocol`/`scope` whose slots name `backends`
    /// (ids 100 + slot).
    fn table(
        protocol: Protocol,
        scope: Scope,
        rev_nat_id: u32,
        backends: &[SocketAddr],
    ) -> MapSnapshot {
        let frontend = Frontend::internal(VIP, 53, protocol).with_scope(scope);
        let spec = FrontendSpec {
            service: "default/dns:dns".into(),
            backends: backends
                .iter()
                .map(|b| BackendAddr {
                    ip: b.ip(),
                    port: b.port(),
                    local: false,
                })
                .collect::<std::collections::BTreeSet<_>>()
                .into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev: false,
            cluster_ip: false,
        };
        let mut snapshot = MapSnapshot::default();
        snapshot.services.insert(
            service_key(&frontend, 0),
            master_value(&spec, backends.len() as u16, rev_nat_id, false, None),
        );
        for (slot, backend) in (1u16..).zip(backends) {
            let id = 100 + u32::from(slot);
            snapshot
                .services
                .insert(service_key(&frontend, slot), slot_value(id, rev_nat_id));
            snapshot.backends.insert(
                id,
                Backend {
                    address: backend.ip().into(),
                    port: Be16::from_host(backend.port()).to_map(),
                    ..Default::default()
                },
            );
        }
        snapshot
    }

    /// The ops that turn `before` into `after` (puts of what changed, deletes of
    /// what went), as any plan would write them.
    fn ops(before: &MapSnapshot, after: &MapSnapshot) -> Vec<MapOp> {
        let mut ops = Vec::new();
        for (key, value) in after.services.iter() {
            if before.services.get(&key) != Some(value) {
                ops.push(MapOp::PutService { key, value: *value });
            }
        }
        for key in before.services.keys() {
            if !after.services.contains_key(&key) {
                ops.push(MapOp::DeleteService { key });
            }
        }
        ops
    }

    fn departed_between(before: &MapSnapshot, after: &MapSnapshot) -> Vec<Departed> {
        Touched::before(before, &ops(before, after)).departed(after)
    }

    #[test]
    fn a_removed_backend_departs_and_the_kept_ones_do_not() {
        let before = table(Protocol::Udp, Scope::Internal, 7, &[pod(1), pod(2), pod(3)]);
        // Slot 2 now names pod 3 (a new id in a real plan; the address is what counts).
        let after = table(Protocol::Udp, Scope::Internal, 7, &[pod(1), pod(3)]);
        assert_eq!(
            departed_between(&before, &after),
            [Departed {
                rev_nat_id: 7,
                protocol: Protocol::Udp,
                backend: pod(2),
            }]
        );
    }

    #[test]
    fn a_removed_frontend_takes_all_its_backends() {
        let before = table(Protocol::Tcp, Scope::Internal, 9, &[pod(1), pod(2)]);
        let departed = departed_between(&before, &MapSnapshot::default());
        let backends: Vec<SocketAddr> = departed.iter().map(|d| d.backend).collect();
        assert_eq!(backends, [pod(1), pod(2)]);
        assert!(departed
            .iter()
            .all(|d| d.rev_nat_id == 9 && d.protocol == Protocol::Tcp));
    }

    #[test]
    fn additions_external_entries_and_fresh_tables_depart_nothing() {
        let one = table(Protocol::Udp, Scope::Internal, 7, &[pod(1)]);
        let two = table(Protocol::Udp, Scope::Internal, 7, &[pod(1), pod(2)]);
        assert!(departed_between(&one, &two).is_empty());
        assert!(departed_between(&MapSnapshot::default(), &two).is_empty());
        // The per-packet path's external entries are not the socket hooks' business.
        let external = table(Protocol::Udp, Scope::External, 8, &[pod(1), pod(2)]);
        assert!(departed_between(&external, &MapSnapshot::default()).is_empty());
    }

    fn revnat(
        cookie: u64,
        backend: SocketAddr,
        rev_nat_id: u32,
    ) -> (SockRevNatKey, SockRevNatValue) {
        let key = SockRevNatKey {
            cookie,
            address: IpAddrBe::from(backend.ip()),
            port: Be16::from_host(backend.port()).to_map(),
            ..Default::default()
        };
        let value = SockRevNatValue {
            address: VIP.into(),
            port: Be16::from_host(53).to_map(),
            rev_nat_id,
            ..Default::default()
        };
        (key, value)
    }

    #[test]
    fn stale_sockets_are_those_sent_to_the_backend_through_the_frontend_it_left() {
        let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)), 53);
        let departures = Departures::new(&[
            Departed {
                rev_nat_id: 7,
                protocol: Protocol::Udp,
                backend: pod(2),
            },
            Departed {
                rev_nat_id: 8,
                protocol: Protocol::Tcp,
                backend: pod(2),
            },
            Departed {
                rev_nat_id: 9,
                protocol: Protocol::Udp,
                backend: v6,
            },
        ]);
        let entries = [
            revnat(1, pod(2), 7),  // UDP through the frontend pod 2 left: stale
            revnat(2, pod(1), 7),  // another backend of it: kept
            revnat(3, pod(2), 10), // pod 2 through another frontend it still serves
            revnat(4, pod(2), 8),  // TCP: only with close_tcp
            revnat(5, v6, 9),      // IPv6 backends alike
        ];
        assert_eq!(
            stale_entries(&entries, &departures, false),
            [entries[0].0, entries[4].0]
        );
        assert_eq!(
            stale_entries(&entries, &departures, true),
            [entries[0].0, entries[3].0, entries[4].0]
        );
        assert!(departures.is_stale(7, pod(2), Protocol::Udp, false));
        assert!(!departures.is_stale(7, pod(2), Protocol::Tcp, true));
        assert!(!departures.is_stale(8, pod(2), Protocol::Tcp, false));
        assert!(departures.is_stale(8, pod(2), Protocol::Tcp, true));
        assert!(departures.has_backend(v6) && !departures.has_backend(pod(1)));
        assert_eq!(departures.protocols(false), [Protocol::Udp].into());
        assert_eq!(
            departures.protocols(true),
            [Protocol::Tcp, Protocol::Udp].into()
        );
    }

    #[test]
    fn slots_are_read_only_up_to_the_master_count() {
        let mut before = table(Protocol::Udp, Scope::Internal, 7, &[pod(1), pod(2)]);
        // A slot past the count is not chosen by the hooks: its backend is not one.
        let frontend = Frontend::internal(VIP, 53, Protocol::Udp);
        let master: ServiceValue = before.services[&service_key(&frontend, 0)];
        before.services.insert(
            service_key(&frontend, 0),
            ServiceValue { count: 1, ..master },
        );
        let after = table(Protocol::Udp, Scope::Internal, 7, &[pod(1)]);
        assert!(departed_between(&before, &after).is_empty());
    }
}
