//! NodePort packet rate on one CPU: `lb_xdp` against `lb_tc_external` and against
//! the kernel routing the same packets to the pod address (direct), for a backend
//! on another node.
//!
//! ```text
//!  gen ns                 node ns (lb agent)                    sink ns
//!  eth0 10.77.0.2 ─── eth0 10.77.0.1      eth1 10.78.0.1 ─── eth0 10.78.0.2
//!  lb_xdp_gen (live)      NodePort 30080 -> 10.79.0.11:8080      lb_xdp_drop
//!                         (10.79.0.0/24 via 10.78.0.2: a pod on another node)
//! ```
//!
//! The generator is `lb_xdp_gen` run through BPF_PROG_TEST_RUN's live-frames mode
//! on the gen's veth: no skb and no system call per packet, so its own cost is small
//! and equal in every row. Every stage runs in softirq on the generator's CPU (a
//! veth receives on the CPU that sends), so the rate at the sink is what one CPU
//! carries: the generator, the node's path, and the sink's drop. The sink counts
//! every frame its veth takes in (`rx_packets`); `lb_xdp_drop` ends each one there,
//! as a wire would. (xdp-tools' `xdp-bench drop` would do, but inside a namespace
//! `ip netns exec` hides bpffs from libxdp, and it also loads tracepoint programs
//! this kernel's BTF lacks.)
//!
//! The node's uplink needs an XDP program for a veth to deliver the generator's
//! frames: in the TC and direct rows that is `lb_xdp_pass`, which hands each frame
//! to the stack as a NIC's driver would (an skb is built, then TC runs).
//!
//! Rows: new flows (a SYN from a new source address and port each time, so every
//! packet is a new conntrack entry and SNAT port) and one established flow (the same
//! ACK over and over: a conntrack hit).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, ManifestDir, Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::util::{poll, unique_name};
use lb_tests::xdp::{self, Generator};
use serde::{Deserialize, Serialize};

use crate::run::{Config, Stat};

const GEN_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const NODE_UPLINK_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const NODE_SINK_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 1);
const SINK_IP: Ipv4Addr = Ipv4Addr::new(10, 78, 0, 2);
const POD_IP: Ipv4Addr = Ipv4Addr::new(10, 79, 0, 11);
const POD_PORT: u16 = 8080;
const NODE_PORT: u16 = 30080;
const NODE_NAME: &str = "pps-node";

/// One measured row.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PpsResult {
    /// `direct`, `tc` or `xdp`.
    pub path: String,
    /// `new` (a new flow per packet) or `established` (one flow).
    pub flows: String,
    /// Packets per second reaching the sink, over the repetitions.
    pub pps: Stat,
    /// Packets reaching the sink / packets sent, over all repetitions.
    pub delivered: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Direct,
    Tc,
    Xdp,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Tc => "tc",
            Path::Xdp => "xdp",
        }
    }
}

/// The three namespaces; field order is teardown order.
struct Bed {
    _sink_drop: xdp::XdpPass,
    manifests: ManifestDir,
    cgroup: Cgroup,
    gen: NetNs,
    node: NetNs,
    sink: NetNs,
}

