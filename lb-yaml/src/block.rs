//! A fast reader for block-style YAML, the form `kubectl get -o yaml` writes and most
//! hand-written manifests use: a serde `Deserializer` straight over the lines.
//!
//! libyaml and a generic value tree cost about 100 ns per byte: 3.4 s for the 33 MB
//! of 10k Services with 10 endpoints each. This reader accepts a strict subset (block
//! mappings and sequences, plain, quoted and literal scalars, decimal integers, `{}`
//! and `[]`) and gives up on everything else (anchors, tags, flow collections,
//! multi-line scalars, floats, other number forms, duplicate keys). The caller then
//! reads that document with serde_norway, so the subset is a shortcut, not a dialect: a
//! test checks that whatever this reader accepts, serde_norway reads as the same value.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

/// The name of an enum this reader tags with the `(apiVersion, kind)` of the mapping
/// being read (`""` for either when absent), so a caller can pick the type of a
/// Kubernetes object before reading it, without a generic value in between.
pub const KIND_TAGGED: &str = "lb::kind_tagged";

/// Reads a document as `T`; `None` when it is outside the subset, not valid YAML, or
/// not a `T`, in which case the caller must use a full YAML parser.
pub fn from_str<'a, T: de::Deserialize<'a>>(doc: &'a str) -> Option<T> {
    if !plain_characters(doc) {
        return None;
    }
    let mut lines = Vec::with_capacity(doc.len() / 16);
    for raw in doc.split('\n') {
        lines.push(Line::new(raw)?);
    }
    let mut reader = Reader {
        lines,
        pos: 0,
        keys: Vec::new(),
        depth: 0,
    };
    reader.skip_blank();
    let root = match reader.current() {
        None => Resolved::Inline(Inline::Scalar(Scalar::Null)),
        // A document whose root is indented is valid but unusual: leave it to libyaml.
        Some(line) if line.indent != 0 => return None,
        Some(_) => reader.resolve(Start::Block(0)).ok()?,
    };
    let value = T::deserialize(Node {
        reader: &mut reader,
        resolved: root,
    })
    .ok()?;
    reader.skip_blank();
    reader.current().is_none().then_some(value)
}

/// Why the reader gave up; the caller does not need to know, libyaml will say.
#[derive(Debug)]
pub struct Unsupported;

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("outside the block YAML subset")
    }
}

impl std::error::Error for Unsupported {}

impl de::Error for Unsupported {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Unsupported
    }
}

type Result<T> = std::result::Result<T, Unsupported>;

/// Rejects characters YAML forbids or treats as line breaks (C0 controls other than
/// newline, DEL, C1 controls, NEL, LS, PS) and the byte order mark, and tabs: YAML
/// allows them in some places and not others, kubectl never writes them, and
/// refusing them per document spares a check per scalar.
fn plain_characters(doc: &str) -> bool {
    let ascii_ok = |b: u8| (b >= 0x20 && b != 0x7f) || b == b'\n';
    // A branch-free fold over fixed-size blocks vectorizes; `all` stops at every byte.
    let bad_control = doc.as_bytes().chunks(256).any(|block| {
        block.iter().fold(false, |bad, &b| {
            bad | ((b < 0x20 && b != b'\n') || b == 0x7f)
        })
    });
    if bad_control {
        return false;
    }
    if doc.is_ascii() {
        return true;
    }
    doc.chars().all(|c| {
        if c.is_ascii() {
            ascii_ok(c as u8)
        } else {
            !matches!(
                c,
                '\u{80}'..='\u{9f}' | '\u{2028}' | '\u{2029}' | '\u{feff}'
            )
        }
    })
}

#[derive(Clone, Copy)]
struct Line<'a> {
    /// Leading spaces.
    indent: usize,
    /// The line after its indentation, trailing whitespace removed.
    text: &'a str,
    /// The whole line, for literal block scalars.
    raw: &'a str,
}

impl<'a> Line<'a> {
    fn new(raw: &'a str) -> Option<Self> {
        let indent = raw.len() - raw.trim_start_matches(' ').len();
        let text = raw[indent..].trim_end_matches(' ');
        // Document markers belong to the caller's splitting, not inside a document.
        if matches!(raw.as_bytes().first(), Some(b'-' | b'.')) {
            let marker = |m: &str| {
                raw.strip_prefix(m)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
            };
            if marker("---") || marker("...") {
                return None;
            }
        }
        Some(Line { indent, text, raw })
    }

    fn is_blank(&self) -> bool {
        self.text.is_empty() || self.text.starts_with('#')
    }

    fn is_sequence_item(&self) -> bool {
        self.text == "-" || self.text.starts_with("- ")
    }
}

