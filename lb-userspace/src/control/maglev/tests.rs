use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use lb_common::{maglev, IpAddrBe};
use proptest::prelude::*;

use super::*;

/// splitmix64: deterministic test inputs without a dependency.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// `n` backends at consecutive IPv4 addresses from `first`, all on `port`.
fn consecutive(first: Ipv4Addr, n: usize, port: u16) -> Vec<(IpAddr, u16)> {
    (0..n as u32)
        .map(|i| (IpAddr::V4(Ipv4Addr::from(u32::from(first) + i)), port))
        .collect()
}

fn ids(backends: &[(IpAddr, u16)]) -> Vec<Identity> {
    identities(backends.iter().copied()).expect("backends in table order")
}

/// Which backend each slot sends to, by identity: what a flow sees, whatever the
/// positions.
fn owners(table: &[u16], identities: &[Identity]) -> Vec<Identity> {
    table.iter().map(|&p| identities[usize::from(p)]).collect()
}

fn moved<T: PartialEq>(before: &[T], after: &[T]) -> f64 {
    assert_eq!(before.len(), after.len(), "tables of one size");
    let changed = before.iter().zip(after).filter(|(a, b)| a != b).count();
    changed as f64 / before.len() as f64
}

fn balance(table: &[u16], n: usize) -> f64 {
    let shares = shares(table, n);
    let (min, max) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
    assert!(*min > 0, "every backend owns a slot: {shares:?}");
    f64::from(*max) / f64::from(*min)
}

#[test]
fn table_sizes_are_the_largest_primes_below_powers_of_two() {
    for (i, &size) in TABLE_SIZES.iter().enumerate() {
        let power = 1u32 << (8 + i);
        assert!(is_prime(size), "{size}");
        assert!(size < power, "{size} below {power}");
        assert!(
            (size + 1..power).all(|k| !is_prime(k)),
            "{size} is the largest prime below {power}"
        );
    }
}

#[test]
fn table_size_is_the_smallest_rung_with_100_slots_per_backend() {
    let cases = [
        (1, 251),
        (2, 251),
        (3, 509),
        (5, 509),
        (6, 1_021),
        (10, 1_021),
        (11, 2_039),
        (100, 16_381),
        (655, 65_521),
        (656, 131_071),
        (1_000, 131_071),
        (1_310, 131_071),
        (1_311, 131_071),
        (MAX_BACKENDS, 131_071),
    ];
    for (n, size) in cases {
        assert_eq!(table_size(n), Ok(size), "{n} backends");
    }
    assert_eq!(table_size(0), Err(MaglevError::NoBackends));
    assert_eq!(
        table_size(MAX_BACKENDS + 1),
        Err(MaglevError::TooManyBackends {
            count: 65_536,
            max: 65_535
        })
    );
}

#[test]
fn identities_number_repeated_addresses_and_leave_out_ports() {
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    let got = ids(&[(a, 80), (a, 81), (b, 80)]);
    assert_eq!(
        got,
        [
            Identity::new(a, 0),
            Identity::new(a, 1),
            Identity::new(b, 0)
        ]
    );
    assert_eq!(got[1].to_string(), "10.0.0.1#1");
    // Two ports of one Service: the same pods behind other target ports.
    let http = consecutive(Ipv4Addr::new(10, 0, 0, 1), 5, 8080);
    let https = consecutive(Ipv4Addr::new(10, 0, 0, 1), 5, 8443);
    assert_eq!(ids(&http), ids(&https));
    assert_eq!(
        build(&ids(&http), 509, 1).unwrap(),
        build(&ids(&https), 509, 1).unwrap()
    );
}

