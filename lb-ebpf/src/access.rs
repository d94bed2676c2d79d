//! Packet access for the modules both per-packet programs share (parsing, NAT,
//! routing): TC reads and writes an skb through the kernel's helpers, XDP reads and
//! writes the frame's first buffer directly, so one parser and one rewrite serve
//! both, monomorphized per program.
//!
//! - TC (`TcContext`): `bpf_skb_load_bytes` / `bpf_skb_store_bytes`, and the
//!   checksum helpers, which also keep `skb->csum` and `CHECKSUM_PARTIAL` skbs
//!   right: what the TC path always did.
//! - XDP (`XdpContext`): bounds-checked direct access to the linear part (the
//!   headers; a multi-buffer frame's payload is never touched), and checksums
//!   patched with `csum.rs` arithmetic (RFC 1624). A frame has no skb state to keep
//!   in step: its checksums are complete, as the wire carries them.
//!
//! Offsets are from the start of the frame. Errors carry no detail: every caller
//! treats a failed access the same way (the header is not there, or not writable).

use aya_ebpf::{
    bindings::{
        bpf_adj_room_mode::{BPF_ADJ_ROOM_MAC, BPF_ADJ_ROOM_NET},
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, BPF_F_MARK_MANGLED_0,
        BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM,
    },
    helpers::generated::{bpf_csum_diff, bpf_xdp_adjust_head, bpf_xdp_get_buff_len},
    programs::{TcContext, XdpContext},
    EbpfContext,
};
use lb_common::IpAddrBe;

use crate::csum;
use crate::hdr::{ETH_HLEN, IP6_HLEN, IP_HLEN};

/// Where a TCP or UDP checksum lies, and whether it is UDP's, in which zero means
/// "no checksum" (IPv4) and must stay zero, and a computed zero is sent as 0xffff.
#[derive(Clone, Copy)]
pub struct L4Csum {
    pub off: usize,
    pub udp: bool,
}

/// Where [`Packet::open_room`] inserts bytes. The headers in front of that place
/// move towards the start of the buffer, so what lies behind it (the TCP/UDP
/// header and payload) stays where it is: a checksum the hardware is yet to
/// complete (`CHECKSUM_PARTIAL`, its start counted from the buffer's head) still
/// finds its bytes.
#[derive(Clone, Copy)]
pub enum Room {
    /// Right behind the fixed IP header (20 bytes, or 40 for IPv6): an IPv4 option
    /// or an IPv6 extension header goes there, before any already present.
    AfterIp { v6: bool },
    /// Right behind the Ethernet header: an outer IP header of the same family
    /// (IPv4 in IPv4, IPv6 in IPv6).
    AfterEthernet { v6: bool },
}

pub trait Packet: EbpfContext {
    /// Bytes in the whole packet, every buffer of a multi-buffer frame included.
    fn packet_len(&self) -> usize;

    /// The device the packet came in on.
    fn ingress_device(&self) -> u32;

    /// `size_of::<T>()` bytes at `off`, as they lie in the packet. At least two:
    /// under XDP the compiler turns the bounds check of a single byte at an offset
    /// the verifier cannot pin down into one the verifier does not accept (`p >=
    /// end` instead of `p + 1 > end`); a lone byte is read with its neighbour.
    fn read<T: Copy>(&self, off: usize) -> Result<T, ()>;

    /// Writes `value` at `off` (at least two bytes, as for `read`). Checksums are
    /// the caller's (the `*_csum_update*` below).
    fn write<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()>;

    /// The IPv4 header checksum at `csum_off` follows a field of `size` bytes (2 or
    /// 4) changing from `from` to `to` (both as the field lies in memory).
    fn ip_csum_update(&self, csum_off: usize, from: u32, to: u32, size: u32) -> Result<(), ()>;

    /// The TCP/UDP checksum follows a field of `size` bytes (2 or 4) changing from
    /// `from` to `to`; `pseudo`: the field is part of the pseudo header (an IPv4
    /// address), not of the segment (a port).
    fn l4_csum_update(
        &self,
        csum: &L4Csum,
        from: u32,
        to: u32,
        size: u32,
        pseudo: bool,
    ) -> Result<(), ()>;

    /// The TCP/UDP checksum follows an IPv6 address of its pseudo header changing.
    fn l4_csum_update6(&self, csum: &L4Csum, from: &IpAddrBe, to: &IpAddrBe) -> Result<(), ()>;

    /// Inserts `len` bytes at `room` (at most 40), for the caller to write: what
    /// they hold before is unspecified (TC zeroes them, XDP leaves old bytes).
    fn open_room(&self, room: Room, len: u32) -> Result<(), ()>;