struct Reader<'a> {
    lines: Vec<Line<'a>>,
    pos: usize,
    /// Keys of the mappings being read, innermost last: one allocation per
    /// document instead of one per mapping.
    keys: Vec<Cow<'a, str>>,
    /// Nesting of the node being read; deeper documents go to serde_norway, which
    /// refuses them with an error instead of this reader recursing without bound.
    depth: usize,
}

/// Deeper than any Kubernetes object; serde_norway's own limit is 128.
const MAX_DEPTH: usize = 64;

/// Where a node begins.
enum Start<'a> {
    /// On the current line, which is indented by this much.
    Block(usize),
    /// After `key:` of an entry whose key sits at column `indent`.
    Value { indent: usize, rest: &'a str },
}

/// A node whose form is known; a block mapping or sequence has not been read yet.
enum Resolved<'a> {
    Mapping(usize),
    Sequence(usize),
    Inline(Inline<'a>),
}

enum Inline<'a> {
    Scalar(Scalar<'a>),
    EmptyMapping,
    EmptySequence,
}

enum Scalar<'a> {
    Null,
    Bool(bool),
    Integer(i64),
    String(Cow<'a, str>),
}

impl<'a> Reader<'a> {
    fn current(&self) -> Option<Line<'a>> {
        self.lines.get(self.pos).copied()
    }

    fn skip_blank(&mut self) {
        while self.current().is_some_and(|l| l.is_blank()) {
            self.pos += 1;
        }
    }

    /// Reads as far as the form of the node: all of a scalar, nothing of a block.
    fn resolve(&mut self, start: Start<'a>) -> Result<Resolved<'a>> {
        match start {
            Start::Block(indent) => {
                let line = self.current().ok_or(Unsupported)?;
                if line.is_sequence_item() {
                    return Ok(Resolved::Sequence(indent));
                }
                if mapping_entry(line.text).ok_or(Unsupported)?.is_some() {
                    return Ok(Resolved::Mapping(indent));
                }
                // A scalar on a line of its own (a sequence item's): it must end there.
                self.pos += 1;
                let inline = inline_value(line.text).ok_or(Unsupported)?;
                self.skip_blank();
                match self.current() {
                    Some(next) if next.indent >= indent => Err(Unsupported),
                    _ => Ok(Resolved::Inline(inline)),
                }
            }
            Start::Value { indent, rest } => {
                if rest.is_empty() || rest.starts_with('#') {
                    self.skip_blank();
                    return match self.current() {
                        Some(next) if next.indent > indent => {
                            self.resolve(Start::Block(next.indent))
                        }
                        // kubectl writes a mapping's sequences at the key's own column.
                        Some(next) if next.indent == indent && next.is_sequence_item() => {
                            Ok(Resolved::Sequence(indent))
                        }
                        _ => Ok(Resolved::Inline(Inline::Scalar(Scalar::Null))),
                    };
                }
                let inline = match rest {
                    "|" => self.literal(indent, true)?,
                    "|-" => self.literal(indent, false)?,
                    _ => {
                        let inline = inline_value(rest).ok_or(Unsupported)?;
                        // More-indented lines after a scalar would continue it (a
                        // multi-line scalar).
                        self.skip_blank();
                        if self.current().is_some_and(|next| next.indent > indent) {
                            return Err(Unsupported);
                        }
                        inline
                    }
                };
                Ok(Resolved::Inline(inline))
            }
        }
    }

    /// A literal block scalar (`|` keeps one final newline, `|-` none) under a key at
    /// column `indent`.
    fn literal(&mut self, indent: usize, keep_newline: bool) -> Result<Inline<'a>> {
        let mut block_indent = None;
        let mut text = String::new();
        let mut pending_newlines = 0;
        while let Some(line) = self.current() {
            let blank = line.raw.trim_start_matches(' ').is_empty();
            if blank {
                // Spaces beyond the block's indentation on an empty line would be
                // content; leading empty lines change indentation detection.
                if block_indent.is_none_or(|b| line.raw.len() > b) {
                    return Err(Unsupported);
                }
                pending_newlines += 1;
                self.pos += 1;
                continue;
            }
            let b = *block_indent.get_or_insert(line.indent);
            if b <= indent {
                break; // the first line after `|` is not indented: an empty block
            }
            if line.indent < b {
                if line.indent > indent {
                    return Err(Unsupported); // between the key and the block: invalid
                }
                break;
            }
            if !text.is_empty() || pending_newlines > 0 {
                text.push('\n');
            }
            for _ in 0..pending_newlines {
                text.push('\n');
            }
            pending_newlines = 0;
            text.push_str(&line.raw[b..]);
            self.pos += 1;
        }
        if block_indent.is_none_or(|b| b <= indent) {
            // No content line: YAML reads an empty string.
            return Ok(Inline::Scalar(Scalar::String(Cow::Borrowed(""))));
        }
        if keep_newline {
            text.push('\n');
        }
        Ok(Inline::Scalar(Scalar::String(Cow::Owned(text))))
    }

    /// `(apiVersion, kind)` of the block mapping at column `indent` that starts on
    /// the current line, read ahead without moving.
    fn kind_of(&self, indent: usize) -> Result<(Cow<'a, str>, Cow<'a, str>)> {
        let mut api_version = Cow::Borrowed("");
        let mut kind = Cow::Borrowed("");
        for line in &self.lines[self.pos..] {
            if line.is_blank() {
                continue;
            }
            if line.indent < indent {
                break;
            }
            if line.indent > indent || line.is_sequence_item() {
                continue;
            }
            let Some(Some((key, rest))) = mapping_entry(line.text) else {
                return Err(Unsupported);
            };
            let slot = match key.as_ref() {
                "apiVersion" => &mut api_version,
                "kind" => &mut kind,
                _ => continue,
            };
            // `kind:` alone (null, or a block below): not a name, and `inline_value`
            // needs text to look at.
            if rest.is_empty() {
                return Err(Unsupported);
            }
            match inline_value(rest) {
                Some(Inline::Scalar(Scalar::String(value))) => *slot = value,
                _ => return Err(Unsupported),
            }
        }
        Ok((api_version, kind))
    }
}

