//! lb-demo: shows the socket load balancer at work on this machine, in a sandbox.
//!
//! `lb-demo --lb target/debug/lb --examples examples` builds a miniature node (three
//! backend pods and a client pod, each in its own network namespace, on a bridge),
//! creates a cgroup for the client, starts `lb agent` on the example manifests, sends
//! TCP connections and UDP requests from the client to every Service frontend, prints
//! which pod answered how often, shows `lb services`, and removes everything again —
//! also on error or Ctrl-C. Needs root.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use lb_tests::agent::{ServiceEntry, SYNC_TIMEOUT};
use lb_tests::probe::Tally;
use lb_tests::{interrupt, Testbed, Tools};

const TCP_CONNECTIONS: u32 = 300;
const UDP_REQUESTS: u32 = 60;

#[derive(Parser)]
#[command(about = "Demonstrate the lb socket load balancer in throwaway network namespaces")]
struct Args {
    /// The lb binary (default: `lb` next to this program).
    #[arg(long, env = "LB_BIN")]
    lb: Option<PathBuf>,
    /// Directory (or file) of Kubernetes Service/EndpointSlice YAML.
    #[arg(long, default_value = "examples")]
    examples: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = interrupt::install_handler() {
        eprintln!("lb-demo: {e:#}");
        return ExitCode::FAILURE;
    }
    // `run` owns the testbed: by the time it returns, everything is torn down.
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) if interrupt::requested() => {
            eprintln!("lb-demo: interrupted");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("lb-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn lb_path(args: &Args) -> Result<PathBuf> {
    let path = match &args.lb {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("executable has no directory")?
            .join("lb"),
    };
    if !path.is_file() {
        bail!(
            "lb binary not found at {} (build it with `cargo xtask build`, or pass --lb)",
            path.display()
        );
    }
    Ok(path)
}

fn run(args: &Args) -> Result<()> {
    let lb = lb_path(args)?;
    if !args.examples.exists() {
        bail!("{} does not exist", args.examples.display());
    }
    let tools = Tools::beside_current_exe()?;

    step("Building the sandbox node");
    // Dropped after `bed` (declared before it): reports the teardown once it is done.
    let _announce = AnnounceCleanup;
    let mut bed = Testbed::new(tools, 3, 1)?;
    let client = bed.topo.client();
    println!(
        "  bridge br0 10.244.1.1/24 in netns {}",
        bed.topo.node().name()
    );
    for pod in bed.topo.pods() {
        println!(
            "  pod {:<8} {:<13} lb-echo on TCP {} and UDP {}",
            pod.name(),
            pod.ip(),
            lb_tests::ECHO_TCP_PORT,
            lb_tests::ECHO_UDP_PORT
        );
    }
    println!("  pod {:<8} {:<13} the client", client.name(), client.ip());
    println!(
        "  cgroup {} (the client runs here)",
        bed.cgroup.path().display()
    );

    step(&format!("Starting lb agent on {}", args.examples.display()));
    bed.start_agent_on(&lb, &args.examples)?;
    let entries = bed.agent().wait_services(
        "the agent to program at least one frontend",
        SYNC_TIMEOUT,
        |e| !e.is_empty(),
    )?;
    println!(
        "  ready: {} frontend(s) pinned under {}",
        entries.len(),
        bed.agent().pin_dir().display()
    );

    step("Sending traffic from the client pod to the Service VIPs");
    let mut rows = Vec::new();
    for entry in &entries {
        let fe = &entry.frontend;
        let to = std::net::SocketAddr::new(fe.ip, fe.port);
        let label = format!("{to}/{}", fe.protocol);
        let (tally, seen) = match fe.protocol.as_str() {
            "TCP" => {
                let r = bed.tcp(0, to, TCP_CONNECTIONS)?;
                (r.tally, r.peers)
            }
            "UDP" => {
                let r = bed.udp(0, to, UDP_REQUESTS, 1)?;
                (r.tally, r.sources)
            }
            other => bail!("unexpected protocol {other} in lb services"),
        };
        let seen: Vec<_> = seen.into_iter().collect();
        println!(
            "  {label:<22} {:>3} {} -> client saw the server as {}",
            tally.attempts,
            if fe.protocol == "TCP" {
                "connections"
            } else {
                "requests   "
            },
            seen.join(", ")
        );
        rows.push((label, entry.clone(), tally));
    }

    step("Who answered");
    println!("  The client only ever addressed the VIP; the socket hooks chose a pod for each");
    println!("  TCP connection and for each UDP socket.\n");
    print_table(&bed, &rows)?;

    step("lb services");
    for line in bed.agent().services_text()?.lines() {
        println!("  {line}");
    }

    step("Stopping the agent and cleaning up");
    let agent = bed.agent_mut();
    agent.stop()?;
    agent.set_log_on_drop(false);
    Ok(())
}

/// Prints, on drop, that the sandbox is gone; runs on success, error and Ctrl-C.
struct AnnounceCleanup;

impl Drop for AnnounceCleanup {
    fn drop(&mut self) {
        println!("  removed the namespaces, the cgroup, the pinned maps and programs");
    }
}

fn step(title: &str) {
    println!("\n== {title}");
}

/// One row per (frontend, backend pod): count, share and a bar.
fn print_table(bed: &Testbed, rows: &[(String, ServiceEntry, Tally)]) -> Result<()> {
    let pod_ip: BTreeMap<&str, String> = bed
        .topo
        .pods()
        .iter()
        .map(|p| (p.name(), p.ip().to_string()))
        .collect();
    println!(
        "  {:<22} {:<8} {:<13} {:>6} {:>7}",
        "SERVICE", "BACKEND", "POD IP", "COUNT", "SHARE"
    );
    for (i, (label, entry, tally)) in rows.iter().enumerate() {
        if i > 0 {
            println!();
        }
        let total = tally.attempts.max(1);
        for (name, &count) in &tally.backends {
            let share = f64::from(count) * 100.0 / f64::from(total);
            println!(
                "  {label:<22} {name:<8} {:<13} {count:>6} {share:>6.1}%  {}",
                pod_ip.get(name.as_str()).map_or("?", String::as_str),
                "#".repeat((share / 2.0).round() as usize)
            );
        }
        for (errno, &count) in &tally.errors {
            let share = f64::from(count) * 100.0 / f64::from(total);
            println!("  {label:<22} {errno:<22} {count:>6} {share:>6.1}%");
        }
        if entry.affinity_timeout_sec.is_some() {
            println!("  {label:<22} (session affinity: one client, one backend)");
        }
    }
    if rows.iter().any(|(_, _, t)| t.answered < t.attempts) {
        bail!("some requests failed; see the table above");
    }
    Ok(())
}
