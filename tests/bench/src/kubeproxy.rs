//! kube-proxy-style rule sets for the benchmark's peers: iptables mode
//! (`iptables-restore` input) and nftables mode (`nft -f` input), written from
//! kube-proxy's documented behaviour and the rule sets a cluster shows
//! (`iptables-save`, `nft list ruleset`), not from its source.
//!
//! iptables mode: `PREROUTING`/`OUTPUT` jump to `KUBE-SERVICES`, which holds one rule
//! per Service port (match the cluster IP and port) jumping to `KUBE-SVC-<hash>`; that
//! chain marks traffic from outside the pod CIDR for masquerade and picks an endpoint
//! with `-m statistic --mode random --probability 1/(n-i)` rules, each jumping to a
//! `KUBE-SEP-<hash>` chain that DNATs. `KUBE-SERVICES` ends with the jump to
//! `KUBE-NODEPORTS` for local destinations. The filter table gets kube-proxy's
//! firewall/forward chains, traversed by every new connection.
//!
//! Chain names are deterministic like kube-proxy's: the first 16 characters of
//! base32(sha256(servicePortName + protocol [+ endpoint])), so a generated rule set can
//! be compared with a real cluster's `iptables-save`.
//!
//! nftables mode: table `ip kube-proxy`, a `service-ips` verdict map
//! (`ip daddr . meta l4proto . th dport`) to one chain per Service port, which picks
//! an endpoint chain with `numgen random mod n vmap { ... }`; endpoint chains DNAT.

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use sha2::{Digest, Sha256};

/// kube-proxy's masquerade mark (`--iptables-masquerade-bit 14`).
pub const MASQ_MARK: &str = "0x4000";

/// One Service port and its endpoints, as both rule generators see it.
#[derive(Clone, Debug)]
pub struct SvcPort {
    pub namespace: String,
    pub name: String,
    pub port_name: String,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub target_port: u16,
    /// `nodePort` of a `type: NodePort` Service.
    pub node_port: Option<u16>,
    /// Ready endpoints (pod addresses), in the EndpointSlice's order.
    pub endpoints: Vec<Ipv4Addr>,
}

impl SvcPort {
    /// `namespace/name:port`, kube-proxy's ServicePortName.
    pub fn service_port_name(&self) -> String {
        format!("{}/{}:{}", self.namespace, self.name, self.port_name)
    }

    fn endpoint(&self, ip: Ipv4Addr) -> String {
        format!("{ip}:{}", self.target_port)
    }
}

