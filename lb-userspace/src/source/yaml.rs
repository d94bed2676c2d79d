//! Services and EndpointSlices from files saved with `kubectl get -o yaml` (or `-o json`).

use std::borrow::Cow;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;

use super::lean::{EndpointSlice, Service};
use serde_json::value::RawValue;
use serde_json::Value;

use lb_yaml::{block as block_yaml, split_documents, Document};

use super::{Location, ObjectError, Objects, Problem, SourceError};

const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// A manifest file that could not be read. The other files still load; this one is
/// reported (log, `/metrics`, the agent status) until it is fixed or removed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{}: {problem}; fix or remove the file (the other files still apply)", path.display())]
pub struct FileError {
    pub path: PathBuf,
    #[source]
    pub problem: FileProblem,
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum FileProblem {
    #[error("cannot read it: {0}")]
    Read(#[source] Arc<io::Error>),
    #[error("a symlink to {}, which does not exist", target.display())]
    DanglingSymlink { target: PathBuf },
    #[error("not UTF-8 text (invalid byte at offset {offset}); save it as UTF-8")]
    NotUtf8 { offset: usize },
    #[error("a {kind}, not a regular file")]
    NotAFile { kind: &'static str },
}

impl FileError {
    fn io(path: &Path, error: io::Error) -> Self {
        // Only a symlink has a link target to read.
        let problem = match fs::read_link(path) {
            Ok(target) if error.kind() == io::ErrorKind::NotFound => {
                FileProblem::DanglingSymlink { target }
            }
            _ => FileProblem::Read(Arc::new(error)),
        };
        FileError {
            path: path.to_owned(),
            problem,
        }
    }
}

/// The manifest files at `path` (the file itself, or every `*.yaml`, `*.yml` and
/// `*.json` file directly in the directory), in file name order so that "first one
/// wins" rules are reproducible, each with the reason it cannot be read where that
/// is known without reading it (a dangling symlink, a FIFO). Directories are not
/// manifests and are passed over; only a path that cannot be read at all is an
/// error.
pub fn manifest_files(path: &Path) -> Result<Vec<Result<PathBuf, FileError>>, SourceError> {
    let meta = fs::metadata(path).map_err(|e| SourceError::from_io(path, e))?;
    if !meta.is_dir() {
        return Ok(vec![regular_file(path, &meta)]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(|e| SourceError::from_io(path, e))? {
        let entry = entry.map_err(|e| SourceError::from_io(path, e))?;
        if let Some(file) = manifest_entry(&entry.path()) {
            files.push(file);
        }
    }
    files.sort_by(|a, b| entry_path(a).cmp(entry_path(b)));
    Ok(files)
}

/// Whether a directory entry's name makes it a manifest file: dot files are editor
/// swap files and the `..data` links of ConfigMap mounts.
pub fn is_manifest_name(file: &Path) -> bool {
    let hidden = file
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'));
    !hidden && has_extension(file, &EXTENSIONS)
}

/// One directory entry as [`manifest_files`] lists it: `None` when it is no manifest
/// (its name, or a directory) or no longer exists at all; an error when it cannot
/// be read as one (a dangling symlink, a FIFO, ...).
pub fn manifest_entry(file: &Path) -> Option<Result<PathBuf, FileError>> {
    if !is_manifest_name(file) {
        return None;
    }
    // Follows symlinks, as ConfigMap volumes are made of them.
    match fs::metadata(file) {
        Ok(m) if m.is_dir() => None,
        Ok(m) => Some(regular_file(file, &m)),
        // Gone, not even a dangling link left: nothing to report.
        Err(_) if fs::symlink_metadata(file).is_err() => None,
        Err(e) => Some(Err(FileError::io(file, e))),
    }
}

fn entry_path(entry: &Result<PathBuf, FileError>) -> &Path {
    match entry {
        Ok(path) => path,
        Err(e) => &e.path,
    }
}

/// Reading a FIFO would block the poller until a writer comes; devices and sockets
/// hold no manifests either.
fn regular_file(path: &Path, meta: &fs::Metadata) -> Result<PathBuf, FileError> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    let kind = if t.is_file() {
        return Ok(path.to_owned());
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else {
        "special file"
    };
    Err(FileError {
        path: path.to_owned(),
        problem: FileProblem::NotAFile { kind },
    })
}

/// Bytes of a manifest file read at a time. The file is read and parsed piece by
/// piece, each piece ending before a `---` line, so the agent never holds the
/// whole text: at 100k Services the bench's file is 330 MB, most of the memory
/// budget, where its objects take a fraction of that.
const READ_PIECE: usize = 4 << 20;

/// One manifest file's objects.
pub fn load_file(file: &Path) -> Result<Objects, FileError> {
    load_in_pieces(file, READ_PIECE)
}

fn load_in_pieces(file: &Path, piece: usize) -> Result<Objects, FileError> {
    let not_utf8 = |offset| FileError {
        path: file.to_owned(),
        problem: FileProblem::NotUtf8 { offset },
    };
    if has_extension(file, &["json"]) {
        let bytes = fs::read(file).map_err(|e| FileError::io(file, e))?;
        let text = String::from_utf8(bytes).map_err(|e| not_utf8(e.utf8_error().valid_up_to()))?;
        return Ok(parse_str(file, &text));
    }
    let mut reader = fs::File::open(file).map_err(|e| FileError::io(file, e))?;
    let mut objects = Objects::default();
    let mut at = Position::default();
    let mut pending: Vec<u8> = Vec::with_capacity(piece);
    let mut want = piece;
    let mut eof = false;
    while !eof || !pending.is_empty() {
        while !eof && pending.len() < want {
            let room = want - pending.len();
            let read = (&mut reader)
                .take(room as u64)
                .read_to_end(&mut pending)
                .map_err(|e| FileError::io(file, e))?;
            eof = read == 0;
        }
        let cut = match eof {
            true => pending.len(),
            false => match last_document_start(&pending) {
                Some(cut) => cut,
                // One document longer than a piece: read on until it ends.
                None => {
                    want += piece;
                    continue;
                }
            },
        };
        let text = std::str::from_utf8(&pending[..cut])
            .map_err(|e| not_utf8(at.bytes + e.valid_up_to()))?;
        let text = match at.bytes {
            0 => text.strip_prefix('\u{feff}').unwrap_or(text),
            _ => text,
        };
        parse_yaml(file, text, &mut at, &mut objects);
        at.bytes += cut;
        pending.drain(..cut);
        want = piece;
    }
    Ok(objects)
}

/// Where a piece of a file starts: documents, lines and bytes before it.
#[derive(Default)]
struct Position {
    documents: usize,
    lines: usize,
    bytes: usize,
}

/// The start of the last line of `text` that opens a document (`---` alone or
/// followed by a blank), after the first byte: a piece cut there splits into the
/// same documents as the whole file, since a document marker ends whatever came
/// before it. A marker on the unfinished last line does not count.
fn last_document_start(text: &[u8]) -> Option<usize> {
    let mut end = text.len();
    while let Some(at) = memchr::memmem::rfind(&text[..end], b"\n---") {
        let start = at + 1;
        match text.get(start + 3) {
            Some(b'\n' | b'\r' | b' ' | b'\t') => return Some(start),
            _ => end = at,
        }
    }
    None
}

/// Parse the text of one file; `file` is only used to name it in errors and to tell
/// JSON from YAML.
pub fn parse_str(file: &Path, text: &str) -> Objects {
    // Editors on Windows start files with a byte order mark; kubectl strips it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut objects = Objects::default();
    if has_extension(file, &["json"]) {
        parse_json(file, text, &mut objects);
        return objects;
    }
    parse_yaml(file, text, &mut Position::default(), &mut objects);
    objects
}

/// Parse YAML text that starts at `at` in its file (a whole file, or a piece that
/// starts a document), adding to `objects`; `at` moves past its documents and lines.
fn parse_yaml(file: &Path, text: &str, at: &mut Position, objects: &mut Objects) {
    let mut docs = split_documents(text);
    // Every document the split counts is one it returns, so numbering goes on from
    // the pieces before.
    for doc in &mut docs {
        doc.index += at.documents;
        doc.line += at.lines;
        doc.text_line += at.lines;
    }
    at.documents += docs.len();
    at.lines += memchr::memchr_iter(b'\n', text.as_bytes()).count();
    // Documents are independent: read them on every CPU, then concatenate in file
    // order so that "first one wins" rules do not depend on the split.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = docs.len().div_ceil(threads).max(PARALLEL_MIN_DOCUMENTS);
    if docs.len() <= chunk {
        parse_documents(file, &docs, objects);
        return;
    }
    let parts: Vec<Objects> = std::thread::scope(|scope| {
        let workers: Vec<_> = docs
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    let mut objects = Objects::default();
                    parse_documents(file, part, &mut objects);
                    objects
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    for part in parts {
        append(objects, part);
    }
}

/// Adds what one thread found after what the threads before it found.
fn append(objects: &mut Objects, part: Objects) {
    objects.services.extend(part.services);
    objects.slices.extend(part.slices);
    objects.nodes.extend(part.nodes);
    objects.errors.extend(part.errors);
}

/// Below this many documents per thread, spawning costs more than it saves.
const PARALLEL_MIN_DOCUMENTS: usize = 256;

fn parse_documents(file: &Path, docs: &[Document], objects: &mut Objects) {
    for doc in docs {
        let location = Location {
            file: file.to_owned(),
            document: doc.index,
            line: doc.line,
            item: None,
        };
        // Block-style YAML (what kubectl writes) is read without libyaml, straight
        // into the typed objects; whatever that reader leaves, or whatever does not
        // load cleanly from it, takes the full path below, which also words every
        // error.
        if let Some(manifest) = block_yaml::from_str::<Manifest>(&doc.text) {
            manifest.add_to(objects);
            continue;
        }
        match serde_norway::from_str::<StrictValue>(&doc.text) {
            Ok(StrictValue(value)) => take_document(value, &location, objects),
            Err(_) => {
                // Parse again with the document at its place in the file so the
                // error's line numbers are the file's; only on the rare error path.
                let padded = "\n".repeat(doc.text_line - 1) + &doc.text;
                let message = match serde_norway::from_str::<StrictValue>(&padded) {
                    Err(e) => e.to_string(),
                    Ok(_) => "unreadable document".to_owned(),
                };
                objects.errors.push(ObjectError {
                    location: Some(location),
                    ..ObjectError::new("", "", "", Problem::InvalidYaml { message })
                });
            }
        }
    }
}

/// serde_json's `Value`, except that a mapping repeating a key is an error:
/// serde_json keeps the last value silently, while kubectl and the API server refuse
/// such an object (and the block reader gives up on it, leaving it to this path).
struct StrictValue(Value);

impl<'de> serde::Deserialize<'de> for StrictValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> serde::de::Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }

    /// As serde_json does: a float JSON cannot hold (NaN, infinity) is null.
    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }

    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        serde::Deserialize::deserialize(d).map(|StrictValue(v)| v)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(StrictValue(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut fields = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate key {:?} in a mapping; remove one of them (kubectl and the \
                     API server refuse it)",
                    super::Capped(&key)
                )));
            }
            let StrictValue(value) = map.next_value()?;
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }
}

/// No name: the API server refuses such an object, and a Service or slice without
/// one cannot be told apart from others in messages or matched to its slices.
fn unnamed(meta: &super::lean::Meta) -> bool {
    meta.name.as_deref().is_none_or(str::is_empty)
}

/// A document (or an item of a list) read by the block YAML reader, typed by its
/// `apiVersion` and `kind` before its fields are read. Only clean loads: anything
/// the general path would report (a missing kind, another version of a kind we
/// proxy, a schema error) fails the whole document, which then takes that path.
enum Manifest {
    Service(Arc<Service>),
    Slice(Arc<EndpointSlice>),
    Node(Arc<Node>),
    List(Vec<Manifest>),
    /// Not ours to proxy, read through only to check it is well-formed.
    Other,
}

impl Manifest {
    fn add_to(self, objects: &mut Objects) {
        match self {
            Manifest::Service(service) => objects.services.push(service),
            Manifest::Slice(slice) => objects.slices.push(slice),
            Manifest::Node(node) => objects.nodes.push(node),
            Manifest::List(items) => items.into_iter().for_each(|i| i.add_to(objects)),
            Manifest::Other => {}
        }
    }
}

/// `items` of a list; typed lists from the API leave kind and apiVersion out of
/// their items, so those are read as the list's item type.
#[derive(serde::Deserialize)]
struct Items<T> {
    #[serde(default = "Option::default")]
    items: Option<Vec<T>>,
}

impl<T> Items<T> {
    fn into_manifests(self, wrap: impl Fn(T) -> Manifest) -> Manifest {
        Manifest::List(self.items.into_iter().flatten().map(wrap).collect())
    }
}

/// A list's item: an object of any kind, but not another list.
struct ListItem(Manifest);

impl<'de> serde::Deserialize<'de> for Manifest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_enum(
            block_yaml::KIND_TAGGED,
            &[],
            ManifestVisitor { lists: true },
        )
    }
}

