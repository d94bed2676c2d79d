//! Fuzzing the block reader with proptest, bounded so it runs with the unit tests:
//! the seed corpus (`lb-yaml/tests/corpus/`) mutated byte- and line-wise, and
//! arbitrary YAML-ish text. Properties: splitting and reading never panic, and
//! whatever the block reader accepts (as a generic value, or as a typed Service or
//! EndpointSlice) serde_norway reads the same way.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proptest::prelude::*;
use serde_json::Value;

use crate::{block, split_documents};

/// Text that exercises YAML's indicators, markers, scalars on the edges of the
/// subset, and characters the block reader must refuse.
const PIECES: &[&str] = &[
    ": ",
    "- ",
    "-",
    "#",
    " #c",
    "---\n",
    "--- ",
    "...\n",
    "\n",
    "  ",
    "    ",
    "\t",
    "\"",
    "'",
    "{",
    "}",
    "{}",
    "[",
    "]",
    "[]",
    ",",
    "|",
    "|-",
    "|+",
    ">",
    ">-",
    "&a ",
    "*a",
    "!!str ",
    "!x ",
    "~",
    "null",
    "Null",
    "true",
    "False",
    "yes",
    "0x10",
    "0o7",
    "0b1",
    "1e3",
    ".5",
    "-0",
    "00",
    "012",
    "+1",
    "-1",
    ".inf",
    ".NaN",
    "9223372036854775808",
    "é",
    "\u{85}",
    "\u{feff}",
    "\u{2028}",
    "\u{7f}",
    "\u{0}",
    "\r",
    "\r\n",
    "\\",
    "\\u00e9",
    "\\x41",
    "name: x\n",
    "kind: Service\n",
    "apiVersion: v1\n",
    "metadata:\n  name: dup\n",
    "<<: *a\n",
    "? k\n",
    "%YAML 1.2\n",
    "items:\n",
    "spec:\n  ports:\n  - port: 1\n",
];

#[derive(Clone, Debug)]
enum Mutation {
    Insert { at: usize, piece: usize },
    Delete { at: usize, len: usize },
    DuplicateLine { line: usize },
    DeleteLine { line: usize },
    Indent { line: usize, by: usize },
    Dedent { line: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let n = any::<usize>();
    prop_oneof![
        4 => (n, 0..PIECES.len()).prop_map(|(at, piece)| Mutation::Insert { at, piece }),
        2 => (n, 1usize..16).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => n.prop_map(|line| Mutation::DuplicateLine { line }),
        1 => n.prop_map(|line| Mutation::DeleteLine { line }),
        1 => (n, 1usize..4).prop_map(|(line, by)| Mutation::Indent { line, by }),
        1 => n.prop_map(|line| Mutation::Dedent { line }),
    ]
}

/// The byte offset at or before `at % (len + 1)` that is a character boundary.
fn boundary(text: &str, at: usize) -> usize {
    let mut at = at % (text.len() + 1);
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn apply(text: &mut String, mutation: &Mutation) {
    let mut lines: Vec<String> = text.split('\n').map(str::to_owned).collect();
    let pick = |line: usize| line % lines.len();
    match *mutation {
        Mutation::Insert { at, piece } => {
            let at = boundary(text, at);
            text.insert_str(at, PIECES[piece]);
            return;
        }
        Mutation::Delete { at, len } => {
            let start = boundary(text, at);
            let end = boundary(text, start.saturating_add(len).min(text.len()));
            if end > start {
                text.replace_range(start..end, "");
            }
            return;
        }
        Mutation::DuplicateLine { line } => {
            let i = pick(line);
            lines.insert(i, lines[i].clone());
        }
        Mutation::DeleteLine { line } => {
            let i = pick(line);
            lines.remove(i);
        }
        Mutation::Indent { line, by } => {
            let i = pick(line);
            lines[i].insert_str(0, &" ".repeat(by));
        }
        Mutation::Dedent { line } => {
            let i = pick(line);
            if lines[i].starts_with(' ') {
                lines[i].remove(0);
            }
        }
    }
    *text = lines.join("\n");
}

fn corpus() -> Vec<(PathBuf, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus");
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "md"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p, text)
        })
        .collect();
    seeds.sort();
    assert!(
        seeds.len() >= 5,
        "the seed corpus is missing: {}",
        dir.display()
    );
    seeds
}

/// A Kubernetes object as the agent reads it from the block reader.
type Object = crate::Kinded<Box<Service>, Box<EndpointSlice>>;

/// The properties, for one text.
fn check(text: &str) -> Result<(), TestCaseError> {
    for doc in split_documents(text) {
        let general = serde_norway::from_str::<Value>(&doc.text);
        if let Some(fast) = block::from_str::<Value>(&doc.text) {
            prop_assert_eq!(
                Some(&fast),
                general.as_ref().ok(),
                "the block reader read {:?} differently from serde_norway ({:?})",
                doc.text,
                general.as_ref().err()
            );
        }
        let general = |kind| {
            let typed = match kind {
                "Service" => serde_norway::from_str(&doc.text).map(Object::Service),
                _ => serde_norway::from_str(&doc.text).map(Object::Slice),
            };
            typed.map_err(|e| {
                TestCaseError::fail(format!(
                    "the block reader typed {:?}, serde_norway refuses it: {e}",
                    doc.text
                ))
            })
        };
        match block::from_str::<Object>(&doc.text) {
            Some(fast @ Object::Service(_)) => prop_assert_eq!(&fast, &general("Service")?),
            Some(fast @ Object::Slice(_)) => prop_assert_eq!(&fast, &general("EndpointSlice")?),
            Some(Object::Other) | None => {}
        }
    }
    Ok(())
}

proptest! {
    // Bounded so the unit tests stay quick (a few seconds in a debug build); a
    // longer run: PROPTEST_CASES=100000 cargo test -p lb-yaml fuzz.
    #![proptest_config(ProptestConfig {
        cases: 600,
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn fuzz_mutated_corpus(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..8),
    ) {
        let seeds = corpus();
        let (_, text) = &seeds[seed.index(seeds.len())];
        let mut text = text.clone();
        for m in &mutations {
            apply(&mut text, m);
        }
        check(&text)?;
    }

    #[test]
    fn fuzz_arbitrary_text(
        text in "([a-z]{1,6}|[-:#'\"{}\\[\\],|>&*!~?% \\t\\n.0-9]|\\u{e9}|\\u{85}|\\u{feff}){0,120}",
    ) {
        check(&text)?;
    }
}

/// The seeds themselves, unmutated.
#[test]
fn the_corpus_reads_and_agrees() {
    for (file, text) in corpus() {
        check(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }
}