pub fn run(lb: &std::path::Path, cfg: &Config) -> Result<Vec<PpsResult>> {
    let bed = Bed::build()?;
    let count: u32 = if cfg.quick { 500_000 } else { 2_000_000 };
    let generator = Generator::load(&bed.gen, "eth0")?;
    let frames = [
        ("new", bed.frame(NODE_UPLINK_IP, NODE_PORT, TCP_SYN)?),
        (
            "established",
            bed.frame(NODE_UPLINK_IP, NODE_PORT, TCP_ACK)?,
        ),
    ];
    let direct_frames = [
        ("new", bed.frame(POD_IP, POD_PORT, TCP_SYN)?),
        ("established", bed.frame(POD_IP, POD_PORT, TCP_ACK)?),
    ];
    let mut out = Vec::new();
    for path in [Path::Direct, Path::Tc, Path::Xdp] {
        // The node's uplink takes veth frames only with an XDP program on it.
        let pass = match path {
            Path::Xdp => None,
            _ => Some(xdp::attach_pass(&bed.node, "eth0")?),
        };
        let agent = match path {
            Path::Direct => None,
            Path::Tc => Some(bed.start_agent(lb, "off")?),
            Path::Xdp => Some(bed.start_agent(lb, "native")?),
        };
        let frames = if path == Path::Direct {
            &direct_frames
        } else {
            &frames
        };
        for (flows, frame) in frames {
            let row = bed
                .measure(&generator, frame, count, cfg)
                .with_context(|| format!("{} {flows}", path.name()))?;
            println!(
                "  pps        {:<6} {flows:<11} {:.0} packets/s [{:.0}–{:.0}], {:.1}% delivered",
                path.name(),
                row.0.median,
                row.0.min,
                row.0.max,
                row.1 * 100.0
            );
            out.push(PpsResult {
                path: path.name().into(),
                flows: (*flows).into(),
                pps: row.0,
                delivered: row.1,
            });
        }
        if let Some(agent) = &agent {
            ensure_translated(agent, path)?;
        }
        drop(agent);
        drop(pass);
    }
    Ok(out)
}

/// The row's packets went through the path it names (not, say, XDP passing them on
/// to TC): the agent's counters say so.
fn ensure_translated(agent: &Agent, path: Path) -> Result<()> {
    let stats = agent.stats()?;
    let (counter, other) = match path {
        Path::Xdp => ("xdp_redirect", "tc_new_flow"),
        _ => ("tc_new_flow", "xdp_redirect"),
    };
    let n = stats.get(counter).copied().unwrap_or(0);
    ensure!(
        n > 0,
        "{counter} is 0: the packets did not take the {} path: {stats:?}",
        path.name()
    );
    let m = stats.get(other).copied().unwrap_or(0);
    ensure!(
        m == 0,
        "{other} is {m} in the {} row: {stats:?}",
        path.name()
    );
    Ok(())
}

const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;

impl Bed {
    fn build() -> Result<Bed> {
        let base = unique_name("lbpps");
        let gen = NetNs::create(&format!("{base}-gen"))?;
        let node = NetNs::create(&format!("{base}-node"))?;
        let sink = NetNs::create(&format!("{base}-sink"))?;
        node.sysctls(&[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
        ])?;
        link(&gen, "eth0", GEN_IP, &node, "eth0", NODE_UPLINK_IP)?;
        link(&sink, "eth0", SINK_IP, &node, "eth1", NODE_SINK_IP)?;
        node.ip(&["route", "add", "10.79.0.0/24", "via", &SINK_IP.to_string()])?;
        // The sink never answers ARP for the backend's next hop in time for the
        // first packets of a row: the entry is there from the start, as on a busy
        // node.
        let sink_mac = mac(&sink, "eth0")?;
        node.ip(&[
            "neigh",
            "replace",
            &SINK_IP.to_string(),
            "lladdr",
            &sink_mac,
            "dev",
            "eth1",
            "nud",
            "permanent",
        ])?;
        node.sysctls(&[("net/ipv4/conf/*/rp_filter", "0")])?;
        let sink_drop = xdp::attach_drop(&sink, "eth0")?;
        Ok(Bed {
            _sink_drop: sink_drop,
            manifests: ManifestDir::create()?,
            cgroup: Cgroup::create(&unique_name("lb-bench-pps"))?,
            gen,
            node,
            sink,
        })
    }