impl<'de> serde::Deserialize<'de> for ListItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_enum(
            block_yaml::KIND_TAGGED,
            &[],
            ManifestVisitor { lists: false },
        )
        .map(ListItem)
    }
}

struct ManifestVisitor {
    /// Whether a list is read as one; items that are lists are not ours to proxy,
    /// as on the general path.
    lists: bool,
}

impl<'de> serde::de::Visitor<'de> for ManifestVisitor {
    type Value = Manifest;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<Manifest, A::Error> {
        use serde::de::{Error, IgnoredAny, VariantAccess};
        let ((api_version, kind), object): ((Cow<str>, Cow<str>), _) = data.variant()?;
        let not_clean = || A::Error::custom("left to the general path");
        Ok(match (api_version.as_ref(), kind.as_ref()) {
            ("v1", "Service") => {
                let service: Service = object.newtype_variant()?;
                if unnamed(&service.metadata) {
                    return Err(not_clean());
                }
                Manifest::Service(Arc::new(service))
            }
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                let slice: EndpointSlice = object.newtype_variant()?;
                if unnamed(&slice.metadata) {
                    return Err(not_clean());
                }
                Manifest::Slice(Arc::new(slice))
            }
            ("v1", "Node") => Manifest::Node(Arc::new(object.newtype_variant()?)),
            (_, "Service" | "EndpointSlice" | "Node" | "") => return Err(not_clean()),
            (_, "List") if self.lists => {
                let list: Items<ListItem> = object.newtype_variant()?;
                list.into_manifests(|item| item.0)
            }
            (_, "ServiceList") if self.lists => {
                let list: Items<Service> = object.newtype_variant()?;
                if list.items.iter().flatten().any(|s| unnamed(&s.metadata)) {
                    return Err(not_clean());
                }
                list.into_manifests(|s| Manifest::Service(Arc::new(s)))
            }
            (_, "EndpointSliceList") if self.lists => {
                let list: Items<EndpointSlice> = object.newtype_variant()?;
                if list.items.iter().flatten().any(|s| unnamed(&s.metadata)) {
                    return Err(not_clean());
                }
                list.into_manifests(|s| Manifest::Slice(Arc::new(s)))
            }
            _ => {
                object.newtype_variant::<IgnoredAny>()?;
                Manifest::Other
            }
        })
    }
}