    /// Writes header bytes that no incremental checksum update accounts for (an
    /// option, an extension header or an outer header the program adds, an IP
    /// header it rewrites whole): TC keeps the skb's receive checksum in step with
    /// them, XDP has none to keep.
    fn write_added<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()>;
}

impl Packet for TcContext {
    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.len() as usize
    }

    #[inline(always)]
    fn ingress_device(&self) -> u32 {
        // SAFETY: reading the program's own context; at TC ingress the skb's device
        // is the one it arrived on.
        unsafe { (*self.skb.skb).ifindex }
    }

    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Result<T, ()> {
        self.load(off).map_err(|_| ())
    }

    #[inline(always)]
    fn write<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()> {
        self.store(off, value, 0).map_err(|_| ())
    }

    #[inline(always)]
    fn ip_csum_update(&self, csum_off: usize, from: u32, to: u32, size: u32) -> Result<(), ()> {
        self.l3_csum_replace(csum_off, from as u64, to as u64, size as u64)
            .map_err(|_| ())
    }

    #[inline(always)]
    fn l4_csum_update(
        &self,
        csum: &L4Csum,
        from: u32,
        to: u32,
        size: u32,
        pseudo: bool,
    ) -> Result<(), ()> {
        let mut flags = size as u64;
        if pseudo {
            flags |= BPF_F_PSEUDO_HDR as u64;
        }
        if csum.udp {
            flags |= BPF_F_MARK_MANGLED_0 as u64;
        }
        TcContext::l4_csum_replace(self, csum.off, from as u64, to as u64, flags).map_err(|_| ())
    }

    /// 16 bytes as one difference (`bpf_csum_diff`); size 0 tells the helper the
    /// value is a difference, not a field.
    #[inline(always)]
    fn l4_csum_update6(&self, csum: &L4Csum, from: &IpAddrBe, to: &IpAddrBe) -> Result<(), ()> {
        let mut old = from.words;
        let mut new = to.words;
        // SAFETY: both buffers are 16 bytes on this stack frame.
        let diff = unsafe { bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(());
        }
        let mut flags = BPF_F_PSEUDO_HDR as u64;
        if csum.udp {
            flags |= BPF_F_MARK_MANGLED_0 as u64;
        }
        TcContext::l4_csum_replace(self, csum.off, 0, diff as u64, flags).map_err(|_| ())
    }

    /// `bpf_skb_adjust_room`: at the network layer (after the fixed IP header), or
    /// at the MAC layer flagged as an encapsulation, so the kernel records the
    /// inner headers and a GSO packet is segmented as a tunnel's (its segments
    /// shrink by the outer header, so each still fits the MTU).
    #[inline(always)]
    fn open_room(&self, room: Room, len: u32) -> Result<(), ()> {
        let (mode, flags) = match room {
            Room::AfterIp { .. } => (BPF_ADJ_ROOM_NET, 0),
            Room::AfterEthernet { v6: false } => {
                (BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 as u64)
            }
            Room::AfterEthernet { v6: true } => {
                (BPF_ADJ_ROOM_MAC, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 as u64)
            }
        };
        self.adjust_room(len as i32, mode, flags).map_err(|_| ())
    }

    #[inline(always)]
    fn write_added<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()> {
        self.store(off, value, BPF_F_RECOMPUTE_CSUM as u64)
            .map_err(|_| ())
    }
}

/// The furthest header offset XDP reads: a frame's first buffer is at most a page,
/// and the verifier needs an offset it can bound before it admits the access.
const XDP_MAX_OFF: usize = 4096;

/// The address of `size_of::<T>()` bytes at `off` in the frame's first buffer, or
/// `Err` when they are not all there.
#[inline(always)]
fn xdp_at<T>(ctx: &XdpContext, off: usize) -> Result<usize, ()> {
    const {
        assert!(
            core::mem::size_of::<T>() >= 2,
            "read or write a byte with its neighbour"
        )
    };
    if off > XDP_MAX_OFF {
        return Err(());
    }
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return Err(());
    }
    Ok(start + off)
}

impl Packet for XdpContext {
    #[inline(always)]
    fn packet_len(&self) -> usize {
        // SAFETY: the helper only reads the program's own context.
        unsafe { bpf_xdp_get_buff_len(self.ctx) as usize }
    }

    #[inline(always)]
    fn ingress_device(&self) -> u32 {
        XdpContext::ingress_ifindex(self) as u32
    }

