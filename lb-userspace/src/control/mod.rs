//! kube-proxy's rules and the plan, pure: no kernel, no I/O. Objects are read as
//! kube-proxy reads them ([`interpret`], with [`topology`]) into one desired state
//! kept per Service ([`index`]); the planner ([`plan`]) turns a change of that state
//! into ordered map operations against what the agent last wrote ([`known`]), with
//! the ids it hands out ([`ids`]) and the Maglev tables it places ([`maglev`],
//! [`maglev_tables`]).

pub mod ids;
pub mod index;
pub mod interpret;
pub mod known;
pub mod maglev;
pub mod maglev_tables;
pub mod masquerade;
pub mod options;
pub mod plan;
pub mod policy;
pub mod topology;

pub use interpret::build_desired;
pub use options::{NodePortRange, SourceOptions};