/// The fields that decide what a document is.
#[derive(serde::Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "apiVersion")]
    api_version: Option<Cow<'a, str>>,
}

/// Only of a JSON object: serde would also read a struct from an array.
fn head_of(json: &str) -> Option<Head<'_>> {
    if !json.trim_start().starts_with('{') {
        return None;
    }
    serde_json::from_str(json).ok()
}

#[derive(serde::Deserialize)]
struct ListItems<'a> {
    #[serde(borrow, default)]
    items: Option<Vec<&'a RawValue>>,
}

/// Loads a document given as JSON straight into typed objects, without a generic
/// value in between. Returns false, having added nothing, for anything that is not a
/// clean load (an error, an unexpected shape): the caller then takes the general
/// path, which reports the problem with its location.
fn take_json_document(json: &str, objects: &mut Objects) -> bool {
    let Some(head) = head_of(json) else {
        return false;
    };
    let item_kind = match head.kind.as_deref() {
        Some("List") => None,
        Some("ServiceList") => Some(("Service", "v1")),
        Some("EndpointSliceList") => Some(("EndpointSlice", "discovery.k8s.io/v1")),
        _ => return take_json_object(json, head, objects),
    };
    let Ok(ListItems { items }) = serde_json::from_str::<ListItems>(json) else {
        return false;
    };
    let mut found = Objects::default();
    for item in items.unwrap_or_default() {
        let Some(mut head) = head_of(item.get()) else {
            return false;
        };
        if let Some((kind, api_version)) = item_kind {
            head.kind.get_or_insert(Cow::Borrowed(kind));
            head.api_version.get_or_insert(Cow::Borrowed(api_version));
        }
        if !take_json_object(item.get(), head, &mut found) {
            return false;
        }
    }
    objects.services.extend(found.services);
    objects.slices.extend(found.slices);
    objects.nodes.extend(found.nodes);
    true
}

