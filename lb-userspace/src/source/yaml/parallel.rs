//! YAML text into objects on every CPU: the text is split into documents, which
//! are independent, and runs of them are parsed on scoped threads, then put back
//! together in file order so that "first one wins" rules do not depend on the
//! split. Each document tries the block fast path first and falls back to the
//! general path.

use std::path::Path;

use lb_yaml::{block as block_yaml, split_documents, Document};

use super::block::Manifest;
use super::general::take_yaml_document;
use crate::source::Objects;

/// Where a piece of a file starts: documents, lines and bytes before it.
#[derive(Default)]
pub(super) struct Position {
    pub(super) documents: usize,
    pub(super) lines: usize,
    pub(super) bytes: usize,
}

/// Below this many documents per thread, spawning costs more than it saves.
const PARALLEL_MIN_DOCUMENTS: usize = 256;

/// Parse YAML text that starts at `at` in its file (a whole file, or a piece that
/// starts a document), adding to `objects`; `at` moves past its documents and lines.
pub(super) fn parse_yaml(file: &Path, text: &str, at: &mut Position, objects: &mut Objects) {
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

fn parse_documents(file: &Path, docs: &[Document], objects: &mut Objects) {
    for doc in docs {
        // Block-style YAML (what kubectl writes) is read without libyaml, straight
        // into the typed objects; whatever that reader leaves, or whatever does not
        // load cleanly from it, takes the general path, which also words every
        // error.
        match block_yaml::from_str::<Manifest>(&doc.text) {
            Some(manifest) => manifest.add_to(objects),
            None => take_yaml_document(file, doc, objects),
        }
    }
}

/// Adds what one thread found after what the threads before it found.
fn append(objects: &mut Objects, part: Objects) {
    objects.services.extend(part.services);
    objects.slices.extend(part.slices);
    objects.nodes.extend(part.nodes);
    objects.network_policies.extend(part.network_policies);
    objects.pods.extend(part.pods);
    objects.namespaces.extend(part.namespaces);
    objects.errors.extend(part.errors);
}
