//! Memory snapshots: a server without Redis keeps its cache across a restart by writing
//! its entries and keys to `[cache] snapshot_path` on shutdown and loading them at start
//! (the semantic index is rebuilt from the entries' stored embeddings, in one bulk pass).
//!
//! Format: JSON lines. The first line is `{"reprise_snapshot":1}`; then one `{"entry":{...}}`
//! per entry and one `{"key":"<hex>","id":"<entry id>"}` per exact key or alias. The file is
//! written to a temporary name and renamed, so a crash never leaves half a snapshot; a line
//! that does not parse (or a snapshot of another version) is skipped, never fatal.

use std::io::{BufRead, BufWriter, Write};
use std::path::Path;

use reprise_cache::{Digest, Entry, EntryId};
use serde::{Deserialize, Serialize};

use crate::state::AppState;

const VERSION: u32 = 1;

/// One line of a snapshot. Parsed by trying each shape in turn rather than as an untagged
/// enum: serde's untagged buffering cannot carry the 128-bit entry ids.
#[derive(Serialize, Deserialize)]
struct HeaderLine {
    reprise_snapshot: u32,
}

#[derive(Serialize, Deserialize)]
struct EntryLine {
    entry: Entry,
}

#[derive(Serialize, Deserialize)]
struct KeyLine {
    key: String,
    id: String,
}

enum Line {
    Entry(Box<Entry>),
    Key(KeyLine),
}

fn parse_line(line: &str) -> Option<Line> {
    if let Ok(e) = serde_json::from_str::<EntryLine>(line) {
        return Some(Line::Entry(Box::new(e.entry)));
    }
    serde_json::from_str::<KeyLine>(line).ok().map(Line::Key)
}

fn hex(d: &Digest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Digest> {
    if s.len() != 64 {
        return None;
    }
    let mut d = [0u8; 32];
    for (i, byte) in d.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(d)
}

/// What a save or load handled.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Entries written or loaded.
    pub entries: usize,
    /// Keys written or loaded.
    pub keys: usize,
    /// Lines skipped on load (corrupt, expired, unknown version).
    pub skipped: usize,
}

/// Writes the memory tier to `path` (atomically: a temporary file renamed into place).
pub fn save(state: &AppState, path: &Path) -> std::io::Result<Counts> {
    let tmp = path.with_extension("tmp");
    let mut counts = Counts::default();
    {
        let mut w = BufWriter::new(std::fs::File::create(&tmp)?);
        serde_json::to_writer(
            &mut w,
            &HeaderLine {
                reprise_snapshot: VERSION,
            },
        )?;
        w.write_all(b"\n")?;
        for e in state.store.entries() {
            if e.is_expired() {
                continue;
            }
            serde_json::to_writer(
                &mut w,
                &EntryLine {
                    entry: (*e).clone(),
                },
            )?;
            w.write_all(b"\n")?;
            counts.entries += 1;
        }
        for (key, id) in state.store.keys() {
            serde_json::to_writer(
                &mut w,
                &KeyLine {
                    key: hex(&key),
                    id: id.to_string(),
                },
            )?;
            w.write_all(b"\n")?;
            counts.keys += 1;
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(counts)
}

/// Loads a snapshot into memory and the index; a missing file loads nothing.
pub async fn load(state: &AppState, path: &Path) -> std::io::Result<Counts> {
    let mut counts = Counts::default();
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(counts),
        Err(e) => return Err(e),
    };
    let mut lines = std::io::BufReader::new(file).lines();
    match lines
        .next()
        .transpose()?
        .and_then(|l| serde_json::from_str::<HeaderLine>(&l).ok())
    {
        Some(h) if h.reprise_snapshot == VERSION => {}
        _ => {
            tracing::warn!(path = %path.display(), "not a snapshot of this version; ignored");
            return Ok(counts);
        }
    }
    let mut entries = Vec::new();
    let mut keys = Vec::new();
    for line in lines {
        match parse_line(&line?) {
            Some(Line::Entry(entry)) if !entry.is_expired() => entries.push(*entry),
            Some(Line::Key(KeyLine { key, id })) => match (unhex(&key), id.parse::<EntryId>()) {
                (Some(k), Ok(id)) => keys.push((k, id)),
                _ => counts.skipped += 1,
            },
            _ => counts.skipped += 1,
        }
    }
    let loaded = state
        .store
        .load(entries, keys, |n| {
            tracing::info!(entries = n, "loading snapshot")
        })
        .await;
    counts.entries = loaded.entries;
    counts.keys = loaded.keys;
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_line_round_trip() {
        let e = Entry {
            id: EntryId(5),
            namespace: "n".into(),
            model: "m".into(),
            text: "t".into(),
            finish_reason: "stop".into(),
            prompt_tokens: 1,
            completion_tokens: 1,
            prompt: "p".into(),
            partition: [1; 32],
            embedding: Some(vec![0.5f32, 0.5].into()),
            origin: Default::default(),
            tags: vec![],
            refusals: Vec::new(),
            created_ms: 1,
            expires_ms: u64::MAX,
            gen_ms: 0,
        };
        let s = serde_json::to_string(&EntryLine { entry: e }).unwrap();
        assert!(matches!(parse_line(&s), Some(Line::Entry(_))), "{s}");
        assert!(matches!(
            parse_line(r#"{"key":"00","id":"1"}"#),
            Some(Line::Key(_))
        ));
        assert!(parse_line("garbage").is_none());
    }

    #[test]
    fn hex_round_trip() {
        let d = [0xab; 32];
        assert_eq!(unhex(&hex(&d)), Some(d));
        assert_eq!(unhex("zz"), None);
    }
}
