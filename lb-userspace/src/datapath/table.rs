//! What the kernel maps hold, read back into frontends for `lb services`, the metric
//! labels and for checking the reconciler. Tolerates any map contents: a table dumped in the middle of an
//! update, or left by a crashed agent, is shown with its problems rather than refused.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

use lb_common::ServiceValue;
use serde::Serialize;

use crate::datapath::codec::{affinity_timeout, backend_addr, frontend_of};
use crate::datapath::snapshot::{MapOp, MapSnapshot};
use crate::model::{Algorithm, Frontend};

/// One frontend as programmed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProgrammedFrontend {
    pub frontend: Frontend,
    /// 0 when the master entry is missing.
    pub rev_nat_id: u32,
    pub affinity_timeout_sec: Option<u32>,
    /// How the per-packet path picks a backend for a new flow (the socket hooks
    /// always pick at random).
    pub algorithm: Algorithm,
    /// The Maglev table, when `algorithm` is Maglev.
    pub maglev: Option<MaglevTableRef>,
    /// The backends the master counts, in slot order, as far as they are present.
    pub backends: Vec<ProgrammedBackend>,
    /// Inconsistencies, in words; empty for a well-formed frontend.
    pub problems: Vec<String>,
}

/// Where a Maglev master's table lies in `LB_MAGLEV`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MaglevTableRef {
    /// Its first slot in the arena.
    pub first_slot: u32,
    /// Its size in slots (a prime).
    pub size: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ProgrammedBackend {
    pub slot: u16,
    pub id: u32,
    pub ip: IpAddr,
    pub port: u16,
    /// The endpoint runs on this node.
    pub local: bool,
    /// Its passive-health record for this frontend (`LB_QUARANTINE`), once it
    /// refused a connection; filled by [`with_quarantine`], `None` before.
    pub quarantine: Option<BackendQuarantine>,
}

/// A backend's `LB_QUARANTINE` entry, as `lb services` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BackendQuarantine {
    /// New connections of the frontend skip it now.
    pub active: bool,
    /// How much longer they will (0 when not active).
    pub remaining_ms: u64,
    /// Until when, on the kernel's monotonic clock (`CLOCK_MONOTONIC`, ns).
    pub until_monotonic_ns: u64,
    /// Refusals since its last success (the backoff level).
    pub strikes: u32,
    /// Quarantines since the entry was made.
    pub quarantines: u64,
    /// New connections that skipped it.
    pub skips: u64,
    /// Who saw its last refusal: `socket` (a connect through the hooks) or
    /// `packet` (a RST on the per-packet path).
    pub seen_by: &'static str,
}

impl BackendQuarantine {
    /// The record of `value` at monotonic time `now_ns`.
    pub fn at(value: &lb_common::QuarantineValue, now_ns: u64) -> Self {
        let active = value.is_active(now_ns);
        BackendQuarantine {
            active,
            remaining_ms: value.until_ns.saturating_sub(now_ns) / 1_000_000,
            until_monotonic_ns: value.until_ns,
            strikes: value.strikes,
            quarantines: value.quarantines,
            skips: value.skips,
            seen_by: if value.is_by_socket() {
                "socket"
            } else {
                "packet"
            },
        }
    }
}

/// Fills each backend's [`ProgrammedBackend::quarantine`] from `LB_QUARANTINE`'s
/// `entries`, read at monotonic time `now_ns`.
pub fn with_quarantine(
    frontends: &mut [ProgrammedFrontend],
    entries: &[(lb_common::QuarantineKey, lb_common::QuarantineValue)],
    now_ns: u64,
) {
    let by_key: BTreeMap<(u32, u32), &lb_common::QuarantineValue> = entries
        .iter()
        .map(|(k, v)| ((k.rev_nat_id, k.backend_id), v))
        .collect();
    for frontend in frontends {
        for backend in &mut frontend.backends {
            backend.quarantine = by_key
                .get(&(frontend.rev_nat_id, backend.id))
                .map(|v| BackendQuarantine::at(v, now_ns));
        }
    }
}

