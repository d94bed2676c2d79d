//! The per-flow hash that picks a Maglev slot, shared by the kernel programs and the
//! agent so both compute the same slot for the same flow.
//!
//! The hash covers the client's address and port, the frontend's port and the
//! protocol, and deliberately not the destination address: a flow that enters another
//! node (ECMP rehash, a node drained from the load balancer) arrives there with that
//! node's address or the same VIP, and must still land on the same backend.
//!
//! It is XXH64 (the published algorithm, seeded) over a fixed 24-byte record, written
//! out as straight-line 64-bit arithmetic: three lane rounds and the finalizer, with no
//! loop, no table and no division, which the BPF verifier walks in a few dozen
//! instructions. Being XXH64 exactly, any independent implementation can check it.
//!
//! The record, in byte order:
//!
//! | bytes  | field                                     |
//! |--------|-------------------------------------------|
//! | 0..16  | source address, network order (IPv4-mapped) |
//! | 16..18 | source port, network order                |
//! | 18..20 | destination port, network order           |
//! | 20     | IP protocol                               |
//! | 21..24 | zero                                      |
//!
//! XXH64 reads its input as little-endian 64-bit lanes; the words are converted with
//! `from_le`, which is free on little-endian machines (and BPF's `bpfel`) and keeps a
//! big-endian node's hash equal to everyone else's.

use crate::{IpAddrBe, MAGLEV_SLOTS_PER_ENTRY};

/// The Maglev table sizes, a ladder of primes: the largest prime below each power of
/// two from 2^8 to 2^17. A master names its table's size by its index here (see
/// `ServiceValue::maglev`); why a ladder, and which rung a backend count gets, is
/// the agent's business (`control::maglev` in lb-userspace).
pub const TABLE_SIZES: [u32; 10] = [
    251, 509, 1_021, 2_039, 4_093, 8_191, 16_381, 32_749, 65_521, 131_071,
];

/// `TABLE_SIZES[rung]` (`rung` below its length) by arithmetic alone: each size
/// is `2^(8 + rung)` less a distance below 32, five bits each in one constant.
/// The kernel programs call this in a loop (a quarantined pick's Maglev probes),
/// where an indexed read of the table had its address computed before the
/// bounds check, which the verifier refuses.
#[inline(always)]
pub const fn table_size_of_rung(rung: u32) -> u32 {
    // 5, 3, 3, 9, 3, 1, 3, 19, 15, 1: 256 - 5 = 251, 512 - 3 = 509, ...
    const BELOW: u64 = 5
        | 3 << 5
        | 3 << 10
        | 9 << 15
        | 3 << 20
        | 1 << 25
        | 3 << 30
        | 19 << 35
        | 15 << 40
        | 1 << 45;
    let rung = rung % TABLE_SIZES.len() as u32;
    (256u32 << rung) - ((BELOW >> (5 * rung)) & 31) as u32
}

/// The arena slots a table of `size` slots takes: `size` rounded up to whole
/// `LB_MAGLEV` entries, so that every table starts at an entry's first slot.
#[inline(always)]
pub const fn extent_slots(size: u32) -> u32 {
    size.div_ceil(MAGLEV_SLOTS_PER_ENTRY) * MAGLEV_SLOTS_PER_ENTRY
}

/// The seed as the four lanes of the `LB_MAGLEV` header entry (lane `i` holds bits
/// `16 i .. 16 i + 16`).
pub const fn seed_lanes(seed: u64) -> [u16; 4] {
    [
        seed as u16,
        (seed >> 16) as u16,
        (seed >> 32) as u16,
        (seed >> 48) as u16,
    ]
}

/// The seed a header entry holds (the inverse of [`seed_lanes`]).
pub const fn seed_of_lanes(lanes: [u16; 4]) -> u64 {
    lanes[0] as u64 | (lanes[1] as u64) << 16 | (lanes[2] as u64) << 32 | (lanes[3] as u64) << 48
}

const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

/// Length of the hashed record in bytes; XXH64 mixes the length into its state.
const RECORD_LEN: u64 = 24;

/// One 8-byte lane folded into the state, as XXH64 does for its tail lanes.
#[inline(always)]
const fn lane(state: u64, input: u64) -> u64 {
    let k = input
        .wrapping_mul(PRIME64_2)
        .rotate_left(31)
        .wrapping_mul(PRIME64_1);
    (state ^ k)
        .rotate_left(27)
        .wrapping_mul(PRIME64_1)
        .wrapping_add(PRIME64_4)
}

