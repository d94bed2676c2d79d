//! The kernel memory of Maglev at scale, measured rather than estimated: 100k
//! NodePort Services x 10 endpoints (no two with the same endpoints, so 100k
//! tables), every one Maglev, planned and written into real maps by the agent's
//! planner and map writer, then each map's `memlock` read from its fdinfo (what the
//! kernel charges for it). Prints the figures and the plan and write times.
//!
//! Ignored by default (a minute and about 0.5 GB of kernel memory); run by hand as
//! root, in release mode:
//!
//! ```text
//! LB_EBPF_OBJECT=$PWD/lb-ebpf/target/bpfel-unknown-none/release/lb-ebpf \
//!   cargo test --release -p lb-userspace --test maglev_scale -- --ignored --nocapture
//! ```
//!
//! `LB_MAGLEV_SCALE_SERVICES` (default 100000) sets the number of Services;
//! `LB_MAGLEV_SCALE_RANDOM=1` makes every frontend random, the same run without
//! Maglev to compare with.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use lb_common::map_names;
use lb_userspace::control::known::KnownTable;
use lb_userspace::control::plan;
use lb_userspace::datapath::loader;
use lb_userspace::datapath::maps::PinnedMaps;
use lb_userspace::datapath::pins::{self, MapSizes, PinLayout};
use lb_userspace::model::{BackendAddr, DesiredState, Frontend, FrontendSpec, Protocol};
use lb_userspace::node::host as sys;

const SEED: u64 = 0x6c62_0000_0000_0001;
const BACKENDS: u32 = 10;

/// Removes the test's pins however it ends.
struct PinGuard(PinLayout);

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Ok(Some(lock)) = pins::lock_for_cleanup(&self.0) {
            let _ = pins::cleanup(&self.0, &lock);
        }
    }
}

