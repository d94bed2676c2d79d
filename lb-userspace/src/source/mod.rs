//! Where Services and EndpointSlices come from, and kube-proxy's rules for turning
//! them into a [`crate::model::DesiredState`].
