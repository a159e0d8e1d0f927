//! Context equivalence: conversations whose earlier messages differ only by a paraphrase share
//! one context.
//!
//! A conversation's context is its system prompt and earlier exchanges, and matches exactly
//! ([`super::context`]). Two users rarely word them alike: "Always reply in Spanish." /
//! "Your responses must be written in Spanish.", "Explain what compound interest is." /
//! "What is compound interest?" before the same answer. Before the context is resolved, each
//! such message is replaced by the first message of its kind seen in this namespace and model
//! that it paraphrases: cosine at least `semantic.context_threshold` on what the embedder
//! reads of both, the false-hit gate passed (so "in Spanish" / "in English", "for children" /
//! "for physicians", "under 20 words" / "in detail" stay apart), and the whole of both read
//! by the embedder (a longer message is only ever itself). Messages without an equivalent
//! become the canonical form for later ones. The conversation's exact key is untouched; only
//! the context the semantic tier matches in (its partition and turn links) is the canonical
//! one, so a paraphrased history reaches the entries and turn links the first wording wrote.
//!
//! Assistant messages are compared the same way with the same threshold: an answer reworded
//! ("Kilimanjaro, in Tanzania, is Africa's tallest mountain" / "Africa's highest peak is
//! Kilimanjaro, a volcano in Tanzania") keeps the subject, while two different poems, lists
//! or drafts (the content a "translate that" acts on) are far apart and keep their contexts
//! apart. Each role has its own forms (a question never stands for an answer).
//!
//! The forms are kept per replica in memory, bounded by `semantic.context_forms_bytes` (a
//! byte-weighted LRU of groups, one per tenant scope, namespace, model and role, each of at
//! most [`GROUP_FORMS`] forms and a sixteenth of the budget, oldest forms out first). Replicas learn their forms apart: a conversation canonicalised
//! differently on two replicas is a miss on the other, never a wrong answer.

use std::sync::Arc;

use parking_lot::Mutex;
use reprise_backend::ChatMessage;
use reprise_cache::Digest;
use reprise_embedder::{cosine, Embedder};

use crate::key::KeyHasher;
use crate::state::AppState;

/// The most forms one group keeps (the oldest go first); a lookup scans them all.
pub const GROUP_FORMS: usize = 256;

/// The longest message, in bytes, that is compared by meaning; longer ones stand for
/// themselves only.
pub const MAX_FORM_BYTES: usize = 2048;

/// The most context messages of one request compared by meaning (the first ones; the rest
/// stand for themselves), so a long conversation costs a bounded number of embeddings.
pub const MAX_MESSAGES: usize = 64;

/// One canonical form: its text and embedding.
#[derive(Clone)]
struct Form {
    text: Arc<str>,
    vector: Arc<[f32]>,
}

/// The canonical forms of one group, newest last.
#[derive(Default)]
struct Group {
    forms: Vec<Form>,
}

impl Group {
    fn bytes(&self) -> u32 {
        let b: usize = self
            .forms
            .iter()
            .map(|f| f.text.len() + f.vector.len() * 4 + 64)
            .sum();
        // The group's own header, and moka's bookkeeping for it.
        (b + 128 + reprise_cache::ITEM_OVERHEAD as usize).min(u32::MAX as usize) as u32
    }
}

/// The canonical forms of context messages, per group (see the module).
pub struct Forms {
    groups: moka::sync::Cache<Digest, Arc<Mutex<Group>>>,
    /// The most bytes one group may weigh: a sixteenth of the budget, so that one busy
    /// group never pushes every other one out.
    group_bytes: u32,
}

impl Forms {
    /// Forms kept within `bytes` (0: nothing kept, no equivalence).
    pub fn new(bytes: u64) -> Self {
        Forms {
            groups: moka::sync::Cache::builder()
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .max_capacity(bytes)
                .weigher(|_, g: &Arc<Mutex<Group>>| g.lock().bytes())
                .build(),
            group_bytes: (bytes / 16).min(u32::MAX as u64) as u32,
        }
    }

    /// Bytes held, as weighed (after pending maintenance).
    pub fn weighted_size(&self) -> u64 {
        self.groups.run_pending_tasks();
        self.groups.weighted_size()
    }
}

