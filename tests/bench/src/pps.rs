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

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use etherparse::PacketBuilder;
use lb_common::GEN_FRAME_LEN;
use lb_tests::agent::{Agent, AgentSpec, READY_TIMEOUT};
use lb_tests::cgroup::Cgroup;
use lb_tests::manifests::{documents, Endpoint, EndpointSlice, ManifestDir, Service, ServicePort};
use lb_tests::netns::NetNs;
use lb_tests::util::{poll, run as run_cmd, unique_name};
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
/// The Service's backends, from `POD_IP` up (all in 10.79.0.0/24, behind the sink).
const BACKENDS: u8 = 200;

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
    let frames = [
        ("new", bed.frame(NODE_UPLINK_IP, NODE_PORT, Flags::Syn)?),
        (
            "established",
            bed.frame(NODE_UPLINK_IP, NODE_PORT, Flags::Ack)?,
        ),
    ];
    let direct_frames = [
        ("new", bed.frame(POD_IP, POD_PORT, Flags::Syn)?),
        ("established", bed.frame(POD_IP, POD_PORT, Flags::Ack)?),
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
            lb_tests::interrupt::check()?;
            let generator = Generator::load(&bed.gen, "eth0", frame)?;
            let stats_before = agent.as_ref().map(|a| a.stats()).transpose()?;
            let forwarded_before = bed.forwarded()?;
            let row = bed
                .measure(&generator, count, cfg)
                .with_context(|| format!("{} {flows}", path.name()))?;
            let forwarded = bed.forwarded()? - forwarded_before;
            let counters = match (&agent, stats_before) {
                (Some(agent), Some(before)) => counter_deltas(&before, &agent.stats()?),
                _ => Default::default(),
            };
            ensure_path(path, flows, &row, forwarded, &counters)
                .with_context(|| format!("the {} {flows} row", path.name()))?;
            println!(
                "  pps        {:<6} {flows:<11} {:.0} packets/s [{:.0}–{:.0}], {:.1}% delivered",
                path.name(),
                row.pps.median,
                row.pps.min,
                row.pps.max,
                row.share() * 100.0
            );
            out.push(PpsResult {
                path: path.name().into(),
                flows: (*flows).into(),
                pps: row.pps.clone(),
                delivered: row.share(),
            });
        }
        drop(agent);
        drop(pass);
    }
    Ok(out)
}

/// What one row measured: the rates of its repetitions, and every frame sent and
/// delivered to the sink from the start of its warm-up to the end.
struct Row {
    pps: Stat,
    measured_sent: u64,
    measured_delivered: u64,
    total_delivered: u64,
}

impl Row {
    /// Frames reaching the sink / frames sent, over the measured repetitions.
    fn share(&self) -> f64 {
        self.measured_delivered as f64 / self.measured_sent as f64
    }
}