/// A node being handed to serde.
struct Node<'r, 'a> {
    reader: &'r mut Reader<'a>,
    resolved: Resolved<'a>,
}

impl<'r, 'a> Node<'r, 'a> {
    /// Runs `read` one level deeper, or gives up past `MAX_DEPTH`.
    fn nested<T>(
        reader: &mut Reader<'a>,
        read: impl FnOnce(&mut Reader<'a>) -> Result<T>,
    ) -> Result<T> {
        if reader.depth == MAX_DEPTH {
            return Err(Unsupported);
        }
        reader.depth += 1;
        let value = read(reader);
        reader.depth -= 1;
        value
    }
}

impl<'de> de::Deserializer<'de> for Node<'_, 'de> {
    type Error = Unsupported;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.resolved {
            Resolved::Mapping(indent) => Node::nested(self.reader, |reader| {
                let first_key = reader.keys.len();
                let value = visitor.visit_map(MappingAccess {
                    reader: &mut *reader,
                    indent,
                    first_key,
                    rest: "",
                })?;
                reader.keys.truncate(first_key);
                Ok(value)
            }),
            Resolved::Sequence(indent) => Node::nested(self.reader, |reader| {
                visitor.visit_seq(SequenceAccess { reader, indent })
            }),
            Resolved::Inline(Inline::EmptyMapping) => visitor.visit_map(Empty),
            Resolved::Inline(Inline::EmptySequence) => visitor.visit_seq(Empty),
            Resolved::Inline(Inline::Scalar(scalar)) => match scalar {
                Scalar::Null => visitor.visit_unit(),
                Scalar::Bool(b) => visitor.visit_bool(b),
                Scalar::Integer(i) => visitor.visit_i64(i),
                Scalar::String(Cow::Borrowed(s)) => visitor.visit_borrowed_str(s),
                Scalar::String(Cow::Owned(s)) => visitor.visit_string(s),
            },
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        match self.resolved {
            Resolved::Inline(Inline::Scalar(Scalar::Null)) => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value> {
        match self.resolved {
            Resolved::Mapping(indent) if name == KIND_TAGGED => {
                let (api_version, kind) = self.reader.kind_of(indent)?;
                visitor.visit_enum(KindTagged {
                    tag: (api_version, kind),
                    node: self,
                })
            }
            // A unit variant, written as its name.
            Resolved::Inline(Inline::Scalar(Scalar::String(s))) if name != KIND_TAGGED => {
                visitor.visit_enum(s.into_deserializer())
            }
            _ => Err(Unsupported),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value> {
        // Read all the same: what is skipped must be inside the subset too.
        self.deserialize_any(visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct seq tuple tuple_struct map struct identifier
    }
}

struct MappingAccess<'r, 'a> {
    reader: &'r mut Reader<'a>,
    indent: usize,
    /// Where this mapping's keys start in `reader.keys`.
    first_key: usize,
    /// The line after the current entry's `key:`.
    rest: &'a str,
}

impl<'de> de::MapAccess<'de> for MappingAccess<'_, 'de> {
    type Error = Unsupported;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>> {
        let reader = &mut *self.reader;
        reader.skip_blank();
        let Some(line) = reader.current() else {
            return Ok(None);
        };
        if line.indent < self.indent {
            return Ok(None);
        }
        if line.indent > self.indent || line.is_sequence_item() {
            return Err(Unsupported);
        }
        let (key, rest) = mapping_entry(line.text).flatten().ok_or(Unsupported)?;
        if reader.keys[self.first_key..].contains(&key) {
            return Err(Unsupported);
        }
        reader.keys.push(key.clone());
        reader.pos += 1;
        self.rest = rest;
        seed.deserialize(key.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value> {
        let resolved = self.reader.resolve(Start::Value {
            indent: self.indent,
            rest: self.rest,
        })?;
        seed.deserialize(Node {
            reader: &mut *self.reader,
            resolved,
        })
    }
}

struct SequenceAccess<'r, 'a> {
    reader: &'r mut Reader<'a>,
    indent: usize,
}

impl<'de> de::SeqAccess<'de> for SequenceAccess<'_, 'de> {
    type Error = Unsupported;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>> {
        let reader = &mut *self.reader;
        let indent = self.indent;
        reader.skip_blank();
        let Some(line) = reader.current() else {
            return Ok(None);
        };
        if line.indent < indent || (line.indent == indent && !line.is_sequence_item()) {
            return Ok(None);
        }
        if line.indent > indent {
            return Err(Unsupported);
        }
        let rest = line.text[1..].trim_start_matches(' ');
        let resolved = if rest.is_empty() || rest.starts_with('#') {
            // `-` alone: the item is the block below it, or null.
            reader.pos += 1;
            reader.skip_blank();
            match reader.current() {
                Some(next) if next.indent > indent => reader.resolve(Start::Block(next.indent))?,
                _ => Resolved::Inline(Inline::Scalar(Scalar::Null)),
            }
        } else {
            // The item's content starts a node at its own column; lines below that
            // continue it are indented to the same column.
            let column = indent + (line.text.len() - rest.len());
            reader.lines[reader.pos] = Line {
                indent: column,
                text: rest,
                raw: line.raw,
            };
            reader.resolve(Start::Block(column))?
        };
        seed.deserialize(Node { reader, resolved }).map(Some)
    }
}

/// `{}` and `[]`.
struct Empty;

impl<'de> de::MapAccess<'de> for Empty {
    type Error = Unsupported;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, _: K) -> Result<Option<K::Value>> {
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, _: V) -> Result<V::Value> {
        Err(Unsupported)
    }
}

impl<'de> de::SeqAccess<'de> for Empty {
    type Error = Unsupported;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, _: T) -> Result<Option<T::Value>> {
        Ok(None)
    }
}

/// A mapping read as the variant `(apiVersion, kind)` of a [`KIND_TAGGED`] enum,
/// whose content is the mapping itself.
struct KindTagged<'r, 'a> {
    tag: (Cow<'a, str>, Cow<'a, str>),
    node: Node<'r, 'a>,
}

impl<'r, 'de> de::EnumAccess<'de> for KindTagged<'r, 'de> {
    type Error = Unsupported;
    type Variant = Node<'r, 'de>;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self::Variant)> {
        let (api_version, kind) = self.tag;
        let tag = de::value::SeqDeserializer::new([api_version, kind].into_iter());
        Ok((seed.deserialize(tag)?, self.node))
    }
}

impl<'de> de::VariantAccess<'de> for Node<'_, 'de> {
    type Error = Unsupported;

    fn unit_variant(self) -> Result<()> {
        Err(Unsupported)
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value> {
        Err(Unsupported)
    }

    fn struct_variant<V: Visitor<'de>>(self, _: &'static [&'static str], _: V) -> Result<V::Value> {
        Err(Unsupported)
    }
}

/// A value written on its entry's line: a scalar, `{}` or `[]`.
fn inline_value(text: &str) -> Option<Inline<'_>> {
    let scalar = match text.as_bytes()[0] {
        b'"' | b'\'' => {
            let (value, after) = quoted(text)?;
            if !comment_or_nothing(after) {
                return None;
            }
            Scalar::String(value)
        }
        b'{' | b'[' => {
            return match strip_comment(text) {
                "{}" => Some(Inline::EmptyMapping),
                "[]" => Some(Inline::EmptySequence),
                _ => None,
            }
        }
        _ => {
            let plain = match first_indicator(text) {
                None => text,
                Some((i, Indicator::Comment)) => text[..i].trim_end_matches(' '),
                // `: ` inside the scalar would make it a mapping.
                Some((_, Indicator::Colon)) => return None,
            };
            if !plain_scalar_ok(plain) || plain.ends_with(':') {
                return None;
            }
            match resolve_plain(plain)? {
                Plain::Null => Scalar::Null,
                Plain::Bool(b) => Scalar::Bool(b),
                Plain::Integer => Scalar::Integer(plain.parse().ok()?),
                Plain::String => Scalar::String(Cow::Borrowed(plain)),
            }
        }
    };
    Some(Inline::Scalar(scalar))
}

/// `key: rest` split at the key, `Some(None)` for a line that is not a mapping entry,
/// `None` for a key outside the subset.
fn mapping_entry(text: &str) -> Option<Option<(Cow<'_, str>, &str)>> {
    let (key, after) = match text.as_bytes()[0] {
        b'"' | b'\'' => {
            let (key, after) = quoted(text)?;
            match after.strip_prefix(':') {
                Some(after) if after.is_empty() || after.starts_with(' ') => (key, after),
                _ if comment_or_nothing(after) => return Some(None),
                _ => return None,
            }
        }
        _ => {
            let (key, after) = match first_indicator(text) {
                Some((i, Indicator::Colon)) => (&text[..i], &text[i + 1..]),
                // A scalar with a comment, unless the comment would hold a key's end.
                Some((_, Indicator::Comment)) => {
                    return if text.ends_with(':') || find_pair(text, b':', b' ').is_some() {
                        None
                    } else {
                        Some(None)
                    };
                }
                None => match text.strip_suffix(':') {
                    Some(key) => (key, ""),
                    None => return Some(None),
                },
            };
            let key = key.trim_end_matches(' ');
            if !plain_scalar_ok(key) || key == "<<" || !matches!(resolve_plain(key)?, Plain::String)
            {
                return None;
            }
            (Cow::Borrowed(key), after)
        }
    };
    let rest = after.trim_start_matches(' ');
    let rest = if rest.starts_with('#') { "" } else { rest };
    Some(Some((key, rest)))
}

/// Where the two bytes `a` `b` first follow each other; lines are short, so a plain
/// scan beats setting up a substring search.
fn find_pair(s: &str, a: u8, b: u8) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut from = 0;
    while let Some(i) = bytes[from..].iter().position(|&x| x == a) {
        let at = from + i;
        if bytes.get(at + 1) == Some(&b) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

enum Indicator {
    /// `: `, ending a key.
    Colon,
    /// ` #`, starting a comment.
    Comment,
}

/// The first `: ` or ` #` of a plain line: whichever comes first decides what the
/// line is, so the scan stops there (at the end of the key, for most lines).
fn first_indicator(s: &str) -> Option<(usize, Indicator)> {
    let b = s.as_bytes();
    for i in 1..b.len() {
        match (b[i - 1], b[i]) {
            (b':', b' ') => return Some((i - 1, Indicator::Colon)),
            (b' ', b'#') => return Some((i - 1, Indicator::Comment)),
            _ => {}
        }
    }
    None
}

/// Whether `s` can be a plain scalar here: not empty, and not starting with one of
/// YAML's indicators (a `-` only when followed by more than a space).
fn plain_scalar_ok(s: &str) -> bool {
    let Some(&first) = s.as_bytes().first() else {
        return false;
    };
    match first {
        b'-' => s.len() > 1 && s.as_bytes()[1] != b' ',
        b'?' | b':' | b',' | b'[' | b']' | b'{' | b'}' | b'#' | b'&' | b'*' | b'!' | b'|'
        | b'>' | b'\'' | b'"' | b'%' | b'@' | b'`' => false,
        _ => true,
    }
}

/// The plain scalar before a ` #` comment.
fn strip_comment(text: &str) -> &str {
    match find_pair(text, b' ', b'#') {
        Some(i) => text[..i].trim_end_matches(' '),
        None => text,
    }
}

/// What may follow a quoted scalar on its line.
fn comment_or_nothing(after: &str) -> bool {
    let rest = after.trim_start_matches(' ');
    rest.is_empty() || (rest.starts_with('#') && after.starts_with(' '))
}

enum Plain {
    Null,
    Bool(bool),
    /// Written as is: a decimal that JSON reads as the same integer.
    Integer,
    String,
}

/// How serde_norway (YAML 1.2 core schema) reads a plain scalar, for the cases this
/// reader handles; `None` for numbers it leaves to serde_norway (floats, other bases,
/// leading zeros, out of i64's range) and anything that might parse as one.
fn resolve_plain(s: &str) -> Option<Plain> {
    // Most keys and values start with a letter that begins no null, bool or number.
    let first = s.as_bytes()[0];
    if first.is_ascii_alphabetic()
        && !matches!(first, b'n' | b'N' | b't' | b'T' | b'f' | b'F' | b'i' | b'I')
    {
        return Some(Plain::String);
    }
    match s {
        "~" | "null" | "Null" | "NULL" => return Some(Plain::Null),
        "true" | "True" | "TRUE" => return Some(Plain::Bool(true)),
        "false" | "False" | "FALSE" => return Some(Plain::Bool(false)),
        _ => {}
    }
    if decimal_integer(s) {
        return Some(Plain::Integer);
    }
    let unsigned = s.trim_start_matches(['+', '-']).as_bytes();
    let starts_with = |p: &[u8]| {
        unsigned
            .get(..p.len())
            .is_some_and(|b| b.eq_ignore_ascii_case(p))
    };
    // `0x1F`, `0o17`, `0b101` are integers; `0b8e9c6e-...` (a uid) is a string.
    let radix_integer = [b"0x", b"0o", b"0b"].iter().any(|p| {
        starts_with(*p)
            && unsigned.len() > 2
            && unsigned[2..]
                .iter()
                .all(|b| b.is_ascii_hexdigit() || *b == b'_')
    });
    // Rust's float syntax: digits with at most one `.` and an exponent, or
    // inf/infinity/nan in any case. Addresses and versions fail the cheap test first.
    let float_like = match unsigned.first() {
        Some(b'0'..=b'9' | b'.') => {
            unsigned.iter().filter(|&&b| b == b'.').count() <= 1
                && unsigned
                    .iter()
                    .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
                && s.parse::<f64>().is_ok()
        }
        Some(b'i' | b'I' | b'n' | b'N') => ["inf", "infinity", "nan"]
            .iter()
            .any(|word| unsigned.eq_ignore_ascii_case(word.as_bytes())),
        _ => false,
    };
    if radix_integer || starts_with(b".inf") || starts_with(b".nan") || float_like {
        return None;
    }
    Some(Plain::String)
}

/// `0` or an optionally negative decimal without leading zeros that fits an i64
/// (`-0` excluded: JSON and YAML disagree on its type).
fn decimal_integer(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && s != "-0"
        && s.parse::<i64>().is_ok()
}

/// A single- or double-quoted scalar that closes on its line, and the text after it.
fn quoted(text: &str) -> Option<(Cow<'_, str>, &str)> {
    let quote = text.as_bytes()[0];
    let body = &text[1..];
    // Most quoted scalars (timestamps, versions) have nothing to unescape.
    if let Some(end) = body.find(quote as char) {
        let inner = &body[..end];
        let after = &body[end + 1..];
        let escaped = match quote {
            b'\'' => after.starts_with('\''),
            _ => inner.contains('\\'),
        };
        if !escaped {
            return Some((Cow::Borrowed(inner), after));
        }
    }
    if quote == b'\'' {
        let mut value = String::new();
        let mut rest = body;
        loop {
            let end = rest.find('\'')?;
            value.push_str(&rest[..end]);
            rest = &rest[end + 1..];
            match rest.strip_prefix('\'') {
                Some(after) => {
                    value.push('\'');
                    rest = after;
                }
                None => return Some((Cow::Owned(value), rest)),
            }
        }
    }
    let mut value = String::new();
    let mut chars = body.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((Cow::Owned(value), &body[i + 1..])),
            '\\' => {
                let (_, e) = chars.next()?;
                value.push(match e {
                    '"' => '"',
                    '\\' => '\\',
                    '/' => '/',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'n' => '\n',
                    'r' => '\r',
                    't' => '\t',
                    'u' => {
                        let mut code = 0;
                        for _ in 0..4 {
                            code = code * 16 + chars.next()?.1.to_digit(16)?;
                        }
                        // Surrogate halves are not characters: left to serde_norway.
                        char::from_u32(code)?
                    }
                    _ => return None,
                });
            }
            _ => value.push(c),
        }
    }
    None // closes on a later line: a multi-line scalar
}

#[cfg(test)]
mod tests {
    use super::from_str;
    use serde_json::Value;

    /// What the slow path reads: serde_norway straight into a JSON value.
    fn serde_norway(doc: &str) -> Option<Value> {
        serde_norway::from_str::<Value>(doc).ok()
    }

    /// Whenever the fast reader accepts a document, serde_norway must read the same
    /// value from it. Returns whether the fast reader accepted it.
    fn agrees(doc: &str) -> bool {
        let Some(fast) = from_str::<Value>(doc) else {
            return false;
        };
        assert_eq!(Some(fast), serde_norway(doc), "read differently: {doc:?}");
        true
    }

    const KUBECTL_SERVICE: &str = r#"apiVersion: v1
kind: Service
metadata:
  annotations:
    kubectl.kubernetes.io/last-applied-configuration: |
      {"apiVersion":"v1","kind":"Service","metadata":{"annotations":{},"name":"web","namespace":"demo"},"spec":{"ports":[{"port":80}]}}
  creationTimestamp: "2026-11-01T10:00:00Z"
  labels:
    app.kubernetes.io/name: web
  managedFields:
  - apiVersion: v1
    fieldsType: FieldsV1
    fieldsV1:
      f:spec:
        f:ports:
          .: {}
          k:{"port":80,"protocol":"TCP"}:
            .: {}
            f:port: {}
    manager: kubectl-client-side-apply
    operation: Update
    time: "2026-11-01T10:00:00Z"
  name: web
  namespace: demo
  resourceVersion: "1234"
  uid: 0b8e9c6e-9d5a-4c1e-8f3a-2f1d6e7c8b9a
spec:
  clusterIP: 10.96.0.10
  clusterIPs:
  - 10.96.0.10
  internalTrafficPolicy: Cluster
  ipFamilies:
  - IPv4
  ipFamilyPolicy: SingleStack
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
  - name: metrics # scraped
    port: 9090
    protocol: TCP
    targetPort: metrics
  selector:
    app: web
  sessionAffinity: None
  type: ClusterIP
status:
  loadBalancer: {}
"#;

    const KUBECTL_SLICE: &str = r#"addressType: IPv4
apiVersion: discovery.k8s.io/v1
endpoints:
- addresses:
  - 10.244.1.5
  conditions:
    ready: true
    serving: true
    terminating: false
  nodeName: node-a
  targetRef:
    kind: Pod
    name: web-0
    namespace: demo
    uid: 1c2d3e4f-0000-4000-8000-000000000001
- addresses:
  - 10.244.2.7
  conditions:
    ready: false
  nodeName: node-b
kind: EndpointSlice
metadata:
  labels:
    kubernetes.io/service-name: web
  name: web-abc12
  namespace: demo
ports:
- name: http
  port: 8080
  protocol: TCP
"#;

    #[test]
    fn kubectl_output_takes_the_fast_path_and_reads_the_same() {
        assert!(agrees(KUBECTL_SERVICE));
        assert!(agrees(KUBECTL_SLICE));
    }

    #[test]
    fn the_repository_manifests_take_the_fast_path_and_read_the_same() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut documents = 0;
        // The examples are what the agent reads; the deployment's flow sequences
        // (`verbs: ["get"]`) are outside the subset, but must not read differently.
        for (file, fast) in [
            ("examples/services.yaml", true),
            ("examples/endpointslices.yaml", true),
            ("deploy/daemonset.yaml", false),
            ("deploy/rbac.yaml", false),
        ] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            for doc in text.split("\n---\n") {
                let accepted = agrees(doc);
                assert!(
                    accepted || !fast,
                    "{file}: not read by the fast path:\n{doc}"
                );
                documents += accepted as usize;
            }
        }
        assert!(documents >= 2);
    }