    #[inline(always)]
    fn read<T: Copy>(&self, off: usize) -> Result<T, ()> {
        let at = xdp_at::<T>(self, off)?;
        // SAFETY: `xdp_at` checked that the bytes lie inside the frame's buffer; no
        // alignment is assumed.
        let value = unsafe { core::ptr::read_unaligned(at as *const T) };
        if core::mem::size_of::<T>() > 8 {
            // A header (bytes here, as the frame gives no alignment) becomes its
            // words once, in a stack slot, rather than bytes kept in registers
            // until each use, which the compiler spills byte by byte.
            return Ok(core::hint::black_box(value));
        }
        Ok(value)
    }

    #[inline(always)]
    fn write<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()> {
        let at = xdp_at::<T>(self, off)?;
        // SAFETY: as in `read`; an XDP program may write its frame.
        unsafe { core::ptr::write_unaligned(at as *mut T, *value) };
        Ok(())
    }

    #[inline(always)]
    fn ip_csum_update(&self, csum_off: usize, from: u32, to: u32, size: u32) -> Result<(), ()> {
        let old: u16 = self.read(csum_off)?;
        let new = if size == 2 {
            csum::replace16(old, from as u16, to as u16)
        } else {
            csum::replace32(old, from, to)
        };
        self.write(csum_off, &new)
    }

    /// The pseudo header is summed like any other field here: a frame's checksum is
    /// complete, never a partial one awaiting hardware.
    #[inline(always)]
    fn l4_csum_update(
        &self,
        csum: &L4Csum,
        from: u32,
        to: u32,
        size: u32,
        _pseudo: bool,
    ) -> Result<(), ()> {
        let old: u16 = self.read(csum.off)?;
        if csum.udp && old == 0 {
            return Ok(());
        }
        let new = if size == 2 {
            csum::replace16(old, from as u16, to as u16)
        } else {
            csum::replace32(old, from, to)
        };
        self.write(csum.off, &mangle_zero(csum, new))
    }

    #[inline(always)]
    fn l4_csum_update6(&self, csum: &L4Csum, from: &IpAddrBe, to: &IpAddrBe) -> Result<(), ()> {
        let mut sum: u16 = self.read(csum.off)?;
        if csum.udp && sum == 0 {
            return Ok(());
        }
        for i in 0..4 {
            sum = csum::replace32(sum, from.words[i], to.words[i]);
        }
        self.write(csum.off, &mangle_zero(csum, sum))
    }

    /// `bpf_xdp_adjust_head` grows the frame at its front; the headers in front of
    /// `room` then move there.
    #[inline(always)]
    fn open_room(&self, room: Room, len: u32) -> Result<(), ()> {
        if len > 40 {
            return Err(());
        }
        // SAFETY: the helper only moves the program's own frame's start, within
        // the headroom the kernel keeps (it refuses a move past it).
        if unsafe { bpf_xdp_adjust_head(self.ctx, -(len as i32)) } != 0 {
            return Err(());
        }
        let from = len as usize;
        match room {
            Room::AfterIp { v6: false } => move_front::<{ ETH_HLEN + IP_HLEN }>(self, from),
            Room::AfterIp { v6: true } => move_front::<{ ETH_HLEN + IP6_HLEN }>(self, from),
            Room::AfterEthernet { .. } => move_front::<ETH_HLEN>(self, from),
        }
    }

    #[inline(always)]
    fn write_added<T: Copy>(&self, off: usize, value: &T) -> Result<(), ()> {
        self.write(off, value)
    }
}

/// The `N` header bytes at `from` move to the start of the frame; the `from` bytes
/// behind them (the room [`Packet::open_room`] made) keep what they held, for the
/// caller to overwrite. Word by word, front first (the destination lies before the
/// source), through registers: a header-sized buffer would cost stack the
/// programs do not have.
#[inline(always)]
fn move_front<const N: usize>(ctx: &XdpContext, from: usize) -> Result<(), ()> {
    const { assert!(N % 4 == 2, "header lengths here are 14, 34 and 54") };
    let mut at = 0;
    while at + 4 <= N {
        let w: u32 = ctx.read(from + at)?;
        ctx.write(at, &w)?;
        at += 4;
    }
    let tail: u16 = ctx.read(from + at)?;
    ctx.write(at, &tail)
}

/// A UDP checksum that comes out as zero is sent as 0xffff (its one's-complement
/// twin): zero would say "no checksum".
#[inline(always)]
fn mangle_zero(csum: &L4Csum, value: u16) -> u16 {
    if csum.udp && value == 0 {
        0xffff
    } else {
        value
    }
}
