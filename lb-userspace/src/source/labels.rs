//! The label and annotation names lb reads, in one place (as kube-proxy's
//! well_known_labels.go): the decoder keeps what they mark, the rules act on it.

/// The Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Set on Services (and their slices) handled by another proxy; lb skips them.
pub const LABEL_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Set on headless Services' slices; lb skips them.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// The Node label kube-proxy takes this node's zone from.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// When the EndpointSlice controller saw the change a slice carries (RFC 3339): the
/// start of kube-proxy's network programming latency.
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The Service annotation that chooses how the per-packet path picks a backend for
/// its NodePort, LoadBalancer and externalIP frontends: `maglev` or `random`
/// (overrides `lb agent --lb-algorithm`).
pub const ANNOTATION_ALGORITHM: &str = "service.lb/algorithm";

/// kube-proxy's selector for Services: those claimed by another proxy and headless
/// ones are not proxied.
pub const SERVICE_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// EndpointSlices that belong to a Service, with kube-proxy's selector on top: the
/// EndpointSlice controller copies the Service's labels onto its slices and marks
/// those of headless Services.
pub const SLICE_LABEL_SELECTOR: &str = "kubernetes.io/service-name,\
     !service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