type Group = (Option<ServiceValue>, BTreeMap<u16, ServiceValue>);

/// Frontend ids and the frontends they name, from the master entries alone: what
/// the metrics label counters with, without decoding every backend. Kept as
/// frontends and spelled out when a scrape labels a counter: as strings they were
/// 10.6 MB at 100k Services.
pub fn frontend_names(snapshot: &MapSnapshot) -> BTreeMap<u32, Frontend> {
    snapshot
        .services
        .groups()
        .filter_map(|(key, group)| Some((group.master?.rev_nat_id, frontend_of(key)?)))
        .collect()
}

/// How [`frontend_names`] changes when `ops` are applied to `before`: the id of
/// each master written gets its frontend's name, the id of each master deleted or
/// renumbered is gone. Costs the ops, not the table.
pub fn frontend_names_patch(before: &MapSnapshot, ops: &[MapOp]) -> Vec<(u32, Option<Frontend>)> {
    let mut patch = Vec::new();
    for op in ops {
        match op {
            MapOp::PutService { key, value } if key.backend_slot == 0 => {
                if let Some(old) = before.services.get(key) {
                    if old.rev_nat_id != value.rev_nat_id {
                        patch.push((old.rev_nat_id, None));
                    }
                }
                if let Some(frontend) = frontend_of(key) {
                    patch.push((value.rev_nat_id, Some(frontend)));
                }
            }
            MapOp::DeleteService { key } if key.backend_slot == 0 => {
                if let Some(old) = before.services.get(key) {
                    patch.push((old.rev_nat_id, None));
                }
            }
            _ => {}
        }
    }
    patch
}

/// Group the service entries by frontend and check each against the backends map.
pub fn decode(snapshot: &MapSnapshot) -> Vec<ProgrammedFrontend> {
    let mut groups: BTreeMap<Frontend, Group> = BTreeMap::new();
    for (key, value) in snapshot.services.iter() {
        let Some(frontend) = frontend_of(&key) else {
            continue;
        };
        let group = groups.entry(frontend).or_default();
        if key.backend_slot == 0 {
            group.0 = Some(*value);
        } else {
            group.1.insert(key.backend_slot, *value);
        }
    }
    groups
        .into_iter()
        .map(|(frontend, (master, slots))| decode_one(snapshot, frontend, master, &slots))
        .collect()
}

fn decode_one(
    snapshot: &MapSnapshot,
    frontend: Frontend,
    master: Option<ServiceValue>,
    slots: &BTreeMap<u16, ServiceValue>,
) -> ProgrammedFrontend {
    let mut problems = Vec::new();
    let Some(master) = master else {
        problems.push(format!(
            "no master entry (slot 0); {} slot(s) left without one",
            slots.len()
        ));
        return ProgrammedFrontend {
            frontend,
            rev_nat_id: 0,
            affinity_timeout_sec: None,
            algorithm: Algorithm::Random,
            maglev: None,
            backends: Vec::new(),
            problems,
        };
    };
    let mut backends = Vec::new();
    for slot in 1..=master.count {
        let Some(value) = slots.get(&slot) else {
            problems.push(format!("slot {slot} of {} is missing", master.count));
            continue;
        };
        if value.rev_nat_id != master.rev_nat_id {
            problems.push(format!(
                "slot {slot} has frontend id {}, the master {}",
                value.rev_nat_id, master.rev_nat_id
            ));
        }
        let id = value.backend_id;
        let Some(backend) = snapshot.backends.get(&id) else {
            problems.push(format!(
                "slot {slot} names backend {id}, which is not in {}",
                lb_common::map_names::BACKENDS
            ));
            continue;
        };
        if backend.proto != frontend.protocol.number() {
            problems.push(format!(
                "backend {id} in slot {slot} has protocol {}",
                backend.proto
            ));
        }
        let addr = backend_addr(backend);
        backends.push(ProgrammedBackend {
            slot,
            id,
            ip: addr.ip,
            port: addr.port,
            local: addr.local,
            quarantine: None,
        });
    }
    let stale: Vec<String> = slots
        .keys()
        .filter(|&&s| s > master.count)
        .map(u16::to_string)
        .collect();
    if !stale.is_empty() {
        problems.push(format!(
            "slot(s) {} beyond the count {} (stale)",
            stale.join(", "),
            master.count
        ));
    }
    if master.rev_nat_id == 0 {
        problems.push("frontend id is 0".to_owned());
    }
    let maglev = master
        .maglev()
        .map(|(first_slot, size)| MaglevTableRef { first_slot, size });
    ProgrammedFrontend {
        frontend,
        rev_nat_id: master.rev_nat_id,
        affinity_timeout_sec: affinity_timeout(&master),
        algorithm: if maglev.is_some() {
            Algorithm::Maglev
        } else {
            Algorithm::Random
        },
        maglev,
        backends,
        problems,
    }
}

