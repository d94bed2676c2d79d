//! Desired state + current map contents -> ordered map operations. Pure: no kernel,
//! no I/O, so every ordering and capacity rule is unit-tested.

use std::collections::BTreeMap;

use lb_common::{Backend, ServiceKey, ServiceValue};

use crate::model::{DesiredState, Frontend};

/// The kernel's service table as read from the pinned maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapSnapshot {
    /// Every `LB_SERVICES` entry (masters and slots).
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    /// Every `LB_BACKENDS` entry.
    pub backends: BTreeMap<u32, Backend>,
}

/// `max_entries` of the maps the plan writes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    pub services: u32,
    pub backends: u32,
}

/// One map write, applied in plan order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend { id: u32, backend: Backend },
    PutService { key: ServiceKey, value: ServiceValue },
    DeleteService { key: ServiceKey },
    DeleteBackend { id: u32 },
}

/// A frontend the plan leaves as it is in the kernel, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    #[error(
        "service {service} ({frontend}): {map} is full ({capacity} entries); \
         kept its previous state; raise the map size with --{flag}"
    )]
    MapFull {
        service: String,
        frontend: Frontend,
        map: &'static str,
        capacity: u32,
        flag: &'static str,
    },
    #[error("service {service} ({frontend}): {count} endpoints exceed the {max} slots one frontend can hold")]
    TooManyBackends {
        service: String,
        frontend: Frontend,
        count: usize,
        max: usize,
    },
    #[error("no free frontend id left (all {max} in use); {service} ({frontend}) not programmed")]
    OutOfIds {
        service: String,
        frontend: Frontend,
        max: u32,
    },
}

/// Result of planning: operations to apply in order, and the frontends skipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<MapOp>,
    pub rejected: Vec<ReconcileError>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

/// Compute the operations that turn `current` into `desired`.
pub fn plan(desired: &DesiredState, current: &MapSnapshot, capacity: Capacity) -> Plan {
    let _ = (desired, current, capacity);
    todo!("implemented by the reconciler work item")
}
