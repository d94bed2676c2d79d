//! Passive health: a backend that refuses a new connection (a RST to the SYN, an
//! ICMP unreachable, a `connect()` failing through the socket hooks) is skipped by
//! the new connections of that frontend for a while, with no health checker.
//!
//! Everything here is pure and shared: the kernel programs call it on the
//! `LB_QUARANTINE` entry in place, the agent's tests call the same functions, so
//! the backoff and the order in which a new connection looks past a quarantined
//! pick are one piece of code for both.
//!
//! - Backoff: the first refusal quarantines the backend for 1 s; a refusal after
//!   that quarantine ended (the backend was tried again and refused again) doubles
//!   it, up to 60 s; the first connection it accepts clears it. Refusals *during* a
//!   quarantine (SYNs that were already on their way when the first RST came back)
//!   do not add to it: one outage, one step.
//! - Fall-through: a new connection whose pick is quarantined looks at a bounded
//!   list of other candidates ([`scan_slot`] for random picks, [`maglev_probe`]
//!   then [`scan_slot`] for Maglev) and takes the first that is not; when every
//!   candidate is quarantined it keeps its first pick, so a Service whose every
//!   backend refuses behaves as without quarantine.

use crate::{QuarantineValue, QUARANTINE_FLAG_BY_SOCKET};

/// The first quarantine of a backend.
pub const BASE_NS: u64 = 1_000_000_000;
/// The longest quarantine, however often the backend refused.
pub const MAX_NS: u64 = 60_000_000_000;
/// The level at which the backoff reaches [`MAX_NS`] (1 s << 6 = 64 s, capped);
/// strikes beyond it are not counted, so the counter never wraps.
pub const MAX_LEVEL: u32 = 7;

/// How many candidates a new connection looks at beyond its first pick when that
/// one is quarantined (random picks: the first `min(count, SCAN_TRIES)` of
/// [`scan_slot`]'s order, which with up to this many backends is every one).
/// Bounded so the verifier walks a short loop.
pub const SCAN_TRIES: u32 = 8;
/// Maglev frontends first look this many further entries down the flow's probe
/// sequence ([`maglev_probe`]), then fall to the random scan.
pub const MAGLEV_PROBES: u32 = 4;

/// ICMP destination unreachable (RFC 792).
const ICMP_DEST_UNREACH: u8 = 3;
/// ICMPv6 destination unreachable (RFC 4443 3.1).
const ICMP6_DEST_UNREACH: u8 = 1;

/// An ICMP error about a new flow's first packet that refuses it: host unreachable
/// (code 1: the backend's node has no neighbour for it) or port unreachable (code
/// 3: nothing listens, a UDP backend's "RST"). Other codes (network unreachable,
/// fragmentation needed, administratively prohibited) say something about the
/// path or a firewall, not the backend.
pub const fn icmp_refuses(icmp_type: u8, code: u8) -> bool {
    icmp_type == ICMP_DEST_UNREACH && (code == 1 || code == 3)
}

/// [`icmp_refuses`]' ICMPv6 twin: address unreachable (code 3) or port
/// unreachable (code 4).
pub const fn icmp6_refuses(icmp_type: u8, code: u8) -> bool {
    icmp_type == ICMP6_DEST_UNREACH && (code == 3 || code == 4)
}

/// How long a backend is quarantined at `level` (1 for the first refusal):
/// 1 s, 2 s, 4 s, ... capped at 60 s.
pub const fn backoff_ns(level: u32) -> u64 {
    if level == 0 {
        return 0;
    }
    if level >= MAX_LEVEL {
        return MAX_NS;
    }
    let ns = BASE_NS << (level - 1);
    if ns > MAX_NS {
        MAX_NS
    } else {
        ns
    }
}

impl QuarantineValue {
    /// New connections of the frontend skip the backend at time `now_ns`
    /// (`bpf_ktime_get_ns`).
    #[inline(always)]
    pub const fn is_active(&self, now_ns: u64) -> bool {
        now_ns < self.until_ns
    }

    /// The last refusal was seen by the socket hooks (`sockops`), not the
    /// per-packet path.
    #[inline(always)]
    pub const fn is_by_socket(&self) -> bool {
        self.flags & QUARANTINE_FLAG_BY_SOCKET != 0
    }

