//! Maglev lookup tables (Eisenbud et al., NSDI 2016): consistent hashing that spreads
//! flows evenly over a frontend's backends and, when one backend leaves or joins,
//! moves little more than that backend's share of them.
//!
//! A table is a pure function of the backends' identities, the table size and the
//! seed (`--maglev-seed`, the same on every node), so every node builds the same table
//! from the same EndpointSlices, and a flow that enters any node (hashed with
//! [`lb_common::maglev::flow_hash`], which leaves out the destination address) lands
//! on the same backend.
//!
//! - A backend's identity is its address plus an occurrence number for the rare set
//!   that holds one address twice ([`Identity`], [`identities`]); the port is not part
//!   of it. Backends are ordered by (address, port) and a table's entries are
//!   positions into that order, so two ports of one Service (same pods, other target
//!   ports), or two Services over the same pods, have equal identities and share one
//!   table instead of building and storing one per port.
//! - The table size is a function of the backend count alone ([`table_size`]), taken
//!   from a ladder of primes so that it stays put while a Service scales within a rung.
//! - The offsets and skips come from XXH3 (64-bit, seeded): a published, stable hash
//!   from the `xxhash-rust` crate, independent of the machine's byte order and of the
//!   Rust version, so nodes of any architecture and agents of any version agree.

use std::fmt;
use std::net::IpAddr;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The table sizes, in order: the largest prime below each power of two from 2^8 to
/// 2^17. A frontend gets the smallest rung with at least [`SLOTS_PER_BACKEND`] slots
/// per backend, else the last.
///
/// Why a ladder and not the smallest prime above `100 x backends`: a table of another
/// size is another table (every slot's permutation changes, and so does which slot a
/// flow hashes to), so a size that followed every change of the backend count would
/// move nearly all flows each time a Service scaled by one, which is what Maglev is
/// there to prevent. On a ladder of doublings the size changes only when the count
/// crosses a rung (2 -> 3, 5 -> 6, 10 -> 11, 20 -> 21, 40 -> 41, 81 -> 82, 163 -> 164,
/// 327 -> 328, 655 -> 656), where nearly all flows move once; within a rung a change
/// of one backend moves its share of the slots and a little more (see
/// [`SLOTS_PER_BACKEND`]). The price is at most twice the memory of the tightest
/// size: 502 bytes for up to 2 backends, 2042 bytes for up to 10.
///
/// The kernel reads the same ladder (`lb_common::maglev::TABLE_SIZES`): a master
/// names its table's size by its index.
pub const TABLE_SIZES: [u32; 10] = lb_common::maglev::TABLE_SIZES;

/// The smallest table.
pub const MIN_TABLE_SIZE: u32 = TABLE_SIZES[0];

/// The largest table: 256 KiB at 2 bytes a slot. It keeps 100 slots per backend up
/// to 1310 backends; past that a backend's share is `1/backends` give or take one
/// slot in 131071 (at 10 000 backends, 13 or 14 slots: shares differ by up to 8%; at
/// the limit of 65 535, 2 or 3 slots). Larger tables would even that out at the cost
/// of memory and build time for every Service that large; at 2^17 slots a build of
/// 1000 backends takes about 4 ms (release build, measured on a loaded 2-CPU machine).
pub const MAX_TABLE_SIZE: u32 = TABLE_SIZES[TABLE_SIZES.len() - 1];

/// Slots per backend that the table size aims for (the Maglev paper's
/// recommendation): with `M >= 100 N` the largest and the smallest share differ by at
/// most one slot in a hundred. Removing or adding one backend moves its `1/N` of the
/// slots plus the cascade of the others' claims: measured at these sizes, 1% to 2.5%
/// more on average below a few hundred backends (up to about 20% in a rare removal
/// from a set of 4 or 5), under 1.5% from 250 backends (see the tests).
pub const SLOTS_PER_BACKEND: u32 = 100;

/// Most backends one table can hold: entries are 16-bit positions, and the value
/// `u16::MAX` marks an empty slot while the table fills.
pub const MAX_BACKENDS: usize = u16::MAX as usize;

/// Marks a slot not yet taken while a table fills; never in a built table.
const EMPTY: u16 = u16::MAX;