/// A Maglev frontend's table as the kernel has it, for `lb maglev`: how its
/// slots are shared out among the frontend's backends.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MaglevShares {
    pub frontend: Frontend,
    pub table: MaglevTableRef,
    /// Frontends (entries of any scope) whose masters name the same table.
    pub shared_by: usize,
    /// Each backend in slot order, with the table slots that send flows to it.
    pub backends: Vec<BackendShare>,
    /// Slots holding a position that names no backend of the frontend (the
    /// kernel picks at random for those flows and counts `maglev_miss`).
    pub unassigned: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BackendShare {
    pub backend: ProgrammedBackend,
    pub slots: u32,
    /// `slots` over the table size.
    pub share: f64,
}

/// The master of `frontend` and its Maglev table's place, if it has one.
pub fn maglev_table_of(snapshot: &MapSnapshot, frontend: &Frontend) -> Option<MaglevTableRef> {
    let key = crate::datapath::codec::service_key(frontend, 0);
    let (first_slot, size) = snapshot.services.get(&key)?.maglev()?;
    Some(MaglevTableRef { first_slot, size })
}

/// The shares of `frontend`'s backends in `table` (its Maglev table as read from
/// `LB_MAGLEV`, [`maglev_table_of`] slots); `None` when it has no Maglev master.
pub fn maglev_shares(
    snapshot: &MapSnapshot,
    frontend: &Frontend,
    table: &[u16],
) -> Option<MaglevShares> {
    let table_ref = maglev_table_of(snapshot, frontend)?;
    let programmed = decode_frontend(snapshot, frontend)?;
    let count = snapshot
        .services
        .get(&crate::datapath::codec::service_key(frontend, 0))
        .map_or(0, |m| usize::from(m.count));
    // Slots per position; a position past the frontend's slots is no backend's.
    let mut counts = vec![0u32; count];
    for &position in table {
        if let Some(n) = counts.get_mut(usize::from(position)) {
            *n += 1;
        }
    }
    let size = table.len().max(1) as f64;
    let mut assigned = 0;
    let backends = programmed
        .backends
        .iter()
        .map(|b| {
            let slots = counts.get(usize::from(b.slot - 1)).copied().unwrap_or(0);
            assigned += slots;
            BackendShare {
                backend: *b,
                slots,
                share: f64::from(slots) / size,
            }
        })
        .collect();
    let shared_by = snapshot
        .services
        .groups()
        .filter(|(_, g)| {
            g.master
                .and_then(|m| m.maglev())
                .is_some_and(|(first, _)| first == table_ref.first_slot)
        })
        .count();
    Some(MaglevShares {
        frontend: *frontend,
        table: table_ref,
        shared_by,
        backends,
        unassigned: table.len() as u32 - assigned,
    })
}

/// One frontend as programmed (see [`decode`]).
fn decode_frontend(snapshot: &MapSnapshot, frontend: &Frontend) -> Option<ProgrammedFrontend> {
    let key = crate::datapath::codec::service_key(frontend, 0);
    let group = snapshot.services.group(&key)?;
    let slots: BTreeMap<u16, ServiceValue> = group.slots.iter().copied().collect();
    Some(decode_one(snapshot, *frontend, group.master, &slots))
}