fn take_json_object(json: &str, head: Head, objects: &mut Objects) -> bool {
    match (head.kind.as_deref(), head.api_version.as_deref()) {
        (Some("Service"), Some("v1")) => match serde_json::from_str::<Service>(json) {
            Ok(service) if !unnamed(&service.metadata) => objects.services.push(Arc::new(service)),
            _ => return false,
        },
        (Some("EndpointSlice"), Some("discovery.k8s.io/v1")) => {
            match serde_json::from_str::<EndpointSlice>(json) {
                Ok(slice) if !unnamed(&slice.metadata) => objects.slices.push(Arc::new(slice)),
                _ => return false,
            }
        }
        (Some("Node"), Some("v1")) => match serde_json::from_str::<Node>(json) {
            Ok(node) => objects.nodes.push(Arc::new(node)),
            Err(_) => return false,
        },
        (Some("Service" | "EndpointSlice" | "Node"), _) | (None, _) => return false,
        (Some(_), _) => {} // not ours to proxy
    }
    true
}

fn has_extension(path: &Path, wanted: &[&str]) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| wanted.iter().any(|w| e.eq_ignore_ascii_case(w)))
}

/// `kubectl -o json` writes one value; concatenated values (several `kubectl get`
/// appended to one file) are read one after another.
fn parse_json(file: &Path, text: &str, objects: &mut Objects) {
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<&RawValue>();
    let mut index = 0;
    loop {
        let start = stream.byte_offset();
        let next = stream.next();
        let Some(result) = next else { break };
        index += 1;
        // Typed straight from the text when it loads cleanly; otherwise through a
        // generic value, which words the problem.
        let result = match result {
            Ok(raw) if take_json_document(raw.get(), objects) => continue,
            Ok(raw) => serde_json::from_str::<Value>(raw.get()),
            Err(e) => Err(e),
        };
        // Counted only here: counting lines for every value would be quadratic.
        let skipped = text[start..].len() - text[start..].trim_start().len();
        let line = 1 + text[..start + skipped].matches('\n').count();
        let location = Location {
            file: file.to_owned(),
            document: index,
            line,
            item: None,
        };
        match result {
            Ok(value) => take_document(value, &location, objects),
            Err(e) => {
                // The stream cannot find the start of the next value after an error
                // (and a value serde_json cannot hold is as good as unreadable).
                objects.errors.push(ObjectError {
                    location: Some(location),
                    ..ObjectError::new(
                        "",
                        "",
                        "",
                        Problem::InvalidJson {
                            message: e.to_string(),
                        },
                    )
                });
                break;
            }
        }
    }
}