/// The group of messages of `role` in one namespace and model, for one tenant scope.
fn group_key(scope: &str, namespace: &str, model: &str, role: &str) -> Digest {
    let mut h = KeyHasher::new("context-forms");
    h.str(scope).str(namespace).str(model).str(role);
    h.finish()
}

/// `msgs` with every context message (system prompt, earlier user and assistant messages;
/// not the last message nor those pending before it) replaced by its canonical form. `None`
/// when nothing was replaced. The context is `msgs[..context_len]` (the messages before those
/// pending and the query).
pub async fn canonical(
    state: &AppState,
    embedder: &Arc<dyn Embedder>,
    scope: &str,
    namespace: &str,
    model: &str,
    msgs: &[ChatMessage],
    context_len: usize,
) -> Option<Vec<ChatMessage>> {
    let threshold = state.config.semantic.context_threshold;
    // Which messages are compared by meaning: short enough, and read whole by the embedder.
    let candidates: Vec<usize> = (0..context_len)
        .filter(|&i| {
            let m = &msgs[i];
            m.is_plain()
                && !m.content.trim().is_empty()
                && m.content.len() <= MAX_FORM_BYTES
                && matches!(
                    m.role.as_str(),
                    "system" | "developer" | "user" | "assistant"
                )
        })
        .take(MAX_MESSAGES)
        .collect();
    if candidates.is_empty() {
        return None;
    }
    let texts: Vec<String> = candidates
        .iter()
        .map(|&i| msgs[i].content.clone())
        .collect();
    // Only those the embedder reads whole are embedded (finding that tokenizes: CPU pool).
    let (candidates, texts): (Vec<usize>, Vec<String>) = {
        let e = embedder.clone();
        state
            .cpu
            .run(move || {
                candidates
                    .into_iter()
                    .zip(texts)
                    .filter(|(_, x)| e.reading(x).is_whole(x.len()))
                    .unzip()
            })
            .await
    };
    if candidates.is_empty() {
        return None;
    }
    let vectors = embedder.embed_many_in(scope, &texts).await.ok()?;
    // Each message's group, and its forms copied out of the lock (handles only); the scan
    // for the best form above the threshold (up to 256 forms a message, 64 messages) runs on
    // the CPU pool, holding no lock.
    let (groups, forms): (Vec<_>, Vec<Vec<Form>>) = candidates
        .iter()
        .map(|&i| {
            let key = group_key(scope, namespace, model, &msgs[i].role);
            let group = state.context_forms.groups.get_with(key, Default::default);
            let forms = group.lock().forms.clone();
            ((key, group), forms)
        })
        .unzip();
    let (bests, vectors) = {
        state
            .cpu
            .run(move || {
                let bests: Vec<Option<Arc<str>>> = forms
                    .iter()
                    .zip(&vectors)
                    .map(|(forms, v)| {
                        forms
                            .iter()
                            .map(|f| (cosine(&f.vector, v), f))
                            .filter(|(c, _)| *c >= threshold)
                            .max_by(|a, b| a.0.total_cmp(&b.0))
                            .map(|(_, f)| f.text.clone())
                    })
                    .collect();
                (bests, vectors)
            })
            .await
    };
    let mut out: Option<Vec<ChatMessage>> = None;
    let each = candidates.iter().zip(vectors).zip(groups).zip(bests);
    for (((&i, v), (key, group)), best) in each {
        let m = &msgs[i];
        let form = match best {
            Some(t) if *t == *m.content => Some(t),
            Some(t) => {
                let (q, c) = (m.content.clone(), t.clone());
                let pass = state
                    .cpu
                    .run(move || reprise_policies::gate(&q, &c).is_pass())
                    .await;
                pass.then_some(t)
            }
            None => None,
        };
        match form {
            Some(t) if *t != *m.content => {
                let o = out.get_or_insert_with(|| msgs.to_vec());
                o[i].content = t.to_string();
            }
            Some(_) => {}
            None => {
                // A new form: later paraphrases of it will stand for it.
                let mut g = group.lock();
                g.forms.push(Form {
                    text: Arc::from(m.content.as_str()),
                    vector: v,
                });
                let cap = state.context_forms.group_bytes;
                while g.forms.len() > GROUP_FORMS || (g.forms.len() > 1 && g.bytes() > cap) {
                    g.forms.remove(0);
                }
                drop(g);
                // Re-weighed with its new form.
                state.context_forms.groups.insert(key, group);
            }
        }
    }
    out
}
