//! What the XDP tests need around the nodes: a pass program on the far end of the
//! veths `lb_xdp` transmits into (a veth delivers `XDP_TX`ed and redirected frames
//! only when its peer runs XDP), and transmit checksumming off on the veths that
//! send to an XDP program (a veth hands over partial checksums, which XDP cannot
//! see; a NIC delivers complete ones).

use std::process::Command;

use anyhow::{ensure, Context, Result};
use aya::programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};
use lb_common::{program_names, GEN_FRAME_LEN};

use crate::netns::NetNs;
use crate::util::run;

/// A helper program (`lb_xdp_pass`, `lb_xdp_drop`) on one device; detached when
/// dropped (with the namespace, at the latest).
pub struct XdpPass {
    _ebpf: Ebpf,
}

/// Attaches `lb_xdp_pass` (from the kernel object the tests were built with) to
/// `device` in `ns`, natively.
pub fn attach_pass(ns: &NetNs, device: &str) -> Result<XdpPass> {
    attach_helper(ns, device, program_names::XDP_PASS)
}

/// Attaches `lb_xdp_drop` to `device` in `ns`, natively: a sink that drops and
/// (through the device's receive counter) counts every frame.
pub fn attach_drop(ns: &NetNs, device: &str) -> Result<XdpPass> {
    attach_helper(ns, device, program_names::XDP_DROP)
}

fn attach_helper(ns: &NetNs, device: &str, program: &'static str) -> Result<XdpPass> {
    let path = option_env!("LB_EBPF_OBJECT")
        .context("built without LB_EBPF_OBJECT: run through `cargo xtask test`")?;
    let object = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    let device = device.to_owned();
    ns.run_in(move || {
        // Its own, unpinned maps: only the one program is loaded.
        let mut ebpf = EbpfLoader::new().load(&object)?;
        let prog: &mut Xdp = ebpf
            .program_mut(program)
            .with_context(|| format!("{program} missing from the kernel object"))?
            .try_into()?;
        prog.load()?;
        prog.attach(&device, XdpMode::Driver)
            .with_context(|| format!("attaching {program} to {device}"))?;
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

/// The benchmark's packet generator: `lb_xdp_gen` run through BPF_PROG_TEST_RUN's
/// live-frames mode with `device` in `ns` as the ingress device, so every frame it
/// returns `XDP_TX` for leaves through `device` (see lb-ebpf/src/traffic_gen.rs).
/// Loaded for one frame, which it rewrites from its template on every send.
pub struct Generator<'a> {
    ebpf: Ebpf,
    ns: &'a NetNs,
    ifindex: u32,
    frame: [u8; GEN_FRAME_LEN],
}

impl<'a> Generator<'a> {
    /// `frame`: Ethernet, IPv4 without options and TCP without options, no
    /// payload, checksums complete (`GEN_FRAME_LEN` bytes).
    pub fn load(ns: &'a NetNs, device: &str, frame: &[u8]) -> Result<Self> {
        let frame: [u8; GEN_FRAME_LEN] = frame.try_into().map_err(|_| {
            anyhow::anyhow!(
                "the generator sends {GEN_FRAME_LEN}-byte frames (Ethernet, IPv4, TCP), not {}",
                frame.len()
            )
        })?;
        let path = option_env!("LB_EBPF_OBJECT")
            .context("built without LB_EBPF_OBJECT: build through `cargo xtask`")?;
        let object = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        // Its own, unpinned maps: only the generator is loaded.
        let mut ebpf = EbpfLoader::new()
            // The template in frame order: the program copies it as it lies in memory.
            .override_global("LB_GEN_FRAME", &frame, true)
            .load(&object)
            .context("loading the kernel object for lb_xdp_gen")?;
        let prog: &mut Xdp = ebpf
            .program_mut(program_names::XDP_GEN)
            .context("lb_xdp_gen missing from the kernel object")?
            .try_into()?;
        prog.load()?;
        let name = std::ffi::CString::new(device)?;
        let ifindex = ns.run_in(|| {
            // SAFETY: a NUL-terminated name that outlives the call.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            ensure!(index != 0, "no device {device} in {}", ns.name());
            Ok(index)
        })?;
        Ok(Generator {
            ebpf,
            ns,
            ifindex,
            frame,
        })
    }

    /// Sends the frame `count` times (varied as `traffic_gen.rs` says), from a
    /// thread in the namespace pinned to `cpu`, so the sending and whatever the
    /// receivers do in softirq on that CPU share it. Returns how long the sending
    /// took.
    pub fn send(&self, count: u32, cpu: usize) -> Result<std::time::Duration> {
        let prog: &Xdp = self
            .ebpf
            .program(program_names::XDP_GEN)
            .context("lb_xdp_gen not loaded")?
            .try_into()?;
        let ctx_in = xdp_md(GEN_FRAME_LEN as u32, self.ifindex);
        self.ns.run_in(|| {
            crate::util::pin_to_cpu(cpu)?;
            let started = std::time::Instant::now();
            prog.test_run(TestRunOptions {
                data_in: Some(&self.frame),
                ctx_in: Some(&ctx_in),
                repeat: count,
                attrs: TestRunAttrs::new().xdp_live_frames(64),
                ..TestRunOptions::default()
            })
            .context("BPF_PROG_TEST_RUN of lb_xdp_gen (live frames)")?;
            Ok(started.elapsed())
        })
    }
}

/// `struct xdp_md` as BPF_PROG_TEST_RUN reads it: the frame's bounds and the
/// ingress device (its other fields zero).
fn xdp_md(data_end: u32, ingress_ifindex: u32) -> [u8; 24] {
    let mut md = [0u8; 24];
    md[4..8].copy_from_slice(&data_end.to_ne_bytes());
    md[12..16].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    md
}