    /// The agent on the node, as the DaemonSet starts it (devices found by itself),
    /// with one NodePort Service whose only endpoint is on another node.
    fn start_agent(&self, lb: &std::path::Path, xdp_mode: &str) -> Result<Agent> {
        let svc = Service::new(
            "pps",
            Ipv4Addr::new(10, 96, 77, 1),
            vec![ServicePort::tcp("p", 80, POD_PORT.into()).with_node_port(NODE_PORT.into())],
        )
        .node_port();
        let slice = EndpointSlice::for_service(
            &svc,
            vec![Endpoint::ready("pps-backend", POD_IP).on_node("pps-sink")],
        );
        self.manifests
            .write("pps.yaml", &documents([svc.to_yaml(), slice.to_yaml()]))?;
        let spec = AgentSpec::new(self.manifests.path(), &self.cgroup, NODE_NAME)
            .netns(&self.node)
            .args(["--xdp", xdp_mode]);
        let mut agent = Agent::start_with(lb, &spec)?;
        agent.set_log_on_drop(false);
        agent.wait_ready(READY_TIMEOUT)?;
        agent.wait_services("the NodePort frontend", READY_TIMEOUT, |entries| {
            entries
                .iter()
                .any(|e| e.is(NODE_UPLINK_IP, NODE_PORT, "TCP") && !e.backend_addrs().is_empty())
        })?;
        if xdp_mode != "off" {
            poll("lb_xdp on the node's uplink", READY_TIMEOUT, || {
                Ok(self
                    .node
                    .ip(&["-j", "link", "show", "dev", "eth0"])?
                    .contains("\"xdp\"")
                    .then_some(()))
            })?;
        }
        Ok(agent)
    }

    /// An Ethernet + IPv4 + TCP frame from the generator to `dst`:`dport` with
    /// TCP flags `flags`, checksums complete.
    fn frame(&self, dst: Ipv4Addr, dport: u16, flags: u8) -> Result<Vec<u8>> {
        let dst_mac = parse_mac(&mac(&self.node, "eth0")?)?;
        let src_mac = parse_mac(&mac(&self.gen, "eth0")?)?;
        Ok(tcp_frame(
            dst_mac, src_mac, GEN_IP, dst, 40_000, dport, flags,
        ))
    }

    /// `cfg.reps` runs of `count` frames after a warm-up: the packets/s that reached
    /// the sink, and the share of all frames sent that reached it.
    fn measure(
        &self,
        generator: &Generator<'_>,
        frame: &[u8],
        count: u32,
        cfg: &Config,
    ) -> Result<(Stat, f64)> {
        generator.send(frame, count / 10, cfg.cpu)?;
        self.settled_rx()?;
        let (mut rates, mut sent, mut delivered) = (Vec::new(), 0u64, 0u64);
        for _ in 0..cfg.reps {
            let before = self.settled_rx()?;
            let took = generator.send(frame, count, cfg.cpu)?;
            let got = self.settled_rx()? - before;
            rates.push(got as f64 / took.as_secs_f64());
            sent += u64::from(count);
            delivered += got;
        }
        if std::env::var_os("LB_BENCH_PPS_DEBUG").is_some() {
            for (ns, dev) in [
                (&self.gen, "eth0"),
                (&self.node, "eth0"),
                (&self.node, "eth1"),
                (&self.sink, "eth0"),
            ] {
                let v = link_json(ns, dev, true)?;
                eprintln!("    {} {dev}: {}", ns.name(), v["stats64"]);
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", ns.name(), "ethtool", "-S", dev])
                    .output()?;
                let text = String::from_utf8_lossy(&out.stdout);
                let nonzero: Vec<&str> = text
                    .lines()
                    .filter(|l| !l.trim_end().ends_with(": 0"))
                    .collect();
                eprintln!("      {}", nonzero.join(" | "));
            }
        }
        let stat = Stat::of(rates).context("no repetitions")?;
        Ok((stat, delivered as f64 / sent as f64))
    }

    /// The sink's received-frame count once it stops moving (the last batch's
    /// softirq work runs right after the sending returns; bounded).
    fn settled_rx(&self) -> Result<u64> {
        let mut last = rx_packets(&self.sink)?;
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            let now = rx_packets(&self.sink)?;
            if now == last {
                return Ok(now);
            }
            last = now;
        }
        Ok(last)
    }
}