    /// Scalars on YAML's edges, in every position the reader handles.
    #[test]
    fn scalars_read_as_serde_norway_reads_them_or_are_left_to_it() {
        let scalars = [
            "",
            "~",
            "null",
            "Null",
            "NULL",
            "nULL",
            "true",
            "True",
            "TRUE",
            "tRUE",
            "false",
            "yes",
            "no",
            "on",
            "off",
            "y",
            "n",
            "0",
            "-0",
            "+0",
            "00",
            "007",
            "8",
            "-8",
            "+8",
            "1_000",
            "0x1F",
            "0X1f",
            "0o17",
            "0b101",
            "-0x1",
            "1e3",
            "1E3",
            "1.5",
            ".5",
            "5.",
            "-.5",
            "1.5e-3",
            ".inf",
            "-.Inf",
            "+.INF",
            ".NaN",
            ".nan",
            "nan",
            "NaN",
            "inf",
            "-inf",
            "Infinity",
            "infinity",
            "10.96.0.1",
            "10.96.0",
            "1.2.3.4.5",
            "fd00::1",
            "2001:db8::1",
            "::1",
            "2026-11-01T10:00:00Z",
            "2026-11-01",
            "12345678901234567890",
            "9223372036854775807",
            "9223372036854775808",
            "-9223372036854775808",
            "-9223372036854775809",
            "a: b",
            "a:b",
            "a:",
            ":a",
            "a #b",
            "a# b",
            "a #",
            "'q'",
            "'it''s'",
            "''",
            "'unterminated",
            "\"d\"",
            "\"a\\nb\"",
            "\"\\x41\"",
            "\"\\u00e9\"",
            "\"\\ud800\"",
            "\"\\u+041\"",
            "\"\\/\"",
            "\"tab\\tq\\\"\"",
            "\"unterminated",
            "\"a\" # c",
            "\"a\"b",
            "'a' b",
            "-",
            "- a",
            "-a",
            "--a",
            "?",
            "? a",
            "?a",
            "[]",
            "{}",
            "[ ]",
            "{ }",
            "[a]",
            "{a: 1}",
            "[] # c",
            "&x a",
            "*x",
            "!!str 1",
            "!t a",
            "|",
            "|-",
            "|+",
            "|2",
            ">",
            ">-",
            "%a",
            "@a",
            "`a",
            "é",
            "日本",
            "a\tb",
            "a , b",
            "a,b",
            "a]",
            "a}",
            "<<",
            "=",
            ".",
            "..",
            "...",
            "---a",
            "k:{\"port\":80}",
            "#",
            "a b  c",
        ];
        let mut accepted = 0;
        for s in scalars {
            for doc in [
                format!("key: {s}\n"),
                format!("- {s}\n"),
                format!("{s}: v\n"),
                format!("a:\n- {s}\n- x\n"),
                format!("a:\n  b: {s}\n  c: d\n"),
                format!("- k: {s}\n  l: m\n"),
                format!("{s}\n"),
            ] {
                accepted += agrees(&doc) as usize;
            }
        }
        assert!(
            accepted > 300,
            "the fast path took only {accepted} documents"
        );
    }

