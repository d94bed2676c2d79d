use std::fs;
use std::path::{Path, PathBuf};

use lb_yaml::{block as block_yaml, split_documents};

use super::block::Manifest;
use super::general::take_document;
use super::pieces::{load_in_pieces, READ_PIECE};
use super::*;
use crate::source::{Location, Problem, SourceError};

const SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: default
spec:
  clusterIP: 10.96.0.10
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
  type: ClusterIP
";

const SLICE: &str = "\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-abc
  namespace: default
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
endpoints:
- addresses: [10.0.0.1]
  conditions: {ready: true}
ports:
- name: http
  port: 8080
  protocol: TCP
";

fn parse(text: &str) -> Objects {
    parse_str(Path::new("objs.yaml"), text)
}

#[test]
fn loads_service_and_slice_documents() {
    let o = parse(&format!("---\n{SERVICE}---\n{SLICE}\n---\n"));
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(o.services.len(), 1);
    assert_eq!(o.services[0].metadata.name.as_deref(), Some("web"));
    assert_eq!(o.slices.len(), 1);
    assert_eq!(o.slices[0].metadata.name.as_deref(), Some("web-abc"));
}

#[test]
fn loads_list_kinds() {
    let text = "\
apiVersion: v1
kind: List
metadata:
  resourceVersion: \"\"
items:
- apiVersion: v1
  kind: Service
  metadata: {name: a, namespace: default}
  spec: {clusterIP: 10.96.0.1, ports: [{port: 80}]}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: ignored, namespace: default}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: a-1, namespace: default}
  addressType: IPv4
  endpoints: null
---
apiVersion: v1
kind: ServiceList
items:
- metadata: {name: b, namespace: default}
  spec: {clusterIP: 10.96.0.2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
- metadata: {name: b-1, namespace: default}
  addressType: IPv4
  endpoints: []
";
    let o = parse(text);
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    let names = |v: Vec<Option<String>>| v.into_iter().flatten().collect::<Vec<_>>();
    assert_eq!(
        names(
            o.services
                .iter()
                .map(|s| s.metadata.name.as_deref().map(str::to_owned))
                .collect()
        ),
        ["a", "b"]
    );
    assert_eq!(
        names(
            o.slices
                .iter()
                .map(|s| s.metadata.name.as_deref().map(str::to_owned))
                .collect()
        ),
        ["a-1", "b-1"]
    );
}

/// Lists in block style take the typed reader, item kinds and all; what it
/// cannot load cleanly (an item of another version of a kind we proxy, or
/// without a kind) goes to the general path and is reported there.
#[test]
fn block_style_lists_load_typed_or_are_reported_by_the_general_path() {
    let lists = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata:
    name: a
    namespace: default
  spec:
    clusterIP: 10.96.0.1
    ports:
    - port: 80
- apiVersion: v1
  kind: ConfigMap
  metadata:
    name: ignored
  data:
    key: value
- apiVersion: v1
  kind: List
  items:
  - apiVersion: v1
    kind: Service
    metadata:
      name: nested-lists-are-not-read
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: a-1
    namespace: default
  addressType: IPv4
  endpoints:
---
apiVersion: v1
kind: ServiceList
items:
- metadata:
    name: b
    namespace: default
  spec:
    clusterIP: 10.96.0.2
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSliceList
items:
---
apiVersion: v1
kind: EndpointSliceList
items:
- metadata:
    name: b-1
    namespace: default
  addressType: IPv4
  endpoints: []
";
    let fast = typed_and_general_agree(lists);
    let names: Vec<_> = fast
        .services
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(fast.slices.len(), 2);

    let refused = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata:
    name: fine
- apiVersion: v2
  kind: Service
  metadata:
    name: future
    namespace: ns1
- metadata:
    name: kindless
";
    assert!(block_yaml::from_str::<Manifest>(refused).is_none());
    let o = parse(refused);
    assert_eq!(o.services.len(), 1);
    let problems: Vec<_> = o
        .errors
        .iter()
        .map(|e| (e.location.as_ref().unwrap().item, e.reason.clone()))
        .collect();
    assert_eq!(
        problems,
        [
            (
                Some(1),
                Problem::UnsupportedApiVersion {
                    kind: "Service".into(),
                    found: "v2".into(),
                    expected: "v1"
                }
            ),
            (Some(2), Problem::MissingKind)
        ]
    );
}

