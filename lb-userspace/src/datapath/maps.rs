//! The pinned maps as the agent and the CLI see them: read a snapshot, apply a plan.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap};
use aya::sys::SyscallError;
use aya_obj::generated::bpf_cmd;
use lb_common::{
    map_names, stat, Backend, CtKey, CtValue, MaglevSlots, QuarantineKey, QuarantineValue,
    ServiceKey, ServiceValue, SockRevNatKey, SockRevNatValue, SourceRangeKey, SvcStats,
    MAGLEV_SLOTS_PER_ENTRY,
};

use crate::datapath::codec::{self, Capacity, SourceRange};
use crate::datapath::pins::PinLayout;
use crate::datapath::snapshot::{MapOp, MapSnapshot};

#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error(
        "cannot open pinned map {path}: {source}; is an agent running with this --pin-dir \
         (or was it ever started)?"
    )]
    Open {
        path: PathBuf,
        #[source]
        source: MapError,
    },
    #[error("reading {map}: {source}")]
    Read {
        map: &'static str,
        #[source]
        source: MapError,
    },
    #[error("{op} in {map} failed: {source}")]
    Write {
        map: &'static str,
        op: String,
        #[source]
        source: MapError,
    },
}

/// A batch of the service table as the kernel holds it, from [`TableReader::read`].
pub enum TableBatch {
    Services(Vec<(ServiceKey, ServiceValue)>),
    Backends(Vec<(u32, Backend)>),
}

/// Reads the service table with descriptors of its own ([`PinnedMaps::table_reader`]).
pub struct TableReader {
    services: OwnedFd,
    backends: OwnedFd,
}

impl TableReader {
    /// Both maps, a batch at a time, each handed to `each` as read, until it
    /// returns false. Needs batched lookups (Linux 5.6).
    pub fn read(&self, mut each: impl FnMut(TableBatch) -> bool) -> Result<(), MapsError> {
        let failed = |map: &'static str| {
            move |io_error| MapsError::Read {
                map,
                source: MapError::SyscallError(SyscallError {
                    call: "bpf_map_lookup_batch",
                    io_error,
                }),
            }
        };
        let mut going = true;
        lookup_batched(
            self.services.as_fd(),
            |batch: &[(ServiceKey, ServiceValue)]| {
                going = going && each(TableBatch::Services(batch.to_vec()));
            },
        )
        .map_err(failed(map_names::SERVICES))?;
        lookup_batched(self.backends.as_fd(), |batch: &[(u32, Backend)]| {
            going = going && each(TableBatch::Backends(batch.to_vec()));
        })
        .map_err(failed(map_names::BACKENDS))
    }
}

/// `LB_SOCK_REVNAT`: which backend the socket hooks sent each socket to, through
/// which frontend. Read by whoever closes the sockets of removed endpoints.
pub struct SockRevNatMap {
    map: HashMap<MapData, SockRevNatKey, SockRevNatValue>,
    fd: OwnedFd,
}

impl SockRevNatMap {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        let (map, fd) = open_hash(layout, map_names::SOCK_REVNAT)?;
        Ok(SockRevNatMap { map, fd })
    }

    /// The entry of one socket and backend, if any.
    pub fn get(&self, key: &SockRevNatKey) -> Result<Option<SockRevNatValue>, MapsError> {
        found(self.map.get(key, 0), map_names::SOCK_REVNAT)
    }

    /// Every entry, handed to `each` a batch at a time (read whole, the bench's
    /// 262k entries were a 15 MB spike on every sweep); see [`read_in_batches`].
    pub fn for_each_batch(
        &self,
        each: impl FnMut(&[(SockRevNatKey, SockRevNatValue)]),
    ) -> Result<(), MapsError> {
        read_in_batches(&self.map, self.fd.as_fd(), map_names::SOCK_REVNAT, each)
    }

    /// Removes one entry; one already evicted is fine.
    pub fn remove(&mut self, key: &SockRevNatKey) -> Result<(), MapsError> {
        ignore_missing(self.map.remove(key)).map_err(|source| MapsError::Write {
            map: map_names::SOCK_REVNAT,
            op: format!("delete {key:?}"),
            source,
        })
    }
}

