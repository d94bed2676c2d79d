//! The hand-over between the two programs of a node-facing device: `lb_xdp` leaves
//! an [`XdpMark`] in the metadata of a packet it translated and passes to the
//! stack, and `lb_tc_external`, which runs next on the same device, lets such a
//! packet through without parsing or looking it up again. The kernel keeps XDP
//! metadata in front of the packet into the skb (`skb->data_meta`), native and
//! generic XDP alike; nothing else writes it.

use core::mem::size_of;

use aya_ebpf::{
    helpers::generated::bpf_xdp_adjust_meta,
    programs::{TcContext, XdpContext},
};
use lb_common::{XdpMark, XDP_MARK_MAGIC};

const MARK_LEN: usize = size_of::<XdpMark>();

/// Puts the mark in front of the frame. `false` when the driver keeps no metadata
/// or has no room for it: the packet then goes unmarked, and TC's second look finds
/// nothing to do (its tuple is already the translated one), only costs time.
#[inline(always)]
pub fn mark(ctx: &XdpContext) -> bool {
    // SAFETY: the helper only moves the program's own frame's metadata start.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(MARK_LEN as i32)) } != 0 {
        return false;
    }
    let meta = ctx.metadata();
    if meta + MARK_LEN > ctx.metadata_end() {
        return false;
    }
    let value = XdpMark {
        magic: XDP_MARK_MAGIC,
    };
    // SAFETY: the bounds check above keeps the write inside the metadata the
    // helper just made room for.
    unsafe { core::ptr::write_unaligned(meta as *mut XdpMark, value) };
    true
}

/// Whether `lb_xdp` marked this packet: its metadata starts with the mark.
#[inline(always)]
pub fn is_marked(ctx: &TcContext) -> bool {
    // SAFETY: reading the program's own context; the kernel turns these fields
    // into packet pointers.
    let (meta, data) = unsafe { ((*ctx.skb.skb).data_meta, (*ctx.skb.skb).data) };
    let (meta, data) = (meta as usize, data as usize);
    if meta + MARK_LEN > data {
        return false;
    }
    // SAFETY: the bounds check above keeps the read inside the metadata.
    let found = unsafe { core::ptr::read_unaligned(meta as *const XdpMark) };
    found.magic == XDP_MARK_MAGIC
}