/// An item of a typed list takes the list's kind and apiVersion only for what it
/// leaves out: an item that names another version, or another kind, is what it
/// names, whichever reader takes the document (the block reader once read every
/// item of a ServiceList as a Service).
#[test]
fn typed_list_items_are_what_they_name_on_every_path() {
    let clean = "\
apiVersion: v1
kind: ServiceList
items:
- metadata:
    name: plain
    namespace: default
  spec:
    clusterIP: 10.96.0.1
- apiVersion: v1
  kind: Node
  metadata:
    name: node-a
";
    let fast = typed_and_general_agree(clean);
    assert_eq!(fast.services.len(), 1);
    assert_eq!(fast.nodes.len(), 1);

    let other_version = format!("{clean}- apiVersion: v2\n  metadata:\n    name: future\n");
    assert!(block_yaml::from_str::<Manifest>(&other_version).is_none());
    let json = r#"{"apiVersion":"v1","kind":"ServiceList","items":[
{"metadata":{"name":"plain","namespace":"default"},"spec":{"clusterIP":"10.96.0.1"}},
{"apiVersion":"v1","kind":"Node","metadata":{"name":"node-a"}},
{"apiVersion":"v2","metadata":{"name":"future"}}]}"#;
    for o in [
        parse(&other_version),
        general_path_only(&other_version),
        parse_str(Path::new("objs.json"), json),
    ] {
        let names: Vec<_> = o
            .services
            .iter()
            .map(|s| s.metadata.name.as_deref().unwrap())
            .collect();
        assert_eq!(names, ["plain"]);
        assert_eq!(o.nodes.len(), 1);
        let problems: Vec<_> = o
            .errors
            .iter()
            .map(|e| (e.location.as_ref().unwrap().item, e.reason.clone()))
            .collect();
        assert_eq!(
            problems,
            [(
                Some(2),
                Problem::UnsupportedApiVersion {
                    kind: "Service".into(),
                    found: "v2".into(),
                    expected: "v1"
                }
            )]
        );
    }
}

#[test]
fn broken_documents_are_reported_and_the_rest_load() {
    let text = format!(
        "{SERVICE}---\nkind: Service\nmetadata: [unclosed\n---\n\
             apiVersion: v1\nkind: Service\nmetadata: {{name: bad, namespace: ns1}}\n\
             spec: {{ports: [{{port: eighty}}]}}\n---\n{SLICE}---\n# only a comment\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\n---\n- just\n- a list\n"
    );
    let o = parse(&text);
    assert_eq!(o.services.len(), 1);
    assert_eq!(o.slices.len(), 1);
    assert_eq!(o.errors.len(), 3, "{:?}", o.errors);

    let yaml = &o.errors[0];
    let loc = yaml.location.as_ref().unwrap();
    assert_eq!((loc.document, loc.line), (2, 14));
    assert!(matches!(yaml.reason, Problem::InvalidYaml { .. }));
    // Line numbers in the parser's message are the file's, not the document's.
    assert!(yaml.to_string().contains("line 16 column 11"), "{yaml}");

    let schema = &o.errors[1];
    assert_eq!(schema.location.as_ref().unwrap().document, 3);
    assert_eq!(
        (schema.kind.as_str(), schema.namespace.as_str()),
        ("Service", "ns1")
    );
    assert!(
        schema.to_string().starts_with(
            "objs.yaml document 3 (line 17): Service ns1/bad: cannot be read as a Service"
        ),
        "{schema}"
    );

    assert_eq!(o.errors[2].reason, Problem::NotAnObject);
    assert_eq!(o.errors[2].location.as_ref().unwrap().document, 7);
}

