//! Memory snapshots: a server without Redis keeps its cache across a restart by writing
//! its entries and keys to `[cache] snapshot_path` on shutdown and loading them at start
//! (the semantic index is rebuilt from the entries' stored embeddings, in one bulk pass).
//!
//! Format: JSON lines. The first line is `{"reprise_snapshot":1}`; then the verdicts learned
//! thresholds stand on, `{"evidence":{...}}` ([`crate::bounds::Bounds::saved`]; an older
//! release skips the line); then one `{"entry":{...}}` per entry and one
//! `{"key":"<hex>","id":"<entry id>"}` per exact key or alias. The file is
//! written to a temporary name, synced and renamed (the directory synced after), so a crash
//! never leaves half a snapshot; a line that does not parse (or a snapshot of another version)
//! is skipped, never fatal, and a load reads within the memory budget (see [`load`]).

use std::io::{BufWriter, Write};

use crate::lines::next_line;
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

#[derive(Serialize, Deserialize)]
struct EvidenceLine {
    evidence: serde_json::Value,
}

enum Line {
    Entry(Box<Entry>),
    Key(KeyLine),
    Evidence(serde_json::Value),
}

fn parse_line(line: &[u8]) -> Option<Line> {
    if let Ok(e) = serde_json::from_slice::<EntryLine>(line) {
        return Some(Line::Entry(Box::new(e.entry)));
    }
    if line.starts_with(b"{\"evidence\":") {
        return serde_json::from_slice::<EvidenceLine>(line)
            .ok()
            .map(|e| Line::Evidence(e.evidence));
    }
    serde_json::from_slice::<KeyLine>(line).ok().map(Line::Key)
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

/// A new file at `path` (truncated if there), readable by this user only: a snapshot holds
/// every tenant's prompts and answers, and each save renames a new file into place, so a
/// mode the operator set on the old one would not last.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let file = options.open(path)?;
    // A temporary file left by a crash keeps the mode it was created with: set it again.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(file)
}

