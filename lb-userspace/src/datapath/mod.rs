//! The service table in the kernel's layout, and everything that touches the kernel
//! for it: the map encoding ([`codec`]), what the maps hold ([`snapshot`], read back
//! for `lb services` by [`table`]), the pinned maps ([`maps`]), conntrack and source
//! ranges, the per-packet links on devices ([`device_links`]), how remote backends
//! are reached ([`forwarding`]: SNAT or DSR), loading and attaching ([`loader`]) and
//! the pin directory ([`pins`]); NetworkPolicy's maps ([`policy`]).

pub mod codec;
pub mod conntrack;
pub mod device_links;
pub mod forwarding;
pub mod loader;
pub mod maps;
pub mod masquerade;
pub mod pins;
pub mod policy;
pub mod snapshot;
pub mod source_ranges;
pub mod table;

/// aya's errors keep the errno in their source; a message without it is useless.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