/// The API server refuses an object without a name; so does the agent, on every
/// path a document can take, naming where the object is.
#[test]
fn objects_without_a_name_are_refused() {
    let block = SERVICE.replace("  name: web\n", "");
    let flow = "apiVersion: v1\nkind: Service\nmetadata: {namespace: ns1, name: \"\"}\n\
                    spec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}\n";
    let slice = SLICE.replace("  name: web-abc\n", "");
    let list = "apiVersion: v1\nkind: ServiceList\nitems:\n- metadata:\n    name: named\n\
                    - metadata:\n    namespace: ns2\n";
    let text = format!("{block}---\n{flow}---\n{SERVICE}---\n{slice}---\n{list}");
    let o = parse(&text);
    let names: Vec<_> = o.services.iter().map(|s| s.metadata.name.clone()).collect();
    assert_eq!(names, [Some("web".into()), Some("named".into())]);
    assert!(o.slices.is_empty());
    let problems: Vec<_> = o
        .errors
        .iter()
        .map(|e| {
            let loc = e.location.as_ref().unwrap();
            (e.kind.as_str(), loc.document, loc.item, e.reason.clone())
        })
        .collect();
    assert_eq!(
        problems,
        [
            ("Service", 1, None, Problem::MissingName),
            ("Service", 2, None, Problem::MissingName),
            ("EndpointSlice", 4, None, Problem::MissingName),
            ("Service", 5, Some(1), Problem::MissingName),
        ]
    );
    assert_eq!(
        o.errors[1].to_string(),
        "objs.yaml document 2 (line 13): Service ns1/<unnamed>: has no metadata.name; \
             name it (the API server refuses an object without one)"
    );

    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"namespace":"default"},
"spec":{"clusterIP":"10.96.0.3","ports":[{"port":53}]}}"#;
    let o = parse_str(Path::new("objs.json"), json);
    assert!(o.services.is_empty());
    assert_eq!(o.errors.len(), 1);
    assert_eq!(o.errors[0].reason, Problem::MissingName);
}

/// kubectl and the API server refuse a mapping that repeats a key; serde_json's
/// value would keep the last one. Both readers refuse it, at any depth.
#[test]
fn duplicate_keys_are_refused() {
    let top = SERVICE.replace("kind: Service\n", "kind: Service\nkind: Service\n");
    let nested = SERVICE.replace("  name: web\n", "  name: web\n  name: other\n");
    let in_list = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Service\n  \
                       metadata: {name: a, name: b}\n";
    for doc in [&top, &nested, in_list] {
        assert!(block_yaml::from_str::<Manifest>(doc).is_none(), "{doc}");
        assert!(
            block_yaml::from_str::<serde_json::Value>(doc).is_none(),
            "{doc}"
        );
        let o = parse(&format!("{SLICE}---\n{doc}"));
        assert!(o.services.is_empty(), "{doc}: {:?}", o.services);
        assert_eq!(o.slices.len(), 1, "the other document still loads");
        assert_eq!(o.errors.len(), 1, "{doc}: {:?}", o.errors);
        let message = o.errors[0].to_string();
        assert!(message.contains("duplicate key"), "{message}");
        assert_eq!(o.errors[0].location.as_ref().unwrap().document, 2);
    }
    // The message names the mapping and the key.
    let o = parse(&format!("{SLICE}---\n{nested}"));
    assert!(
        o.errors[0]
            .to_string()
            .contains("metadata: duplicate key \"name\""),
        "{}",
        o.errors[0]
    );
}

/// Found by the fuzz test: an empty `kind:` or `apiVersion:` made the block
/// reader index an empty value and panic, taking the agent down.
#[test]
fn an_empty_kind_or_api_version_is_reported_not_a_panic() {
    for text in [
        "apiVersion: v1\nkind:\nmetadata:\n  name: x\n",
        "apiVersion:\nkind: Service\nmetadata:\n  name: x\n",
        "apiVersion: v1\nkind: # none\nmetadata:\n  name: x\n",
        "apiVersion: v1\nkind:\n  nested: block\n",
    ] {
        let o = parse(text);
        assert!(o.services.is_empty(), "{text}");
        assert_eq!(o.errors.len(), 1, "{text}: {:?}", o.errors);
    }
}