pub fn render_maglev_shares(shares: &MaglevShares) -> String {
    let t = &shares.table;
    let mut out = format!(
        "{}: Maglev table of {} slots ({} bytes), LB_MAGLEV slots {}..{}, shared by {} frontend(s)\n",
        shares.frontend,
        t.size,
        lb_common::maglev::extent_slots(t.size) * 2,
        t.first_slot,
        t.first_slot + t.size,
        shares.shared_by
    );
    let _ = writeln!(out, "{:<46} {:>6} {:>8}", "BACKEND", "SLOTS", "SHARE");
    for b in &shares.backends {
        let addr = std::net::SocketAddr::new(b.backend.ip, b.backend.port).to_string();
        let _ = writeln!(out, "{addr:<46} {:>6} {:>7.2}%", b.slots, b.share * 100.0);
    }
    if shares.unassigned > 0 {
        let _ = writeln!(
            out,
            "! {} slot(s) name no backend of this frontend (those flows pick at random)",
            shares.unassigned
        );
    }
    out
}

/// One frontend's counters, for `lb stats --per-service`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceCounters {
    pub frontend: Frontend,
    pub rev_nat_id: u32,
    pub connections: u64,
    pub no_backend: u64,
    /// New flows dropped for coming from outside `loadBalancerSourceRanges`.
    pub source_range_drops: u64,
}

/// Joins the per-frontend counters with the frontends they belong to; counters of
/// frontends that are gone are left out.
pub fn service_counters(
    snapshot: &MapSnapshot,
    counters: &[(u32, lb_common::SvcStats)],
) -> Vec<ServiceCounters> {
    let by_id: BTreeMap<u32, lb_common::SvcStats> = counters.iter().copied().collect();
    decode(snapshot)
        .into_iter()
        .map(|f| {
            let c = by_id.get(&f.rev_nat_id).copied().unwrap_or_default();
            ServiceCounters {
                frontend: f.frontend,
                rev_nat_id: f.rev_nat_id,
                connections: c.connections,
                no_backend: c.no_backend,
                source_range_drops: c.source_range_drops,
            }
        })
        .collect()
}

pub fn render_service_counters(rows: &[ServiceCounters]) -> String {
    let mut out = format!(
        "{:<34} {:>12} {:>12} {:>18}\n",
        "FRONTEND", "CONNECTIONS", "NO_BACKEND", "SOURCE_RANGE_DROPS"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "{:<34} {:>12} {:>12} {:>18}",
            row.frontend.to_string(),
            row.connections,
            row.no_backend,
            row.source_range_drops
        );
    }
    out
}

/// An aligned table for people; problems follow their frontend's row.
/// A backend in `lb services`' text: its address, and its quarantine while one
/// runs (`10.244.1.13:8080 (quarantined 1.8s more, strike 2)`).
fn backend_text(b: &ProgrammedBackend) -> String {
    let addr = std::net::SocketAddr::new(b.ip, b.port);
    match b.quarantine {
        Some(q) if q.active => format!(
            "{addr} (quarantined {:.1}s more, strike {})",
            q.remaining_ms as f64 / 1000.0,
            q.strikes
        ),
        _ => addr.to_string(),
    }
}