/// `LB_CT`, the per-packet path's conntrack, opened on its own: read by `lb
/// conntrack` and by the agent's collector thread, never on the agent's loop.
pub struct ConntrackMap {
    map: HashMap<MapData, CtKey, CtValue>,
    fd: OwnedFd,
}

impl ConntrackMap {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        let (map, fd) = open_hash(layout, map_names::CT)?;
        Ok(ConntrackMap { map, fd })
    }

    /// Every entry (both directions of every flow).
    /// Read in batches: entry by entry it was two syscalls per entry.
    pub fn entries(&self) -> Result<Vec<(CtKey, CtValue)>, MapsError> {
        let mut entries = Vec::new();
        read_in_batches(&self.map, self.fd.as_fd(), map_names::CT, |batch| {
            entries.extend_from_slice(batch)
        })?;
        Ok(entries)
    }

    /// One entry, if present.
    pub fn get(&self, key: &CtKey) -> Result<Option<CtValue>, MapsError> {
        found(self.map.get(key, 0), map_names::CT)
    }

    /// Removes one entry; one already gone (LRU eviction) is fine.
    pub fn remove(&mut self, key: &CtKey) -> Result<(), MapsError> {
        ignore_missing(self.map.remove(key)).map_err(|source| MapsError::Write {
            map: map_names::CT,
            op: format!("delete {key:?}"),
            source,
        })
    }
}

/// `LB_QUARANTINE`, passive health's record of the backends that refused a new
/// connection: read by `lb services` and the metrics, written only by the
/// programs.
pub struct QuarantineMap {
    map: HashMap<MapData, QuarantineKey, QuarantineValue>,
    fd: OwnedFd,
}

impl QuarantineMap {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        let (map, fd) = open_hash(layout, map_names::QUARANTINE)?;
        Ok(QuarantineMap { map, fd })
    }

    /// Every entry: one per (frontend, backend) that ever refused, as long as the
    /// LRU keeps it.
    pub fn entries(&self) -> Result<Vec<(QuarantineKey, QuarantineValue)>, MapsError> {
        let mut entries = Vec::new();
        read_in_batches(&self.map, self.fd.as_fd(), map_names::QUARANTINE, |batch| {
            entries.extend_from_slice(batch)
        })?;
        Ok(entries)
    }
}

/// Handles on the pinned maps of one agent.
pub struct PinnedMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    backends: HashMap<MapData, u32, Backend>,
    stats: PerCpuArray<MapData, u64>,
    service_stats: PerCpuHashMap<MapData, u32, SvcStats>,
    source_ranges: LpmTrie<MapData, SourceRangeKey, u8>,
    maglev: Array<MapData, MaglevSlots>,
    /// The service, backend and Maglev maps' descriptors again, for batched
    /// updates and reads (aya 0.14 has no batch API).
    services_fd: OwnedFd,
    backends_fd: OwnedFd,
    maglev_fd: OwnedFd,
    /// Entries written through batch syscalls since open (the rest went one by one).
    batched: u64,
    capacity: Capacity,
}