/// Writes the memory tier to `path` (atomically: a temporary file renamed into place).
pub fn save(state: &AppState, path: &Path) -> std::io::Result<Counts> {
    let tmp = path.with_extension("tmp");
    let mut counts = Counts::default();
    {
        let mut w = BufWriter::new(private_file(&tmp)?);
        serde_json::to_writer(
            &mut w,
            &HeaderLine {
                reprise_snapshot: VERSION,
            },
        )?;
        w.write_all(b"\n")?;
        serde_json::to_writer(
            &mut w,
            &EvidenceLine {
                evidence: state.bounds.saved(),
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
    // The rename itself is made durable: without it a power loss can bring back the older
    // snapshot (and with it entries deleted since).
    #[cfg(unix)]
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(counts)
}

/// Longest line a load reads: an entry line longer than this (or than a quarter of the
/// memory tier's budget) is skipped without being held, as is anything of a corrupt file
/// without line ends.
const MAX_LINE_BYTES: u64 = 64 << 20;

/// Entries handed from the file's reader to the store at a time: at most this many, and a
/// page is handed on once its lines reach [`PAGE_BYTES`].
const PAGE: usize = 256;
/// See [`PAGE`].
const PAGE_BYTES: usize = 1 << 20;

/// What the file's reader found besides the entries it handed on.
#[derive(Default)]
struct Read {
    /// Whether the first line is this version's header (nothing else is read otherwise).
    header: bool,
    keys: Vec<(Digest, EntryId)>,
    /// The verdicts learned thresholds stand on, when the snapshot kept them.
    evidence: Option<serde_json::Value>,
    skipped: usize,
    /// The error that stopped the reading midway (what came before it is loaded).
    error: Option<std::io::Error>,
}

/// Loads a snapshot into memory and the index; a missing file loads nothing. Streams: the
/// file is read off the async workers a page of entries at a time (at most 256 entries or
/// a megabyte of lines, or one line of at most a quarter of the budget; a longer line is
/// skipped unread), and once the entries loaded weigh the memory tier's budget the rest is
/// left unread: a snapshot of a bigger budget, or a corrupt one, never holds more than
/// about twice the budget in memory (the entries loaded and four pages in flight).
/// Keys are loaded for the entries held.
pub async fn load(state: &AppState, path: &Path) -> std::io::Result<Counts> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Counts::default()),
        Err(e) => return Err(e),
    };
    let budget = state.config.cache.memory_bytes;
    // Four pages may be held at once (one read, two waiting, one loading), each of at most
    // a megabyte or one line: lines within a quarter of the budget keep that within it.
    let cap = (budget / 4).clamp(1 << 16, MAX_LINE_BYTES);
    // The key tier holds an eighth of the budget; a key read is 48 bytes here.
    let max_keys = usize::try_from(budget / 8 / 48).unwrap_or(usize::MAX);
    let (pages, taken) = tokio::sync::mpsc::channel(2);
    let reader = tokio::task::spawn_blocking(move || read(file, cap, max_keys, pages));
    let loaded = state
        .store
        .load_pages(taken, |n| tracing::info!(entries = n, "loading snapshot"))
        .await;
    let read = reader.await.map_err(std::io::Error::other)??;
    if let Some(e) = &read.error {
        tracing::warn!(
            error = %e,
            path = %path.display(),
            entries = loaded.entries,
            "the snapshot could not be read to its end: what came before is loaded"
        );
    }
    if !read.header {
        tracing::warn!(path = %path.display(), "not a snapshot of this version; ignored");
        return Ok(Counts::default());
    }
    // With Redis, the other replicas' evidence (this one's before the restart among them)
    // is read from there; taken from the snapshot too, it would count twice.
    if let Some(evidence) = read.evidence.filter(|_| state.store.redis().is_none()) {
        let scopes = state.bounds.restore(state, evidence);
        if scopes > 0 {
            tracing::info!(
                scopes,
                "learned thresholds' verdicts loaded from the snapshot"
            );
        }
    }
    if loaded.stopped_at_budget {
        tracing::warn!(
            path = %path.display(),
            entries = loaded.entries,
            "the snapshot holds more than cache.memory_bytes: the rest was not loaded"
        );
    }
    Ok(Counts {
        entries: loaded.entries,
        keys: state.store.load_keys(read.keys).await,
        skipped: read.skipped,
    })
}

