//! What a start finds under the pin directory, and what it leaves there when it
//! fails: pinned maps keep the size they were created with, and pins a failed start
//! created serve nothing.

use std::fs;
use std::path::PathBuf;

use aya::maps::MapInfo;
use lb_common::map_names;
use tracing::{info, warn};

use super::layout::{remove_layout, PinLayout};

/// `max_entries` of the maps the agent sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub sock_revnat: u32,
    pub affinity: u32,
    pub conntrack: u32,
    /// `LB_MAGLEV`'s capacity in table slots (`--maglev-table-slots`), a multiple of
    /// four: the map has a quarter as many entries.
    pub maglev_slots: u32,
    /// `LB_MASQ`'s capacity (`--masquerade-map-size`): two entries per
    /// masqueraded flow.
    pub masquerade: u32,
}

impl MapSizes {
    /// `max_entries` of `LB_MAGLEV`: four slots an entry.
    pub fn maglev_entries(&self) -> u32 {
        self.maglev_slots / lb_common::MAGLEV_SLOTS_PER_ENTRY
    }
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: lb_common::DEFAULT_SERVICES_MAX,
            backends: lb_common::DEFAULT_BACKENDS_MAX,
            sock_revnat: lb_common::DEFAULT_SOCK_REVNAT_MAX,
            affinity: lb_common::DEFAULT_AFFINITY_MAX,
            conntrack: lb_common::DEFAULT_CT_MAX,
            maglev_slots: lb_common::DEFAULT_MAGLEV_SLOTS,
            masquerade: lb_common::DEFAULT_MASQ_MAX,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PinsError {
    #[error(
        "pinned map {map} in {} has {pinned} entries, but {flag} asks for {requested}: a \
         pinned map keeps its size. Start with {flag} {pinned}, or run \
         `lb cleanup --pin-dir {}` first to recreate the maps (this detaches the datapath \
         and drops its conntrack state until the agent is back)",
        maps_dir.display(),
        root.display()
    )]
    SizeMismatch {
        map: &'static str,
        flag: &'static str,
        pinned: u32,
        requested: u32,
        maps_dir: PathBuf,
        root: PathBuf,
    },
    #[error("cannot read the pinned map {}: {source}", path.display())]
    ReadPinned {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
}

/// The maps sized by a flag, with the flag, the size it asks for, and how many of
/// the flag's units one map entry holds.
fn sized_maps(sizes: MapSizes) -> [(&'static str, &'static str, u32, u32); 7] {
    [
        (
            map_names::SERVICES,
            "--services-map-size",
            sizes.services,
            1,
        ),
        (
            map_names::BACKENDS,
            "--backends-map-size",
            sizes.backends,
            1,
        ),
        (
            map_names::SOCK_REVNAT,
            "--sock-revnat-map-size",
            sizes.sock_revnat,
            1,
        ),
        (
            map_names::AFFINITY,
            "--affinity-map-size",
            sizes.affinity,
            1,
        ),
        (map_names::CT, "--conntrack-map-size", sizes.conntrack, 1),
        (
            map_names::MAGLEV,
            "--maglev-table-slots",
            sizes.maglev_slots,
            lb_common::MAGLEV_SLOTS_PER_ENTRY,
        ),
        (
            map_names::MASQ,
            "--masquerade-map-size",
            sizes.masquerade,
            1,
        ),
    ]
}

/// Refuses sizes that differ from those of maps already pinned in this layout:
/// the loader reuses a pinned map as it is, so a new size would be silently
/// ignored (and the capacity the agent plans with would be wrong).
pub fn check_map_sizes(layout: &PinLayout, sizes: MapSizes) -> Result<(), PinsError> {
    for (map, flag, requested, per_entry) in sized_maps(sizes) {
        let path = layout.map_path(map);
        if !path.exists() {
            continue;
        }
        let pinned = MapInfo::from_pin(&path)
            .map_err(|source| PinsError::ReadPinned {
                path: path.clone(),
                source,
            })?
            .max_entries()
            .saturating_mul(per_entry);
        if pinned != requested {
            return Err(PinsError::SizeMismatch {
                map,
                flag,
                pinned,
                requested,
                maps_dir: layout.maps_dir(),
                root: layout.root().to_owned(),
            });
        }
    }
    Ok(())
}

/// Removes, when dropped before [`CreatedPins::keep`], the pin directories a start
/// created: a start that fails after the maps were pinned (an attach refused) must
/// not leave maps, or hooks attached through link pins, that no agent keeps up to
/// date. Directories that were there before belong to a datapath already serving
/// and are left alone.
pub struct CreatedPins {
    /// Created by this start, innermost first.
    created: Vec<PathBuf>,
    root: PathBuf,
    kept: bool,
}

impl CreatedPins {
    /// Notes what does not exist yet; call before the maps are loaded.
    pub fn before_load(layout: &PinLayout) -> Self {
        let created = [
            layout.links_dir(),
            layout.maps_dir(),
            layout.root().to_owned(),
        ]
        .into_iter()
        .filter(|dir| !dir.exists())
        .collect();
        CreatedPins {
            created,
            root: layout.root().to_owned(),
            kept: false,
        }
    }

    /// The start succeeded: the pins are the datapath's now.
    pub fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for CreatedPins {
    fn drop(&mut self) {
        if self.kept || self.created.is_empty() {
            return;
        }
        for dir in &self.created {
            if !dir.exists() {
                continue;
            }
            // Link pins first (unpinning detaches the hooks), then the maps.
            let removed = if fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none()) {
                fs::remove_dir(dir)
            } else {
                remove_layout(dir)
            };
            match removed {
                Ok(()) => info!(dir = %dir.display(), "removed what this failed start pinned"),
                Err(e) => warn!(
                    "cannot remove {} after the failed start ({e}); run `lb cleanup --pin-dir {}`",
                    dir.display(),
                    self.root.display()
                ),
            }
        }
    }
}