pub fn render_text(frontends: &[ProgrammedFrontend]) -> String {
    let header = ["FRONTEND", "ID", "AFFINITY", "ALGORITHM", "BACKENDS"];
    let rows: Vec<[String; 5]> = frontends
        .iter()
        .map(|f| {
            let backends = if f.backends.is_empty() {
                "(none: connections refused)".to_owned()
            } else {
                f.backends
                    .iter()
                    .map(backend_text)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            [
                f.frontend.to_string(),
                f.rev_nat_id.to_string(),
                f.affinity_timeout_sec
                    .map_or_else(|| "-".to_owned(), |t| format!("{t}s")),
                match f.maglev {
                    Some(table) => format!("maglev/{}", table.size),
                    None => f.algorithm.to_string(),
                },
                backends,
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: [&str; 5]| {
        let _ = writeln!(
            out,
            "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        );
    };
    line(header);
    for (row, f) in rows.iter().zip(frontends) {
        line([&row[0], &row[1], &row[2], &row[3], &row[4]]);
        for problem in &f.problems {
            line(["", "", "", "", &format!("! {problem}")]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::codec::service_key as key_of;
    use crate::model::Protocol;
    use lb_common::{Backend, SVC_FLAG_AFFINITY};

    fn frontend(ip: [u8; 4], port: u16, protocol: Protocol) -> Frontend {
        Frontend::internal(std::net::Ipv4Addr::from(ip).into(), port, protocol)
    }

    fn backend(ip: [u8; 4], port: u16) -> Backend {
        Backend {
            address: std::net::IpAddr::from(ip).into(),
            port: port.to_be(),
            proto: lb_common::IPPROTO_TCP,
            flags: 0,
        }
    }

    fn master(count: u16, rev: u32) -> ServiceValue {
        ServiceValue {
            count,
            rev_nat_id: rev,
            ..Default::default()
        }
    }

    fn slot(id: u32, rev: u32) -> ServiceValue {
        ServiceValue {
            backend_id: id,
            rev_nat_id: rev,
            ..Default::default()
        }
    }

    /// `lb services` shows a backend's quarantine while it runs and until when,
    /// per frontend: the same backend id under another frontend id is another
    /// record.
    #[test]
    fn quarantined_backends_are_shown_with_their_time_left() {
        let web = frontend([10, 96, 0, 10], 80, Protocol::Tcp);
        let mut s = MapSnapshot::default();
        s.services.insert(key_of(&web, 0), master(2, 1));
        s.services.insert(key_of(&web, 1), slot(10, 1));
        s.services.insert(key_of(&web, 2), slot(11, 1));
        s.backends.insert(10, backend([10, 0, 0, 1], 8080));
        s.backends.insert(11, backend([10, 0, 0, 2], 8080));
        let mut t = decode(&s);
        let now = 50_000_000_000;
        let mut running = lb_common::QuarantineValue::default();
        running.refused(now - 200_000_000, 0);
        running.skips = 4;
        let mut ended = lb_common::QuarantineValue::default();
        ended.refused(now - 5_000_000_000, lb_common::QUARANTINE_FLAG_BY_SOCKET);
        let key = |rev_nat_id, backend_id| lb_common::QuarantineKey {
            rev_nat_id,
            backend_id,
        };
        let entries = [(key(1, 11), running), (key(7, 10), ended)];
        with_quarantine(&mut t, &entries, now);
        assert_eq!(t[0].backends[0].quarantine, None, "frontend 7's record");
        assert_eq!(
            t[0].backends[1].quarantine,
            Some(BackendQuarantine {
                active: true,
                remaining_ms: 800,
                until_monotonic_ns: now + 800_000_000,
                strikes: 1,
                quarantines: 1,
                skips: 4,
                seen_by: "packet",
            })
        );
        let text = render_text(&t);
        assert!(
            text.contains("10.0.0.1:8080, 10.0.0.2:8080 (quarantined 0.8s more, strike 1)"),
            "{text}"
        );
        let ended_view = BackendQuarantine::at(&ended, now);
        assert!(!ended_view.active && ended_view.remaining_ms == 0);
        assert_eq!(ended_view.seen_by, "socket");
    }

    #[test]
    fn decodes_well_formed_and_broken_frontends() {
        let web = frontend([10, 96, 0, 10], 80, Protocol::Tcp);
        let dns = frontend([10, 96, 0, 11], 53, Protocol::Udp);
        let half = frontend([10, 96, 0, 12], 443, Protocol::Tcp);
        let mut s = MapSnapshot::default();
        s.services.insert(
            key_of(&web, 0),
            ServiceValue {
                flags: SVC_FLAG_AFFINITY,
                affinity_timeout_sec: 60,
                ..master(2, 1)
            },
        );
        s.services.insert(key_of(&web, 1), slot(10, 1));
        s.services.insert(key_of(&web, 2), slot(11, 1));
        s.backends.insert(10, backend([10, 0, 0, 1], 8080));
        s.backends.insert(11, backend([10, 0, 0, 2], 8080));
        s.services.insert(key_of(&dns, 0), master(0, 2));
        s.services.insert(key_of(&half, 0), master(3, 3));
        s.services.insert(key_of(&half, 1), slot(10, 3));
        s.services.insert(key_of(&half, 3), slot(99, 3));
        s.services.insert(key_of(&half, 4), slot(11, 3));
        // Orphan slot without a master.
        let orphan = frontend([10, 96, 0, 13], 80, Protocol::Tcp);
        s.services.insert(key_of(&orphan, 1), slot(11, 9));

        // Metric labels come from the masters alone; the orphan slot has none.
        let names: Vec<_> = frontend_names(&s)
            .into_iter()
            .map(|(id, f)| (id, f.to_string()))
            .collect();
        assert_eq!(
            names,
            [
                (1, "10.96.0.10:80/TCP".to_owned()),
                (2, "10.96.0.11:53/UDP".to_owned()),
                (3, "10.96.0.12:443/TCP".to_owned()),
            ]
        );

        let t = decode(&s);
        assert_eq!(t.len(), 4);
        assert_eq!(t[0].frontend, web);
        assert_eq!(t[0].rev_nat_id, 1);
        assert_eq!(t[0].affinity_timeout_sec, Some(60));
        assert_eq!(
            t[0].backends,
            [
                ProgrammedBackend {
                    slot: 1,
                    id: 10,
                    ip: std::net::Ipv4Addr::new(10, 0, 0, 1).into(),
                    port: 8080,
                    local: false,
                    quarantine: None,
                },
                ProgrammedBackend {
                    slot: 2,
                    id: 11,
                    ip: std::net::Ipv4Addr::new(10, 0, 0, 2).into(),
                    port: 8080,
                    local: false,
                    quarantine: None,
                },
            ]
        );
        assert!(t[0].problems.is_empty());
        assert_eq!(t[1].frontend, dns);
        assert!(t[1].backends.is_empty() && t[1].problems.is_empty());
        assert_eq!(t[1].affinity_timeout_sec, None);
        assert_eq!(t[2].backends.len(), 1);
        assert_eq!(
            t[2].problems,
            [
                "slot 2 of 3 is missing",
                "slot 3 names backend 99, which is not in LB_BACKENDS",
                "slot(s) 4 beyond the count 3 (stale)",
            ]
        );
        assert_eq!(t[3].rev_nat_id, 0);
        assert_eq!(t[3].problems.len(), 1);

        let text = render_text(&t);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "FRONTEND            ID  AFFINITY  ALGORITHM  BACKENDS"
        );
        assert_eq!(
            lines[1],
            "10.96.0.10:80/TCP   1   60s       random     10.0.0.1:8080, 10.0.0.2:8080"
        );
        assert_eq!(
            lines[2],
            "10.96.0.11:53/UDP   2   -         random     (none: connections refused)"
        );
        assert_eq!(
            lines[3],
            "10.96.0.12:443/TCP  3   -         random     10.0.0.1:8080"
        );
        assert_eq!(
            lines[4],
            format!("{}! slot 2 of 3 is missing", " ".repeat(45))
        );
        assert_eq!(lines.len(), 1 + 4 + 3 + 1);
    }

    /// IPv6 frontends and backends print bracketed, as `[fd00::1]:80`.
    #[test]
    fn ipv6_addresses_print_bracketed() {
        let web = Frontend::internal("fd00:96::10".parse().unwrap(), 80, Protocol::Tcp);
        let mut s = MapSnapshot::default();
        s.services.insert(key_of(&web, 0), master(1, 4));
        s.services.insert(key_of(&web, 1), slot(10, 4));
        s.backends.insert(
            10,
            Backend {
                address: "fd00:244::11".parse::<std::net::IpAddr>().unwrap().into(),
                ..backend([0; 4], 8080)
            },
        );
        let text = render_text(&decode(&s));
        assert_eq!(
            text.lines().nth(1),
            Some("[fd00:96::10]:80/TCP  4   -         random     [fd00:244::11]:8080")
        );
        assert_eq!(frontend_names(&s)[&4].to_string(), "[fd00:96::10]:80/TCP");
    }

    /// A Maglev master shows its table in `lb services`, and `lb maglev` counts
    /// each backend's slots (a slot naming no backend of the frontend is said).
    #[test]
    fn maglev_masters_show_their_table_and_shares() {
        let web = frontend([192, 0, 2, 10], 30080, Protocol::Tcp);
        let twin = frontend([192, 0, 2, 11], 30080, Protocol::Tcp);
        let mut s = MapSnapshot::default();
        let maglev_master = ServiceValue {
            backend_id: 4,
            flags: lb_common::maglev_flags(0).unwrap(),
            ..master(2, 1)
        };
        s.services.insert(key_of(&web, 0), maglev_master);
        s.services.insert(
            key_of(&twin, 0),
            ServiceValue {
                rev_nat_id: 2,
                ..maglev_master
            },
        );
        for (f, rev) in [(web, 1), (twin, 2)] {
            s.services.insert(key_of(&f, 1), slot(10, rev));
            s.services.insert(key_of(&f, 2), slot(11, rev));
        }
        s.backends.insert(10, backend([10, 0, 0, 1], 8080));
        s.backends.insert(11, backend([10, 0, 0, 2], 8080));
        let t = decode(&s);
        assert_eq!(t[0].algorithm, Algorithm::Maglev);
        assert_eq!(
            t[0].maglev,
            Some(MaglevTableRef {
                first_slot: 4,
                size: 251
            })
        );
        assert!(render_text(&t)
            .lines()
            .nth(1)
            .unwrap()
            .contains("  maglev/251  "));

        // 120 slots to the first backend, 130 to the second, one to nobody.
        let mut table = vec![0u16; 120];
        table.extend([1u16; 130]);
        table.push(7);
        let shares = maglev_shares(&s, &web, &table).unwrap();
        assert_eq!(shares.shared_by, 2);
        assert_eq!(
            shares
                .backends
                .iter()
                .map(|b| (b.backend.slot, b.slots))
                .collect::<Vec<_>>(),
            [(1, 120), (2, 130)]
        );
        assert_eq!(shares.unassigned, 1);
        let text = render_maglev_shares(&shares);
        assert!(text.starts_with(
            "192.0.2.10:30080/TCP: Maglev table of 251 slots (504 bytes), LB_MAGLEV slots \
             4..255, shared by 2 frontend(s)\n"
        ));
        assert!(text.contains("10.0.0.2:8080"));
        assert!(text.contains("51.79%"), "{text}");
        assert!(text.contains("! 1 slot(s) name no backend"), "{text}");
        assert_eq!(
            maglev_shares(&s, &frontend([192, 0, 2, 99], 1, Protocol::Tcp), &table),
            None
        );
    }

    #[test]
    fn empty_table_has_only_the_header() {
        assert_eq!(
            render_text(&decode(&MapSnapshot::default())),
            "FRONTEND  ID  AFFINITY  ALGORITHM  BACKENDS\n"
        );
    }

    #[test]
    fn serializes_to_json() {
        let web = frontend([10, 96, 0, 10], 80, Protocol::Tcp);
        let mut s = MapSnapshot::default();
        s.services.insert(key_of(&web, 0), master(0, 7));
        let json = serde_json::to_string(&decode(&s)).unwrap();
        assert_eq!(
            json,
            r#"[{"frontend":{"ip":"10.96.0.10","port":80,"protocol":"TCP","scope":"internal"},"rev_nat_id":7,"affinity_timeout_sec":null,"algorithm":"random","maglev":null,"backends":[],"problems":[]}]"#
        );
    }
}
