//! Cutting a YAML stream into documents.

use std::borrow::Cow;

/// One document of a YAML stream.
pub struct Document<'a> {
    /// 1-based.
    pub index: usize,
    /// 1-based line of the file where the document starts (its `---` line if any).
    pub line: usize,
    pub text: Cow<'a, str>,
    /// 1-based line of the file that is the first line of `text`.
    pub text_line: usize,
}

/// Cut YAML text into documents ourselves rather than letting the parser iterate them:
/// the parser stops at the first syntax error, and one broken document must not hide
/// the ones after it. YAML forbids `---` and `...` at the start of a line inside
/// content, so cutting there is exact. Documents borrow the text where they can.
pub fn split_documents(text: &str) -> Vec<Document<'_>> {
    let mut docs = Vec::new();
    let mut open: Option<OpenDocument> = None;
    let mut index = 0;
    let mut markers = MarkerLines::new(text);
    // The start of the current line and its 0-based number.
    let mut offset = 0;
    let mut n = 0;
    while offset < text.len() {
        if open.is_some() {
            // Inside a document only marker lines matter: jump to the next one
            // instead of walking every line (a 33 MB file has a million).
            let next = markers.next_from(offset);
            n += count_newlines(&text.as_bytes()[offset..next]);
            offset = next;
            if offset == text.len() {
                break;
            }
        }
        let start = offset;
        offset = text[start..]
            .find('\n')
            .map_or(text.len(), |i| start + i + 1);
        let line = text[start..offset].trim_end_matches(['\n', '\r']);
        n += 1;
        if let Some(rest) = marker(line, "---") {
            docs.extend(open.take().map(|o| o.close(text, start)));
            index += 1;
            open = Some(OpenDocument {
                index,
                line: n,
                marker: true,
                head: (!rest.trim().is_empty()).then_some(rest),
                body: offset,
            });
        } else if marker(line, "...").is_some() {
            docs.extend(open.take().map(|o| o.close(text, start)));
        } else if open.is_none() {
            let trimmed = line.trim_start();
            // Blank lines, comments and directives outside a document start none.
            if trimmed.is_empty() || trimmed.starts_with('#') || line.starts_with('%') {
                continue;
            }
            index += 1;
            open = Some(OpenDocument {
                index,
                line: n,
                marker: false,
                head: None,
                body: start,
            });
        }
    }
    docs.extend(open.map(|o| o.close(text, text.len())));
    docs
}

/// Newlines in `bytes`, counted in blocks whose sums fit a byte so the loop
/// vectorizes.
fn count_newlines(bytes: &[u8]) -> usize {
    bytes
        .chunks(255)
        .map(|block| block.iter().fold(0u8, |n, &b| n + u8::from(b == b'\n')) as usize)
        .sum()
}

/// Finds the lines that may be document markers (starting `---` or `...`) with a
/// substring search, remembering the next hit of each so the text is searched once.
struct MarkerLines<'a> {
    text: &'a str,
    /// The next line start found for `---` and for `...` (`text.len()`: none left).
    next: [Option<usize>; 2],
    /// SIMD substring search; std's `find` walks a 33 MB file at a fraction the speed.
    finders: [memchr::memmem::Finder<'static>; 2],
}

impl<'a> MarkerLines<'a> {
    fn new(text: &'a str) -> Self {
        MarkerLines {
            text,
            next: [None, None],
            finders: ["\n---", "\n..."].map(memchr::memmem::Finder::new),
        }
    }

    /// The first line at or after the line start `from` that begins with a marker's
    /// characters, or the end of the text.
    fn next_from(&mut self, from: usize) -> usize {
        let text = self.text;
        let mut first = text.len();
        for (next, finder) in self.next.iter_mut().zip(&self.finders) {
            if next.is_none_or(|p| p < from) {
                let found = if text.as_bytes()[from..].starts_with(&finder.needle()[1..]) {
                    Some(from)
                } else {
                    finder.find(&text.as_bytes()[from..]).map(|i| from + i + 1)
                };
                *next = Some(found.unwrap_or(text.len()));
            }
            first = first.min(next.unwrap_or(text.len()));
        }
        first
    }
}

struct OpenDocument<'a> {
    index: usize,
    line: usize,
    /// Whether the document starts with a `---` line.
    marker: bool,
    /// What follows `---` on its line, when not blank.
    head: Option<&'a str>,
    /// Byte offset of the document's first line after the marker.
    body: usize,
}

impl<'a> OpenDocument<'a> {
    fn close(self, text: &'a str, end: usize) -> Document<'a> {
        let body = &text[self.body..end];
        let (text, text_line) = match self.head {
            Some(head) => (Cow::Owned(format!("{head}\n{body}")), self.line),
            None => (Cow::Borrowed(body), self.line + usize::from(self.marker)),
        };
        Document {
            index: self.index,
            line: self.line,
            text,
            text_line,
        }
    }
}

/// The rest of the line when it starts with the document marker `m`.
fn marker<'a>(line: &'a str, m: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(m)?;
    if rest.is_empty() || rest.starts_with([' ', '\t']) {
        Some(rest)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitting_keeps_marker_line_content_and_skips_preamble() {
        let docs = split_documents("# header\n%YAML 1.2\n--- {a: 1}\n...\n\n---\nb: 2\n");
        let got: Vec<_> = docs
            .iter()
            .map(|d| (d.index, d.line, d.text_line, &*d.text))
            .collect();
        assert_eq!(got, [(1, 3, 3, " {a: 1}\n"), (2, 6, 7, "b: 2\n")]);
        // A key that merely starts with dashes is content, not a marker.
        assert_eq!(split_documents("a: 1\n---b: 2\n").len(), 1);
    }

    /// Inside a document the splitter jumps from marker line to marker line; line
    /// numbers must still count every line it jumped over, past 255 of them too.
    #[test]
    fn splitting_counts_the_lines_it_jumps_over() {
        let long: String = (0..600).map(|i| format!("k{i}: v\n")).collect();
        let text = format!("{long}---b\n...b: 1\n...\n\n# c\nc: 1\r\n---\r\nd: 1\n--- \n...");
        let got: Vec<_> = split_documents(&text)
            .iter()
            .map(|d| (d.index, d.line, d.text_line, d.text.len()))
            .collect();
        assert_eq!(
            got,
            [
                (1, 1, 1, long.len() + "---b\n...b: 1\n".len()),
                (2, 606, 606, "c: 1\r\n".len()),
                (3, 607, 608, "d: 1\n".len()),
                (4, 609, 610, 0),
            ]
        );
        assert_eq!(count_newlines(&[b'\n'; 1000]), 1000);
    }
}