    /// The backend refused a new connection at `now_ns`. Returns whether this
    /// started a quarantine (false: one was running, and the refusal is part of the
    /// same outage). `flags` (`QUARANTINE_FLAG_*`) say who saw it.
    #[inline(always)]
    pub fn refused(&mut self, now_ns: u64, flags: u32) -> bool {
        if self.is_active(now_ns) {
            return false;
        }
        if self.strikes < MAX_LEVEL {
            self.strikes += 1;
        }
        self.until_ns = now_ns.saturating_add(backoff_ns(self.strikes));
        self.flags = flags;
        self.quarantines = self.quarantines.wrapping_add(1);
        true
    }

    /// The backend accepted a new connection: it is healthy, and its next refusal
    /// starts over at 1 s. Returns whether anything changed (false: it was
    /// healthy already, and the caller need not write).
    #[inline(always)]
    pub fn accepted(&mut self) -> bool {
        if self.strikes == 0 && self.until_ns == 0 {
            return false;
        }
        self.strikes = 0;
        self.until_ns = 0;
        true
    }
}

/// The stride of a random pick's scan: a prime above [`SCAN_TRIES`] chosen by
/// `entropy`, so that with up to `SCAN_TRIES` backends it is coprime with the
/// count and the scan visits every slot once. Several strides, not one, so that a
/// quarantined backend's share is spread over the others rather than all going to
/// the slot after it. A stride dividing `count` (only possible with more than
/// `SCAN_TRIES` backends) falls back to 1.
#[inline(always)]
pub const fn scan_stride(count: u16, entropy: u32) -> u32 {
    // The primes 11, 13, 17, 19, 23, 29, 31, 37, a byte each: shifted out of a
    // constant rather than indexed in a table, which the BPF program would have
    // to read from memory (a stack copy indexed by a variable is refused).
    const STRIDES: u64 =
        11 | 13 << 8 | 17 << 16 | 19 << 24 | 23 << 32 | 29 << 40 | 31 << 48 | 37 << 56;
    // The top bits of a Fibonacci hash: `entropy` itself already chose the start
    // (its remainder by the count), and its low bits are what that used.
    let k = entropy.wrapping_mul(0x9E37_79B1) >> 29;
    let stride = ((STRIDES >> (k * 8)) & 0xff) as u32;
    // `stride == 0` never holds; said so that no stride of 0 could come out.
    if stride == 0 || count == 0 || (count as u32).is_multiple_of(stride) {
        1
    } else {
        stride
    }
}

/// Candidate `i` (0 = the first pick) of a random pick's scan over `count` slots
/// starting at slot `start` (1-based, as `ServiceKey::backend_slot`), with
/// [`scan_stride`]'s `stride` (`start` itself for a `count` of 0).
#[inline(always)]
pub const fn scan_slot(start: u16, stride: u32, i: u32, count: u16) -> u16 {
    if count == 0 {
        return start;
    }
    let count = count as u64;
    let zero_based = (start as u64).wrapping_sub(1) % count;
    ((zero_based + i as u64 * stride as u64) % count) as u16 + 1
}