/// Reads a snapshot's lines (each within `cap` bytes), handing its entries on in pages until
/// the receiver is gone (the budget is full), and keeps up to `max_keys` keys.
fn read(
    file: impl std::io::Read,
    cap: u64,
    max_keys: usize,
    pages: tokio::sync::mpsc::Sender<Vec<Entry>>,
) -> std::io::Result<Read> {
    let mut r = std::io::BufReader::new(file);
    let mut out = Read::default();
    let mut buf = Vec::new();
    match next_line(&mut r, &mut buf, 1024)? {
        Some(true) => {}
        _ => return Ok(out),
    }
    match serde_json::from_slice::<HeaderLine>(&buf) {
        Ok(h) if h.reprise_snapshot == VERSION => out.header = true,
        _ => return Ok(out),
    }
    let mut page = Vec::with_capacity(PAGE);
    let mut page_bytes = 0;
    let mut taking = true;
    loop {
        let whole = match next_line(&mut r, &mut buf, cap) {
            Ok(Some(whole)) => whole,
            Ok(None) => break,
            // What was read before is handed on and its keys loaded: entries already in
            // memory would otherwise be held without their keys.
            Err(e) => {
                out.error = Some(e);
                break;
            }
        };
        if !whole {
            out.skipped += 1;
            continue;
        }
        if buf.starts_with(b"{\"entry\":") && !taking {
            // Past the budget: not parsed.
            continue;
        }
        match parse_line(&buf) {
            Some(Line::Entry(entry)) if !entry.is_expired() => {
                page.push(*entry);
                page_bytes += buf.len();
                if page.len() == PAGE || page_bytes >= PAGE_BYTES {
                    page_bytes = 0;
                    taking = pages.blocking_send(std::mem::take(&mut page)).is_ok();
                }
            }
            Some(Line::Evidence(e)) if out.evidence.is_none() => out.evidence = Some(e),
            Some(Line::Key(KeyLine { key, id })) if out.keys.len() < max_keys => {
                match (unhex(&key), id.parse::<EntryId>()) {
                    (Some(k), Ok(id)) => out.keys.push((k, id)),
                    _ => out.skipped += 1,
                }
            }
            _ => out.skipped += 1,
        }
    }
    if taking && !page.is_empty() {
        let _ = pages.blocking_send(page);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry `id` answering `text`, never expiring.
    fn entry(id: u128, text: &str) -> Entry {
        Entry {
            id: EntryId(id),
            namespace: "n".into(),
            model: "m".into(),
            text: text.into(),
            finish_reason: "stop".into(),
            prompt_tokens: 1,
            completion_tokens: 1,
            prompt: "p".into(),
            partition: [1; 32],
            embedding: None,
            embedder: None,
            origin: Default::default(),
            tags: vec![],
            refusals: Vec::new(),
            created_ms: 1,
            expires_ms: u64::MAX,
            gen_ms: 0,
        }
    }

    #[test]
    fn entry_line_round_trip() {
        let mut e = entry(5, "t");
        e.embedding = Some(vec![0.5f32, 0.5].into());
        let s = serde_json::to_string(&EntryLine { entry: e }).unwrap();
        assert!(
            matches!(parse_line(s.as_bytes()), Some(Line::Entry(_))),
            "{s}"
        );
        assert!(matches!(
            parse_line(br#"{"key":"00","id":"1"}"#),
            Some(Line::Key(_))
        ));
        assert!(parse_line(b"garbage").is_none());
    }

    /// A read error midway (a bad disk block) hands on what came before and says so: the
    /// lines read are not lost, and the error is not a load of nothing.
    #[test]
    fn a_read_error_midway_keeps_what_came_before() {
        struct Failing(std::io::Cursor<Vec<u8>>);
        impl std::io::Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                match self.0.read(buf)? {
                    0 => Err(std::io::Error::other("bad block")),
                    n => Ok(n),
                }
            }
        }
        let mut text = format!("{{\"reprise_snapshot\":{VERSION}}}\n");
        text.push_str(&format!(
            "{{\"key\":\"{}\",\"id\":\"{}\"}}\n",
            hex(&[7; 32]),
            EntryId(9)
        ));
        let (tx, _rx) = tokio::sync::mpsc::channel(2);
        let read = read(
            Failing(std::io::Cursor::new(text.into_bytes())),
            1 << 20,
            10,
            tx,
        )
        .unwrap();
        assert!(read.header);
        assert_eq!(read.keys, vec![([7; 32], EntryId(9))]);
        assert!(read.error.is_some());
    }

    /// Pages are handed on by bytes as well as by count: large answers come a megabyte of
    /// lines at a time, not 256 at once.
    #[test]
    fn large_entries_come_a_megabyte_at_a_time() {
        let mut text = format!("{{\"reprise_snapshot\":{VERSION}}}\n");
        for i in 0..10 {
            let e = entry(i, &"a".repeat(300 << 10));
            text.push_str(&serde_json::to_string(&EntryLine { entry: e }).unwrap());
            text.push('\n');
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let reader = std::thread::spawn(move || {
            read(std::io::Cursor::new(text.into_bytes()), 1 << 20, 10, tx).unwrap()
        });
        let mut pages = Vec::new();
        while let Some(page) = rx.blocking_recv() {
            pages.push(page.len());
        }
        let read = reader.join().unwrap();
        assert!(read.header);
        assert_eq!(pages.iter().sum::<usize>(), 10, "{pages:?}");
        // 300 KiB a line: the fourth passes a megabyte.
        assert!(pages.iter().all(|n| *n <= 4), "{pages:?}");
    }

    #[test]
    fn hex_round_trip() {
        let d = [0xab; 32];
        assert_eq!(unhex(&hex(&d)), Some(d));
        assert_eq!(unhex("zz"), None);
    }
}
