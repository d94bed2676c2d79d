//! `lb-bench`: the datapath and control-plane benchmark (`cargo xtask bench`).
//!
//! - [`kubeproxy`]: kube-proxy-style iptables / nftables rule sets (the peers);
//! - [`netio`]: the compiled client and server run inside the namespaces;
//! - [`run`]: the topology and the measurements;
//! - [`report`]: results.json, the README table and the PNG plots.
pub mod kubeproxy;
pub mod netio;
pub mod report;
pub mod run;