#[test]
fn identities_want_strictly_ascending_backends() {
    let mut backends = consecutive(Ipv4Addr::new(10, 0, 0, 1), 3, 80);
    backends.swap(0, 2);
    assert!(matches!(
        identities(backends.iter().copied()),
        Err(MaglevError::NotOrdered { index: 1, .. })
    ));
    sort_backends(&mut backends);
    assert!(identities(backends.iter().copied()).is_ok());
    backends.push(backends[2]);
    assert!(matches!(
        identities(backends.iter().copied()),
        Err(MaglevError::NotOrdered { index: 3, .. })
    ));
    // A BTreeSet of one family's (address, port) is already in table order.
    let set: BTreeSet<(IpAddr, u16)> = [
        ("fd00::2", 80),
        ("fd00::1", 443),
        ("fd00::1", 80),
        ("fd00::10", 1),
    ]
    .into_iter()
    .map(|(a, p)| (a.parse().unwrap(), p))
    .collect();
    let got = identities(set.iter().copied()).unwrap();
    assert_eq!(got[0].occurrence, 0);
    assert_eq!(got[1].occurrence, 1);
}

#[test]
fn build_rejects_what_it_cannot_build() {
    let five = ids(&consecutive(Ipv4Addr::new(10, 0, 0, 1), 5, 80));
    assert_eq!(build(&[], 251, 0), Err(MaglevError::NoBackends));
    for size in [250, 3, 131_101, 0, 1] {
        assert_eq!(
            build(&five, size, 0),
            Err(MaglevError::BadTableSize { size, backends: 5 }),
            "size {size}"
        );
    }
    assert_eq!(build(&five, 5, 0).map(|t| t.len()), Ok(5));
    let mut repeated = five.clone();
    repeated[3] = repeated[1];
    assert_eq!(
        build(&repeated, 251, 0),
        Err(MaglevError::DuplicateIdentity {
            identity: five[1],
            first: 1,
            second: 3
        })
    );
}

#[test]
fn a_one_backend_table_is_all_that_backend() {
    let one = ids(&consecutive(Ipv4Addr::new(10, 0, 0, 1), 1, 80));
    assert_eq!(build(&one, 251, 9).unwrap(), vec![0u16; 251]);
}

#[test]
fn every_backend_owns_its_share_to_one_slot() {
    for n in [1, 2, 3, 7, 10, 64, 655, 1_000, 5_000] {
        let backends = ids(&consecutive(Ipv4Addr::new(10, 1, 0, 0), n, 80));
        let size = table_size(n).unwrap();
        let table = build(&backends, size, 42).unwrap();
        let shares = shares(&table, n);
        let floor = size / n as u32;
        assert!(
            shares.iter().all(|&s| s == floor || s == floor + 1),
            "{n} backends in {size} slots"
        );
        assert_eq!(shares.iter().sum::<u32>(), size);
    }
}

/// Each slot's backend, by identity, for random sets: how quarantine and removal
/// compare.
fn random_set(mix: &mut Mix, n: usize) -> Vec<(IpAddr, u16)> {
    let set: BTreeSet<u32> = std::iter::repeat_with(|| mix.next() as u32)
        .take(n)
        .collect();
    set.into_iter()
        .map(|a| (IpAddr::V4(Ipv4Addr::from(a)), 8080))
        .collect()
}

#[test]
fn excluded_backends_lose_their_slots_as_if_absent() {
    let mut mix = Mix(26);
    for n in [2, 3, 10, 50] {
        let backends = random_set(&mut mix, n);
        let all = ids(&backends);
        let size = table_size(n).unwrap();
        let full = build(&all, size, 7).unwrap();
        let quarantined: &[usize] = if n > 2 { &[0, n / 2] } else { &[1] };
        let is_out = |p: usize| quarantined.contains(&p);
        let without = build_without(&all, size, 7, is_out).unwrap();
        // The table of the set without them, at the same size.
        let rest: Vec<Identity> = (0..n).filter(|&p| !is_out(p)).map(|p| all[p]).collect();
        let absent = build(&rest, size, 7).unwrap();
        assert_eq!(
            owners(&without, &all),
            owners(&absent, &rest),
            "{n} backends"
        );
        let got = shares(&without, n);
        assert!(quarantined.iter().all(|&p| got[p] == 0), "{got:?}");
        // The others keep most of their slots (a rebuilt table of another kind
        // would keep about 1 in n - 2 of them): Maglev's cascade moves a few
        // percent per excluded backend, as removals do.
        let kept = full
            .iter()
            .zip(&without)
            .filter(|(before, _)| !is_out(usize::from(**before)))
            .filter(|(before, after)| before == after)
            .count();
        let others = full.iter().filter(|p| !is_out(usize::from(**p))).count();
        assert!(
            kept as f64 >= 0.9 * others as f64,
            "{n} backends: {kept} of {others} slots kept"
        );
    }
}