    #[test]
    fn deep_nesting_is_left_to_serde_norway() {
        let deep: String = (0..200).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert!(from_str::<Value>(&deep).is_none());
        let shallow: String = (0..20).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert!(agrees(&shallow));
    }

    /// Layouts: indentation, sequences, literals, comments and what must be refused.
    #[test]
    fn structures_read_as_serde_norway_reads_them_or_are_left_to_it() {
        let docs = [
            "a: 1\nb:\n  c: 2\n  d:\n  - 3\n  - 4\ne: 5\n",
            "a:\n  - 1\n  - 2\nb: 3\n",
            "a:\n- 1\n-\n  x: 2\n- - 3\n  - 4\n- []\n",
            "- - a\n  - b\n- c\n",
            "-   a: 1\n    b: 2\n- c\n",
            "-\n- a\n",
            "- # comment\n  a: 1\n",
            "a:\n\n  # comment\n\n  b: 1\n# end\n",
            "a: 1\n  b: 2\n",
            "a: 1\n- b\n",
            "a:\n    b: 1\n  c: 2\n",
            "a: b\n  c\n",
            "a: 'multi\n  line'\n",
            "a: \"multi\n  line\"\n",
            "a: |\n  line one\n  line two\nb: 1\n",
            "a: |-\n  line one\n  line two\nb: 1\n",
            "a: |\n  one\n\n  two\n\n\nb: 1\n",
            "a: |\n  one\n    indented\n  two  \n",
            "a: |\n\n  leading blank\n",
            "a: |\nb: 1\n",
            "a: |\n",
            "a: |\n    deep\n  shallow\n",
            "a: |\n  x\n   \n  y\n",
            "a: |\n  # not a comment\n  ---x\n",
            "- a: |\n    in a sequence\n  b: 2\n",
            "a: >\n  folded\n",
            "a: |+\n  keep\n\n",
            "a: &anchor 1\nb: *anchor\n",
            "a: {b: 1}\n",
            "a: [1, 2]\n",
            "a: 1\na: 2\n",
            "'a': 1\n\"a\": 2\n",
            "\"quoted key\": 1\n'single': 2\n\"k\" : 3\n",
            "\"k\":1\n",
            "\"quoted key\": 1\n'single': \"two\"\n",
            "? a\n: b\n",
            "<<: {a: 1}\n",
            "a:\tb\n",
            "\ta: 1\n",
            "a: 1 \t\n",
            "a:\n\t- 1\n",
            "  a: 1\n",
            "# only a comment\n",
            "\n\n",
            "",
            "a: 1\n...\n",
            "a: 1\r\nb: 2\r\n",
            "a: \u{85}\n",
            "\u{feff}a: 1\n",
            "a: \u{7f}\n",
            "a: b # comment\nc: 'd' # comment\ne: \"f\"  # comment\n",
            "a: b#c\n",
            "a : 1\n",
            "a  :  1\n",
            "a b: c d\n",
            "key with spaces: 1\n",
            "a: b: c\n",
            "a: -\n",
            "a:\n  -\n",
            "x: [] # c\ny: {} # c\n",
            "scalar document\n",
            "- x\nnot-a-sequence-item\n",
            "a:\n  - 1\n   - 2\n",
            "a:\n  b: 1\n   c: 2\n",
        ];
        let mut accepted = 0;
        for doc in docs {
            accepted += agrees(doc) as usize;
        }
        assert!(
            accepted > 25,
            "the fast path took only {accepted} documents"
        );
    }
}