#[test]
fn a_leading_byte_order_mark_is_ignored() {
    let o = parse(&format!("\u{feff}{SERVICE}"));
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(o.services.len(), 1);
    let o = parse(&format!("\u{feff}---\n{SERVICE}---\n{SLICE}"));
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!((o.services.len(), o.slices.len()), (1, 1));
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j"},"spec":{"clusterIP":"10.96.0.3"}}"#;
    let o = parse_str(Path::new("objs.json"), &format!("\u{feff}{json}"));
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(o.services.len(), 1);
}

/// A huge value is logged as its start and its length, however it got into the
/// message: its own field, or the parser's wording of it.
#[test]
fn huge_values_are_cut_in_messages() {
    let huge = "x".repeat(10 << 20);
    let schema = SERVICE.replace("port: 80", &format!("port: {huge}"));
    let api = SERVICE.replace("apiVersion: v1", &format!("apiVersion: v{huge}"));
    for text in [schema, api] {
        let o = parse(&text);
        assert_eq!(o.errors.len(), 1, "{:?}", o.errors.len());
        let message = o.errors[0].to_string();
        assert!(message.len() < 1000, "{} bytes logged", message.len());
        assert!(message.contains("bytes)"), "{message}");
    }
}

#[test]
fn wrong_api_version_and_missing_kind_are_errors() {
    let text = "\
apiVersion: discovery.k8s.io/v1beta1
kind: EndpointSlice
metadata: {name: old, namespace: default}
addressType: IPv4
endpoints: []
---
metadata: {name: nokind}
";
    let o = parse(text);
    assert!(o.slices.is_empty());
    assert_eq!(o.errors.len(), 2);
    assert_eq!(
        o.errors[0].to_string(),
        "objs.yaml document 1 (line 1): EndpointSlice default/old: apiVersion \
             \"discovery.k8s.io/v1beta1\" is not supported for EndpointSlice; export it as \
             discovery.k8s.io/v1"
    );
    assert_eq!(o.errors[1].reason, Problem::MissingKind);
    assert_eq!(o.errors[1].name, "nokind");
}

#[test]
fn list_item_errors_name_the_item() {
    let text = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: ok, namespace: default}
- apiVersion: v1
  kind: Service
  metadata: {name: broken, namespace: default}
  spec: {ports: 80}
";
    let o = parse(text);
    assert_eq!(o.services.len(), 1);
    assert_eq!(o.errors.len(), 1);
    assert_eq!(o.errors[0].location.as_ref().unwrap().item, Some(1));
    assert!(o.errors[0]
        .to_string()
        .starts_with("objs.yaml document 1 (line 1) items[1]: Service default/broken:"));
}

#[test]
fn json_documents() {
    let text = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"j","namespace":"default"},
"spec":{"clusterIP":"10.96.0.3","ports":[{"port":53,"protocol":"UDP"}]}}
{"apiVersion":"v1","kind":"Service","metadata":{"name":"k"}, "spec": {"ports": "x"}}
{"broken":
"#;
    let o = parse_str(Path::new("objs.json"), text);
    assert_eq!(o.services.len(), 1);
    assert_eq!(o.errors.len(), 2, "{:?}", o.errors);
    assert_eq!(o.errors[0].location.as_ref().unwrap().line, 3);
    assert_eq!(o.errors[0].name, "k");
    assert!(matches!(o.errors[1].reason, Problem::InvalidJson { .. }));
    assert_eq!(o.errors[1].location.as_ref().unwrap().document, 3);
}