/// XXH64's finalizer: every input bit reaches every output bit.
#[inline(always)]
const fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(PRIME64_2);
    h ^= h >> 29;
    h = h.wrapping_mul(PRIME64_3);
    h ^ (h >> 32)
}

/// Two network-order address words as XXH64's little-endian lane.
#[inline(always)]
const fn words_lane(lo: u32, hi: u32) -> u64 {
    (u32::from_le(lo) as u64) | ((u32::from_le(hi) as u64) << 32)
}

/// The hash of a flow for Maglev: the low 32 bits of XXH64 (seeded with `seed`, the
/// agent's `--maglev-seed`, equal on every node) of the record in the module docs.
///
/// `sport_be` and `dport_be` are ports as packet headers and `bpf_sock_addr` carry
/// them (network byte order in a native `u16`).
#[inline(always)]
pub const fn flow_hash(
    saddr: &IpAddrBe,
    sport_be: u16,
    dport_be: u16,
    proto: u8,
    seed: u64,
) -> u32 {
    let w = &saddr.words;
    let ports_proto = (u16::from_le(sport_be) as u64)
        | ((u16::from_le(dport_be) as u64) << 16)
        | ((proto as u64) << 32);
    let mut h = seed.wrapping_add(PRIME64_5).wrapping_add(RECORD_LEN);
    h = lane(h, words_lane(w[0], w[1]));
    h = lane(h, words_lane(w[2], w[3]));
    h = lane(h, ports_proto);
    avalanche(h) as u32
}

