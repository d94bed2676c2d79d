//! One's-complement checksum arithmetic for headers the programs build or patch by
//! hand (the RST they answer with, ICMP errors they rewrite). Sums are byte-order
//! independent, so fields are used as they lie in memory.

/// One's-complement sum of the 16-bit words of `bytes` (an even length).
#[inline(always)]
pub fn sum(bytes: &[u8]) -> u32 {
    let mut total = 0u32;
    let mut i = 0;
    while i + 1 < bytes.len() {
        total += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    total
}

/// Folds the carries of a sum into 16 bits.
#[inline(always)]
pub fn fold(mut total: u32) -> u16 {
    total = (total & 0xffff) + (total >> 16);
    total = (total & 0xffff) + (total >> 16);
    total as u16
}

/// RFC 1624 incremental update of checksum `csum` for one 16-bit field:
/// HC' = ~(~HC + ~m + m').
#[inline(always)]
pub fn replace16(csum: u16, old: u16, new: u16) -> u16 {
    !fold((!csum as u32) + (!old as u32) + new as u32)
}

/// As [`replace16`], for a 32-bit field (two words).
#[inline(always)]
pub fn replace32(csum: u16, old: u32, new: u32) -> u16 {
    let csum = replace16(csum, old as u16, new as u16);
    replace16(csum, (old >> 16) as u16, (new >> 16) as u16)
}