#[test]
fn nodes_load_on_every_path_for_their_zone() {
    let node = "apiVersion: v1\nkind: Node\nmetadata:\n  name: node-a\n  labels:\n    topology.kubernetes.io/zone: zone-a\n";
    let zone = |o: &Objects| {
        assert!(o.errors.is_empty(), "{:?}", o.errors);
        assert_eq!(o.nodes.len(), 1);
        o.nodes[0].metadata.labels.as_ref().unwrap()["topology.kubernetes.io/zone"].clone()
    };
    assert_eq!(zone(&typed_and_general_agree(node)), "zone-a");
    assert_eq!(zone(&general_path_only(node)), "zone-a");
    let flow = "{apiVersion: v1, kind: Node, metadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-b}}}";
    assert_eq!(zone(&parse(flow)), "zone-b");
    let json = r#"{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Node","metadata":{"name":"node-a","labels":{"topology.kubernetes.io/zone":"zone-c"}}}]}"#;
    assert_eq!(zone(&parse_str(Path::new("n.json"), json)), "zone-c");
    // Another version of Node is not read as one.
    let o = parse("apiVersion: v2\nkind: Node\nmetadata: {name: n}\n");
    assert!(o.nodes.is_empty());
    assert_eq!(o.errors.len(), 1, "{:?}", o.errors);
}

/// Loads documents the way the agent did before the block-YAML reader: each one
/// through serde_norway and a generic value.
fn general_path_only(text: &str) -> Objects {
    let mut objects = Objects::default();
    for doc in split_documents(text) {
        let location = Location {
            file: "x.yaml".into(),
            document: doc.index,
            line: doc.line,
            item: None,
        };
        take_document(
            serde_norway::from_str(&doc.text).unwrap(),
            &location,
            &mut objects,
        );
    }
    objects
}

#[test]
fn the_fast_path_loads_what_the_general_path_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let texts = [
        format!(
            "{SERVICE}---\n{}",
            include_str!("../testdata/kubectl-web-list.yaml")
        ),
        fs::read_to_string(root.join("examples/services.yaml")).unwrap(),
        fs::read_to_string(root.join("examples/endpointslices.yaml")).unwrap(),
    ];
    for text in &texts {
        let fast = typed_and_general_agree(text);
        assert!(!fast.services.is_empty() || !fast.slices.is_empty());
    }
}

/// Block style throughout: the typed reader takes every document, loads them
/// without errors, and loads what the general path loads.
fn typed_and_general_agree(text: &str) -> Objects {
    for doc in split_documents(text) {
        assert!(
            block_yaml::from_str::<Manifest>(&doc.text).is_some(),
            "{}",
            doc.text
        );
    }
    let fast = parse(text);
    let general = general_path_only(text);
    assert!(fast.errors.is_empty(), "{:?}", fast.errors);
    assert_eq!(fast.services, general.services);
    assert_eq!(fast.slices, general.slices);
    assert_eq!(fast.nodes, general.nodes);
    fast
}

#[test]
fn many_documents_load_in_file_order_across_threads() {
    // Enough documents for several threads; order must be the file's.
    let text: String = (0..2000)
        .map(|i| SERVICE.replace("name: web", &format!("name: web-{i}")) + "---\n")
        .collect();
    let o = parse(&text);
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    let names: Vec<String> = o
        .services
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap().to_owned())
        .collect();
    let expected: Vec<String> = (0..2000).map(|i| format!("web-{i}")).collect();
    assert_eq!(names, expected);
}

/// Lists `path` and loads each file, as the file source does: a file that cannot be
/// read is reported and the others still load.
fn load_listed(path: &Path) -> Result<(Vec<PathBuf>, Objects, Vec<FileError>), SourceError> {
    let mut listed = Vec::new();
    let mut objects = Objects::default();
    let mut unreadable = Vec::new();
    for entry in manifest_files(path)? {
        listed.push(match &entry {
            Ok(file) => file.clone(),
            Err(e) => e.path.clone(),
        });
        match entry.and_then(|file| load_file(&file)) {
            Ok(loaded) => {
                objects.services.extend(loaded.services);
                objects.slices.extend(loaded.slices);
                objects.nodes.extend(loaded.nodes);
                objects.errors.extend(loaded.errors);
            }
            Err(e) => unreadable.push(e),
        }
    }
    Ok((listed, objects, unreadable))
}