fn str_field<'a>(value: &'a Value, field: &str) -> Option<&'a str> {
    value.get(field).and_then(Value::as_str)
}

fn meta_field<'a>(value: &'a Value, field: &str) -> &'a str {
    value
        .get("metadata")
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .unwrap_or("")
}

fn take_document(value: Value, location: &Location, objects: &mut Objects) {
    if value.is_null() {
        return; // an empty document, e.g. a trailing `---`
    }
    // Typed lists from the API leave kind and apiVersion out of their items.
    let item_kind = match str_field(&value, "kind") {
        Some("List") => None,
        Some("ServiceList") => Some(("Service", "v1")),
        Some("EndpointSliceList") => Some(("EndpointSlice", "discovery.k8s.io/v1")),
        _ => return take_object(value, location, objects),
    };
    let Value::Object(mut list) = value else {
        unreachable!("has a kind, so it is a mapping")
    };
    let items = match list.remove("items") {
        None | Some(Value::Null) => return,
        Some(Value::Array(items)) => items,
        Some(_) => {
            let kind = str_field(&Value::Object(list), "kind")
                .unwrap_or("")
                .to_owned();
            objects.errors.push(ObjectError {
                location: Some(location.clone()),
                ..ObjectError::new(&kind, "", "", Problem::ItemsNotAList)
            });
            return;
        }
    };
    for (i, mut item) in items.into_iter().enumerate() {
        if let (Some((kind, api_version)), Value::Object(fields)) = (item_kind, &mut item) {
            fields
                .entry("kind")
                .or_insert_with(|| Value::String(kind.to_owned()));
            fields
                .entry("apiVersion")
                .or_insert_with(|| Value::String(api_version.to_owned()));
        }
        let location = Location {
            item: Some(i),
            ..location.clone()
        };
        take_object(item, &location, objects);
    }
}