/// The slot of a table of `table_size` entries that a flow hash selects:
/// `hash * table_size / 2^32`, a multiply and a shift rather than a division (which
/// the verifier and the CPU both charge more for), uniform for a uniform hash.
/// Always below `table_size` (for `table_size > 0`).
#[inline(always)]
pub const fn slot(hash: u32, table_size: u32) -> u32 {
    ((hash as u64 * table_size as u64) >> 32) as u32
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    fn v4(a: [u8; 4]) -> IpAddrBe {
        IpAddrBe::from_v4(u32::from_ne_bytes(a))
    }

    fn v6(octets: [u8; 16]) -> IpAddrBe {
        IpAddrBe::from(core::net::IpAddr::V6(core::net::Ipv6Addr::from(octets)))
    }

    /// Vectors produced by this function and checked against an independent XXH64
    /// (the `xxhash-rust` crate, in lb-userspace's maglev tests): a change to the
    /// record or the arithmetic breaks them.
    #[test]
    fn known_vectors() {
        let cases: [(IpAddrBe, u16, u16, u8, u64, u32); 4] = [
            (v4([0, 0, 0, 0]), 0, 0, 0, 0, KNOWN[0]),
            (
                v4([192, 0, 2, 1]),
                40000u16.to_be(),
                443u16.to_be(),
                crate::IPPROTO_TCP,
                0,
                KNOWN[1],
            ),
            (
                v4([198, 51, 100, 7]),
                53u16.to_be(),
                30053u16.to_be(),
                crate::IPPROTO_UDP,
                0x1234_5678_9abc_def0,
                KNOWN[2],
            ),
            (
                v6([
                    0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42,
                ]),
                51515u16.to_be(),
                80u16.to_be(),
                crate::IPPROTO_TCP,
                u64::MAX,
                KNOWN[3],
            ),
        ];
        for (i, (addr, sport, dport, proto, seed, want)) in cases.iter().enumerate() {
            assert_eq!(
                flow_hash(addr, *sport, *dport, *proto, *seed),
                *want,
                "vector {i}"
            );
        }
    }
    const KNOWN: [u32; 4] = [0xe729_644b, 0xc100_db64, 0x9091_4203, 0x8e69_27f9];

    /// splitmix64: a deterministic source of test inputs (no dependency).
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

    /// The inputs as one bit string: 128 address bits, 16 + 16 port bits, 8 protocol
    /// bits, 64 seed bits.
    const INPUT_BITS: usize = 128 + 16 + 16 + 8 + 64;

    #[derive(Clone, Copy)]
    struct Input {
        addr: IpAddrBe,
        sport: u16,
        dport: u16,
        proto: u8,
        seed: u64,
    }

    impl Input {
        fn random(mix: &mut Mix) -> Self {
            let (a, b) = (mix.next(), mix.next());
            let r = mix.next();
            Input {
                addr: IpAddrBe {
                    words: [a as u32, (a >> 32) as u32, b as u32, (b >> 32) as u32],
                },
                sport: r as u16,
                dport: (r >> 16) as u16,
                proto: (r >> 32) as u8,
                seed: mix.next(),
            }
        }

        fn flipped(mut self, bit: usize) -> Self {
            match bit {
                0..128 => self.addr.words[bit / 32] ^= 1 << (bit % 32),
                128..144 => self.sport ^= 1 << (bit - 128),
                144..160 => self.dport ^= 1 << (bit - 144),
                160..168 => self.proto ^= 1 << (bit - 160),
                _ => self.seed ^= 1 << (bit - 168),
            }
            self
        }

        fn hash(&self) -> u32 {
            flow_hash(&self.addr, self.sport, self.dport, self.proto, self.seed)
        }
    }

    /// Strict avalanche: flipping any one input bit flips each output bit with
    /// probability about one half, so about 16 of the 32 output bits change. Over
    /// 2000 random inputs the standard error of each per-(input, output) bit rate is
    /// about 0.011; the bounds below are far outside chance and catch any input bit
    /// that is ignored or barely mixed.
    #[test]
    fn avalanche_every_input_bit() {
        const SAMPLES: usize = 2000;
        let mut mix = Mix(0x5eed);
        let mut flips = std::vec![[0u32; 32]; INPUT_BITS];
        for _ in 0..SAMPLES {
            let input = Input::random(&mut mix);
            let base = input.hash();
            for (bit, counts) in flips.iter_mut().enumerate() {
                let diff = base ^ input.flipped(bit).hash();
                for (out, count) in counts.iter_mut().enumerate() {
                    *count += (diff >> out) & 1;
                }
            }
        }
        for (bit, counts) in flips.iter().enumerate() {
            let mean_changed = counts.iter().sum::<u32>() as f64 / SAMPLES as f64;
            assert!(
                (15.0..=17.0).contains(&mean_changed),
                "input bit {bit}: {mean_changed:.2} output bits change on average"
            );
            for (out, count) in counts.iter().enumerate() {
                let rate = *count as f64 / SAMPLES as f64;
                assert!(
                    (0.42..=0.58).contains(&rate),
                    "input bit {bit} flips output bit {out} at rate {rate:.3}"
                );
            }
        }
    }

    #[test]
    fn extents_are_whole_entries_and_the_seed_round_trips() {
        assert_eq!(extent_slots(251), 252);
        assert_eq!(extent_slots(1_021), 1_024);
        assert_eq!(extent_slots(131_071), 131_072);
        for size in TABLE_SIZES {
            let extent = extent_slots(size);
            assert!(extent >= size && extent - size < MAGLEV_SLOTS_PER_ENTRY);
            assert_eq!(extent % MAGLEV_SLOTS_PER_ENTRY, 0);
        }
        for seed in [0, 1, 0x1234_5678_9abc_def0, u64::MAX] {
            assert_eq!(seed_of_lanes(seed_lanes(seed)), seed);
        }
        assert_eq!(seed_lanes(0x0004_0003_0002_0001), [1, 2, 3, 4]);
    }

    /// The flags name the size by its rung, `backend_id` the first slot; nothing
    /// else reads as a Maglev master.
    #[test]
    fn masters_name_their_table_through_the_flags() {
        use crate::{maglev_flags, ServiceValue, SVC_FLAG_AFFINITY, SVC_FLAG_MAGLEV};
        for (rung, size) in TABLE_SIZES.iter().enumerate() {
            let master = ServiceValue {
                backend_id: 4096,
                count: 3,
                flags: SVC_FLAG_AFFINITY | maglev_flags(rung).unwrap(),
                ..ServiceValue::default()
            };
            assert_eq!(master.maglev(), Some((4096, *size)));
            assert!(master.is_affinity());
        }
        assert_eq!(maglev_flags(TABLE_SIZES.len()), None);
        let plain = ServiceValue {
            backend_id: 4096,
            ..ServiceValue::default()
        };
        assert_eq!(plain.maglev(), None);
        // A size index past the ladder, which no agent writes.
        let bad = ServiceValue {
            flags: SVC_FLAG_MAGLEV | (12 << 8),
            ..plain
        };
        assert_eq!(bad.maglev(), None);
    }

    #[test]
    fn table_sizes_by_arithmetic_are_the_ladder() {
        for (rung, size) in TABLE_SIZES.iter().enumerate() {
            assert_eq!(table_size_of_rung(rung as u32), *size, "rung {rung}");
        }
    }

    #[test]
    fn slot_is_in_range_and_spans_it() {
        for m in [1u32, 251, 1009, 65_537, 131_071] {
            assert_eq!(slot(0, m), 0);
            assert_eq!(slot(u32::MAX, m), m - 1);
            let mut mix = Mix(u64::from(m));
            for _ in 0..1000 {
                assert!(slot(mix.next() as u32, m) < m);
            }
        }
    }
}