#[test]
fn directories_are_read_in_name_order_and_unreadable_files_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    fs::create_dir_all(dir.join("sub.yaml")).unwrap();
    fs::write(dir.join("e.yaml"), SERVICE.replace("web", "last")).unwrap();
    fs::write(dir.join("b.yml"), SLICE).unwrap();
    fs::write(dir.join("a.yaml"), SERVICE.replace("web", "first")).unwrap();
    fs::write(dir.join("c.json"), "").unwrap();
    fs::write(dir.join("binary.yaml"), b"kind: \xff").unwrap();
    std::os::unix::fs::symlink(dir.join("gone.yaml"), dir.join("dangling.yaml")).unwrap();
    fs::write(dir.join("notes.txt"), "not: [yaml").unwrap();
    fs::write(dir.join(".swap.yaml"), "not: [yaml").unwrap();
    fs::write(dir.join("sub.yaml").join("inner.yaml"), SERVICE).unwrap();

    let (listed, o, unreadable) = load_listed(&dir).unwrap();
    let listed: Vec<_> = listed
        .iter()
        .map(|f| f.strip_prefix(&dir).unwrap())
        .collect();
    let expected = [
        "a.yaml",
        "b.yml",
        "binary.yaml",
        "c.json",
        "dangling.yaml",
        "e.yaml",
    ];
    assert_eq!(listed, expected.map(Path::new));
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    let names: Vec<_> = o
        .services
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap())
        .collect();
    assert_eq!(names, ["first", "last"]);
    assert_eq!(o.slices.len(), 1);
    let problems: Vec<_> = unreadable
        .iter()
        .map(|e| (e.path.strip_prefix(&dir).unwrap(), &e.problem))
        .collect();
    assert!(
        matches!(
            problems[..],
            [
                (binary, FileProblem::NotUtf8 { offset: 6 }),
                (dangling, FileProblem::DanglingSymlink { .. }),
            ] if binary == Path::new("binary.yaml") && dangling == Path::new("dangling.yaml")
        ),
        "{unreadable:?}"
    );

    let (listed, one, unreadable) = load_listed(&dir.join("b.yml")).unwrap();
    assert_eq!(listed, [dir.join("b.yml")]);
    assert_eq!(one.slices.len(), 1);
    assert!(unreadable.is_empty());

    let missing = dir.join("missing.yaml");
    let err = load_listed(&missing).unwrap_err();
    assert!(matches!(err, SourceError::NotFound { .. }));
    assert!(err.to_string().starts_with(&missing.display().to_string()));
}

/// Read piece by piece, a file gives what its whole text gives: the same
/// objects, and errors with the same document and line numbers, whatever the
/// piece size (a piece ends only before a `---` line, and a document longer
/// than a piece is read on to its end).
#[test]
fn a_file_read_in_pieces_reads_as_a_whole() {
    let mut text = String::from("\u{feff}# preamble\n%YAML 1.2\n");
    for i in 0..30 {
        text += &format!(
                "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: s{i}\n  namespace: default\n\
                 spec:\n  clusterIP: 10.96.0.{i}\n  ports:\n  - port: 80\n\
                 --- {{apiVersion: v1, kind: Service, metadata: {{name: f{i}}}, spec: {{clusterIP: 10.96.1.{i}, ports: [{{port: 81}}]}}}}\n\
                 ...\n# between\n\
                 ---\nkind: Service\n  broken: [\n\
                 ---\r\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s{i}-1\n  \
                 labels:\n    kubernetes.io/service-name: s{i}\naddressType: IPv4\nendpoints:\n- addresses: [10.0.0.{i}]\n\
                 ----: dashes that are content\n"
            );
    }
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("all.yaml");
    fs::write(&path, &text).unwrap();
    let whole = format!("{:?}", parse_str(&path, &text));
    for piece in [1, 5, 64, 333, 4096, READ_PIECE] {
        let pieces = load_in_pieces(&path, piece).unwrap();
        assert_eq!(pieces.services.len(), 60);
        assert_eq!(pieces.errors.len(), 30, "{:?}", pieces.errors);
        assert_eq!(format!("{pieces:?}"), whole, "pieces of {piece} bytes");
    }

    // A bad byte is reported at its offset in the file, not in its piece.
    let mut bytes = text.into_bytes();
    let bad = bytes.len() - 10;
    bytes[bad] = 0xff;
    fs::write(&path, &bytes).unwrap();
    for piece in [64, READ_PIECE] {
        let err = load_in_pieces(&path, piece).unwrap_err();
        assert!(
            matches!(err.problem, FileProblem::NotUtf8 { offset } if offset == bad),
            "{err}"
        );
    }
}