fn open(layout: &PinLayout, name: &'static str) -> Result<(Map, u32, OwnedFd), MapsError> {
    let path = layout.map_path(name);
    let wrap = |source| MapsError::Open {
        path: path.clone(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(wrap)?;
    let max_entries = data.info().map_err(wrap)?.max_entries();
    let fd = data.fd().as_fd().try_clone_to_owned().map_err(|io_error| {
        wrap(MapError::SyscallError(SyscallError {
            call: "dup",
            io_error,
        }))
    })?;
    Ok((Map::from_map_data(data).map_err(wrap)?, max_entries, fd))
}

/// A pinned hash map of its own (one a thread of the agent reads on its own), typed,
/// with a second descriptor for batched reads.
fn open_hash<K: aya::Pod, V: aya::Pod>(
    layout: &PinLayout,
    name: &'static str,
) -> Result<(HashMap<MapData, K, V>, OwnedFd), MapsError> {
    let (map, _, fd) = open(layout, name)?;
    let map = HashMap::try_from(map).map_err(|source| MapsError::Open {
        path: layout.map_path(name),
        source,
    })?;
    Ok((map, fd))
}

impl PinnedMaps {
    pub fn open(layout: &PinLayout) -> Result<Self, MapsError> {
        let typed = |name: &'static str, e: MapError| MapsError::Open {
            path: layout.map_path(name),
            source: e,
        };
        let (services, services_max, services_fd) = open(layout, map_names::SERVICES)?;
        let (backends, backends_max, backends_fd) = open(layout, map_names::BACKENDS)?;
        let (stats, _, _) = open(layout, map_names::STATS)?;
        let (service_stats, _, _) = open(layout, map_names::SVC_STATS)?;
        let (source_ranges, _, _) = open(layout, map_names::SOURCE_RANGES)?;
        let (maglev, maglev_max, maglev_fd) = open(layout, map_names::MAGLEV)?;
        Ok(Self {
            services: HashMap::try_from(services).map_err(|e| typed(map_names::SERVICES, e))?,
            backends: HashMap::try_from(backends).map_err(|e| typed(map_names::BACKENDS, e))?,
            stats: PerCpuArray::try_from(stats).map_err(|e| typed(map_names::STATS, e))?,
            service_stats: PerCpuHashMap::try_from(service_stats)
                .map_err(|e| typed(map_names::SVC_STATS, e))?,
            source_ranges: LpmTrie::try_from(source_ranges)
                .map_err(|e| typed(map_names::SOURCE_RANGES, e))?,
            maglev: Array::try_from(maglev).map_err(|e| typed(map_names::MAGLEV, e))?,
            services_fd,
            backends_fd,
            maglev_fd,
            batched: 0,
            capacity: Capacity {
                services: services_max,
                backends: backends_max,
                frontend_ids: codec::MAX_REV_NAT_ID,
                maglev_slots: maglev_max.saturating_mul(MAGLEV_SLOTS_PER_ENTRY),
                maglev_seed: 0,
            },
        })
    }

    /// The seed this agent builds Maglev tables with (`--maglev-seed`, which the
    /// loader also gave the programs): part of [`PinnedMaps::capacity`], what plans
    /// are made with.
    pub fn set_maglev_seed(&mut self, seed: u64) {
        self.capacity.maglev_seed = seed;
    }

    /// How many entries went to the kernel in batches rather than one by one.
    pub fn batched_writes(&self) -> u64 {
        self.batched
    }

    pub fn capacity(&self) -> Capacity {
        self.capacity
    }

    /// The service table's two maps, a batch at a time: `services` gets the
    /// `LB_SERVICES` batches, then `backends` the `LB_BACKENDS` ones.
    fn read_table(
        &self,
        services: impl FnMut(&[(ServiceKey, ServiceValue)]),
        backends: impl FnMut(&[(u32, Backend)]),
    ) -> Result<(), MapsError> {
        read_in_batches(
            &self.services,
            self.services_fd.as_fd(),
            map_names::SERVICES,
            services,
        )?;
        read_in_batches(
            &self.backends,
            self.backends_fd.as_fd(),
            map_names::BACKENDS,
            backends,
        )
    }

    pub fn snapshot(&self) -> Result<MapSnapshot, MapsError> {
        let mut snapshot = MapSnapshot::default();
        // Backends come in hash order: gathered, then sorted into place once
        // (per batch, 1M backends would be sorted 122 times).
        let mut backends = Vec::new();
        self.read_table(
            |batch| snapshot.services.extend(batch.iter().copied()),
            |batch| backends.extend_from_slice(batch),
        )?;
        snapshot.backends.extend(backends);
        snapshot.maglev_seed = self.maglev_header()?;
        Ok(snapshot)
    }

    /// The seed `LB_MAGLEV`'s header entry names.
    fn maglev_header(&self) -> Result<u64, MapsError> {
        let header = self.maglev.get(&0, 0).map_err(|source| MapsError::Read {
            map: map_names::MAGLEV,
            source,
        })?;
        Ok(lb_common::maglev::seed_of_lanes(header.positions))
    }

    /// `size` slots of `LB_MAGLEV` from arena slot `first` on (a Maglev master's
    /// table, for `lb maglev`).
    pub fn maglev_table(&self, first: u32, size: u32) -> Result<Vec<u16>, MapsError> {
        let mut table = Vec::with_capacity(size as usize);
        let entries =
            first / MAGLEV_SLOTS_PER_ENTRY..(first + size).div_ceil(MAGLEV_SLOTS_PER_ENTRY);
        for entry in entries {
            let slots = self
                .maglev
                .get(&entry, 0)
                .map_err(|source| MapsError::Read {
                    map: map_names::MAGLEV,
                    source,
                })?;
            table.extend(slots.positions);
        }
        let skip = (first % MAGLEV_SLOTS_PER_ENTRY) as usize;
        Ok(table.into_iter().skip(skip).take(size as usize).collect())
    }

    /// The service and backend maps' descriptors again, for reading the table on
    /// another thread while this agent keeps writing through its own.
    pub fn table_reader(&self) -> Result<TableReader, MapsError> {
        let dup = |fd: &OwnedFd, map: &'static str| {
            fd.try_clone().map_err(|io_error| MapsError::Read {
                map,
                source: MapError::SyscallError(SyscallError {
                    call: "dup",
                    io_error,
                }),
            })
        };
        Ok(TableReader {
            services: dup(&self.services_fd, map_names::SERVICES)?,
            backends: dup(&self.backends_fd, map_names::BACKENDS)?,
        })
    }

    /// Applies `ops` in order, stopping at the first failure: the plan is ordered so
    /// that any prefix leaves the table consistent. Runs of inserts into one map go
    /// to the kernel as one batch, which applies them in order and stops at the
    /// first failure too, so the guarantee holds either way.
    pub fn apply(&mut self, ops: &[MapOp]) -> Result<(), MapsError> {
        let mut rest = ops;
        while !rest.is_empty() {
            let run = match rest[0] {
                MapOp::PutBackend { .. } => rest
                    .iter()
                    .take_while(|op| matches!(op, MapOp::PutBackend { .. }))
                    .count(),
                MapOp::PutService { .. } => rest
                    .iter()
                    .take_while(|op| matches!(op, MapOp::PutService { .. }))
                    .count(),
                MapOp::PutMaglev { .. } => rest
                    .iter()
                    .take_while(|op| matches!(op, MapOp::PutMaglev { .. }))
                    .count(),
                _ => 1,
            };
            let (now, later) = rest.split_at(run);
            if matches!(now[0], MapOp::PutMaglev { .. }) {
                self.put_tables(now)?;
                rest = later;
                continue;
            }
            let done = if run >= BATCH_MIN {
                self.put_batch(now)
            } else {
                0
            };
            for op in &now[done..] {
                self.apply_one(op)?;
            }
            rest = later;
        }
        Ok(())
    }

    /// Inserts a run of `PutBackend` or `PutService` ops with batched syscalls;
    /// returns how many are known applied. On a failure (or a kernel without batch
    /// operations, before 5.6) the caller applies the rest one by one, which
    /// reports the failing op exactly.
    fn put_batch(&mut self, run: &[MapOp]) -> usize {
        let mut done = 0;
        for chunk in run.chunks(BATCH_CHUNK) {
            let applied = match chunk[0] {
                MapOp::PutBackend { .. } => {
                    update_batch(self.backends_fd.as_fd(), chunk, |op| match op {
                        MapOp::PutBackend { id, backend } => Some((*id, *backend)),
                        _ => None,
                    })
                }
                _ => update_batch(self.services_fd.as_fd(), chunk, |op| match op {
                    MapOp::PutService { key, value } => Some((*key, *value)),
                    _ => None,
                }),
            };
            // After a failure the whole chunk is redone one by one: the kernel's
            // count of applied elements is not written on every error path (an
            // unsupported command leaves it as passed), and inserting the same
            // entry again changes nothing.
            match applied {
                Ok(()) => {
                    done += chunk.len();
                    self.batched += chunk.len() as u64;
                }
                Err(_) => return done,
            }
        }
        done
    }

    /// Writes a run of Maglev tables, their entries batched (a 10-backend table is
    /// 256 entries); entry by entry where a batch fails (or the kernel has no
    /// batch operations), which names the failing one.
    fn put_tables(&mut self, run: &[MapOp]) -> Result<(), MapsError> {
        let mut entries: Vec<(u32, MaglevSlots)> = Vec::new();
        for op in run {
            if let MapOp::PutMaglev {
                first_slot,
                positions,
            } = op
            {
                entries.extend(maglev_entries(*first_slot, positions));
            }
        }
        for chunk in entries.chunks(BATCH_CHUNK) {
            let (keys, values): (Vec<u32>, Vec<MaglevSlots>) = chunk.iter().copied().unzip();
            if write_batch(self.maglev_fd.as_fd(), &keys, &values).is_ok() {
                self.batched += chunk.len() as u64;
                continue;
            }
            for (entry, slots) in chunk {
                self.maglev
                    .set(*entry, slots, 0)
                    .map_err(|source| MapsError::Write {
                        map: map_names::MAGLEV,
                        op: format!("write entry {entry} of a Maglev table"),
                        source,
                    })?;
            }
        }
        Ok(())
    }

    fn apply_one(&mut self, op: &MapOp) -> Result<(), MapsError> {
        if let MapOp::PutMaglevSeed { seed } = op {
            let header = MaglevSlots {
                positions: lb_common::maglev::seed_lanes(*seed),
            };
            return self
                .maglev
                .set(0, header, 0)
                .map_err(|source| MapsError::Write {
                    map: map_names::MAGLEV,
                    op: format!("{op:?}"),
                    source,
                });
        }
        if let MapOp::PutMaglev { .. } = op {
            return self.put_tables(std::slice::from_ref(op));
        }
        let (map, result) = match op {
            MapOp::PutBackend { id, backend } => {
                (map_names::BACKENDS, self.backends.insert(id, backend, 0))
            }
            MapOp::PutService { key, value } => {
                (map_names::SERVICES, self.services.insert(key, value, 0))
            }
            MapOp::DeleteService { key } => (
                map_names::SERVICES,
                ignore_missing(self.services.remove(key)),
            ),
            MapOp::DeleteBackend { id } => (
                map_names::BACKENDS,
                ignore_missing(self.backends.remove(id)),
            ),
            MapOp::PutMaglev { .. } | MapOp::PutMaglevSeed { .. } => {
                unreachable!("handled above")
            }
        };
        result.map_err(|source| MapsError::Write {
            map,
            op: format!("{op:?}"),
            source,
        })
    }

    /// One backend by id, if present.
    pub fn backend(&self, id: u32) -> Result<Option<Backend>, MapsError> {
        found(self.backends.get(&id, 0), map_names::BACKENDS)
    }

    /// Per-frontend counters (by `rev_nat_id`), summed over CPUs.
    pub fn service_stats(&self) -> Result<Vec<(u32, SvcStats)>, MapsError> {
        self.service_stats
            .iter()
            .map(|entry| {
                let (id, per_cpu) = entry.map_err(|source| MapsError::Read {
                    map: map_names::SVC_STATS,
                    source,
                })?;
                let total = per_cpu
                    .iter()
                    .fold(SvcStats::default(), |sum, cpu| SvcStats {
                        connections: sum.connections + cpu.connections,
                        no_backend: sum.no_backend + cpu.no_backend,
                        source_range_drops: sum.source_range_drops + cpu.source_range_drops,
                    });
                Ok((id, total))
            })
            .collect()
    }

    /// Drops the counters of frontends that no longer exist, so ids that are
    /// never reused do not pile up.
    /// Deletes the per-Service counters of frontend ids that are gone (a missing
    /// entry is fine: a frontend that saw no traffic has none).
    pub fn remove_service_stats(&mut self, ids: &[u32]) -> Result<(), MapsError> {
        for id in ids {
            ignore_missing(self.service_stats.remove(id)).map_err(|source| MapsError::Write {
                map: map_names::SVC_STATS,
                op: format!("delete counters of frontend id {id}"),
                source,
            })?;
        }
        Ok(())
    }

    pub fn prune_service_stats(
        &mut self,
        live: &std::collections::BTreeSet<u32>,
    ) -> Result<usize, MapsError> {
        let read_error = |source| MapsError::Read {
            map: map_names::SVC_STATS,
            source,
        };
        let stale: Vec<u32> = self
            .service_stats
            .keys()
            .collect::<Result<Vec<u32>, MapError>>()
            .map_err(read_error)?
            .into_iter()
            .filter(|id| !live.contains(id))
            .collect();
        for id in &stale {
            ignore_missing(self.service_stats.remove(id)).map_err(|source| MapsError::Write {
                map: map_names::SVC_STATS,
                op: format!("delete counters of frontend id {id}"),
                source,
            })?;
        }
        Ok(stale.len())
    }

    /// Every `LB_SOURCE_RANGES` entry (keys no agent writes are left out).
    pub fn source_ranges(&self) -> Result<BTreeSet<SourceRange>, MapsError> {
        self.source_range_keys().map(|keys| {
            keys.iter()
                .filter_map(|k| codec::source_range(k.prefix_len(), &k.data()))
                .collect()
        })
    }

    fn source_range_keys(&self) -> Result<Vec<Key<SourceRangeKey>>, MapsError> {
        self.source_ranges
            .keys()
            .collect::<Result<Vec<_>, MapError>>()
            .map_err(|source| MapsError::Read {
                map: map_names::SOURCE_RANGES,
                source,
            })
    }

    /// Adds the entries of `wanted` the trie lacks and, with `prune`, removes every
    /// other one (see [`crate::datapath::source_ranges`] for when each is safe). Returns how
    /// many entries changed.
    pub fn sync_source_ranges(
        &mut self,
        wanted: &BTreeSet<SourceRange>,
        prune: bool,
    ) -> Result<usize, MapsError> {
        let present = self.source_range_keys()?;
        let have: BTreeSet<SourceRange> = present
            .iter()
            .filter_map(|k| codec::source_range(k.prefix_len(), &k.data()))
            .collect();
        let mut changed = 0;
        for entry in wanted.difference(&have) {
            let (prefix_len, data) = codec::source_range_key(entry);
            self.source_ranges
                .insert(&Key::new(prefix_len, data), 1, 0)
                .map_err(|source| MapsError::Write {
                    map: map_names::SOURCE_RANGES,
                    op: format!("add source range {} of frontend id {}", entry.1, entry.0),
                    source,
                })?;
            changed += 1;
        }
        if !prune {
            return Ok(changed);
        }
        for key in present {
            let keep = codec::source_range(key.prefix_len(), &key.data())
                .is_some_and(|entry| wanted.contains(&entry));
            if keep {
                continue;
            }
            ignore_missing(self.source_ranges.remove(&key)).map_err(|source| MapsError::Write {
                map: map_names::SOURCE_RANGES,
                op: format!(
                    "delete source range entry of frontend id {}",
                    key.data().rev_nat_id
                ),
                source,
            })?;
            changed += 1;
        }
        Ok(changed)
    }

    /// The `LB_STATS` counters summed over CPUs, with their names.
    pub fn stats(&self) -> Result<Vec<(&'static str, u64)>, MapsError> {
        (0..stat::COUNT)
            .map(|index| {
                let per_cpu = self
                    .stats
                    .get(&index, 0)
                    .map_err(|source| MapsError::Read {
                        map: map_names::STATS,
                        source,
                    })?;
                Ok((stat::NAMES[index as usize], per_cpu.iter().sum()))
            })
            .collect()
    }
}

