//! What a program returns: one home for the verdicts, which every module that
//! decides a packet's fate imports from here (and never from another decider).

pub use aya_ebpf::bindings::xdp_action::{XDP_DROP, XDP_PASS, XDP_TX};
pub use aya_ebpf::bindings::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
