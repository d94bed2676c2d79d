//! ip-masq-agent's configuration file (`--ip-masq-agent-config`), read as
//! ip-masq-agent reads it: YAML or JSON with three optional keys,
//! `nonMasqueradeCIDRs` (a list of CIDRs), `masqLinkLocal` and `masqLinkLocalIPv6`
//! (booleans); `resyncInterval` is accepted and ignored (the agent notices a change
//! by itself). A key left out keeps ip-masq-agent's default, as there. Users
//! already have this file (the `ip-masq-agent` ConfigMap), so lb takes it unchanged.
//!
//! Parsing only: which destinations that leaves exempt is `control::masquerade`'s.
//! Problems name the file and the field, so the operator knows what to fix; the
//! agent keeps the last good configuration meanwhile.

use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::Deserialize;

/// What the file says; `None`: the key is absent and ip-masq-agent's default holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MasqConfig {
    /// `nonMasqueradeCIDRs`: destinations not masqueraded.
    pub non_masquerade: Option<Vec<IpNet>>,
    /// `masqLinkLocal`: masquerade traffic to 169.254.0.0/16 too (default false).
    pub masq_link_local: Option<bool>,
    /// `masqLinkLocalIPv6`: masquerade traffic to fe80::/10 too (default false).
    pub masq_link_local_v6: Option<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum MasqConfigError {
    #[error("cannot read the ip-masq-agent config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the ip-masq-agent config {}: {detail} (expected YAML or JSON with \
         nonMasqueradeCIDRs, masqLinkLocal, masqLinkLocalIPv6, resyncInterval)",
        path.display()
    )]
    Syntax { path: PathBuf, detail: String },
    #[error("the ip-masq-agent config {}: {field}: {detail}", path.display())]
    Field {
        path: PathBuf,
        /// The key, with the list index for a CIDR: `nonMasqueradeCIDRs[2]`.
        field: String,
        detail: String,
    },
}

/// The file's keys as written; unknown keys are refused, so a misspelt key is
/// reported rather than silently leaving the default in place.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    #[serde(rename = "nonMasqueradeCIDRs")]
    non_masquerade_cidrs: Option<Vec<String>>,
    #[serde(rename = "masqLinkLocal")]
    masq_link_local: Option<bool>,
    #[serde(rename = "masqLinkLocalIPv6")]
    masq_link_local_ipv6: Option<bool>,
    /// ip-masq-agent's polling interval; lb follows the file by itself.
    #[serde(rename = "resyncInterval")]
    _resync_interval: Option<serde_norway::Value>,
}

/// Reads and checks the file at `path`.
pub fn read(path: &Path) -> Result<MasqConfig, MasqConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| MasqConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

/// Checks `text` as the content of `path` (named in errors). An empty file is the
/// defaults, as ip-masq-agent takes it.
pub fn parse(path: &Path, text: &str) -> Result<MasqConfig, MasqConfigError> {
    if text.trim().is_empty() {
        return Ok(MasqConfig::default());
    }
    // JSON is YAML, so one reader takes both.
    let raw: Raw = serde_norway::from_str(text).map_err(|e| MasqConfigError::Syntax {
        path: path.to_owned(),
        detail: e.to_string(),
    })?;
    let non_masquerade = raw
        .non_masquerade_cidrs
        .map(|cidrs| {
            cidrs
                .iter()
                .enumerate()
                .map(|(i, text)| {
                    cidr(text).map_err(|detail| MasqConfigError::Field {
                        path: path.to_owned(),
                        field: format!("nonMasqueradeCIDRs[{i}]"),
                        detail,
                    })
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    Ok(MasqConfig {
        non_masquerade,
        masq_link_local: raw.masq_link_local,
        masq_link_local_v6: raw.masq_link_local_ipv6,
    })
}

/// A CIDR in canonical form (its address is the network's), as ip-masq-agent
/// requires: `10.0.0.1/8` is more likely a typo than a range.
fn cidr(text: &str) -> Result<IpNet, String> {
    let net: IpNet = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a CIDR (address/prefix length)"))?;
    if net.network() != net.addr() {
        return Err(format!(
            "{text:?} is not a network address; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path() -> &'static Path {
        Path::new("/etc/config/ip-masq-agent")
    }

    #[test]
    fn reads_yaml_as_ip_masq_agent_writes_it() {
        let text = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00::/8\nresyncInterval: 60s\nmasqLinkLocal: true\n";
        let config = parse(path(), text).unwrap();
        assert_eq!(
            config.non_masquerade,
            Some(vec![
                "10.0.0.0/8".parse().unwrap(),
                "fd00::/8".parse().unwrap()
            ])
        );
        assert_eq!(config.masq_link_local, Some(true));
        assert_eq!(config.masq_link_local_v6, None);
    }

    #[test]
    fn reads_json_and_an_empty_file() {
        let text = r#"{"nonMasqueradeCIDRs": [], "masqLinkLocalIPv6": true}"#;
        let config = parse(path(), text).unwrap();
        assert_eq!(config.non_masquerade, Some(vec![]));
        assert_eq!(config.masq_link_local_v6, Some(true));
        assert_eq!(parse(path(), " \n").unwrap(), MasqConfig::default());
    }

    #[test]
    fn a_bad_cidr_names_the_file_the_field_and_the_fix() {
        let text = "nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.2.3/16]\n";
        let error = parse(path(), text).unwrap_err().to_string();
        assert!(error.contains("/etc/config/ip-masq-agent"), "{error}");
        assert!(error.contains("nonMasqueradeCIDRs[1]"), "{error}");
        assert!(error.contains("10.1.0.0/16"), "{error}");
        let error = parse(path(), "nonMasqueradeCIDRs: [banana]\n")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("nonMasqueradeCIDRs[0]") && error.contains("banana"),
            "{error}"
        );
    }

    #[test]
    fn a_misspelt_key_or_a_wrong_type_is_reported() {
        let error = parse(path(), "nonMasqueradeCidrs: [10.0.0.0/8]\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("nonMasqueradeCidrs"), "{error}");
        let error = parse(path(), "masqLinkLocal: maybe\n")
            .unwrap_err()
            .to_string();
        assert!(error.contains("masqLinkLocal"), "{error}");
    }
}
