//! Testbed for the socket load balancer: a node's pod network built from network
//! namespaces, a child cgroup for the socket programs, Kubernetes manifests, and a
//! handle on the `lb` agent. Used by the end-to-end tests (tests/tests/) and by
//! `lb-demo`.
//!
//! Rules every piece follows:
//! - test traffic stays inside the namespaces built here (or loopback); nothing here
//!   connects from the host's own namespace;
//! - programs are attached only to a cgroup created here;
//! - every resource is owned by an RAII guard that removes it on drop, whatever path
//!   the test leaves by, and is named uniquely (pid + counter) so tests run in parallel;
//! - waits are on conditions (a line of output, the agent's map listing), bounded in
//!   time and rounds.

pub mod agent;
pub mod agent_proc;
pub mod cgroup;
pub mod cluster;
pub mod daemonset;
pub mod interrupt;
pub mod lines;
pub mod load;
pub mod manifests;
pub mod netns;
pub mod netpol;
pub mod podman;
pub mod probe;
pub mod process;
pub mod testbed;
pub mod topology;
pub mod util;
pub mod xdp;

pub use agent::{lb_binary, Agent, ServiceEntry};
pub use testbed::{Hold, Testbed, Tools, ECHO_TCP_PORT, ECHO_UDP_PORT};