/// Table slot `i` (0 = the slot [`crate::maglev::slot`] gives the flow) of a
/// Maglev flow's probe sequence over a table of `size` slots (a prime): the same
/// hash walks the table with a step of its own, so a quarantined backend's flows
/// go where the table sends other flows (in proportion to the shares) and every
/// node with the same table and the same quarantines agrees.
#[inline(always)]
pub const fn maglev_probe(hash: u32, size: u32, i: u32) -> u32 {
    let first = crate::maglev::slot(hash, size) as u64;
    if size <= 1 {
        return first as u32;
    }
    // A second hash of the flow for the step, 1..size-1: never 0, so with a prime
    // size the walk visits every slot before it repeats.
    let step = 1 + (hash.wrapping_mul(0x85EB_CA6B).rotate_left(15) as u64) % (size as u64 - 1);
    ((first + i as u64 * step) % size as u64) as u32
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::collections::BTreeSet;
    use std::vec::Vec;

    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn backoff_starts_at_a_second_doubles_and_stops_at_a_minute() {
        let levels: Vec<u64> = (0..=10).map(backoff_ns).collect();
        assert_eq!(
            levels,
            [0, 1, 2, 4, 8, 16, 32, 60, 60, 60, 60]
                .map(|s| s * S)
                .to_vec()
        );
    }

    #[test]
    fn a_refusal_quarantines_and_a_repeat_after_it_ended_doubles() {
        let mut q = QuarantineValue::default();
        assert!(!q.is_active(0));
        assert!(q.refused(10 * S, 0));
        assert!(q.is_active(10 * S) && q.is_active(11 * S - 1) && !q.is_active(11 * S));
        // SYNs already on their way when the first RST came: the same outage.
        assert!(!q.refused(10 * S + 5, 0));
        assert_eq!((q.strikes, q.until_ns, q.quarantines), (1, 11 * S, 1));
        // Tried again once it ended, refused again: 2 s.
        assert!(q.refused(11 * S, QUARANTINE_FLAG_BY_SOCKET));
        assert_eq!((q.strikes, q.until_ns, q.quarantines), (2, 13 * S, 2));
        assert!(q.is_by_socket());
        let mut now = 13 * S;
        for _ in 0..20 {
            assert!(q.refused(now, 0));
            now = q.until_ns;
        }
        assert_eq!(q.strikes, MAX_LEVEL);
        assert_eq!(q.until_ns - backoff_ns(MAX_LEVEL), now - MAX_NS);
        assert_eq!(q.quarantines, 22);
    }

    #[test]
    fn the_first_success_clears_and_the_next_refusal_starts_over() {
        let mut q = QuarantineValue::default();
        assert!(!q.accepted(), "a healthy backend needs no write");
        q.refused(0, 0);
        q.refused(S, 0);
        assert_eq!(q.strikes, 2);
        assert!(q.accepted());
        assert!(!q.is_active(S + 1));
        assert!(!q.accepted());
        q.refused(5 * S, 0);
        assert_eq!((q.strikes, q.until_ns), (1, 6 * S));
        assert_eq!(
            q.quarantines, 3,
            "the count of quarantines survives success"
        );
    }

    /// With up to SCAN_TRIES backends the scan visits every slot exactly once,
    /// whatever the start and entropy.
    #[test]
    fn a_scan_over_few_backends_visits_each_once() {
        for count in 1..=SCAN_TRIES as u16 {
            for entropy in (0..64u32).map(|e| e.wrapping_mul(0x2545_F491)) {
                let stride = scan_stride(count, entropy);
                for start in 1..=count {
                    let seen: BTreeSet<u16> = (0..count as u32)
                        .map(|i| scan_slot(start, stride, i, count))
                        .collect();
                    assert_eq!(seen, (1..=count).collect(), "count {count} start {start}");
                    assert_eq!(scan_slot(start, stride, 0, count), start);
                }
            }
        }
    }

    /// What a new connection gets when one slot is quarantined: the first
    /// candidate not quarantined, as the kernel's loop takes it.
    fn pick(start: u16, entropy: u32, count: u16, bad: u16) -> u16 {
        let stride = scan_stride(count, entropy);
        (0..SCAN_TRIES.min(count as u32))
            .map(|i| scan_slot(start, stride, i, count))
            .find(|&s| s != bad)
            .unwrap_or(start)
    }

    /// A quarantined backend's share goes to the others, never to it: evenly
    /// when every distance is coprime with the count (2, 3, 5), else to the slots
    /// at a coprime distance (with 4 or 6 backends the two neighbours get half
    /// again the share of the others, 1.5 x, for as long as the quarantine lasts).
    #[test]
    fn a_quarantined_share_is_spread_over_the_others() {
        for count in 2..=6u16 {
            let mut shares = std::vec![0u32; count as usize + 1];
            let mut x = 0x1234_5678u32;
            for _ in 0..60_000 {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let start = (x % count as u32) as u16 + 1;
                shares[pick(start, x, count, 1) as usize] += 1;
            }
            assert_eq!(shares[1], 0);
            let (lo, hi) = shares[2..]
                .iter()
                .fold((u32::MAX, 0), |(lo, hi), &s| (lo.min(s), hi.max(s)));
            assert!(
                hi as f64 <= lo as f64 * 1.6,
                "count {count}: shares {shares:?}"
            );
        }
    }

    #[test]
    fn strides_are_coprime_with_small_counts_and_one_when_they_divide() {
        for count in 1..=SCAN_TRIES as u16 {
            for e in 0..256u32 {
                let s = scan_stride(count, e.wrapping_mul(0x0100_0193));
                assert!(count == 1 || !s.is_multiple_of(count as u32));
            }
        }
        // 11 divides 22: that stride falls back to 1.
        let e = (0..u32::MAX)
            .find(|e| e.wrapping_mul(0x9E37_79B1) >> 29 == 0)
            .unwrap();
        assert_eq!(scan_stride(22, e), 1);
        assert_eq!(scan_stride(23, e), 11);
    }

    /// Maglev's fall-through: probe 0 is the table's own slot, the walk visits
    /// distinct slots (a prime size), and a quarantined backend's flows land on the
    /// others in proportion to their slots in the table.
    #[test]
    fn maglev_probes_start_at_the_flow_s_slot_and_walk_distinct_slots() {
        for size in [2u32, 3, 251, 509, 1021] {
            for hash in (0..200u32).map(|h| h.wrapping_mul(0x9E37_79B1)) {
                assert_eq!(maglev_probe(hash, size, 0), crate::maglev::slot(hash, size));
                let walk: BTreeSet<u32> = (0..size.min(64))
                    .map(|i| maglev_probe(hash, size, i))
                    .collect();
                assert_eq!(walk.len() as u32, size.min(64), "size {size} hash {hash}");
                assert!(walk.iter().all(|&s| s < size));
            }
        }
    }

    #[test]
    fn maglev_fall_through_follows_the_table_s_shares() {
        // A 251-slot table over three backends with even shares in a scrambled
        // order (a stand-in for a Maglev table: what matters is the shares, and
        // no period a step could fall in with), backend 0 down.
        let size = 251u32;
        let mut r = 0x2545_F491u32;
        let table: Vec<u16> = (0..size)
            .map(|_| {
                r ^= r << 13;
                r ^= r >> 17;
                r ^= r << 5;
                (r % 3) as u16
            })
            .collect();
        let mut landed = [0u32; 3];
        let mut fell_back = 0;
        let mut x = 0x9E37_79B9u32;
        for _ in 0..30_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let healthy = (0..MAGLEV_PROBES)
                .map(|i| table[maglev_probe(x, size, i) as usize])
                .find(|&b| b != 0);
            match healthy {
                Some(b) => landed[b as usize] += 1,
                None => fell_back += 1,
            }
        }
        assert_eq!(landed[0], 0);
        let ratio = landed[1] as f64 / landed[2] as f64;
        assert!((0.9..1.1).contains(&ratio), "{landed:?}");
        // (1/3)^4 of flows find only the quarantined backend in four probes and go
        // on to the random scan.
        assert!(fell_back < 30_000 / 50, "{fell_back}");
        // A flow whose own slot is healthy keeps it: quarantine moves only the
        // quarantined backend's flows.
        let own = (0..1000u32)
            .map(|h| h.wrapping_mul(0x2545_F491))
            .filter(|&h| table[maglev_probe(h, size, 0) as usize] != 0)
            .count();
        assert!(own > 0);
    }

    #[test]
    fn only_host_and_port_unreachable_refuse() {
        assert!(icmp_refuses(3, 3) && icmp_refuses(3, 1));
        for (t, c) in [(3, 0), (3, 4), (3, 13), (11, 0), (12, 0), (0, 0)] {
            assert!(!icmp_refuses(t, c), "type {t} code {c}");
        }
        assert!(icmp6_refuses(1, 4) && icmp6_refuses(1, 3));
        for (t, c) in [(1, 0), (1, 1), (2, 0), (3, 0), (4, 0), (3, 3)] {
            assert!(!icmp6_refuses(t, c), "type {t} code {c}");
        }
    }
}
