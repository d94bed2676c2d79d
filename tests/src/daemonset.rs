//! deploy/daemonset.yaml's pod, as a kubelet runs it, turned into `podman run`
//! arguments (tests/tests/image.rs).
//!
//! The pod template is read from the manifest, never retyped: its image, command and
//! args, env, volumes, host network and PID, security context and resource limits
//! become podman's flags one for one. What a kubelet adds is added the same way (the
//! service account's token and CA at `/var/run/secrets/kubernetes.io/serviceaccount`,
//! `KUBERNETES_SERVICE_HOST/PORT`, the downward API's `fieldRef`s). The node's side
//! is the test's: [`Node`] says which network namespace is the node's (the host
//! network), and onto which test-owned path each `hostPath` of the manifest maps.
//!
//! A field this module does not know fails the translation, naming the field: a
//! manifest change the test cannot honour must not pass unseen. Fields that only
//! steer scheduling (tolerations, priority, requests) are accepted and have no
//! podman equivalent.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

/// The manifest, relative to the workspace root.
pub const MANIFEST: &str = "deploy/daemonset.yaml";
/// Where a kubelet mounts a pod's service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Pod spec fields and what becomes of them: mapped, or scheduling only.
const POD_FIELDS: &[&str] = &[
    "serviceAccountName",
    "priorityClassName",
    "hostNetwork",
    "dnsPolicy",
    "hostPID",
    "tolerations",
    "terminationGracePeriodSeconds",
    "containers",
    "volumes",
];
const CONTAINER_FIELDS: &[&str] = &[
    "name",
    "image",
    "imagePullPolicy",
    "command",
    "args",
    "env",
    "ports",
    "securityContext",
    "resources",
    "startupProbe",
    "livenessProbe",
    "readinessProbe",
    "volumeMounts",
];
const SECURITY_FIELDS: &[&str] = &[
    "privileged",
    "runAsUser",
    "readOnlyRootFilesystem",
    "allowPrivilegeEscalation",
    "seccompProfile",
    "capabilities",
];

/// The workspace root (tests/ is inside it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
        .to_path_buf()
}

/// One of the container's probes (`httpGet` only, the kind the manifest uses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// `startupProbe`, `livenessProbe` or `readinessProbe`.
    pub kind: String,
    pub path: String,
    pub port: u16,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
}

/// What the test's node gives the pod (what a kubelet and the node's paths would).
pub struct Node<'a> {
    /// The node's network namespace (`/var/run/netns/NAME`): the host network.
    pub netns: &'a Path,
    /// `spec.nodeName`.
    pub node_name: &'a str,
    /// The manifest's `hostPath` paths -> the test-owned paths standing for them.
    pub host_paths: BTreeMap<String, PathBuf>,
    /// A directory with `token`, `ca.crt` and `namespace`, mounted where a kubelet
    /// mounts the service account.
    pub service_account: &'a Path,
    /// The API server, as a kubelet announces the `kubernetes` Service.
    pub api_server: SocketAddr,
}

/// The DaemonSet's pod template with its one container.
pub struct PodTemplate {
    pod: Value,
    container: Value,
}

