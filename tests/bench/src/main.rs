//! lb-bench: the benchmark of `cargo xtask bench` (see tests/bench/).
//!
//! - `lb-bench run --lb PATH --out DIR [--quick]`: build the namespaces, measure every
//!   datapath, write DIR/results.json, DIR/README.md and the plots, clean up.
//! - `lb-bench serve` / `lb-bench client`: the server and client it runs inside the
//!   namespaces.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
mod api;
mod cpu;
mod dsr;
mod entry;
mod kubeproxy;
mod masq;
mod netio;
mod policy;
mod policy_rate;
mod pps;
mod quarantine;
mod report;
mod run;
mod xdp_bulk;

#[derive(Parser)]
#[command(
    name = "lb-bench",
    about = "Datapath and control-plane benchmark of lb vs kube-proxy modes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the whole benchmark.
    Run {
        /// The `lb` binary.
        #[arg(long)]
        lb: PathBuf,
        /// Where results.json, README.md and the plots go.
        #[arg(long)]
        out: PathBuf,
        /// S = 1 and 1000, one repetition.
        #[arg(long)]
        quick: bool,
        /// Skip the TC (NodePort) datapath and the rows built on it (pps, dsr, xdp-bulk,
        /// masquerade).
        #[arg(long)]
        no_tc: bool,
        /// Only these scales (comma-separated), e.g. `1,1000`.
        #[arg(long, value_delimiter = ',')]
        scales: Vec<usize>,
        /// Only these datapaths (comma-separated: iptables, nftables, socket-lb, socket-lb6,
        /// tc-nodeport, tc-nodeport6, socket-lb-api, pps, dsr, xdp-bulk, masquerade,
        /// quarantine). pps, dsr, xdp-bulk, masquerade and quarantine run once, after the
        /// scales (they hold no S Services).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Time endpoint changes under churn at every scale (200, 1000 from 10k up; on in full runs).
        #[arg(long)]
        change_distribution: bool,
    },
    /// Write the manifests the bench programs at scale S (S Services x 10 endpoints)
    /// into a directory, to profile the agent by hand.
    Manifests {
        #[arg(long)]
        services: usize,
        #[arg(long)]
        out: PathBuf,
    },
    /// Re-render README.md and the plots from an existing results.json.
    Report {
        #[arg(long)]
        out: PathBuf,
    },
    /// Request/response and bulk server (inside a pod namespace).
    Serve {
        #[arg(long)]
        name: String,
        #[arg(long)]
        cpu: Option<usize>,
    },
    /// Measuring client (inside a client namespace).
    Client {
        #[arg(long)]
        to: SocketAddr,
        /// lat | rate | bulk | watch | paired-lat | paired-bulk | paired-cpu | paced
        /// (COUNT connections, one every SECS / COUNT, failures counted)
        #[arg(long)]
        mode: String,
        #[arg(long, default_value_t = 2000)]
        count: u64,
        #[arg(long, default_value_t = 2.0)]
        secs: f64,
        #[arg(long)]
        cpu: Option<usize>,
        /// watch: stop at the first answer from this backend.
        #[arg(long)]
        until: Option<String>,
        /// paired-lat | paired-bulk | paired-cpu: measured alternately with --to.
        #[arg(long)]
        baseline: Option<SocketAddr>,
        /// paired-cpu: rounds of one block of --count connections to each address.
        #[arg(long, default_value_t = 8)]
        rounds: u64,
        /// paired-cpu: pids of the servers (comma-separated), whose CPU time counts.
        #[arg(long, value_delimiter = ',')]
        server_pids: Vec<u32>,
        /// paired-cpu: pid of the agent, whose CPU time is reported beside.
        #[arg(long)]
        agent_pid: Option<u32>,
    },
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lb-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Run {
            lb,
            out,
            quick,
            no_tc,
            scales,
            only,
            change_distribution,
        } => {
            lb_tests::interrupt::install_handler()?;
            let mut cfg = run::Config::new(quick);
            cfg.tc_path = !no_tc;
            if !scales.is_empty() {
                cfg.ours_extra_scales.retain(|s| scales.contains(s));
                cfg.scales = scales
                    .into_iter()
                    .filter(|s| !cfg.ours_extra_scales.contains(s))
                    .collect();
            }
            cfg.only = only;
            cfg.change_distribution |= change_distribution;
            let exe = std::env::current_exe()?;
            let results = run::run(exe, lb, cfg)?;
            report::write(&out, &results)?;
            println!("lb-bench: results in {}", out.display());
            Ok(())
        }
        Cmd::Manifests { services, out } => run::write_manifests(&out, services),
        Cmd::Report { out } => report::rerender(&out),
        Cmd::Serve { name, cpu } => {
            if let Some(cpu) = cpu {
                lb_tests::util::pin_to_cpu(cpu)?;
            }
            netio::serve(&name)
        }
        Cmd::Client {
            to,
            mode,
            count,
            secs,
            cpu,
            until,
            baseline,
            rounds,
            server_pids,
            agent_pid,
        } => {
            let args = netio::ClientArgs {
                to,
                baseline,
                mode,
                count,
                secs,
                cpu,
                until,
                rounds,
                server_pids,
                agent_pid,
            };
            let report = netio::client(&args)?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
    }
}