#[test]
fn every_backend_excluded_is_the_full_table() {
    let all = ids(&consecutive(Ipv4Addr::new(10, 0, 0, 1), 3, 80));
    assert_eq!(
        build_without(&all, 509, 3, |_| true).unwrap(),
        build(&all, 509, 3).unwrap()
    );
}

/// A flow's backend as the kernel will find it: hash, slot, table.
fn pick(table: &[u16], addr: &IpAddrBe, sport: u16, dport: u16, proto: u8, seed: u64) -> u16 {
    let hash = maglev::flow_hash(addr, sport.to_be(), dport.to_be(), proto, seed);
    table[maglev::slot(hash, table.len() as u32) as usize]
}

/// Random client flows land on each backend in proportion to its slots (within
/// six standard deviations), and none on a quarantined one.
#[test]
fn flows_land_on_backends_in_proportion_to_their_slots() {
    const FLOWS: u32 = 200_000;
    let mut mix = Mix(0xf10);
    let seed = 0x5eed;
    for n in [3, 10, 40] {
        let all = ids(&random_set(&mut mix, n));
        let size = table_size(n).unwrap();
        for quarantined in [None, Some(1)] {
            let table = build_without(&all, size, seed, |p| Some(p) == quarantined).unwrap();
            let mut landed = vec![0u32; n];
            for _ in 0..FLOWS {
                let r = mix.next();
                let client = IpAddrBe::from_v4(mix.next() as u32);
                let p = pick(&table, &client, r as u16, 30080, 6, seed);
                landed[usize::from(p)] += 1;
            }
            for (position, (&got, share)) in landed.iter().zip(shares(&table, n)).enumerate() {
                let p = f64::from(share) / f64::from(size);
                let want = p * f64::from(FLOWS);
                let sigma = (f64::from(FLOWS) * p * (1.0 - p)).sqrt();
                assert!(
                    (f64::from(got) - want).abs() <= 6.0 * sigma,
                    "{n} backends, quarantined {quarantined:?}: backend {position} got \
                         {got} flows, {want:.0} expected"
                );
            }
            if let Some(q) = quarantined {
                assert_eq!(landed[q], 0);
            }
        }
    }
}

/// lb-common's straight-line flow hash is XXH64 of its documented record, checked
/// against an independent implementation.
#[test]
fn flow_hash_is_xxh64_of_its_record() {
    let mut mix = Mix(64);
    for i in 0..10_000 {
        let (a, b, r, seed) = (mix.next(), mix.next(), mix.next(), mix.next());
        let mut octets = [0u8; 16];
        octets[..8].copy_from_slice(&a.to_be_bytes());
        octets[8..].copy_from_slice(&b.to_be_bytes());
        if i % 2 == 0 {
            octets[..12].copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        }
        let (sport, dport, proto) = (r as u16, (r >> 16) as u16, (r >> 32) as u8);
        let mut record = [0u8; 24];
        record[..16].copy_from_slice(&octets);
        record[16..18].copy_from_slice(&sport.to_be_bytes());
        record[18..20].copy_from_slice(&dport.to_be_bytes());
        record[20] = proto;
        let want = xxhash_rust::xxh64::xxh64(&record, seed) as u32;
        let addr = IpAddrBe::from(IpAddr::V6(Ipv6Addr::from(octets)));
        let got = maglev::flow_hash(&addr, sport.to_be(), dport.to_be(), proto, seed);
        assert_eq!(got, want, "{addr:?} {sport} {dport} {proto} {seed:#x}");
    }
}