/// How much each of the agent's counters grew.
pub(crate) fn counter_deltas(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v.saturating_sub(*before.get(k).unwrap_or(&0))))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// The row's frames took the path it names: every frame the sink got was
/// translated by that path's program (its counters grew by as much, less the
/// slack below) and none by the other's; the direct row went through the node's
/// IP forwarding, the XDP row did not (TC redirects past it too). A hundredth is
/// left either way for the node's own packets, such as IPv6 neighbour discovery,
/// which the sink also counts.
fn ensure_path(
    path: Path,
    flows: &str,
    row: &Row,
    forwarded: u64,
    counters: &BTreeMap<String, u64>,
) -> Result<()> {
    let delivered = row.total_delivered;
    ensure!(delivered > 0, "no frame reached the sink");
    let count = |names: &[&str]| {
        names
            .iter()
            .map(|n| counters.get(*n).copied().unwrap_or(0))
            .sum::<u64>()
    };
    let (ours, theirs): (&[&str], &[&str]) = match (path, flows) {
        (Path::Direct, _) => (&[], &[]),
        // A new-flow row also hits conntrack when two random sources coincide.
        (Path::Tc, _) => (
            &["tc_new_flow", "tc_ct_hit"],
            &["xdp_new_flow", "xdp_redirect"],
        ),
        (Path::Xdp, _) => (&["xdp_redirect"], &["tc_new_flow", "tc_ct_hit"]),
    };
    // A row whose packets were dropped for want of a conntrack entry or SNAT port
    // measured that drop, not the path.
    let starved = count(&["tc_ct_full", "tc_snat_exhausted"]);
    ensure!(
        starved == 0,
        "{starved} packets found no conntrack entry or SNAT port (counters: {counters:?})"
    );
    if !ours.is_empty() {
        ensure!(
            count(ours) + delivered / 100 >= delivered,
            "{ours:?} grew by {} but the sink got {delivered} frames: they did not all take \
             the {} path (counters: {counters:?})",
            count(ours),
            path.name()
        );
        ensure!(
            count(theirs) == 0,
            "{theirs:?} grew by {} in the {} row (counters: {counters:?})",
            count(theirs),
            path.name()
        );
    }
    match path {
        // TC redirects to the egress device itself: no IP forwarding either.
        Path::Tc => {}
        Path::Xdp => ensure!(
            forwarded <= delivered / 100,
            "the node's stack forwarded {forwarded} of {delivered} frames in the XDP row"
        ),
        Path::Direct => ensure!(
            forwarded + delivered / 100 >= delivered,
            "the node's stack forwarded {forwarded} frames but the sink got {delivered}"
        ),
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Flags {
    Syn,
    Ack,
}

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
        // SNAT gives each backend one node port per flow, about 64k of them, and
        // the new-flow row's flows stay in conntrack for the whole run: enough
        // backends (all behind the sink) that a full run's millions of SYNs never
        // run out (the first 65.5k of a one-backend flood went through, every later
        // one was dropped as `tc_snat_exhausted`).
        let backends = (0..BACKENDS)
            .map(|i| {
                let [a, b, c, d] = POD_IP.octets();
                Endpoint::ready(&format!("pps-backend-{i}"), Ipv4Addr::new(a, b, c, d + i))
                    .on_node("pps-sink")
            })
            .collect();
        let slice = EndpointSlice::for_service(&svc, backends);
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

    /// An Ethernet + IPv4 + TCP frame from the generator to `dst`:`dport`,
    /// checksums complete.
    fn frame(&self, dst: Ipv4Addr, dport: u16, flags: Flags) -> Result<Vec<u8>> {
        let dst_mac = parse_mac(&mac(&self.node, "eth0")?)?;
        let src_mac = parse_mac(&mac(&self.gen, "eth0")?)?;
        tcp_frame(dst_mac, src_mac, GEN_IP, dst, 40_000, dport, flags)
    }

    /// `cfg.reps` runs of `count` frames after a warm-up: the packets/s that reached
    /// the sink in each, and the frames sent and delivered.
    fn measure(&self, generator: &Generator<'_>, count: u32, cfg: &Config) -> Result<Row> {
        let start = self.settled_rx()?;
        generator.send(count / 10, cfg.cpu)?;
        let (mut rates, mut sent, mut delivered) = (Vec::new(), 0u64, 0u64);
        let mut end = self.settled_rx()?;
        for _ in 0..cfg.reps {
            let before = end;
            let took = generator.send(count, cfg.cpu)?;
            end = self.settled_rx()?;
            let got = end - before;
            rates.push(got as f64 / took.as_secs_f64());
            sent += u64::from(count);
            delivered += got;
        }
        if std::env::var_os("LB_BENCH_PPS_DEBUG").is_some() {
            self.debug_counters()?;
        }
        Ok(Row {
            pps: Stat::of(rates).context("no repetitions")?,
            measured_sent: sent,
            measured_delivered: delivered,
            total_delivered: end - start,
        })
    }

    /// Where frames went, for `LB_BENCH_PPS_DEBUG=1`: each device's counters (and
    /// its driver's non-zero ones), and the node's non-zero IP and softnet figures.
    fn debug_counters(&self) -> Result<()> {
        for (ns, dev) in [
            (&self.gen, "eth0"),
            (&self.node, "eth0"),
            (&self.node, "eth1"),
            (&self.sink, "eth0"),
        ] {
            let v = link_json(ns, dev, true)?;
            eprintln!("    {} {dev}: {}", ns.name(), v["stats64"]);
            let text = ns_output(ns, &["ethtool", "-S", dev])?;
            let nonzero: Vec<&str> = text
                .lines()
                .filter(|l| !l.trim_end().ends_with(": 0"))
                .collect();
            eprintln!("      {}", nonzero.join(" | "));
        }
        let nstat = ns_output(&self.node, &["nstat", "-asz"])?;
        let nonzero: Vec<&str> = nstat
            .lines()
            .filter(|l| l.starts_with("Ip") || l.starts_with("TcpExt"))
            .filter(|l| l.split_whitespace().nth(1).is_some_and(|v| v != "0"))
            .collect();
        eprintln!("    node nstat: {}", nonzero.join(" | "));
        Ok(())
    }

    /// The node's `IpForwDatagrams`: packets its stack routed on.
    fn forwarded(&self) -> Result<u64> {
        let snmp = ns_output(&self.node, &["cat", "/proc/net/snmp"])?;
        ip_mib(&snmp, "ForwDatagrams")
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

/// `ip netns exec NS ARGS...`'s standard output.
fn ns_output(ns: &NetNs, args: &[&str]) -> Result<String> {
    run_cmd(
        Command::new("ip")
            .args(["netns", "exec", ns.name()])
            .args(args),
    )
}

/// One field of the `Ip:` lines of /proc/net/snmp (a header line, then values).
fn ip_mib(snmp: &str, field: &str) -> Result<u64> {
    let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = ip
        .next()
        .zip(ip.next())
        .context("no Ip: lines in /proc/net/snmp")?;
    let at = names
        .split_whitespace()
        .position(|n| n == field)
        .with_context(|| format!("no {field} in /proc/net/snmp"))?;
    values
        .split_whitespace()
        .nth(at)
        .context("a short Ip: line in /proc/net/snmp")?
        .parse()
        .with_context(|| format!("{field} in /proc/net/snmp"))
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
    a.veth_to(a_dev, b, b_dev)?;
    a.ip(&["addr", "add", &format!("{a_ip}/24"), "dev", a_dev])?;
    b.ip(&["addr", "add", &format!("{b_ip}/24"), "dev", b_dev])?;
    a.ip(&["link", "set", a_dev, "up"])?;
    b.ip(&["link", "set", b_dev, "up"])?;
    Ok(())
}

pub(crate) fn link_json(ns: &NetNs, dev: &str, stats: bool) -> Result<serde_json::Value> {
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
    flags: Flags,
) -> Result<Vec<u8>> {
    let tcp = PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src.octets(), dst.octets(), 64)
        .tcp(sport, dport, 1, 64_240);
    let tcp = match flags {
        Flags::Syn => tcp.syn(),
        Flags::Ack => tcp.ack(1),
    };
    let mut f = Vec::with_capacity(GEN_FRAME_LEN);
    tcp.write(&mut f, &[])
        .context("building the generator's frame")?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{NetHeaders, PacketHeaders, TransportHeader};

    /// The generator takes the frame as it is: its length, and checksums a router
    /// and a receiver accept.
    #[test]
    fn frames_carry_valid_checksums() {
        for flags in [Flags::Syn, Flags::Ack] {
            let f = tcp_frame([1; 6], [2; 6], GEN_IP, POD_IP, 40_000, 8080, flags).unwrap();
            assert_eq!(f.len(), GEN_FRAME_LEN);
            let h = PacketHeaders::from_ethernet_slice(&f).unwrap();
            let Some(NetHeaders::Ipv4(ip, _)) = h.net.clone() else {
                panic!("not IPv4: {h:?}")
            };
            assert_eq!(ip.header_checksum, ip.calc_header_checksum());
            let Some(TransportHeader::Tcp(tcp)) = h.transport else {
                panic!("not TCP: {h:?}")
            };
            assert_eq!(tcp.checksum, tcp.calc_checksum_ipv4(&ip, &[]).unwrap());
            assert_eq!(tcp.syn, matches!(flags, Flags::Syn));
        }
    }
}
