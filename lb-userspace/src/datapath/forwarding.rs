//! How the per-packet programs reach backends on other nodes (`--lb-mode`,
//! `--dsr-dispatch`): SNAT, or direct server return. Handed to the kernel programs
//! at load time as their read-only `LB_DSR` global (`lb_common::DsrConfig`), as
//! `--node-ip` is: a new agent's programs carry the new mode, and the verifier
//! walks only the branches of the mode loaded.

use lb_common::{
    DsrConfig, DSR_DISPATCH_IPIP, DSR_DISPATCH_OPT, LB_MODE_DSR, LB_MODE_HYBRID, LB_MODE_SNAT,
};

/// `--lb-mode`: how a flow entering a node-facing device reaches a backend on
/// another node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LbMode {
    /// SNAT to this node: the backend's replies come back through it.
    #[default]
    Snat,
    /// Direct server return for TCP and UDP: the backend sees the client's
    /// address, and its node answers the client directly.
    Dsr,
    /// DSR for TCP, SNAT for UDP.
    Hybrid,
}

/// `--dsr-dispatch`: how the entry node tells the backend's node which frontend
/// a DSR flow was sent to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DsrDispatch {
    /// An IPv4 option (8 bytes) / IPv6 Destination Options header (24 bytes) on
    /// a flow's TCP SYN and on every UDP datagram; needs a network that forwards
    /// IP options.
    #[default]
    Opt,
    /// Every packet inside an outer IPv4 / IPv6 header (20 / 40 bytes) to the
    /// backend's node, the frontend carried inside on the same packets.
    Ipip,
}

/// `--lb-mode` and `--dsr-dispatch` together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forwarding {
    pub mode: LbMode,
    pub dispatch: DsrDispatch,
}

impl Forwarding {
    /// What the kernel programs are loaded with.
    pub fn kernel_config(&self) -> DsrConfig {
        DsrConfig {
            mode: match self.mode {
                LbMode::Snat => LB_MODE_SNAT,
                LbMode::Dsr => LB_MODE_DSR,
                LbMode::Hybrid => LB_MODE_HYBRID,
            },
            dispatch: match self.dispatch {
                DsrDispatch::Opt => DSR_DISPATCH_OPT,
                DsrDispatch::Ipip => DSR_DISPATCH_IPIP,
            },
            _pad: [0; 2],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{IPPROTO_TCP, IPPROTO_UDP};

    #[test]
    fn the_kernel_sees_the_mode_per_protocol() {
        let config = |mode, dispatch| Forwarding { mode, dispatch }.kernel_config();
        let snat = config(LbMode::Snat, DsrDispatch::Opt);
        assert!(!snat.dsr_for(IPPROTO_TCP) && !snat.dsr_for(IPPROTO_UDP));
        let dsr = config(LbMode::Dsr, DsrDispatch::Ipip);
        assert!(dsr.dsr_for(IPPROTO_TCP) && dsr.dsr_for(IPPROTO_UDP) && dsr.is_ipip());
        let hybrid = config(LbMode::Hybrid, DsrDispatch::Opt);
        assert!(hybrid.dsr_for(IPPROTO_TCP) && !hybrid.dsr_for(IPPROTO_UDP));
        assert!(!hybrid.is_ipip());
        assert_eq!(Forwarding::default().kernel_config(), DsrConfig::default());
    }
}