/// Prints build times (run with `--nocapture`; an unoptimized build is several
/// times slower than the agent's release build) and checks the tables.
#[test]
fn build_time() {
    for (n, size) in [
        (10, None),
        (1_000, None),
        (10, Some(1_009)),
        (1_000, Some(100_003)),
    ] {
        let all = ids(&consecutive(Ipv4Addr::new(10, 2, 0, 0), n, 80));
        let size = size.unwrap_or_else(|| table_size(n).unwrap());
        let runs = 20;
        let start = Instant::now();
        for seed in 0..runs {
            let table = build(&all, size, seed).unwrap();
            assert!(balance(&table, n) <= 1.1);
        }
        let each = start.elapsed() / runs as u32;
        println!("maglev build: {n} backends, {size} slots: {each:?} per table");
    }
}

/// One golden table: the backends (consecutive addresses from `first`, or listed),
/// the seed, and the positions excluded.
struct GoldenTable {
    backends: Vec<(IpAddr, u16)>,
    seed: u64,
    excluded: &'static [usize],
}

fn listed(backends: &[&str]) -> Vec<(IpAddr, u16)> {
    let mut out: Vec<(IpAddr, u16)> = backends
        .iter()
        .map(|b| {
            let s: SocketAddr = b.parse().unwrap();
            (s.ip(), s.port())
        })
        .collect();
    sort_backends(&mut out);
    out
}

fn golden_tables() -> Vec<GoldenTable> {
    vec![
        GoldenTable {
            backends: listed(&["10.0.0.1:80"]),
            seed: 0,
            excluded: &[],
        },
        GoldenTable {
            backends: listed(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]),
            seed: 0,
            excluded: &[],
        },
        GoldenTable {
            backends: listed(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]),
            seed: 0,
            excluded: &[1],
        },
        GoldenTable {
            backends: consecutive(Ipv4Addr::new(10, 244, 1, 10), 10, 8080),
            seed: 0x5eed,
            excluded: &[],
        },
        GoldenTable {
            backends: listed(&[
                "[fd00::1]:80",
                "[fd00::1]:8080",
                "[fd00::a]:80",
                "[2001:db8::7]:443",
                "[fd00:0:0:1::2]:80",
            ]),
            seed: u64::MAX,
            excluded: &[],
        },
        GoldenTable {
            backends: consecutive(Ipv4Addr::new(10, 1, 0, 0), 100, 8080),
            seed: 1,
            excluded: &[],
        },
        GoldenTable {
            backends: consecutive(Ipv4Addr::new(10, 1, 0, 0), 1_000, 8080),
            seed: 1,
            excluded: &[0, 999],
        },
    ]
}