/// `memlock` of a pinned map, from the fdinfo of a descriptor opened on its pin.
fn memlock(layout: &PinLayout, map: &str) -> u64 {
    let data = aya::maps::MapData::from_pin(layout.map_path(map)).expect("open the pin");
    use std::os::fd::{AsFd, AsRawFd};
    let fd = data.fd().as_fd().as_raw_fd();
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("memlock:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("fdinfo has memlock")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// Service `i`: cluster IP 10.{i}, a NodePort on the node's address, ten endpoints
/// of its own (10.128.0.0/9 counted up), the NodePort Maglev when `maglev`.
fn desired(services: u32, maglev: bool) -> DesiredState {
    let node: IpAddr = Ipv4Addr::new(192, 168, 50, 2).into();
    let mut desired = DesiredState::default();
    for i in 0..services {
        let backends: BTreeSet<BackendAddr> = (0..BACKENDS)
            .map(|b| BackendAddr {
                ip: Ipv4Addr::from(0x0a80_0000 + i * BACKENDS + b).into(),
                port: 8080,
                local: false,
            })
            .collect();
        let spec = |maglev| FrontendSpec {
            service: format!("default/svc-{i}:http").into(),
            backends: backends.clone().into(),
            affinity_timeout_sec: None,
            source_ranges: None,
            maglev,
            cluster_ip: false,
        };
        let cluster_ip = IpAddr::from(Ipv4Addr::from(0x0a00_0000 + i));
        desired.frontends.insert(
            Frontend::internal(cluster_ip, 80, Protocol::Tcp),
            spec(false),
        );
        // NodePorts 30000.. on two node "addresses" (ports run out at 32767).
        let (port, node) = (30000 + (i % 2700) as u16, node_of(node, i / 2700));
        desired
            .frontends
            .insert(Frontend::internal(node, port, Protocol::Tcp), spec(maglev));
    }
    desired
}

/// The node's `k`-th address (a node with many: each one holds 2700 NodePorts here,
/// as the NodePort range would on 38 nodes).
fn node_of(base: IpAddr, k: u32) -> IpAddr {
    match base {
        IpAddr::V4(v4) => Ipv4Addr::from(u32::from(v4) + (k << 8)).into(),
        v6 => v6,
    }
}

#[test]
#[ignore = "by hand: 100k Maglev tables in real maps (about 0.5 GB of kernel memory)"]
fn kernel_memory_of_100k_maglev_services() {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    assert!(unsafe { libc::geteuid() } == 0, "run as root");
    let services: u32 = std::env::var("LB_MAGLEV_SCALE_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let maglev = std::env::var("LB_MAGLEV_SCALE_RANDOM").as_deref() != Ok("1");
    let name = format!(
        "lb-maglev-scale-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let layout = PinLayout::new(std::path::Path::new(sys::BPFFS_ROOT).join(name));
    sys::ensure_bpffs(layout.root()).expect("bpffs");
    let _pins = PinGuard(layout.clone());
    // Entries: a master and ten slots per frontend, two frontends per Service.
    let entries = services * 2 * (1 + BACKENDS);
    let sizes = MapSizes {
        services: entries.next_power_of_two(),
        backends: (services * 2 * BACKENDS).next_power_of_two(),
        conntrack: 1024,
        // 1024 slots a 10-backend table, the header's 4 and a little room; the
        // default (4 MiB) when no frontend is Maglev, as an agent would have it.
        maglev_slots: if maglev {
            services * 1024 + 4096
        } else {
            lb_common::DEFAULT_MAGLEV_SLOTS
        },
        ..MapSizes::default()
    };
    let object = loader::kernel_object(None).expect("kernel object embedded");
    let ebpf = loader::load(&object, &layout, sizes, &[], SEED).expect("load");
    let mut maps = PinnedMaps::open(&layout).expect("open maps");
    maps.set_maglev_seed(SEED);
    let capacity = maps.capacity();

    let d = desired(services, maglev);
    let mut known = KnownTable::new(maps.snapshot().unwrap(), capacity);
    let (mut planning, mut writing) = (Duration::ZERO, Duration::ZERO);
    let mut tables = 0;
    let mut started = Instant::now();
    plan::plan_in_pieces(&d, &mut known, capacity, 1024, |p| {
        let planned = Instant::now();
        planning += planned - started;
        assert!(p.rejected.is_empty(), "{:?}", &p.rejected[..1]);
        tables += p
            .ops
            .iter()
            .filter(|op| {
                matches!(
                    op,
                    lb_userspace::datapath::snapshot::MapOp::PutMaglev { .. }
                )
            })
            .count();
        maps.apply(&p.ops).expect("written");
        started = Instant::now();
        writing += started - planned;
        Ok::<(), ()>(())
    })
    .unwrap();
    let want = if maglev { services as usize } else { 0 };
    assert_eq!(tables, want, "one table per Service");
    assert_eq!(known.maglev().len(), want);

    // A full plan over what was written (a restart, a repair) finds nothing to do.
    let read = Instant::now();
    let snapshot = maps.snapshot().unwrap();
    let read = read.elapsed();
    let full = Instant::now();
    let again = plan::plan(&d, &snapshot, capacity);
    let full = full.elapsed();
    assert!(again.is_empty(), "{} ops left", again.ops.len());
    let rebuilt = Instant::now();
    let known_again = KnownTable::new(snapshot, capacity);
    let rebuilt = rebuilt.elapsed();
    assert_eq!(known_again.maglev().len(), want);

    let arena = memlock(&layout, map_names::MAGLEV);
    let svc = memlock(&layout, map_names::SERVICES);
    let backends = memlock(&layout, map_names::BACKENDS);
    println!(
        "{services} Services x {BACKENDS} backends, {} ({} frontends, {entries} \
         LB_SERVICES entries, {tables} tables):",
        if maglev {
            "NodePorts Maglev"
        } else {
            "all random"
        },
        d.frontends.len()
    );
    println!(
        "  LB_MAGLEV memlock {arena} B = {:.1} MiB ({} slots, max_entries {})",
        mib(arena),
        sizes.maglev_slots,
        sizes.maglev_entries()
    );
    println!(
        "  LB_SERVICES memlock {svc} B = {:.1} MiB (max_entries {}, not preallocated)",
        mib(svc),
        sizes.services
    );
    println!(
        "  LB_BACKENDS memlock {backends} B = {:.1} MiB; Maglev + services = {:.1} MiB",
        mib(backends),
        mib(arena + svc)
    );
    println!(
        "  start in pieces of 1024 frontends: plan {:.2} s (tables built included), \
         write {:.2} s; full plan over the written maps {:.2} s (read {:.2} s), \
         kept table rebuilt {:.2} s",
        planning.as_secs_f64(),
        writing.as_secs_f64(),
        full.as_secs_f64(),
        read.as_secs_f64(),
        rebuilt.as_secs_f64()
    );
    drop(ebpf);
}