/// The skip hash's seed is the offset hash's seed with these bits flipped (the
/// 64-bit golden ratio), so the two hashes of one identity are independent.
const SKIP_SEED_XOR: u64 = 0x9E37_79B9_7F4A_7C15;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MaglevError {
    #[error(
        "a Maglev table needs at least one backend; a frontend without backends \
         rejects its connections and needs no table"
    )]
    NoBackends,
    #[error(
        "{count} backends in one Maglev table, more than the {max} its 16-bit positions \
         can name; use the random algorithm for this Service"
    )]
    TooManyBackends { count: usize, max: usize },
    #[error(
        "Maglev table size {size} for {backends} backends: the size must be a prime, at \
         least the backend count and at most {MAX_TABLE_SIZE}; take it from table_size()"
    )]
    BadTableSize { size: u32, backends: usize },
    #[error(
        "backend {index} ({address}, port {port}) comes after a backend it should \
         precede or equals it: backends must be in strictly ascending (address, port) \
         order; sort them with sort_backends()"
    )]
    NotOrdered {
        index: usize,
        address: IpAddr,
        port: u16,
    },
    #[error(
        "backend identity {identity} is at positions {first} and {second}: identities \
         must be distinct; derive them with identities(), which numbers repeats of an \
         address"
    )]
    DuplicateIdentity {
        identity: Identity,
        first: usize,
        second: usize,
    },
}

/// What the permutation of a backend is derived from: its address and how many
/// backends of the same set with the same address precede it in (address, port)
/// order. The port is left out so that sets that differ only in ports share a table.
/// The price, in the rare set with one address twice: when the first of the two
/// leaves, the second takes over its identity and slots, and the second's old slots
/// are shared out, so about `2/N` of the slots move rather than `1/N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity {
    /// The address's 16 bytes in network order, an IPv4 address IPv4-mapped.
    pub address: [u8; 16],
    /// 0 for the first backend at this address, 1 for the second, ...
    pub occurrence: u16,
}

impl Identity {
    pub fn new(address: IpAddr, occurrence: u16) -> Self {
        Identity {
            address: mapped_octets(address),
            occurrence,
        }
    }

    /// The bytes hashed: the 16 address bytes, then the occurrence, big-endian.
    fn bytes(&self) -> [u8; 18] {
        let mut bytes = [0u8; 18];
        bytes[..16].copy_from_slice(&self.address);
        bytes[16..].copy_from_slice(&self.occurrence.to_be_bytes());
        bytes
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let address = std::net::Ipv6Addr::from(self.address).to_canonical();
        write!(f, "{address}#{}", self.occurrence)
    }
}

