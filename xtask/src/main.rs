//! Project tasks: `cargo xtask <command>` (see `cargo xtask --help`).

mod bench;
mod ebpf;
mod image;
mod run;
mod setup;
mod tasks;
mod validate;
mod watchdog;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, test and demo the eBPF load balancer"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a Debian 12 machine lacks (packages, bpf-linker) and mount bpffs.
    Setup,
    /// Build the kernel crate lb-ebpf/ for bpfel-unknown-none.
    BuildEbpf {
        /// Build the dev profile (target/bpfel-unknown-none/debug) instead of release.
        #[arg(long)]
        debug: bool,
    },
    /// Setup, build the eBPF object, the workspace with it and the agent's image
    /// (as `image`), then test.
    Test {
        /// Arguments after `--`: for the test binaries (`-- --nocapture`), or,
        /// if they contain their own `--`, for cargo test itself
        /// (`-- -p lb-tests -- --nocapture`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Setup, build the eBPF object and a release `lb`, then the agent's container
    /// image with no registry: target/image/lb-image.tar (OCI archive, lb:<version>).
    Image,
    /// Setup, build everything, then run the socket-LB demo in network namespaces.
    Demo,
    /// Check deploy/ and examples/ against the Kubernetes API schemas (kubernetes-validate, strict).
    ValidateManifests,
    /// Setup, build, then benchmark direct / kube-proxy iptables / nftables / socket LB /
    /// TC NodePort in network namespaces; writes docs/benchmarks/.
    Bench {
        /// S = 1 and 1000, one repetition.
        #[arg(long)]
        quick: bool,
        /// Arguments after `--` go to `lb-bench run` (`--scales 1,1000`, `--only socket-lb`, `--no-tc`).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

fn run(cli: Cli) -> Result<()> {
    let root = workspace_root();
    match cli.command {
        Cmd::Setup => setup::setup(&root),
        Cmd::BuildEbpf { debug } => ebpf::build(&root, debug).map(drop),
        Cmd::Test { args } => tasks::test(&root, &args),
        Cmd::Image => image::image(&root),
        Cmd::Demo => tasks::demo(&root),
        Cmd::ValidateManifests => validate::validate_manifests(&root),
        Cmd::Bench { quick, args } => bench::bench(&root, quick, &args),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_args(argv: &[&str]) -> Vec<String> {
        match Cli::try_parse_from(argv).unwrap().command {
            Cmd::Test { args } => args,
            _ => panic!("not the test command"),
        }
    }

    #[test]
    fn test_passes_everything_after_the_separator() {
        assert!(test_args(&["xtask", "test"]).is_empty());
        assert_eq!(
            test_args(&["xtask", "test", "--", "--nocapture"]),
            ["--nocapture"]
        );
        assert_eq!(
            test_args(&["xtask", "test", "--", "-p", "lb-tests", "--", "--nocapture"]),
            ["-p", "lb-tests", "--", "--nocapture"]
        );
    }

    #[test]
    fn build_ebpf_takes_debug() {
        let cli = Cli::try_parse_from(["xtask", "build-ebpf", "--debug"]).unwrap();
        assert!(matches!(cli.command, Cmd::BuildEbpf { debug: true }));
    }
}