const POLICY_OBJECTS: &str = "\
apiVersion: v1
kind: Namespace
metadata:
  name: prod
  labels: {team: a}
---
apiVersion: v1
kind: Pod
metadata:
  name: db-0
  namespace: prod
  labels: {app: db}
spec:
  nodeName: node-1
  containers:
  - name: db
    image: postgres
    ports:
    - {name: pg, containerPort: 5432}
status:
  podIP: 10.0.0.7
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: db
  namespace: prod
spec:
  podSelector:
    matchLabels: {app: db}
  ingress:
  - from:
    - podSelector:
        matchLabels: {app: api}
    ports:
    - port: pg
";

#[test]
fn loads_policy_kinds_from_block_yaml_flow_yaml_and_json() {
    let o = parse(POLICY_OBJECTS);
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(
        (o.namespaces.len(), o.pods.len(), o.network_policies.len()),
        (1, 1, 1)
    );
    assert_eq!(o.namespaces[0].labels.get("team"), Some("a"));
    assert_eq!(
        o.pods[0].ips,
        ["10.0.0.7".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(&*o.network_policies[0].name, "db");

    // The same policy in flow style takes the general path.
    let flow = "{apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, \
                metadata: {name: f, namespace: x}, spec: {podSelector: {}}}";
    let o = parse(flow);
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(o.network_policies.len(), 1);

    let json = r#"{"apiVersion":"v1","kind":"PodList","items":[
        {"metadata":{"name":"a","namespace":"x"},"spec":{"containers":[]},
         "status":{"podIP":"10.0.0.1"}}]}"#;
    let o = parse_str(Path::new("pods.json"), json);
    assert!(o.errors.is_empty(), "{:?}", o.errors);
    assert_eq!(o.pods.len(), 1);
}

#[test]
fn malformed_policy_objects_are_reported_by_name_and_skipped() {
    let text = "\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: bad, namespace: prod}
spec:
  podSelector: {}
  ingress:
  - ports:
    - port: 99999
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: good, namespace: prod}
spec:
  podSelector: {}
---
apiVersion: v1
kind: Pod
metadata: {name: p, namespace: prod}
spec: {containers: []}
status: {podIP: not-an-ip}
---
apiVersion: networking.k8s.io/v1beta1
kind: NetworkPolicy
metadata: {name: old, namespace: prod}
";
    for (file, text) in [
        ("objs.yaml", text.to_owned()),
        (
            "objs.json",
            // One JSON document per object, as a List.
            serde_json::json!({
                "apiVersion": "v1", "kind": "List",
                "items": lb_yaml::split_documents(text)
                    .iter()
                    .map(|d| serde_norway::from_str::<serde_json::Value>(&d.text).unwrap())
                    .collect::<Vec<_>>(),
            })
            .to_string(),
        ),
    ] {
        let o = parse_str(Path::new(file), &text);
        let names: Vec<&str> = o.network_policies.iter().map(|p| &*p.name).collect();
        assert_eq!(names, ["good"], "{file}");
        assert!(o.pods.is_empty(), "{file}");
        let messages: Vec<String> = o.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(messages.len(), 3, "{file}: {messages:?}");
        assert!(
            messages[0].contains("NetworkPolicy prod/bad: spec.ingress[0].ports[0].port"),
            "{file}: {messages:?}"
        );
        assert!(
            messages[1].contains("Pod prod/p: status.podIP"),
            "{file}: {messages:?}"
        );
        assert!(
            messages[2].contains("export it as networking.k8s.io/v1"),
            "{file}: {messages:?}"
        );
    }
}