/// Runs shorter than this are not worth building arrays for.
const BATCH_MIN: usize = 16;
/// Elements per batch update: bounds the arrays (and the kernel's time under one
/// call) without adding many syscalls.
const BATCH_CHUNK: usize = 8192;
/// Elements per batch lookup. A kernel built without preemption (PREEMPT_NONE,
/// this machine's and many distributions' default) runs a syscall to its end
/// before any other task on that CPU: 8192 entries of a 1.2M-entry hash map took
/// 13 ms a call here (max 24 ms), and the consistency check's reads, 135 such calls
/// once a minute at 100k Services, held the agent's thread for tens of ms at a time.
/// 1024 took 0.76 ms a call, for the same total (1.93 s against 1.86 s).
const LOOKUP_CHUNK: usize = 1024;

/// The `batch` member of `union bpf_attr`, from aya's kernel bindings.
type BatchAttr = aya_obj::generated::bpf_attr__bindgen_ty_3;

/// An empty batch request for the map `map`.
fn batch_attr(map: BorrowedFd<'_>) -> BatchAttr {
    BatchAttr {
        in_batch: 0,
        out_batch: 0,
        keys: 0,
        values: 0,
        count: 0,
        map_fd: map.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    }
}

/// The `LB_MAGLEV` entries of a table written from arena slot `first_slot` (a
/// multiple of four): its positions four at a time, the last entry padded with
/// position 0.
fn maglev_entries(
    first_slot: u32,
    positions: &[u16],
) -> impl Iterator<Item = (u32, MaglevSlots)> + '_ {
    let first_entry = first_slot / MAGLEV_SLOTS_PER_ENTRY;
    positions
        .chunks(MAGLEV_SLOTS_PER_ENTRY as usize)
        .zip(first_entry..)
        .map(|(slots, entry)| {
            let mut value = MaglevSlots::default();
            value.positions[..slots.len()].copy_from_slice(slots);
            (entry, value)
        })
}