fn joined(values: &[u16]) -> String {
    values
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The golden file as this code computes it.
fn golden_text() -> String {
    let mut out = String::from(
        "# Maglev golden vectors, checked by lb-userspace's maglev tests (golden_vectors).\n\
             # A change here moves flows to other backends when nodes upgrade one by one: it\n\
             # must be deliberate. Rewrite with LB_UPDATE_GOLDEN=1 cargo test -p lb-userspace \
             --lib golden_vectors\n\
             #\n\
             # table: backends in table order, the seed, the positions excluded, the table\n\
             # size, its first and last 8 entries, and XXH3-64 (seed 0) of the whole table\n\
             # as little-endian u16s.\n",
    );
    for t in golden_tables() {
        let all = ids(&t.backends);
        let size = table_size(all.len()).unwrap();
        let table = build_without(&all, size, t.seed, |p| t.excluded.contains(&p)).unwrap();
        let bytes: Vec<u8> = table.iter().flat_map(|p| p.to_le_bytes()).collect();
        let backends = if t.backends.len() > 10 {
            format!(
                "{}..{}({})",
                SocketAddr::from(t.backends[0]),
                SocketAddr::from(t.backends[t.backends.len() - 1]),
                t.backends.len()
            )
        } else {
            t.backends
                .iter()
                .map(|&b| SocketAddr::from(b).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let excluded: Vec<String> = t.excluded.iter().map(usize::to_string).collect();
        out += &format!(
            "table backends={backends} seed={:#x} excluded=[{}] size={size} first={} \
                 last={} xxh3={:#018x}\n",
            t.seed,
            excluded.join(","),
            joined(&table[..8]),
            joined(&table[table.len() - 8..]),
            xxh3_64_with_seed(&bytes, 0),
        );
    }
    out += "#\n# flow: the flow hash of a client flow, and its slot in a table of 1021.\n";
    let flows: [(&str, u16, u16, u8, u64); 5] = [
        ("0.0.0.0", 0, 0, 0, 0),
        ("192.0.2.1", 40_000, 443, 6, 0),
        ("198.51.100.7", 53, 30_053, 17, 0x1234_5678_9abc_def0),
        ("2001:db8::42", 51_515, 80, 6, u64::MAX),
        ("::ffff:203.0.113.9", 65_535, 32_767, 6, 0x5eed),
    ];
    for (addr, sport, dport, proto, seed) in flows {
        let ip: IpAddr = addr.parse::<IpAddr>().unwrap().to_canonical();
        let hash = maglev::flow_hash(
            &IpAddrBe::from(ip),
            sport.to_be(),
            dport.to_be(),
            proto,
            seed,
        );
        out += &format!(
            "flow saddr={ip} sport={sport} dport={dport} proto={proto} seed={seed:#x} \
                 hash={hash:#010x} slot={}\n",
            maglev::slot(hash, 1_021)
        );
    }
    out
}

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/maglev-golden.txt");

#[test]
fn golden_vectors() {
    let want = golden_text();
    if std::env::var_os("LB_UPDATE_GOLDEN").is_some() {
        std::fs::write(GOLDEN, &want).unwrap();
    }
    let held = std::fs::read_to_string(GOLDEN).unwrap_or_default();
    assert!(
        held == want,
        "{GOLDEN} disagrees with the code. The code now gives:\n{want}"
    );
}

fn backend_set(max: usize) -> impl Strategy<Value = Vec<(IpAddr, u16)>> {
    let v4 = proptest::collection::btree_set(any::<u32>(), 1..=max).prop_map(|set| {
        set.into_iter()
            .map(|a| (IpAddr::V4(Ipv4Addr::from(a)), 8080))
            .collect::<Vec<_>>()
    });
    // IPv6 sets with repeated addresses (several ports of one pod).
    let v6 = proptest::collection::btree_set((0u16..64, 1u16..4), 1..=max).prop_map(|set| {
        set.into_iter()
            .map(|(a, port)| (IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, a)), port))
            .collect::<Vec<_>>()
    });
    prop_oneof![3 => v4, 1 => v6]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any insertion order gives the same table (by identity), built twice or on
    /// another node.
    #[test]
    fn the_same_set_gives_the_same_table_in_any_order(
        backends in backend_set(300),
        seed: u64,
        shuffle in any::<proptest::sample::Index>(),
    ) {
        let all = ids(&backends);
        let size = table_size(all.len()).unwrap();
        let table = build(&all, size, seed).unwrap();
        prop_assert_eq!(&table, &build(&all, size, seed).unwrap());
        // The same identities handed over in another order.
        let mut shuffled = all.clone();
        let mut mix = Mix(shuffle.index(usize::MAX) as u64);
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, (mix.next() % (i as u64 + 1)) as usize);
        }
        let other = build(&shuffled, size, seed).unwrap();
        prop_assert_eq!(owners(&table, &all), owners(&other, &shuffled));
        // And the backends listed in another order, sorted back.
        let mut again = backends.clone();
        again.reverse();
        sort_backends(&mut again);
        prop_assert_eq!(table, build(&ids(&again), size, seed).unwrap());
    }

    /// Largest share / smallest share <= 1.1 at the sizes table_size gives (at
    /// least 100 slots per backend up to 1310 backends).
    #[test]
    fn shares_are_balanced(n in 1usize..=1_000, seed: u64) {
        let all = ids(&consecutive(Ipv4Addr::new(10, 3, 0, 0), n, 80));
        let table = build(&all, table_size(n).unwrap(), seed).unwrap();
        prop_assert!(balance(&table, n) <= 1.1);
    }

    /// The bound, 1/N + 2% for each removal: classic Maglev meets it at
    /// 100 or more slots per backend once N is in the hundreds (measured over 400
    /// random removals: largest extra 1.7% at N = 250, 0.6% at 1000). Smaller
    /// sets: `small_sets_move_a_little_more`.
    #[test]
    fn removing_a_backend_moves_about_its_share(
        addresses in proptest::collection::btree_set(any::<u32>(), 256..=1_000),
        seed: u64,
        which: proptest::sample::Index,
    ) {
        let backends = v4_set(addresses);
        let n = backends.len();
        prop_assume!(table_size(n) == table_size(n - 1));
        let moved = removal_moves(&backends, which.index(n), seed);
        prop_assert!(moved <= 1.0 / n as f64 + 0.02, "1 of {} backends: {:.4} moved", n, moved);
    }

    /// Adding one to N - 1 backends is the reverse of removing it: the same bound.
    #[test]
    fn adding_a_backend_moves_about_its_share(
        addresses in proptest::collection::btree_set(any::<u32>(), 256..=1_000),
        seed: u64,
        which: proptest::sample::Index,
    ) {
        let backends = v4_set(addresses);
        let n = backends.len();
        prop_assume!(table_size(n) == table_size(n - 1));
        let added = which.index(n);
        let fewer: Vec<_> = backends.iter().enumerate().filter(|(i, _)| *i != added).map(|(_, b)| *b).collect();
        let size = table_size(n).unwrap();
        let before = by_backend(&fewer, size, seed, &[]);
        let after = by_backend(&backends, size, seed, &[]);
        let moved = moved(&before, &after);
        prop_assert!(moved <= 1.0 / n as f64 + 0.02, "{} backends + 1: {:.4} moved", n - 1, moved);
    }
}