fn mapped_octets(address: IpAddr) -> [u8; 16] {
    match address {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The order of backends in a table: by address (its 16 bytes, IPv4-mapped), then
/// port. For backends of one family this is also the order of `IpAddr`, so a
/// `BTreeSet` of one frontend's backends already iterates in it.
pub fn backend_order(backend: &(IpAddr, u16)) -> ([u8; 16], u16) {
    (mapped_octets(backend.0), backend.1)
}

/// Puts backends into the table's order ([`backend_order`]).
pub fn sort_backends(backends: &mut [(IpAddr, u16)]) {
    backends.sort_unstable_by_key(backend_order);
}

/// The identities of backends given in the table's order (strictly ascending
/// [`backend_order`]): the `i`-th identity belongs to the `i`-th backend.
pub fn identities(
    backends: impl IntoIterator<Item = (IpAddr, u16)>,
) -> Result<Vec<Identity>, MaglevError> {
    let mut out: Vec<Identity> = Vec::new();
    let mut previous: Option<([u8; 16], u16)> = None;
    for (index, backend) in backends.into_iter().enumerate() {
        let key = backend_order(&backend);
        if previous.is_some_and(|p| p >= key) {
            return Err(MaglevError::NotOrdered {
                index,
                address: backend.0,
                port: backend.1,
            });
        }
        let occurrence = match (previous, out.last()) {
            (Some((address, _)), Some(last)) if address == key.0 => last
                .occurrence
                .checked_add(1)
                .ok_or(MaglevError::TooManyBackends {
                    count: index + 1,
                    max: MAX_BACKENDS,
                })?,
            _ => 0,
        };
        out.push(Identity {
            address: key.0,
            occurrence,
        });
        previous = Some(key);
    }
    Ok(out)
}

/// The table size for a set of `backends`: the smallest of [`TABLE_SIZES`] with at
/// least [`SLOTS_PER_BACKEND`] slots per backend, else [`MAX_TABLE_SIZE`].
pub fn table_size(backends: usize) -> Result<u32, MaglevError> {
    Ok(TABLE_SIZES[table_rung(backends)?])
}

/// The index in [`TABLE_SIZES`] of [`table_size`]`(backends)`: what a master
/// carries to name its table's size.
pub fn table_rung(backends: usize) -> Result<usize, MaglevError> {
    check_count(backends)?;
    let wanted = backends as u64 * u64::from(SLOTS_PER_BACKEND);
    Ok(TABLE_SIZES
        .iter()
        .position(|&size| u64::from(size) >= wanted)
        .unwrap_or(TABLE_SIZES.len() - 1))
}

fn check_count(backends: usize) -> Result<(), MaglevError> {
    match backends {
        0 => Err(MaglevError::NoBackends),
        n if n > MAX_BACKENDS => Err(MaglevError::TooManyBackends {
            count: n,
            max: MAX_BACKENDS,
        }),
        _ => Ok(()),
    }
}

fn is_prime(n: u32) -> bool {
    n >= 2
        && (2u32..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

/// The Maglev table of `identities` with `size` slots: entry `s` is the position in
/// `identities` of the backend that slot `s` sends flows to. Every backend gets
/// `size / n` or one more slots.
///
/// The result depends on the set of identities, not on their order in the slice: the
/// backends take their turns in identity order, and the positions returned are those
/// of the slice given.
pub fn build(identities: &[Identity], size: u32, seed: u64) -> Result<Vec<u16>, MaglevError> {
    build_without(identities, size, seed, |_| false)
}

/// The table built as if the backends at the positions where `excluded` is true were
/// absent (quarantined backends, issue 26), at the full set's `size` so that a
/// quarantine never changes the size: their slots go to the others, which keep most
/// of their own (Maglev's minimal disruption: a few percent of the slots move per
/// excluded backend, as in a removal). When every backend is excluded the full table
/// is built, as when nothing is: a frontend whose backends all refuse behaves as
/// without quarantine.
pub fn build_without(
    identities: &[Identity],
    size: u32,
    seed: u64,
    excluded: impl Fn(usize) -> bool,
) -> Result<Vec<u16>, MaglevError> {
    let n = identities.len();
    check_count(n)?;
    if size < n as u32 || size > MAX_TABLE_SIZE || !is_prime(size) {
        return Err(MaglevError::BadTableSize { size, backends: n });
    }
    // `n <= MAX_BACKENDS`, so every position fits in a u16 below EMPTY.
    let mut turns: Vec<u16> = (0..n as u16).collect();
    turns.sort_unstable_by_key(|&p| identities[usize::from(p)]);
    for pair in turns.windows(2) {
        let (first, second) = (usize::from(pair[0]), usize::from(pair[1]));
        if identities[first] == identities[second] {
            return Err(MaglevError::DuplicateIdentity {
                identity: identities[first],
                first: first.min(second),
                second: first.max(second),
            });
        }
    }
    let present: Vec<u16> = turns
        .iter()
        .copied()
        .filter(|&p| !excluded(usize::from(p)))
        .collect();
    let turns = if present.is_empty() { turns } else { present };
    Ok(populate(identities, &turns, size, seed))
}

/// Where a backend's preference list starts and how it steps through the slots.
struct Walk {
    next: u32,
    skip: u32,
}

impl Walk {
    fn new(identity: &Identity, size: u32, seed: u64) -> Self {
        let bytes = identity.bytes();
        let offset = xxh3_64_with_seed(&bytes, seed) % u64::from(size);
        let skip = xxh3_64_with_seed(&bytes, seed ^ SKIP_SEED_XOR) % u64::from(size - 1) + 1;
        // Both are below `size`, which is a u32.
        Walk {
            next: offset as u32,
            skip: skip as u32,
        }
    }

    /// The backend's next preferred slot, then steps past it. With a prime `size`
    /// and `0 < skip < size` the walk visits every slot once per `size` steps.
    fn step(&mut self, size: u32) -> usize {
        let slot = self.next;
        self.next += self.skip;
        if self.next >= size {
            self.next -= size;
        }
        slot as usize
    }
}

/// The Maglev population: the backends of `turns`, in that order, take turns claiming
/// their most preferred slot still free until every slot is taken.
fn populate(identities: &[Identity], turns: &[u16], size: u32, seed: u64) -> Vec<u16> {
    let mut walks: Vec<Walk> = turns
        .iter()
        .map(|&p| Walk::new(&identities[usize::from(p)], size, seed))
        .collect();
    let mut table = vec![EMPTY; size as usize];
    let mut filled = 0u32;
    loop {
        for (&position, walk) in turns.iter().zip(walks.iter_mut()) {
            let mut slot = walk.step(size);
            while table[slot] != EMPTY {
                slot = walk.step(size);
            }
            table[slot] = position;
            filled += 1;
            if filled == size {
                return table;
            }
        }
    }
}

/// How many slots of `table` each of `backends` positions owns. A position at or
/// past `backends` (a table read beside another set) is counted nowhere.
pub fn shares(table: &[u16], backends: usize) -> Vec<u32> {
    let mut counts = vec![0u32; backends];
    for &position in table {
        if let Some(count) = counts.get_mut(usize::from(position)) {
            *count += 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests;