/// Inserts the entries `entry` picks out of a run of ops, in order, with one
/// syscall. `K` and `V` are the map's key and value types, so their sizes are the
/// map's.
fn update_batch<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    run: &[MapOp],
    entry: impl Fn(&MapOp) -> Option<(K, V)>,
) -> io::Result<()> {
    let (keys, values): (Vec<K>, Vec<V>) = run.iter().filter_map(entry).unzip();
    if keys.len() != run.len() {
        // A mixed run: not for one map; the caller applies it op by op.
        return Err(io::ErrorKind::InvalidInput.into());
    }
    write_batch(map, &keys, &values)
}

/// Inserts `keys[i] -> values[i]`, in order, with one syscall. `K` and `V` are the
/// map's key and value types, so their sizes are the map's.
fn write_batch<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> io::Result<()> {
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: keys.len() as u32,
        ..batch_attr(map)
    };
    // SAFETY: the kernel reads `count` keys and values from arrays that outlive
    // the call.
    unsafe { bpf_batch(bpf_cmd::BPF_MAP_UPDATE_BATCH, &mut attr) }
}

/// One batch command of the bpf syscall.
///
/// # Safety
/// The pointers in `attr` (keys, values, positions) must be valid for what `cmd`
/// reads and writes through them, for `count` entries.
unsafe fn bpf_batch(cmd: bpf_cmd, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid bpf_attr prefix of the size passed; the caller
    // vouches for the arrays it points to; the kernel writes back only into them
    // and into `attr`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Every entry of a hash map, with `BPF_MAP_LOOKUP_BATCH` calls of up to
/// [`LOOKUP_CHUNK`] entries. `K` and `V` are the map's key and value types.
fn lookup_batched<K: bytemuck::Pod, V: bytemuck::Pod>(
    map: BorrowedFd<'_>,
    mut each: impl FnMut(&[(K, V)]),
) -> io::Result<()> {
    let mut keys = vec![K::zeroed(); LOOKUP_CHUNK];
    let mut values = vec![V::zeroed(); LOOKUP_CHUNK];
    let mut batch: Vec<(K, V)> = Vec::with_capacity(LOOKUP_CHUNK);
    // The position between calls: a bucket number for hash maps (4 bytes), kept in
    // a buffer as large as any key to be safe.
    let (mut position, mut next) = ([0u8; 64], [0u8; 64]);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { position.as_ptr() as u64 },
            out_batch: next.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: LOOKUP_CHUNK as u32,
            ..batch_attr(map)
        };
        // SAFETY: the kernel writes at most `count` keys and values into arrays of
        // that many, and the next position into `next` (64 bytes, more than a
        // hash map's 4-byte bucket number).
        let done = unsafe { bpf_batch(bpf_cmd::BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let read = (attr.count as usize).min(LOOKUP_CHUNK);
        batch.clear();
        batch.extend(keys.iter().copied().zip(values.iter().copied()).take(read));
        match done {
            Ok(()) => each(&batch),
            // The end of the map.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                each(&batch);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        position = next;
        first = false;
    }
}

/// Every entry of `map`, handed to `each` a batch at a time (never the whole map at
/// once). Entries that the datapath adds or an LRU evicts meanwhile may be missed
/// or listed: what is read is what existed at some point of the walk. Read in
/// batches: two syscalls per entry over the full `LB_SOCK_REVNAT` on every
/// endpoint change took 53% of the CPU samples under churn. Entry by entry where
/// the kernel has no batch lookup (before 5.6).
pub(crate) fn read_in_batches<K: bytemuck::Pod + aya::Pod, V: bytemuck::Pod + aya::Pod>(
    map: &HashMap<MapData, K, V>,
    fd: BorrowedFd<'_>,
    name: &'static str,
    mut each: impl FnMut(&[(K, V)]),
) -> Result<(), MapsError> {
    let mut seen = false;
    let batched = lookup_batched(fd, |batch| {
        seen = true;
        each(batch)
    });
    // Unsupported batch lookups fail before the first batch.
    if batched.is_ok() || seen {
        return batched.map_err(|e| MapsError::Read {
            map: name,
            source: MapError::SyscallError(SyscallError {
                call: "bpf_map_lookup_batch",
                io_error: e,
            }),
        });
    }
    let mut batch = Vec::with_capacity(LOOKUP_CHUNK);
    for entry in map.iter() {
        batch.push(entry.map_err(|source| MapsError::Read { map: name, source })?);
        if batch.len() == LOOKUP_CHUNK {
            each(&batch);
            batch.clear();
        }
    }
    each(&batch);
    Ok(())
}

/// A lookup's value, `None` when the key is not there.
pub(crate) fn found<V>(
    result: Result<V, MapError>,
    map: &'static str,
) -> Result<Option<V>, MapsError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(MapsError::Read { map, source }),
    }
}

/// Deleting what is already gone is success: the end state is what the plan wants.
pub(crate) fn ignore_missing(result: Result<(), MapError>) -> Result<(), MapError> {
    match result {
        Err(MapError::KeyNotFound) => Ok(()),
        other => other,
    }
}
