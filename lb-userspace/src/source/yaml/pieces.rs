//! Reading a YAML file piece by piece, each piece cut just before a `---` line, so
//! the agent never holds the whole text: at 100k Services the bench's file is
//! 330 MB, most of the memory budget, where its objects take a fraction of that.
//! A piece is parsed knowing where it starts in the file, so objects and error
//! locations come out as from the whole text.

use std::fs;
use std::io::Read;
use std::path::Path;

use super::parallel::{parse_yaml, Position};
use super::FileError;
use crate::source::Objects;

/// Bytes of a manifest file read at a time.
pub(super) const READ_PIECE: usize = 4 << 20;

/// A YAML file's objects, read `piece` bytes at a time (more for a document longer
/// than that).
pub(super) fn load_in_pieces(file: &Path, piece: usize) -> Result<Objects, FileError> {
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
            .map_err(|e| FileError::not_utf8(file, at.bytes + e.valid_up_to()))?;
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