/// A veth pair: `a_dev` = `a_ip`/24 in `a`, `b_dev` = `b_ip`/24 in `b`, both up.
fn link(
    a: &NetNs,
    a_dev: &str,
    a_ip: Ipv4Addr,
    b: &NetNs,
    b_dev: &str,
    b_ip: Ipv4Addr,
) -> Result<()> {
    a.ip(&[
        "link",
        "add",
        a_dev,
        "type",
        "veth",
        "peer",
        "name",
        b_dev,
        "netns",
        b.name(),
    ])?;
    a.ip(&["addr", "add", &format!("{a_ip}/24"), "dev", a_dev])?;
    b.ip(&["addr", "add", &format!("{b_ip}/24"), "dev", b_dev])?;
    a.ip(&["link", "set", a_dev, "up"])?;
    b.ip(&["link", "set", b_dev, "up"])?;
    Ok(())
}

fn link_json(ns: &NetNs, dev: &str, stats: bool) -> Result<serde_json::Value> {
    let mut args = vec!["-j"];
    if stats {
        args.push("-s");
    }
    args.extend(["link", "show", "dev", dev]);
    let text = ns.ip(&args)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("ip -j link show {dev}: {text}"))?;
    v.get(0)
        .cloned()
        .with_context(|| format!("no {dev} in {}", ns.name()))
}

fn mac(ns: &NetNs, dev: &str) -> Result<String> {
    link_json(ns, dev, false)?["address"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{dev} in {} has no address", ns.name()))
}

fn rx_packets(ns: &NetNs) -> Result<u64> {
    link_json(ns, "eth0", true)?["stats64"]["rx"]["packets"]
        .as_u64()
        .context("no rx packet count for the sink's eth0")
}

fn parse_mac(text: &str) -> Result<[u8; 6]> {
    let mut out = [0u8; 6];
    let parts: Vec<&str> = text.split(':').collect();
    ensure!(parts.len() == 6, "not a MAC address: {text}");
    for (o, p) in out.iter_mut().zip(parts) {
        *o = u8::from_str_radix(p, 16).with_context(|| format!("not a MAC address: {text}"))?;
    }
    Ok(out)
}

/// Ethernet, a 20-byte IPv4 header and a 20-byte TCP header, no payload.
fn tcp_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    let mut f = Vec::with_capacity(54);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&40u16.to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64;
    ip[9] = 6;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&[&ip]);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&sport.to_be_bytes());
    tcp[2..4].copy_from_slice(&dport.to_be_bytes());
    tcp[4..8].copy_from_slice(&1u32.to_be_bytes());
    if flags & TCP_ACK != 0 {
        tcp[8..12].copy_from_slice(&1u32.to_be_bytes());
    }
    tcp[12] = 5 << 4;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&64_240u16.to_be_bytes());
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&src.octets());
    pseudo[4..8].copy_from_slice(&dst.octets());
    pseudo[9] = 6;
    pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
    let c = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&tcp);
    f
}

/// The Internet checksum of the concatenation of `parts` (each of even length).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum = 0u32;
    for part in parts {
        for w in part.chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header with its checksum in place sums to zero.
    #[test]
    fn frames_carry_valid_checksums() {
        let f = tcp_frame([1; 6], [2; 6], GEN_IP, POD_IP, 40_000, 8080, TCP_SYN);
        assert_eq!(f.len(), 54);
        assert_eq!(checksum(&[&f[14..34]]), 0);
        let mut pseudo = [0u8; 12];
        pseudo[0..4].copy_from_slice(&GEN_IP.octets());
        pseudo[4..8].copy_from_slice(&POD_IP.octets());
        pseudo[9] = 6;
        pseudo[10..12].copy_from_slice(&20u16.to_be_bytes());
        assert_eq!(checksum(&[&pseudo, &f[34..54]]), 0);
    }
}
