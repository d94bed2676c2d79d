//! testbed
