//! Which backends left which frontends in one write, and which sockets that makes
//! stale: pure functions over the service table and `LB_SOCK_REVNAT`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;

use lb_common::{SockRevNatKey, SockRevNatValue, SCOPE_INTERNAL};

use crate::codec::{socket_addr, FrontendKey, MapOp, MapSnapshot};
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

/// A socket the hooks connected to a departed backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StaleSocket {
    pub protocol: Protocol,
    pub backend: SocketAddr,
}

/// The sockets `LB_SOCK_REVNAT` says the hooks sent to a departed backend through
/// the frontend it left, by socket cookie, with the entries to delete: those of UDP
/// sockets (a connected one is closed; an unconnected one picks among the remaining
/// backends on its next send), and of TCP sockets only when they are closed too
/// (`close_tcp`): an open connection still needs its entry for `getpeername`.
pub fn stale_sockets(
    entries: &[(SockRevNatKey, SockRevNatValue)],
    departed: &[Departed],
    close_tcp: bool,
) -> (HashMap<u64, StaleSocket>, Vec<SockRevNatKey>) {
    let wanted: HashMap<(u32, SocketAddr), Protocol> = departed
        .iter()
        .map(|d| ((d.rev_nat_id, d.backend), d.protocol))
        .collect();
    let mut sockets = HashMap::new();
    let mut forget = Vec::new();
    for (key, value) in entries {
        let backend = socket_addr(key.address, key.port);
        let Some(&protocol) = wanted.get(&(value.rev_nat_id, backend)) else {
            continue;
        };
        if protocol == Protocol::Tcp && !close_tcp {
            continue;
        }
        sockets.insert(key.cookie, StaleSocket { protocol, backend });
        forget.push(*key);
    }
    (sockets, forget)
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use lb_common::{Backend, IpAddrBe, ServiceValue};

    use super::*;
    use crate::codec::{master_value, service_key, slot_value, Be16};
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
                .collect(),
            affinity_timeout_sec: None,
            source_ranges: None,
        };
        let mut snapshot = MapSnapshot::default();
        snapshot.services.insert(
            service_key(&frontend, 0),
            master_value(&spec, backends.len() as u16, rev_nat_id, false),
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
        for (key, value) in &after.services {
            if before.services.get(key) != Some(value) {
                ops.push(MapOp::PutService {
                    key: *key,
                    value: *value,
                });
            }
        }
        for key in before.services.keys() {
            if !after.services.contains_key(key) {
                ops.push(MapOp::DeleteService { key: *key });
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
        let departed = [
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
        ];
        let entries = [
            revnat(1, pod(2), 7),  // UDP through the frontend pod 2 left: stale
            revnat(2, pod(1), 7),  // another backend of it: kept
            revnat(3, pod(2), 10), // pod 2 through another frontend it still serves
            revnat(4, pod(2), 8),  // TCP: only with close_tcp
            revnat(5, v6, 9),      // IPv6 backends alike
        ];
        let (sockets, forget) = stale_sockets(&entries, &departed, false);
        let mut cookies: Vec<u64> = sockets.keys().copied().collect();
        cookies.sort_unstable();
        assert_eq!(cookies, [1, 5]);
        assert_eq!(
            sockets[&1],
            StaleSocket {
                protocol: Protocol::Udp,
                backend: pod(2),
            }
        );
        assert_eq!(forget, [entries[0].0, entries[4].0]);

        let (sockets, forget) = stale_sockets(&entries, &departed, true);
        assert_eq!(sockets[&4].protocol, Protocol::Tcp);
        assert_eq!(sockets.len(), 3);
        assert_eq!(forget.len(), 3);
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
