//! The pin directory: where one agent's maps and links live (`layout`), the lock
//! that keeps it to one agent (`lock`), and what a start finds there and leaves
//! behind when it fails (`sizes`).

mod layout;
mod lock;
mod sizes;

pub use layout::{
    cleanup, lock_for_cleanup, other_layouts, remove_layout, CleanupError, CleanupLock,
    CleanupReport, PinLayout,
};
pub use lock::{PinLock, PinLockError, Wait};
pub use sizes::{check_map_sizes, CreatedPins, MapSizes, PinsError};