fn take_object(value: Value, location: &Location, objects: &mut Objects) {
    let namespace = meta_field(&value, "namespace").to_owned();
    let name = meta_field(&value, "name").to_owned();
    let error = |kind: &str, problem: Problem| ObjectError {
        location: Some(location.clone()),
        ..ObjectError::new(kind, &namespace, &name, problem)
    };
    if !value.is_object() {
        objects.errors.push(error("", Problem::NotAnObject));
        return;
    }
    let Some(kind) = str_field(&value, "kind") else {
        objects.errors.push(error("", Problem::MissingKind));
        return;
    };
    let api_version = str_field(&value, "apiVersion").unwrap_or("");
    let (kind, expected): (&'static str, _) = match kind {
        "Service" => ("Service", "v1"),
        "EndpointSlice" => ("EndpointSlice", "discovery.k8s.io/v1"),
        "Node" => ("Node", "v1"),
        _ => return, // not ours to proxy
    };
    if api_version != expected {
        let problem = Problem::UnsupportedApiVersion {
            kind: kind.to_owned(),
            found: api_version.to_owned(),
            expected,
        };
        objects.errors.push(error(kind, problem));
        return;
    }
    let schema = |e: serde_json::Error, kind: &'static str| Problem::Schema {
        kind,
        message: e.to_string(),
    };
    if kind == "Service" {
        match serde_json::from_value::<Service>(value) {
            Ok(svc) if unnamed(&svc.metadata) => {
                objects.errors.push(error(kind, Problem::MissingName))
            }
            Ok(svc) => objects.services.push(Arc::new(svc)),
            Err(e) => objects.errors.push(error(kind, schema(e, kind))),
        }
    } else if kind == "Node" {
        match serde_json::from_value::<Node>(value) {
            Ok(node) => objects.nodes.push(Arc::new(node)),
            Err(e) => objects.errors.push(error(kind, schema(e, kind))),
        }
    } else {
        match serde_json::from_value::<EndpointSlice>(value) {
            Ok(slice) if unnamed(&slice.metadata) => {
                objects.errors.push(error(kind, Problem::MissingName))
            }
            Ok(slice) => objects.slices.push(Arc::new(slice)),
            Err(e) => objects.errors.push(error(kind, schema(e, kind))),
        }
    }
}

#[cfg(test)]
mod tests;