fn v4_set(addresses: BTreeSet<u32>) -> Vec<(IpAddr, u16)> {
    addresses
        .into_iter()
        .map(|a| (IpAddr::V4(Ipv4Addr::from(a)), 8080))
        .collect()
}

/// Each slot's backend, as a flow sees it (address and port).
fn by_backend(
    backends: &[(IpAddr, u16)],
    size: u32,
    seed: u64,
    excluded: &[usize],
) -> Vec<(IpAddr, u16)> {
    let table = build_without(&ids(backends), size, seed, |p| excluded.contains(&p)).unwrap();
    table.iter().map(|&p| backends[usize::from(p)]).collect()
}

/// The share of slots that change backend when the backend at `removed` leaves,
/// at the set's table size.
fn removal_moves(backends: &[(IpAddr, u16)], removed: usize, seed: u64) -> f64 {
    let size = table_size(backends.len()).unwrap();
    let mut fewer = backends.to_vec();
    fewer.remove(removed);
    moved(
        &by_backend(backends, size, seed, &[]),
        &by_backend(&fewer, size, seed, &[]),
    )
}

/// Below a few hundred backends, classic Maglev at 100 to 200 slots per backend
/// moves more than 1/N + 2% in many removals (Maglev's known cascade: the slots
/// the removed backend took early are claimed by others, whose later claims then
/// shift). Measured over 400 random removals at the table_size sizes, the extra
/// beyond 1/N averages 0.8% (N = 3) to 2.5% (N = 10, 20) and reaches 22% at N = 4.
/// This keeps the average within 3% and every removal within 30%, and prints the
/// distribution (`--nocapture`).
#[test]
fn small_sets_move_a_little_more() {
    const SETS: usize = 100;
    let mut mix = Mix(0xd15);
    for n in [3, 4, 5, 8, 10, 20, 40, 81, 163, 255] {
        let mut extra: Vec<f64> = (0..SETS)
            .map(|_| {
                let backends = random_set(&mut mix, n);
                let removed = (mix.next() % n as u64) as usize;
                removal_moves(&backends, removed, mix.next()) - 1.0 / n as f64
            })
            .collect();
        extra.sort_by(f64::total_cmp);
        let mean = extra.iter().sum::<f64>() / SETS as f64;
        let worst = extra[SETS - 1];
        println!(
            "maglev removal, {n} backends in {}: extra moved mean {:.2}%, p90 {:.2}%, max {:.2}%",
            table_size(n).unwrap(),
            mean * 100.0,
            extra[SETS * 9 / 10] * 100.0,
            worst * 100.0
        );
        assert!(mean <= 0.03, "{n} backends: {mean:.4} extra on average");
        assert!(worst <= 0.30, "{n} backends: {worst:.4} extra at worst");
    }
}