/// RFC 4648 base32 (standard alphabet, `=` padding).
pub fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    for chunk in data.chunks(5) {
        let mut block = [0u8; 5];
        block[..chunk.len()].copy_from_slice(chunk);
        let bits = block.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        let symbols = (chunk.len() * 8).div_ceil(5);
        for i in 0..8 {
            if i < symbols {
                let index = (bits >> (35 - 5 * i)) & 0x1f;
                out.push(char::from(ALPHABET[index as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The first `len` characters of base32(sha256(`input`)).
pub fn hash_prefix(input: &str, len: usize) -> String {
    let digest = Sha256::digest(input.as_bytes());
    base32(&digest)[..len].to_string()
}

/// `KUBE-SVC-<16 chars>`: base32(sha256(servicePortName + protocol)).
pub fn svc_chain(svc: &SvcPort) -> String {
    format!(
        "KUBE-SVC-{}",
        hash_prefix(&format!("{}tcp", svc.service_port_name()), 16)
    )
}

/// `KUBE-EXT-<16 chars>`: the external (NodePort) chain of a Service port.
pub fn ext_chain(svc: &SvcPort) -> String {
    format!(
        "KUBE-EXT-{}",
        hash_prefix(&format!("{}tcp", svc.service_port_name()), 16)
    )
}

/// `KUBE-SEP-<16 chars>`: base32(sha256(servicePortName + protocol + endpoint)).
pub fn sep_chain(svc: &SvcPort, ip: Ipv4Addr) -> String {
    format!(
        "KUBE-SEP-{}",
        hash_prefix(
            &format!("{}tcp{}", svc.service_port_name(), svc.endpoint(ip)),
            16
        )
    )
}

/// `--probability` of the `i`-th of `n` endpoint rules: 1/(n-i), kube-proxy's
/// ten-decimal format. The last rule has no statistic match.
fn probability(i: usize, n: usize) -> String {
    format!("{:.10}", 1.0 / (n - i) as f64)
}

/// Rule-set settings shared by both modes.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// `--cluster-cidr`: traffic from outside it to a cluster IP is masqueraded.
    pub cluster_cidr: String,
    /// The Service CIDR (nftables mode drops traffic to unallocated cluster IPs).
    pub service_cidr: String,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            cluster_cidr: "10.244.0.0/16".into(),
            service_cidr: "10.96.0.0/12".into(),
        }
    }
}

/// The filter table kube-proxy keeps in iptables mode (no Service here lacks
/// endpoints, so its KUBE-SERVICES filter chain is empty).
fn iptables_filter(out: &mut String) {
    out.push_str("*filter\n");
    for chain in [
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-FIREWALL",
        "KUBE-FORWARD",
        "KUBE-KUBELET-CANARY",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-CANARY",
        "KUBE-PROXY-FIREWALL",
        "KUBE-SERVICES",
    ] {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
    out.push_str(concat!(
        "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n",
        "-A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n",
        "-A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n",
        "-A INPUT -j KUBE-FIREWALL\n",
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n",
        "-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n",
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n",
        "-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n",
        "-A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
        "-A OUTPUT -j KUBE-FIREWALL\n",
        "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\n",
        "-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n",
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n",
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n",
        "COMMIT\n",
    ));
}

/// The nat chains every sync rewrites, declared (which flushes them under
/// `--noflush`), then their fixed rules.
fn iptables_nat_head(out: &mut String) {
    out.push_str("*nat\n");
    for chain in [
        "KUBE-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
    ] {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
}

fn iptables_nat_fixed_rules(out: &mut String) {
    let _ = writeln!(
        out,
        "-A KUBE-POSTROUTING -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"
    );
    let _ = writeln!(out, "-A KUBE-POSTROUTING -j MARK --xor-mark {MASQ_MARK}");
    out.push_str("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n");
    let _ = writeln!(out, "-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}");
}

/// The `KUBE-SERVICES` rule of one Service port.
fn services_rule(out: &mut String, svc: &SvcPort) {
    let spn = svc.service_port_name();
    let _ = writeln!(
        out,
        "-A KUBE-SERVICES -d {}/32 -p tcp -m comment --comment \"{spn} cluster IP\" -m tcp --dport {} -j {}",
        svc.cluster_ip,
        svc.port,
        svc_chain(svc)
    );
}

fn services_tail(out: &mut String, services: &[SvcPort]) {
    out.push_str("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n");
    for svc in services.iter().filter(|s| s.node_port.is_some()) {
        let _ = writeln!(
            out,
            "-A KUBE-NODEPORTS -p tcp -m comment --comment \"{}\" -m tcp --dport {} -j {}",
            svc.service_port_name(),
            svc.node_port.unwrap_or_default(),
            ext_chain(svc)
        );
    }
}

/// Declarations of a Service port's own chains.
fn service_chain_decls(out: &mut String, svc: &SvcPort) {
    let _ = writeln!(out, ":{} - [0:0]", svc_chain(svc));
    if svc.node_port.is_some() {
        let _ = writeln!(out, ":{} - [0:0]", ext_chain(svc));
    }
    for ip in &svc.endpoints {
        let _ = writeln!(out, ":{} - [0:0]", sep_chain(svc, *ip));
    }
}

/// The rules of a Service port's own chains (SVC, EXT, SEPs).
fn service_chain_rules(out: &mut String, svc: &SvcPort, cfg: &ProxyConfig) {
    let spn = svc.service_port_name();
    let chain = svc_chain(svc);
    if svc.node_port.is_some() {
        let ext = ext_chain(svc);
        let _ = writeln!(out, "-A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ");
        let _ = writeln!(out, "-A {ext} -j {chain}");
    }
    let _ = writeln!(
        out,
        "-A {chain} ! -s {} -d {}/32 -p tcp -m comment --comment \"{spn} cluster IP\" -m tcp --dport {} -j KUBE-MARK-MASQ",
        cfg.cluster_cidr, svc.cluster_ip, svc.port
    );
    let n = svc.endpoints.len();
    for (i, ip) in svc.endpoints.iter().enumerate() {
        let sep = sep_chain(svc, *ip);
        let endpoint = svc.endpoint(*ip);
        if i + 1 < n {
            let _ = writeln!(
                out,
                "-A {chain} -m comment --comment \"{spn} -> {endpoint}\" -m statistic --mode random --probability {} -j {sep}",
                probability(i, n)
            );
        } else {
            let _ = writeln!(
                out,
                "-A {chain} -m comment --comment \"{spn} -> {endpoint}\" -j {sep}"
            );
        }
    }
    for ip in &svc.endpoints {
        let sep = sep_chain(svc, *ip);
        let _ = writeln!(
            out,
            "-A {sep} -s {ip}/32 -m comment --comment \"{spn}\" -j KUBE-MARK-MASQ"
        );
        let _ = writeln!(
            out,
            "-A {sep} -p tcp -m comment --comment \"{spn}\" -m tcp -j DNAT --to-destination {}",
            svc.endpoint(*ip)
        );
    }
}

/// A full `iptables-restore` input (filter and nat tables) for `services`, in that
/// order (kube-proxy's order is random; the caller decides where the measured
/// Service sits). Loaded without `--noflush`, it replaces both tables.
pub fn iptables_full(services: &[SvcPort], cfg: &ProxyConfig) -> String {
    let mut out = String::with_capacity(services.len() * services_bytes_hint(services));
    iptables_filter(&mut out);
    iptables_nat_head(&mut out);
    for svc in services {
        service_chain_decls(&mut out, svc);
    }
    out.push_str(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    out.push_str(
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
    );
    out.push_str("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n");
    iptables_nat_fixed_rules(&mut out);
    for svc in services {
        services_rule(&mut out, svc);
    }
    services_tail(&mut out, services);
    for svc in services {
        service_chain_rules(&mut out, svc, cfg);
    }
    out.push_str("COMMIT\n");
    out
}

fn services_bytes_hint(services: &[SvcPort]) -> usize {
    400 + services.first().map_or(0, |s| s.endpoints.len() * 400)
}

/// The `iptables-restore --noflush` input of a partial sync after the endpoints of
/// `changed` went from `old` to `changed.endpoints`: the filter table and the nat
/// chains that list every Service (`KUBE-SERVICES`, `KUBE-NODEPORTS`, ...) are
/// rewritten whole, the changed Service's chains are rewritten, and endpoint chains
/// that are gone are deleted (`-X`). Other Services' chains are not touched.
pub fn iptables_partial(
    services: &[SvcPort],
    changed: &SvcPort,
    old: &[Ipv4Addr],
    cfg: &ProxyConfig,
) -> String {
    let mut out = String::new();
    iptables_filter(&mut out);
    iptables_nat_head(&mut out);
    service_chain_decls(&mut out, changed);
    let gone: Vec<String> = old
        .iter()
        .filter(|ip| !changed.endpoints.contains(ip))
        .map(|ip| sep_chain(changed, *ip))
        .collect();
    for chain in &gone {
        let _ = writeln!(out, ":{chain} - [0:0]");
    }
    iptables_nat_fixed_rules(&mut out);
    for svc in services {
        services_rule(&mut out, svc);
    }
    services_tail(&mut out, services);
    service_chain_rules(&mut out, changed, cfg);
    for chain in &gone {
        let _ = writeln!(out, "-X {chain}");
    }
    out.push_str("COMMIT\n");
    out
}

/// Table of the nftables mode.
pub const NFT_TABLE: &str = "ip kube-proxy";

/// `<prefix>-<8 chars>-<ns>/<name>/tcp/<port>`, kube-proxy's nftables chain names.
fn nft_chain(prefix: &str, svc: &SvcPort, suffix: &str) -> String {
    let spn = svc.service_port_name();
    format!(
        "{prefix}-{}-{}/{}/tcp/{}{suffix}",
        hash_prefix(&format!("{spn}tcp{suffix}"), 8),
        svc.namespace,
        svc.name,
        svc.port_name
    )
}

pub fn nft_service_chain(svc: &SvcPort) -> String {
    nft_chain("service", svc, "")
}

pub fn nft_external_chain(svc: &SvcPort) -> String {
    nft_chain("external", svc, "")
}

pub fn nft_endpoint_chain(svc: &SvcPort, ip: Ipv4Addr) -> String {
    nft_chain("endpoint", svc, &format!("__{ip}/{}", svc.target_port))
}

/// The fixed part of the table: base chains, masquerading, the maps and the
/// dispatch rules.
fn nft_base(out: &mut String, cfg: &ProxyConfig) {
    let t = NFT_TABLE;
    let _ = writeln!(
        out,
        "add table {t} {{ comment \"rules for kube-proxy\" ; }}"
    );
    let base_chains = [
        (
            "filter-prerouting",
            "type filter hook prerouting priority -110",
        ),
        ("filter-input", "type filter hook input priority -110"),
        ("filter-forward", "type filter hook forward priority -110"),
        ("filter-output", "type filter hook output priority -110"),
        (
            "filter-output-post-dnat",
            "type filter hook output priority -90",
        ),
        ("nat-prerouting", "type nat hook prerouting priority -100"),
        ("nat-output", "type nat hook output priority -100"),
        ("nat-postrouting", "type nat hook postrouting priority 100"),
    ];
    for (name, spec) in base_chains {
        let _ = writeln!(out, "add chain {t} {name} {{ {spec} ; }}");
    }
    for name in [
        "mark-for-masquerade",
        "masquerading",
        "services",
        "service-endpoints-check",
        "nodeport-endpoints-check",
        "cluster-ips-check",
        "firewall-check",
    ] {
        let _ = writeln!(out, "add chain {t} {name}");
    }
    let _ = writeln!(
        out,
        "add set {t} cluster-ips {{ type ipv4_addr ; comment \"Active ClusterIPs\" ; }}"
    );
    for (name, key) in [
        (
            "no-endpoint-services",
            "ipv4_addr . inet_proto . inet_service",
        ),
        ("no-endpoint-nodeports", "inet_proto . inet_service"),
        ("firewall-ips", "ipv4_addr . inet_proto . inet_service"),
        ("service-ips", "ipv4_addr . inet_proto . inet_service"),
        ("service-nodeports", "inet_proto . inet_service"),
    ] {
        let _ = writeln!(out, "add map {t} {name} {{ type {key} : verdict ; }}");
    }
    let rules = [
        "filter-prerouting ct state new jump firewall-check".to_string(),
        "filter-input ct state new jump nodeport-endpoints-check".into(),
        "filter-input ct state new jump service-endpoints-check".into(),
        "filter-forward ct state new jump service-endpoints-check".into(),
        "filter-forward ct state new jump cluster-ips-check".into(),
        "filter-output ct state new jump service-endpoints-check".into(),
        "filter-output ct state new jump firewall-check".into(),
        "filter-output-post-dnat ct state new jump cluster-ips-check".into(),
        "nat-prerouting jump services".into(),
        "nat-output jump services".into(),
        "nat-postrouting jump masquerading".into(),
        format!("mark-for-masquerade meta mark set meta mark or {MASQ_MARK}"),
        format!("masquerading meta mark and {MASQ_MARK} == 0 return"),
        format!("masquerading meta mark set meta mark xor {MASQ_MARK}"),
        "masquerading masquerade fully-random".into(),
        "service-endpoints-check ip daddr . meta l4proto . th dport vmap @no-endpoint-services".into(),
        "nodeport-endpoints-check fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @no-endpoint-nodeports".into(),
        "cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"".into(),
        format!("cluster-ips-check ip daddr {} drop comment \"Drop traffic to unallocated ClusterIPs\"", cfg.service_cidr),
        "firewall-check ip daddr . meta l4proto . th dport vmap @firewall-ips".into(),
        "services ip daddr . meta l4proto . th dport vmap @service-ips".into(),
        "services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports".into(),
    ];
    for rule in rules {
        let _ = writeln!(out, "add rule {t} {rule}");
    }
}

/// Chains and rules of one Service port (service, external, endpoints).
/// One endpoint's chain: masquerade hairpin traffic, DNAT to the endpoint.
fn nft_endpoint(out: &mut String, svc: &SvcPort, ip: Ipv4Addr) {
    let t = NFT_TABLE;
    let ep = nft_endpoint_chain(svc, ip);
    let _ = writeln!(out, "add chain {t} {ep}");
    let _ = writeln!(
        out,
        "add rule {t} {ep} ip saddr {ip} jump mark-for-masquerade"
    );
    let _ = writeln!(
        out,
        "add rule {t} {ep} meta l4proto tcp dnat to {}",
        svc.endpoint(ip)
    );
}

fn nft_service(out: &mut String, svc: &SvcPort, cfg: &ProxyConfig) {
    let t = NFT_TABLE;
    let chain = nft_service_chain(svc);
    let _ = writeln!(out, "add chain {t} {chain}");
    for ip in &svc.endpoints {
        nft_endpoint(out, svc, *ip);
    }
    nft_service_rules(out, svc, cfg);
    if svc.node_port.is_some() {
        let ext = nft_external_chain(svc);
        let _ = writeln!(out, "add chain {t} {ext}");
        let _ = writeln!(out, "add rule {t} {ext} jump mark-for-masquerade");
        let _ = writeln!(out, "add rule {t} {ext} goto {chain}");
    }
}

/// The rules of a Service port's chain: masquerade mark, endpoint choice.
fn nft_service_rules(out: &mut String, svc: &SvcPort, cfg: &ProxyConfig) {
    let t = NFT_TABLE;
    let chain = nft_service_chain(svc);
    let _ = writeln!(
        out,
        "add rule {t} {chain} ip daddr {} tcp dport {} ip saddr != {} jump mark-for-masquerade",
        svc.cluster_ip, svc.port, cfg.cluster_cidr
    );
    let choices: Vec<String> = svc
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, ip)| format!("{i} : goto {}", nft_endpoint_chain(svc, *ip)))
        .collect();
    let _ = writeln!(
        out,
        "add rule {t} {chain} numgen random mod {} vmap {{ {} }}",
        svc.endpoints.len(),
        choices.join(" , ")
    );
}

/// Map elements of one Service port.
fn nft_elements(out: &mut String, svc: &SvcPort) {
    let t = NFT_TABLE;
    let _ = writeln!(out, "add element {t} cluster-ips {{ {} }}", svc.cluster_ip);
    let _ = writeln!(
        out,
        "add element {t} service-ips {{ {} . tcp . {} : goto {} }}",
        svc.cluster_ip,
        svc.port,
        nft_service_chain(svc)
    );
    if let Some(node_port) = svc.node_port {
        let _ = writeln!(
            out,
            "add element {t} service-nodeports {{ tcp . {node_port} : goto {} }}",
            nft_external_chain(svc)
        );
    }
}

/// A full `nft -f` input for `services`: deletes the table if present (the first
/// line creates it so the delete cannot fail), then builds it in one transaction.
pub fn nft_full(services: &[SvcPort], cfg: &ProxyConfig) -> String {
    let mut out = String::with_capacity(services.len() * services_bytes_hint(services));
    let _ = writeln!(out, "add table {NFT_TABLE}\ndelete table {NFT_TABLE}");
    nft_base(&mut out, cfg);
    for svc in services {
        nft_service(&mut out, svc, cfg);
    }
    for svc in services {
        nft_elements(&mut out, svc);
    }
    out
}

/// The `nft -f` transaction of an endpoint change of `changed` (from `old`): the
/// Service chain is flushed and rewritten, new endpoint chains added, endpoint chains
/// that are gone deleted. Like kube-proxy's nftables mode, nothing else is touched.
pub fn nft_partial(changed: &SvcPort, old: &[Ipv4Addr], cfg: &ProxyConfig) -> String {
    let t = NFT_TABLE;
    let mut out = String::new();
    for ip in changed.endpoints.iter().filter(|ip| !old.contains(ip)) {
        nft_endpoint(&mut out, changed, *ip);
    }
    let _ = writeln!(out, "flush chain {t} {}", nft_service_chain(changed));
    nft_service_rules(&mut out, changed, cfg);
    for ip in old.iter().filter(|ip| !changed.endpoints.contains(ip)) {
        let _ = writeln!(out, "delete chain {t} {}", nft_endpoint_chain(changed, *ip));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(endpoints: usize) -> SvcPort {
        SvcPort {
            namespace: "ns1".into(),
            name: "svc1".into(),
            port_name: "p80".into(),
            cluster_ip: Ipv4Addr::new(10, 96, 0, 10),
            port: 80,
            target_port: 8080,
            node_port: Some(30080),
            endpoints: (0..endpoints)
                .map(|i| Ipv4Addr::new(10, 244, 1, 11 + i as u8))
                .collect(),
        }
    }

    #[test]
    fn base32_matches_rfc4648_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "MY======"),
            ("fo", "MZXQ===="),
            ("foo", "MZXW6==="),
            ("foob", "MZXW6YQ="),
            ("fooba", "MZXW6YTB"),
            ("foobar", "MZXW6YTBOI======"),
        ] {
            assert_eq!(base32(input.as_bytes()), want, "{input}");
        }
    }

    #[test]
    fn chain_names_are_deterministic_and_sized() {
        let s = svc(2);
        let chain = svc_chain(&s);
        assert_eq!(chain.len(), "KUBE-SVC-".len() + 16);
        assert_eq!(chain, svc_chain(&s));
        assert_ne!(sep_chain(&s, s.endpoints[0]), sep_chain(&s, s.endpoints[1]));
        // The same hash names the SVC and EXT chains of one Service port.
        assert_eq!(chain[9..], ext_chain(&s)[9..]);
        // iptables limits chain names to 28 characters.
        assert!(sep_chain(&s, s.endpoints[0]).len() <= 28);
    }

    #[test]
    fn probabilities_leave_the_last_endpoint_unconditional() {
        let rules = iptables_full(&[svc(3)], &ProxyConfig::default());
        assert!(rules.contains("--probability 0.3333333333 "), "{rules}");
        assert!(rules.contains("--probability 0.5000000000 "), "{rules}");
        assert_eq!(rules.matches("--probability").count(), 2);
        assert_eq!(rules.matches("-j DNAT --to-destination").count(), 3);
        assert!(rules.ends_with("COMMIT\n"));
    }

    #[test]
    fn partial_sync_deletes_gone_endpoint_chains() {
        let old = svc(2);
        let mut new = old.clone();
        new.endpoints = vec![Ipv4Addr::new(10, 244, 1, 30)];
        let rules = iptables_partial(
            std::slice::from_ref(&new),
            &new,
            &old.endpoints,
            &ProxyConfig::default(),
        );
        for ip in &old.endpoints {
            assert!(rules.contains(&format!("-X {}\n", sep_chain(&old, *ip))));
        }
        assert!(rules.contains(&sep_chain(&new, new.endpoints[0])));
        let nft = nft_partial(&new, &old.endpoints, &ProxyConfig::default());
        assert!(nft.contains("numgen random mod 1 vmap"), "{nft}");
        assert_eq!(nft.matches("delete chain").count(), 2);
    }

    #[test]
    fn nft_ruleset_maps_the_service() {
        let rules = nft_full(&[svc(2)], &ProxyConfig::default());
        assert!(rules.contains(
            "add element ip kube-proxy service-ips { 10.96.0.10 . tcp . 80 : goto service-"
        ));
        assert!(rules.contains("numgen random mod 2 vmap { 0 : goto endpoint-"));
        assert!(rules.contains("service-nodeports { tcp . 30080 : goto external-"));
    }
}
