//! What the XDP tests need around the nodes: a pass program on the far end of the
//! veths `lb_xdp` transmits into (a veth delivers `XDP_TX`ed and redirected frames
//! only when its peer runs XDP), and transmit checksumming off on the veths that
//! send to an XDP program (a veth hands over partial checksums, which XDP cannot
//! see; a NIC delivers complete ones).

use std::os::fd::AsRawFd;
use std::process::Command;

use anyhow::{ensure, Context, Result};
use aya::programs::{Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};
use lb_common::program_names;

use crate::netns::NetNs;
use crate::util::run;

/// `lb_xdp_pass` on one device; detached when dropped (with the namespace, at the
/// latest).
pub struct XdpPass {
    _ebpf: Ebpf,
}

/// Runs `f` on a thread that joined `ns` only (the caller's thread stays put).
pub fn in_netns<T: Send>(ns: &NetNs, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let file = ns.open()?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: plain syscall on an open namespace file; only this thread moves.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                ensure!(rc == 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the namespace thread panicked")
    })
}

/// Attaches `lb_xdp_pass` (from the kernel object the tests were built with) to
/// `device` in `ns`, natively.
pub fn attach_pass(ns: &NetNs, device: &str) -> Result<XdpPass> {
    let path = option_env!("LB_EBPF_OBJECT")
        .context("built without LB_EBPF_OBJECT: run through `cargo xtask test`")?;
    let object = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    let device = device.to_owned();
    in_netns(ns, move || {
        // Its own, unpinned maps: only the pass program is loaded.
        let mut ebpf = EbpfLoader::new().load(&object)?;
        let prog: &mut Xdp = ebpf
            .program_mut(program_names::XDP_PASS)
            .context("lb_xdp_pass missing from the kernel object")?
            .try_into()?;
        prog.load()?;
        prog.attach(&device, XdpMode::Driver)
            .with_context(|| format!("attaching lb_xdp_pass to {device}"))?;
        Ok(XdpPass { _ebpf: ebpf })
    })
}

/// `ethtool -K DEVICE tx off` in `ns`: the device's stack computes full checksums.
pub fn tx_checksum_off(ns: &NetNs, device: &str) -> Result<()> {
    run(Command::new("ip").args([
        "netns",
        "exec",
        ns.name(),
        "ethtool",
        "-K",
        device,
        "tx",
        "off",
    ]))
    .map(drop)
    .with_context(|| format!("turning tx checksumming off on {device} in {}", ns.name()))
}