impl PodTemplate {
    /// Reads [`MANIFEST`]: it must hold one DaemonSet whose pod has one container.
    pub fn read() -> Result<Self> {
        let path = workspace_root().join(MANIFEST);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self> {
        let mut daemonsets = Vec::new();
        for document in serde_norway::Deserializer::from_str(text) {
            let value: Value = serde::Deserialize::deserialize(document)?;
            if value["kind"] == "DaemonSet" {
                daemonsets.push(value);
            }
        }
        ensure!(
            daemonsets.len() == 1,
            "{} DaemonSets, not one",
            daemonsets.len()
        );
        let pod = daemonsets.remove(0)["spec"]["template"]["spec"].take();
        let containers = pod["containers"].as_array().context("no containers")?;
        ensure!(
            containers.len() == 1,
            "{} containers, not one",
            containers.len()
        );
        let container = containers[0].clone();
        only_known(&pod, POD_FIELDS, "the pod spec")?;
        only_known(&container, CONTAINER_FIELDS, "the container")?;
        only_known(
            &container["securityContext"],
            SECURITY_FIELDS,
            "securityContext",
        )?;
        Ok(PodTemplate { pod, container })
    }

    pub fn image(&self) -> Result<&str> {
        self.container["image"].as_str().context("no image")
    }

    /// The container's security context as written.
    pub fn security_context(&self) -> &Value {
        &self.container["securityContext"]
    }

    /// The capabilities the container adds.
    pub fn added_capabilities(&self) -> Vec<String> {
        strings(&self.security_context()["capabilities"]["add"])
    }

    /// What a kubelet gives a stopping container before SIGKILL.
    pub fn termination_grace(&self) -> Duration {
        Duration::from_secs(
            self.pod["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap_or(30),
        )
    }

    /// The container's probes, each an `httpGet`.
    pub fn probes(&self) -> Result<Vec<Probe>> {
        let mut probes = Vec::new();
        for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let probe = &self.container[kind];
            if probe.is_null() {
                continue;
            }
            let get = &probe["httpGet"];
            ensure!(get.is_object(), "{kind} is not an httpGet probe");
            ensure!(
                get["host"].is_null() && matches!(get["scheme"].as_str(), None | Some("HTTP")),
                "{kind}: only plain HTTP to the pod's address is mapped"
            );
            let port = match &get["port"] {
                Value::Number(n) => n.as_u64().and_then(|p| u16::try_from(p).ok()),
                Value::String(name) => self.named_port(name),
                _ => None,
            }
            .with_context(|| format!("{kind}: port {}", get["port"]))?;
            let seconds = |field: &str, default: u64| {
                Duration::from_secs(probe[field].as_u64().unwrap_or(default))
            };
            probes.push(Probe {
                kind: kind.to_string(),
                path: get["path"].as_str().unwrap_or("/").to_string(),
                port,
                period: seconds("periodSeconds", 10),
                timeout: seconds("timeoutSeconds", 1),
                failure_threshold: u32::try_from(probe["failureThreshold"].as_u64().unwrap_or(3))?,
            });
        }
        Ok(probes)
    }

    /// The value of `flag` in the container's args (`--flag VALUE` or `--flag=VALUE`).
    pub fn arg(&self, flag: &str) -> Option<String> {
        let args = strings(&self.container["args"]);
        let prefix = format!("{flag}=");
        args.iter().enumerate().find_map(|(i, a)| {
            if a == flag {
                args.get(i + 1).cloned()
            } else {
                a.strip_prefix(&prefix).map(str::to_string)
            }
        })
    }

    /// Where the container's `path` is on the test's side: below the test-owned
    /// path of the hostPath volume mounted over it.
    pub fn host_path(&self, node: &Node<'_>, path: &str) -> Result<PathBuf> {
        let volumes = self.pod["volumes"].as_array().into_iter().flatten();
        let volumes: Vec<&Value> = volumes.collect();
        for mount in self.container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let Some(target) = mount["mountPath"].as_str() else {
                continue;
            };
            let Ok(rest) = Path::new(path).strip_prefix(target) else {
                continue;
            };
            let host = volumes
                .iter()
                .find(|v| v["name"] == mount["name"])
                .and_then(|v| v["hostPath"]["path"].as_str())
                .with_context(|| format!("the volume mounted at {target} is no hostPath"))?;
            let local = node
                .host_paths
                .get(host)
                .with_context(|| format!("the test maps no path onto the node's {host}"))?;
            return Ok(local.join(rest));
        }
        bail!("no volume is mounted over {path}")
    }

    fn named_port(&self, name: &str) -> Option<u16> {
        self.container["ports"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
    }

    /// `podman run` arguments (after `run --name NAME`) for this pod on `node`.
    /// `drop`: capabilities to take away from what the manifest adds (the test of a
    /// missing capability); empty for the pod as written.
    pub fn podman_args(&self, node: &Node<'_>, drop: &[&str]) -> Result<Vec<String>> {
        let mut args = Vec::new();
        let pod = &self.pod;
        ensure!(
            pod["hostNetwork"] == true,
            "hostNetwork is not true: the agent must be in the node's network namespace"
        );
        // The node's network namespace is the test's, not the machine's.
        args.push(format!("--network=ns:{}", node.netns.display()));
        if pod["hostPID"] == true {
            args.push("--pid=host".into());
        }
        // dnsPolicy: nothing here resolves names (the API server is given by address).
        args.push(format!(
            "--stop-timeout={}",
            self.termination_grace().as_secs()
        ));
        if pod["serviceAccountName"].is_string() {
            args.push(format!(
                "--volume={}:{SERVICE_ACCOUNT_DIR}:ro",
                node.service_account.display()
            ));
        }
        // What a kubelet announces to every container (the `kubernetes` Service).
        args.push(format!(
            "--env=KUBERNETES_SERVICE_HOST={}",
            node.api_server.ip()
        ));
        args.push(format!(
            "--env=KUBERNETES_SERVICE_PORT={}",
            node.api_server.port()
        ));

        let c = &self.container;
        match c["imagePullPolicy"].as_str() {
            // The image was loaded into the test's storage: present, never pulled.
            None | Some("IfNotPresent" | "Never") => args.push("--pull=never".into()),
            Some(other) => bail!("imagePullPolicy {other}: the test has no registry to pull from"),
        }
        for var in c["env"].as_array().into_iter().flatten() {
            let name = var["name"].as_str().context("env entry without name")?;
            let value = match (&var["value"], &var["valueFrom"]) {
                (Value::String(v), Value::Null) => v.clone(),
                (Value::Null, from) => field_ref(from, node)
                    .with_context(|| format!("env {name}: valueFrom {from}"))?,
                _ => bail!("env {name}: neither a value nor a fieldRef"),
            };
            args.push(format!("--env={name}={value}"));
        }
        args.extend(security_args(self.security_context(), drop)?);
        args.extend(resource_args(&c["resources"])?);
        args.extend(self.volume_args(node)?);
        if let Some(command) = c["command"].as_array() {
            args.push(format!("--entrypoint={}", Value::Array(command.clone())));
        }
        args.push(self.image()?.to_string());
        args.extend(strings(&c["args"]));
        Ok(args)
    }

    fn volume_args(&self, node: &Node<'_>) -> Result<Vec<String>> {
        let volumes: BTreeMap<&str, &Value> = self.pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v["name"].as_str()?, v)))
            .collect();
        let mut args = Vec::new();
        for mount in self.container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let name = mount["name"].as_str().context("volumeMount without name")?;
            let volume = volumes
                .get(name)
                .with_context(|| format!("volumeMount {name}: no such volume"))?;
            let host = &volume["hostPath"];
            ensure!(
                host.is_object(),
                "volume {name}: only hostPath volumes are mapped"
            );
            let path = host["path"].as_str().context("hostPath without path")?;
            let local = node.host_paths.get(path).with_context(|| {
                format!(
                    "volume {name}: the manifest mounts the node's {path}, which the test \
                     maps onto none of its own paths"
                )
            })?;
            match host["type"].as_str().unwrap_or("") {
                "Directory" => ensure!(local.is_dir(), "{} is not a directory", local.display()),
                "DirectoryOrCreate" => std::fs::create_dir_all(local)?,
                "" => {}
                other => bail!("volume {name}: hostPath type {other} is not mapped"),
            }
            let target = mount["mountPath"]
                .as_str()
                .context("volumeMount without mountPath")?;
            let mut options = Vec::new();
            if mount["readOnly"] == true {
                options.push("ro");
            }
            options.push(match mount["mountPropagation"].as_str() {
                None | Some("None") => "rprivate",
                Some("HostToContainer") => "rslave",
                Some("Bidirectional") => "rshared",
                Some(other) => bail!("volumeMount {name}: mountPropagation {other}"),
            });
            args.push(format!(
                "--volume={}:{target}:{}",
                local.display(),
                options.join(",")
            ));
        }
        Ok(args)
    }
}

/// Every key of `object` is one of `known`.
fn only_known(object: &Value, known: &[&str], what: &str) -> Result<()> {
    if let Some(map) = object.as_object() {
        for key in map.keys() {
            ensure!(
                known.contains(&key.as_str()),
                "{what} has `{key}`, which tests/src/daemonset.rs does not map onto podman: \
                 map it there"
            );
        }
    }
    Ok(())
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

/// The downward API fields a kubelet fills in.
fn field_ref(from: &Value, node: &Node<'_>) -> Result<String> {
    let path = from["fieldRef"]["fieldPath"]
        .as_str()
        .context("only fieldRef is mapped")?;
    Ok(match path {
        "spec.nodeName" => node.node_name.to_string(),
        other => bail!("fieldRef {other} is not mapped"),
    })
}

fn security_args(security: &Value, drop: &[&str]) -> Result<Vec<String>> {
    let mut args = Vec::new();
    if security["privileged"] == true {
        args.push("--privileged".into());
    }
    if let Some(user) = security["runAsUser"].as_u64() {
        args.push(format!("--user={user}"));
    }
    if security["readOnlyRootFilesystem"] == true {
        // As in Kubernetes: no tmpfs of podman's own over /tmp, /run and /var/tmp.
        args.push("--read-only".into());
        args.push("--read-only-tmpfs=false".into());
    }
    if security["allowPrivilegeEscalation"] == false {
        args.push("--security-opt=no-new-privileges".into());
    }
    match security["seccompProfile"]["type"].as_str() {
        // The runtime's own profile: podman's here.
        Some("RuntimeDefault") => {}
        // Kubernetes runs a container without a profile unconfined.
        None | Some("Unconfined") => args.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => bail!("seccompProfile {other} is not mapped"),
    }
    let caps = &security["capabilities"];
    for cap in strings(&caps["drop"]) {
        args.push(format!("--cap-drop={}", cap.to_lowercase()));
    }
    for cap in strings(&caps["add"]) {
        if !drop.iter().any(|d| d.eq_ignore_ascii_case(&cap)) {
            args.push(format!("--cap-add={cap}"));
        }
    }
    Ok(args)
}

/// Limits become podman's; requests only steer scheduling.
fn resource_args(resources: &Value) -> Result<Vec<String>> {
    let mut args = Vec::new();
    if let Some(memory) = resources["limits"]["memory"].as_str() {
        args.push(format!("--memory={}", memory_bytes(memory)?));
    }
    if let Some(cpu) = resources["limits"]["cpu"].as_str() {
        let millis = match cpu.strip_suffix('m') {
            Some(m) => m.parse::<u64>()?,
            None => cpu.parse::<u64>()? * 1000,
        };
        args.push(format!("--cpus={}", millis as f64 / 1000.0));
    }
    Ok(args)
}

/// A Kubernetes memory quantity in bytes (`256Mi`, `1Gi`, `500M`, `1000`).
pub fn memory_bytes(quantity: &str) -> Result<u64> {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    for (suffix, factor) in units {
        if let Some(number) = quantity.strip_suffix(suffix) {
            return Ok(number.parse::<u64>()? * factor);
        }
    }
    quantity
        .parse()
        .with_context(|| format!("memory quantity {quantity}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: &str = r#"
apiVersion: v1
kind: ServiceAccount
metadata: {name: sa}
---
apiVersion: apps/v1
kind: DaemonSet
spec:
  template:
    spec:
      serviceAccountName: sa
      hostNetwork: true
      hostPID: true
      terminationGracePeriodSeconds: 7
      containers:
        - name: c
          image: lb:1.2.3
          args: [agent, --flag]
          env:
            - {name: A, value: "1"}
            - name: NODE_NAME
              valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
          ports: [{name: healthz, containerPort: 10256}]
          securityContext:
            readOnlyRootFilesystem: true
            seccompProfile: {type: RuntimeDefault}
            capabilities: {drop: [ALL], add: [BPF, NET_ADMIN]}
          resources: {limits: {memory: 1Gi}, requests: {cpu: 100m}}
          readinessProbe: {httpGet: {path: /healthz, port: healthz}, periodSeconds: 2}
          volumeMounts:
            - {name: bpf, mountPath: /sys/fs/bpf, mountPropagation: HostToContainer}
            - {name: cg, mountPath: /run/cg, readOnly: true}
      volumes:
        - {name: bpf, hostPath: {path: /sys/fs/bpf}}
        - {name: cg, hostPath: {path: /sys/fs/cgroup}}
"#;

    fn node(host_paths: &[(&str, &str)]) -> Node<'static> {
        Node {
            netns: Path::new("/var/run/netns/n1"),
            node_name: "node-1",
            host_paths: host_paths
                .iter()
                .map(|(k, v)| (k.to_string(), PathBuf::from(v)))
                .collect(),
            service_account: Path::new("/tmp/sa"),
            api_server: "127.0.0.1:6443".parse().unwrap(),
        }
    }

    #[test]
    fn the_template_becomes_podman_flags() {
        let pod = PodTemplate::parse(POD).unwrap();
        let args = pod
            .podman_args(
                &node(&[("/sys/fs/bpf", "/sys/fs/bpf/t"), ("/sys/fs/cgroup", "/")]),
                &[],
            )
            .unwrap();
        let want = [
            "--network=ns:/var/run/netns/n1",
            "--pid=host",
            "--stop-timeout=7",
            "--volume=/tmp/sa:/var/run/secrets/kubernetes.io/serviceaccount:ro",
            "--env=KUBERNETES_SERVICE_HOST=127.0.0.1",
            "--env=KUBERNETES_SERVICE_PORT=6443",
            "--pull=never",
            "--env=A=1",
            "--env=NODE_NAME=node-1",
            "--read-only",
            "--read-only-tmpfs=false",
            "--cap-drop=all",
            "--cap-add=BPF",
            "--cap-add=NET_ADMIN",
            "--memory=1073741824",
            "--volume=/sys/fs/bpf/t:/sys/fs/bpf:rslave",
            "--volume=/:/run/cg:ro,rprivate",
            "lb:1.2.3",
            "agent",
            "--flag",
        ];
        assert_eq!(args, want);
        let without = pod
            .podman_args(
                &node(&[("/sys/fs/bpf", "/tmp"), ("/sys/fs/cgroup", "/")]),
                &["bpf"],
            )
            .unwrap();
        assert!(
            !without.contains(&"--cap-add=BPF".to_string()),
            "{without:?}"
        );
        assert_eq!(
            pod.probes().unwrap(),
            [Probe {
                kind: "readinessProbe".into(),
                path: "/healthz".into(),
                port: 10256,
                period: Duration::from_secs(2),
                timeout: Duration::from_secs(1),
                failure_threshold: 3,
            }]
        );
    }

    #[test]
    fn what_the_test_cannot_honour_fails() {
        let e =
            PodTemplate::parse(&POD.replace("hostPID: true", "hostPID: true\n      hostIPC: true"))
                .err()
                .unwrap();
        assert!(format!("{e:#}").contains("`hostIPC`"), "{e:#}");
        let pod = PodTemplate::parse(POD).unwrap();
        let e = pod
            .podman_args(&node(&[("/sys/fs/bpf", "/tmp")]), &[])
            .unwrap_err();
        assert!(format!("{e:#}").contains("/sys/fs/cgroup"), "{e:#}");
    }

    #[test]
    fn quantities() {
        assert_eq!(memory_bytes("256Mi").unwrap(), 256 << 20);
        assert_eq!(memory_bytes("1G").unwrap(), 1_000_000_000);
        assert_eq!(memory_bytes("4096").unwrap(), 4096);
        assert!(memory_bytes("lots").is_err());
    }

    /// The manifest itself translates (every field it has is known here).
    #[test]
    fn the_manifest_is_understood() {
        let pod = PodTemplate::read().unwrap();
        assert!(!pod.probes().unwrap().is_empty());
    }
}
