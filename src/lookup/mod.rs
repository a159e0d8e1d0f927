//! Finding a servable entry for a request: steps 4 (exact) and 5 (semantic) of the request
//! path, shared with background generation (prefetch and refresh-ahead look up the request
//! they would generate the same way, so they never generate what the cache can answer).
//!
//! - [`exact`]: by the exact key, memory then Redis;
//! - [`context`]: a conversation's context, resolved turn by turn;
//! - [`equivalence`]: paraphrased context messages replaced by their canonical forms;
//! - [`semantic`]: by meaning within the partition, through the false-hit gate;
//! - [`plan`]: what a write-back of the answer would store (keys, partition, embedding).

pub mod context;
pub mod equivalence;
pub mod exact;
pub mod plan;
pub mod semantic;

use std::sync::Arc;
use std::time::Instant;

use reprise_backend::{ChatMessage, GenRequest, Input, Priority};
use reprise_cache::{now_ms, ByKey, Entry, EntryId, Origin};
use reprise_policies::cache::{Freshness, StaleWindows};
use reprise_policies::semantic::SemanticPolicy;

use crate::candidate::{Arm, Candidate, ShadowResult};
use crate::key;
use crate::metrics::{Outcome, Tier};
use crate::openai::Endpoint;
use crate::state::AppState;
pub use plan::{ObserveLater, WritePlan};

/// A servable entry found for a request.
pub struct Hit {
    /// The entry.
    pub entry: Arc<Entry>,
    /// Exact, semantic or prefetch.
    pub outcome: Outcome,
    /// Cosine similarity for semantic hits.
    pub similarity: Option<f32>,
}

/// A cached paraphrase of a missed request at a looser threshold, `floor` (a degraded
/// answer, `[degrade]`): the semantic search again with the same policy and gate, only the
/// threshold lowered. Only when the best candidate was below the threshold (a near miss) at
/// or above `floor`.
pub(crate) async fn loosely(
    state: &AppState,
    found: &Lookup,
    namespace: &str,
    floor: f32,
    wants: Wants,
) -> Option<Hit> {
    let (_, nearest) = found.notes.near_miss?;
    // Under an error bound the learned thresholds are the bound's own: degrading never goes
    // below them (a tenant whose threshold rose past 1 is served nothing by meaning), so
    // the search would find nothing the lookup did not.
    if found.bounded {
        return None;
    }
    let policy = found.policy.filter(|p| p.enabled && nearest >= floor)?;
    let embedder = state.embedder.as_ref()?;
    let (partition, embedding) = (found.plan.partition?, found.plan.embedding.clone()?);
    let q = semantic::Question {
        text: found.plan.read(),
        embedding: &embedding,
        partition: &partition,
        key: &found.plan.exact,
        scope: crate::auth::scope_of(namespace),
    };
    let loose = SemanticPolicy {
        threshold: floor,
        ..policy
    };
    let mut notes = Notes::default();
    // Without a bound there are no thresholds per entry.
    let (entry, similarity) =
        semantic::find(state, embedder, &loose, None, q, wants, &mut notes).await?;
    Some(Hit {
        entry,
        outcome: Outcome::Semantic,
        similarity: Some(similarity),
    })
}

/// What the lookup saw, for the request log.
#[derive(Debug, Default, Clone)]
pub struct Notes {
    /// Milliseconds spent on the exact lookup (memory, then Redis).
    pub exact_ms: Option<f64>,
    /// Where the exact key was found: `memory` or `redis`.
    pub tier: Option<&'static str>,
    /// Milliseconds spent embedding the query.
    pub embed_ms: Option<f64>,
    /// Milliseconds spent searching and vetting candidates.
    pub search_ms: Option<f64>,
    /// Similarity of the served candidate, else of the best one.
    pub similarity: Option<f32>,
    /// The gate's verdict on the first vetted candidate (`pass` for the served one).
    pub gate: Option<&'static str>,
    /// The threshold the semantic tier served at (the policy's, or learned under a bound).
    pub threshold: Option<f32>,
    /// Nothing was served and the best candidate was under the threshold: it, and its
    /// similarity (a near miss, which a learned threshold may check).
    pub near_miss: Option<(EntryId, f32)>,
    /// The last question of a conversation was read as standing on its own and matched as if
    /// asked with the system prompt alone.
    pub standalone: bool,
}

/// What the cache knows about one request.
pub struct Lookup {
    /// What a write-back of this request's answer would store (keys, partition, embedding).
    pub plan: WritePlan,
    /// A servable entry, when one was found.
    pub hit: Option<Hit>,
    /// The entry that answered the previous turn of this conversation, when reprise served it.
    pub prev_entry: Option<EntryId>,
    /// The semantic policy applied, when the request could be matched semantically.
    pub policy: Option<SemanticPolicy>,
    /// The scope of that policy's learned threshold (see [`crate::bounds::scope`]; empty
    /// when no semantic policy applied).
    pub scope: String,
    /// The policy's threshold was learned under the tenant's error bound (`delta`): nothing
    /// is served by meaning below it, not even when the SLO is at risk ([`loosely`]).
    pub bounded: bool,
    /// Under that bound, on the running policy: entries with verdicts of their own are
    /// judged at their own thresholds.
    pub per_entry: Option<semantic::PerEntry>,
    /// The exact key leads to an entry, only one too old for this request: a paraphrase's
    /// answer served instead must not take the key from it.
    pub exact_taken: bool,
    /// The exact key leads only to an expired entry, still kept, that the request's stale
    /// windows ([`Wants::stale`]) and `max-age` admit: it may be served stale (never as a
    /// hit). Found by the exact key only: the semantic tier serves fresh entries alone.
    pub stale: Option<Arc<Entry>>,
    /// The embedder's queue was full (the seconds it asks callers to wait): the semantic
    /// lookup did not run.
    pub embed_overloaded: Option<u64>,
    /// Looked up under the tenant's candidate policy (a canary's side): a hit by meaning is
    /// served but never linked to this phrasing's keys, so requests under the running policy
    /// (and all of them after a rollback) do not inherit what only the candidate matched.
    pub on_candidate: bool,
    /// The exact hit (or the stale answer) came through a key that leads to another
    /// wording's answer (an alias a hit by meaning or a prefetch linked): a verdict on it
    /// refuses as one on a hit by meaning does.
    pub aliased: bool,
    /// What the lookup saw.
    pub notes: Notes,
}

impl Lookup {
    /// Nothing found, and a write plan for the exact key only (no turn link, no partition):
    /// what a request whose lookup ran out of time goes on with.
    pub fn unmatched(namespace: &str, endpoint: Endpoint, req: &GenRequest) -> Lookup {
        let exact = key::exact_key(namespace, endpoint, req);
        Lookup {
            plan: WritePlan::new(exact, namespace, req),
            hit: None,
            prev_entry: None,
            policy: None,
            scope: String::new(),
            bounded: false,
            per_entry: None,
            exact_taken: false,
            stale: None,
            embed_overloaded: None,
            on_candidate: false,
            aliased: false,
            notes: Notes::default(),
        }
    }
}

/// What a request accepts from the cache besides the configured policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wants {
    /// Similarity threshold requested by the client (only ever raises the configured one).
    pub threshold: Option<f32>,
    /// How old an answer the client takes (`Cache-Control: max-age`).
    pub freshness: Freshness,
    /// Which of the tenant's policies it is looked up under (its candidate's, or its own
    /// with the candidate's beside it in shadow mode).
    pub arm: Arm,
    /// How long past their expiry it takes answers (the policy's stale windows narrowed by
    /// its `Cache-Control`); none by default.
    pub stale: StaleWindows,
}

impl Wants {
    /// Whether `entry` is young enough.
    pub fn fresh(&self, entry: &Entry) -> bool {
        self.freshness.admits(entry.created_ms, now_ms())
    }

    /// Whether the expired `entry` may be served stale (either window), within `max-age`.
    pub fn takes_stale(&self, entry: &Entry) -> bool {
        self.fresh(entry) && self.stale.any(entry.expires_ms, now_ms())
    }
}

/// What a lookup is asked: the request and what it may do.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The (scoped) namespace.
    pub namespace: &'a str,
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The request, as served.
    pub req: &'a GenRequest,
    /// Read the cache (otherwise only the write plan is filled).
    pub read: bool,
    /// Fill the parts of the write plan a write needs.
    pub write: bool,
    /// What the request accepts besides the configured policy.
    pub wants: Wants,
    /// Client traffic, recorded in the lookup metrics.
    pub counted: bool,
}

/// Steps 4 and 5: exact lookup, then semantic lookup. Always fills the write plan (only the
/// parts `ask.write` needs) and reads only when `ask.read`.
pub async fn lookup(state: &Arc<AppState>, ask: Ask<'_>) -> Lookup {
    let Ask {
        namespace,
        endpoint,
        req,
        read,
        wants,
        counted,
        ..
    } = ask;
    let mut found = Lookup::unmatched(namespace, endpoint, req);
    found.on_candidate = wants.arm == Arm::Candidate;
    let exact = found.plan.exact;
    // 4. Exact first: a hit needs no conversation analysis (the hot path), unless the
    // prefetcher wants to know which earlier answer this turn followed.
    let exact_hit = if read {
        // Too old for this client is a miss; a generated answer then takes the key over.
        let t = std::time::Instant::now();
        let (by_key, tier) = exact::find(state, &exact, wants, counted).await;
        found.notes.exact_ms = Some(ms(t));
        found.notes.tier = tier;
        found.exact_taken = matches!(by_key, ByKey::Stale);
        if let ByKey::Expired(entry) = &by_key {
            // An expired answer to another wording (an alias) is served stale only where a
            // fresh one would be: not once it is refused to every question by meaning or to
            // some neighbourhood, nor to a client or tenant that has aliases matched again by
            // meaning (a stale answer is not); a verdict on it refuses as one on an aliased
            // hit does.
            let alias = is_alias(entry, asked(req));
            let barred = alias
                && (entry.refused_by_meaning()
                    || entry.refuses_around()
                    || rematches_aliases(state, namespace, &wants));
            if !barred && wants.takes_stale(entry) {
                found.stale = Some(entry.clone());
                found.aliased = alias;
            }
        }
        by_key.fresh()
    } else {
        None
    };
    // An entry refused to every question by meaning answers no other wording through an
    // alias either (only its own question).
    let exact_hit = exact_hit.filter(|e| !(is_alias(e, asked(req)) && e.refused_by_meaning()));
    // A client that asks its own threshold, or a tenant under an error bound, is served an
    // exact hit on another wording (an alias a looser match linked) only when it also
    // passes that threshold by meaning: decided once the question is known.
    // (Only an alias asks: an exact hit on its own question stays on the fast path.)
    // So is one on an entry refused by meaning to some question: the alias may have been
    // linked before, within the refused neighbourhood.
    let served_here = exact_hit.as_ref().is_some_and(|e| {
        !is_alias(e, asked(req))
            || !(e.refuses_around() || rematches_aliases(state, namespace, &wants))
    });
    if served_here && state.prefetch.is_none() {
        if let Some(entry) = &exact_hit {
            note_alias(&mut found, entry, asked(req));
        }
        found.hit = exact_hit.map(|entry| hit(entry, Outcome::Exact, None));
        shadow_exact_hit(state, namespace, wants, counted);
        return found;
    }
    // Boxed: the rest is a large future, which the exact hit above (the hot path) should not
    // carry (and copy) along.
    let rest = beyond_exact(state, ask, found, exact_hit);
    Box::pin(rest).await
}

/// The question a request asks: its last user message, or its prompt.
fn asked(req: &GenRequest) -> Option<&str> {
    match &req.input {
        Input::Prompt(p) => Some(p),
        Input::Chat(msgs) => msgs
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.as_str()),
    }
}

/// Marks an exact hit on another wording's answer (`asked` is not the entry's own
/// question: the key was linked to it by a hit by meaning or a prefetch; both wordings
/// known, since an entry stored without the semantic tier records none), and notes where
/// it was asked: the entry's partition, which is what feedback on it refuses.
fn note_alias(found: &mut Lookup, entry: &Entry, asked: Option<&str>) {
    let Some(q) = asked.filter(|_| is_alias(entry, asked)) else {
        return;
    };
    found.aliased = true;
    found.plan.partition = Some(entry.partition);
    found.plan.prompt = q.to_string();
    found.plan.window = q.len();
}

/// Whether an exact hit on `entry` for the question `asked` came by an alias: another
/// wording, both known (an entry stored without the semantic tier records none).
fn is_alias(entry: &Entry, asked: Option<&str>) -> bool {
    asked.is_some_and(|q| !entry.prompt.is_empty() && q != entry.prompt)
}

/// Whether an exact hit by an alias must pass the match by meaning again: for a client that
/// asks its own threshold, and for a tenant under an error bound, whose threshold moves
/// with the verdicts (an alias linked at an earlier threshold would keep serving its
/// wording after wrong verdicts raised the threshold past its similarity, and verdicts on
/// it would carry no similarity to learn from).
fn rematches_aliases(state: &AppState, namespace: &str, wants: &Wants) -> bool {
    wants.threshold.is_some() || {
        let policies = state.policies.load();
        crate::bounds::delta_of(state, policies.tenants.for_namespace(namespace)) > 0.0
    }
}

/// The rest of [`lookup`] after the exact tier: the conversation, then the semantic lookup
/// (or, for an exact hit the prefetcher follows, the turn it continued).
async fn beyond_exact(
    state: &Arc<AppState>,
    ask: Ask<'_>,
    mut found: Lookup,
    exact_hit: Option<Arc<Entry>>,
) -> Lookup {
    let Ask {
        namespace,
        endpoint,
        req,
        read,
        write,
        wants,
        counted,
    } = ask;
    // The conversation: what is matched by meaning, the context it must match in, and the
    // context of the same question asked alone when it may stand on its own.
    let mut canon = None;
    let mut followup = false;
    let (query, context, alone) = match &req.input {
        Input::Prompt(p) => (Some(p.clone()), key::messages_digest("preamble", &[]), None),
        Input::Chat(msgs) => {
            match canonical_chat(state, namespace, req, msgs, wants, &mut canon).await {
                Some(conv) => {
                    let turns = state.config.cache.context_turns;
                    let ctx = context::resolve(state, namespace, &req.model, &conv, turns).await;
                    // The next turn looks up the links of its first `turns` exchanges only:
                    // an answer past them gets none (they would be written, never read).
                    if conv.turns.len() < turns {
                        found.plan.turn = Some((ctx.turn, ctx.query));
                        found.plan.raw_turn = Some(ctx.raw);
                    }
                    found.prev_entry = ctx.prev_entry;
                    let refers = reprise_policies::standalone::refers_back(&conv.last.content);
                    let alone = context::standalone(&conv, refers);
                    followup = !conv.turns.is_empty() && refers;
                    (Some(conv.last.content.clone()), ctx.partition, alone)
                }
                None => (None, [0; 32], None),
            }
        }
    };
    // An alias stands for "this wording was answered" under the configured threshold; a
    // client asking its own, or a tenant under an error bound, is matched by meaning
    // instead, at its threshold (it finds the same entry there when the two wordings are
    // that close).
    let rematch = rematches_aliases(state, namespace, &wants);
    let exact_hit = exact_hit.filter(|e| match query.as_deref() {
        // Only another wording, both known, is matched again (an entry stored without the
        // semantic tier records no wording: it answers its own key only).
        Some(q) if (rematch || e.refuses_around()) && !e.prompt.is_empty() => q == e.prompt,
        _ => true,
    });
    if let Some(entry) = exact_hit {
        note_alias(&mut found, &entry, query.as_deref());
        if entry.origin == Origin::Prefetch && !found.aliased {
            // Where a predicted wording was asked: what feedback on it would refuse.
            if let Some(q) = &query {
                found.plan.partition = Some(entry.partition);
                found.plan.prompt = q.clone();
                found.plan.window = q.len();
            }
        }
        found.hit = Some(hit(entry, Outcome::Exact, None));
        shadow_exact_hit(state, namespace, wants, counted);
        return found;
    }
    // 5. Semantic.
    let (Some(query), Some(embedder)) = (query, &state.embedder) else {
        return found;
    };
    // The live policies: the tenant's own rules (or its candidate's) first, then the global
    // ones; rules name namespaces inside the tenant.
    let policies = state.policies.load();
    let tenant = policies.tenants.for_namespace(namespace);
    let delta = crate::bounds::delta_of(state, tenant);
    // The policy a side of the tenant serves under, and the scope of its learned threshold:
    // its threshold is its own (a follow-up's, for a follow-up), or learned under the error
    // bound from its own configured one; a client's `x-reprise-threshold` only ever raises
    // it. The running policy and a shadow candidate are judged alike.
    let serving = |rules: &[reprise_policies::semantic::Rule], arm: Arm| {
        let mut policy = semantic_policy(&policies, rules, namespace, &req.model, None);
        let scope = crate::bounds::scope(
            reprise_policies::semantic::matching(
                rules.iter().chain(&policies.rules),
                crate::auth::sub_namespace(namespace),
                &req.model,
            ),
            arm,
            tenant.candidate().map(|c| c.fingerprint()),
        );
        let mut learned = None;
        let mut per_entry = None;
        if delta > 0.0 {
            let floor = state.config.semantic.min_threshold;
            let l = state
                .bounds
                .threshold(tenant.name(), &scope, delta, policy.threshold, floor);
            policy.threshold = l.threshold;
            learned = Some(l);
            // Entries' own thresholds, learned from the running policy's verdicts (a
            // candidate's stay in its scope): a canary's candidate keeps only their raises.
            per_entry = Some(semantic::PerEntry {
                delta,
                scope: l.threshold,
                floor,
                requested: wants.threshold,
                raise_only: arm == Arm::Candidate,
                counted,
            });
        } else if followup {
            // A follow-up is matched within its context only, where the content it acts on
            // is already the same: its own threshold.
            policy.threshold = policy.followup();
        }
        (policy.raised(wants.threshold), scope, learned, per_entry)
    };
    let (policy, scope, learned, per_entry) = serving(tenant.semantic_rules(wants.arm), wants.arm);
    // A canary's candidate may read a question as standing alone where the running policy
    // does not: it looks the question up alone, but its answer is stored in the
    // conversation's own partition, so the control side (and every request after a
    // rollback) never reads an answer written with a history in view as one asked alone.
    let stores_alone = wants.arm != Arm::Candidate || {
        let running = tenant.semantic_rules(Arm::Current);
        semantic_policy(&policies, running, namespace, &req.model, None).standalone
    };
    if let (Some(learned), true) = (&learned, counted) {
        state.metrics.learned(tenant.name(), &scope, learned);
    }
    let shadow = match (wants.arm, tenant.candidate()) {
        (Arm::Shadow, Some(c)) if counted => {
            // A shadow candidate serves nothing, so no verdict is ever taken on its side:
            // under the bound it reads the evidence of the scope its rules match, taken on
            // the same traffic (the candidate's own scope is a canary's), and the entries'
            // own thresholds as the running policy does.
            let (policy, _, _, per_entry) = serving(&c.config().semantic_rules, Arm::Shadow);
            Some(Shadow {
                policy,
                per_entry: per_entry.map(|p| semantic::PerEntry {
                    counted: false,
                    ..p
                }),
                candidate: c.clone(),
                tenant: tenant.name().to_string(),
            })
        }
        _ => None,
    };
    drop(policies);
    let shadow_on = shadow.as_ref().is_some_and(|s| s.policy.enabled);
    if !(policy.enabled || shadow_on) || (!read && !write) {
        if let Some(s) = shadow.filter(|_| read) {
            s.record(state, None, None);
        }
        return found;
    }
    if policy.enabled {
        found.policy = Some(policy);
        found.scope = scope;
        found.bounded = delta > 0.0;
        found.per_entry = per_entry;
        found.notes.threshold = Some(policy.threshold);
    }
    // The embedder reads a bounded start of the question; the rest, and the words it reads
    // as its unknown token, must match exactly, so they join the partition. Finding them
    // tokenizes up to 16 KiB: off the async workers.
    let reading = {
        let (embedder, query) = (embedder.clone(), query.clone());
        state.cpu.run(move || embedder.reading(&query)).await
    };
    let window = query.floor_char_boundary(reading.end);
    let (matched, unread) = query.split_at(window);
    let unknown = reading.unknown_words(&query);
    // Indexed also when only a shadow candidate matches by meaning: it needs the entries.
    let mut partition = key::partition_key(namespace, endpoint, req, &context, unread, &unknown);
    found.plan.partition = Some(partition);
    found.plan.prompt = query.clone();
    found.plan.window = window;
    let t = Instant::now();
    let scope = crate::auth::scope_of(namespace);
    // Background work (prefetch, refresh) embeds on the queue's spare room only, never
    // waiting in line with clients: refused, it is skipped as when the queue is full.
    let embedded = match req.priority {
        Priority::Background => embedder
            .embed_many_spare(scope, &[matched.to_string()])
            .await
            .and_then(|v| {
                let missing = || reprise_embedder::EmbedError::Inference("no vector".into());
                v.into_iter().next().ok_or_else(missing)
            }),
        _ => embedder.embed_in(scope, matched).await,
    };
    let embedding = match embedded {
        Ok(e) => e,
        Err(reprise_embedder::EmbedError::Overloaded { retry_after_secs }) => {
            // Too busy to embed: the caller decides (a client request that needed the read
            // is told to retry, so the backend is not handed every request meanwhile).
            tracing::debug!("embedder queue full; semantic tier skipped");
            found.embed_overloaded = Some(retry_after_secs);
            return found;
        }
        Err(e) => {
            // The semantic tier is an optimisation: a failing embedder degrades to exact-only.
            tracing::warn!(error = %e, "embedding failed; semantic tier skipped");
            return found;
        }
    };
    if let Some((alone, recent)) = alone.filter(|_| policy.standalone) {
        // A question that stands on its own and is unrelated to the last exchanges is
        // stored and matched as if asked with the system prompt alone.
        let limit = state.config.semantic.standalone_max_related;
        if let Ok(v) = embedder.embed_many_in(scope, &recent).await {
            if v.iter()
                .all(|r| reprise_embedder::cosine(r, &embedding) < limit)
            {
                partition = key::partition_key(namespace, endpoint, req, &alone, unread, &unknown);
                found.notes.standalone = true;
                if stores_alone {
                    found.plan.partition = Some(partition);
                    // No turn link: its entry answers the question asked alone, and the
                    // next turn's context resolved through it would drop this history, so
                    // this conversation's follow-ups would share answers with those of the
                    // question asked alone (or after another history). They resolve by
                    // their raw text.
                    found.plan.turn = None;
                    found.plan.raw_turn = None;
                }
            }
        }
    }
    found.notes.embed_ms = Some(ms(t));
    found.plan.embedding = Some(embedding.clone());
    if !read {
        return found;
    }
    let exact = found.plan.exact;
    let question = || semantic::Question {
        text: matched,
        embedding: &embedding,
        partition: &partition,
        key: &exact,
        scope: crate::auth::scope_of(namespace),
    };
    let served = match policy.enabled {
        true => {
            let q = question();
            let per_entry = per_entry.as_ref();
            semantic::find(
                state,
                embedder,
                &policy,
                per_entry,
                q,
                wants,
                &mut found.notes,
            )
            .await
        }
        false => None,
    };
    if let Some(s) = shadow {
        let would = match s.policy.enabled {
            true => {
                let mut notes = Notes::default();
                let q = question();
                let per_entry = s.per_entry.as_ref();
                semantic::find(state, embedder, &s.policy, per_entry, q, wants, &mut notes).await
            }
            false => None,
        };
        let served = served.as_ref().map(|(e, _)| e.id);
        s.record(state, served, would.map(|(e, sim)| (e.id, sim)));
    }
    if counted && policy.enabled {
        state.metrics.lookup(Tier::Semantic, served.is_some());
    }
    found.hit = served.map(|(entry, sim)| hit(entry, Outcome::Semantic, Some(sim)));
    found
}

/// Whether the running policy of `namespace`'s tenant matches `model`'s questions by meaning
/// there (the tenant's own rules, then the global ones): what serves a wording another
/// wording's answer, prefetch's aliases too, asks it first.
pub(crate) fn matches_by_meaning(state: &AppState, namespace: &str, model: &str) -> bool {
    let policies = state.policies.load();
    let tenant = policies.tenants.for_namespace(namespace);
    let rules = tenant.semantic_rules(Arm::Current);
    semantic_policy(&policies, rules, namespace, model, None).enabled
}

/// The semantic policy of a request in `namespace` for `model`: `rules` (a tenant's own, or
/// its candidate's) first, then the global ones; rules name namespaces inside the tenant.
fn semantic_policy(
    policies: &crate::policy::Policies,
    rules: &[reprise_policies::semantic::Rule],
    namespace: &str,
    model: &str,
    threshold: Option<f32>,
) -> SemanticPolicy {
    reprise_policies::semantic::resolve(
        policies.semantic,
        rules.iter().chain(&policies.rules),
        crate::auth::sub_namespace(namespace),
        model,
        threshold,
    )
}

/// The conversation of `msgs` split for semantic matching, its context messages replaced by
/// their canonical forms when the request's policy treats paraphrased contexts as one
/// (`equivalence`); `canon` holds the rewritten messages the split borrows.
async fn canonical_chat<'m>(
    state: &AppState,
    namespace: &str,
    req: &GenRequest,
    msgs: &'m [ChatMessage],
    wants: Wants,
    canon: &'m mut Option<Vec<ChatMessage>>,
) -> Option<key::Conversation<'m>> {
    let conv = key::split_conversation(msgs)?;
    let (Some(embedder), true) = (&state.embedder, conv.turns.len() + conv.preamble.len() > 0)
    else {
        return Some(conv);
    };
    let on = {
        let policies = state.policies.load();
        let rules = policies
            .tenants
            .for_namespace(namespace)
            .semantic_rules(wants.arm);
        let p = semantic_policy(&policies, rules, namespace, &req.model, None);
        p.enabled && p.context_equivalence
    };
    if !on {
        return Some(conv);
    }
    let context_len = msgs.len() - 1 - conv.pending.len();
    let scope = crate::auth::scope_of(namespace);
    let model = &req.model;
    *canon =
        equivalence::canonical(state, embedder, scope, namespace, model, msgs, context_len).await;
    match canon {
        Some(m) => key::split_conversation(m),
        None => Some(conv),
    }
}

/// A shadow candidate's lookup beside the served one.
struct Shadow {
    policy: SemanticPolicy,
    /// Entries' own thresholds, as the running policy reads them.
    per_entry: Option<semantic::PerEntry>,
    candidate: Arc<Candidate>,
    tenant: String,
}

impl Shadow {
    /// Counts what the candidate would have served (`would`, with its similarity) against
    /// what was served.
    fn record(self, state: &AppState, served: Option<EntryId>, would: Option<(EntryId, f32)>) {
        let result = ShadowResult::of(served, would.map(|(id, _)| id));
        self.candidate.record_shadow(result);
        let similarity = match result {
            ShadowResult::WouldHit | ShadowResult::Different => would.map(|(_, s)| s),
            _ => None,
        };
        state
            .metrics
            .shadow(&self.tenant, result.as_str(), similarity);
    }
}

/// An exact hit agrees with any candidate: the exact tier does not depend on the policy.
fn shadow_exact_hit(state: &AppState, namespace: &str, wants: Wants, counted: bool) {
    if wants.arm != Arm::Shadow || !counted {
        return;
    }
    let policies = state.policies.load();
    let tenant = policies.tenants.for_namespace(namespace);
    if let Some(c) = tenant.candidate() {
        c.record_shadow(ShadowResult::AgreeHit);
        state.metrics.shadow(tenant.name(), "agree_hit", None);
    }
}

/// A hit on `entry` found by `tier`. A prefetched entry says so on its first use; after
/// that it is a normal entry.
fn hit(entry: Arc<Entry>, tier: Outcome, similarity: Option<f32>) -> Hit {
    let outcome = match entry.origin {
        Origin::Prefetch => Outcome::Prefetch,
        _ => tier,
    };
    Hit {
        entry,
        outcome,
        similarity,
    }
}

/// Milliseconds since `t`.
pub(crate) fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    //! The lookup's branches over a deterministic embedder (bag of words: the same words give
    //! similarity 1, disjoint words about 0) and a scripted backend; the end-to-end tests
    //! run the same paths with the real model.

    use std::sync::Arc;

    use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
    use reprise_backend::{FinishReason, GenRequest, Usage};
    use reprise_embedder::FakeEmbedder;

    use super::*;
    use crate::config::Config;
    use crate::generate::write_back;
    use crate::test_support::chat;

    fn state_with(embedder: FakeEmbedder, prefetch: bool) -> Arc<AppState> {
        let mut config = Config::default();
        config.semantic.enabled = true;
        config.prefetch.enabled = prefetch;
        let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
        AppState::new(config, backend, Some(Arc::new(embedder))).unwrap()
    }

    fn state() -> Arc<AppState> {
        state_with(FakeEmbedder::new(256), false)
    }

    async fn find(state: &Arc<AppState>, ns: &str, req: &GenRequest, wants: Wants) -> Lookup {
        let ask = Ask {
            namespace: ns,
            endpoint: Endpoint::Chat,
            req,
            read: true,
            write: true,
            wants,
            counted: false,
        };
        lookup(state, ask).await
    }

    /// Looks `req` up and stores `answer` for it as a miss would.
    async fn store(state: &Arc<AppState>, ns: &str, req: &GenRequest, answer: &str) -> EntryId {
        let found = find(state, ns, req, Wants::default()).await;
        assert!(found.hit.is_none(), "stored only after a miss");
        let usage = Usage::default();
        write_back(
            state,
            found.plan,
            answer.into(),
            FinishReason::Stop,
            usage,
            0,
        )
        .await
    }

    fn ask(q: &str) -> GenRequest {
        chat(&[("user", q)])
    }

    /// A state whose embedder reads two wordings of one question as the same vector, with
    /// an answer ("E") stored for the first; and the two wordings.
    async fn stored_paraphrase() -> (Arc<AppState>, &'static str, &'static str) {
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let (y, x) = (
            "How do I reset my password?",
            "How can I reset my password?",
        );
        let s = state_with(FakeEmbedder::new(8).pin(y, &v).pin(x, &v), false);
        store(&s, "ns", &ask(y), "E").await;
        (s, y, x)
    }

    #[tokio::test]
    async fn canonical_context_forms_keep_within_their_byte_budget() {
        let mut config = Config::default();
        config.semantic.enabled = true;
        config.semantic.context_forms_bytes = 64 << 10;
        let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
        let s = AppState::new(config, backend, Some(Arc::new(FakeEmbedder::new(64)))).unwrap();
        for i in 0..400 {
            let system = format!(
                "persona{i} speaks with accent{i} about topic{i} {}",
                "x".repeat(200)
            );
            let req = chat(&[
                ("system", &system),
                ("user", "What is the capital of France?"),
            ]);
            find(&s, "ns", &req, Wants::default()).await;
        }
        let held = s.context_forms.weighted_size();
        assert!(held > 0, "forms are kept");
        assert!(
            held <= 64 << 10,
            "{held} bytes held over a budget of 64 KiB"
        );
    }

    /// The next turn looks up the links of its first `context_turns` exchanges: an answer
    /// past them is given no turn link (it would be written and never read).
    #[tokio::test]
    async fn no_turn_link_past_the_turns_looked_up() {
        let mut config = Config::default();
        config.semantic.enabled = true;
        config.cache.context_turns = 2;
        let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
        let s = AppState::new(config, backend, Some(Arc::new(FakeEmbedder::new(64)))).unwrap();
        let mut msgs = Vec::new();
        let mut linked = Vec::new();
        for _ in 0..4 {
            msgs.push(("user", "Why is the sky blue today?"));
            let found = find(&s, "ns", &chat(&msgs), Wants::default()).await;
            linked.push(found.plan.turn.is_some());
            msgs.push(("assistant", "Because of scattering."));
        }
        assert_eq!(linked, [true, true, false, false]);
    }

    #[tokio::test]
    async fn an_exact_repeat_is_an_exact_hit_without_conversation_analysis() {
        let s = state();
        let id = store(&s, "ns", &ask("What is the capital of France?"), "Paris").await;
        let found = find(
            &s,
            "ns",
            &ask("What is the capital of France?"),
            Wants::default(),
        )
        .await;
        let hit = found.hit.expect("a hit");
        assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Exact));
        // Exact hits skip the conversation (no turn link) unless prefetch wants it.
        assert!(found.plan.turn.is_none());
        assert!(
            found.notes.embed_ms.is_none(),
            "no embedding for an exact hit"
        );
    }

    #[tokio::test]
    async fn with_prefetch_an_exact_hit_still_resolves_its_context() {
        let s = state_with(FakeEmbedder::new(64), true);
        let first = chat(&[("user", "Who wrote Hamlet?")]);
        let prev = store(&s, "ns", &first, "Shakespeare").await;
        let second = chat(&[
            ("user", "Who wrote Hamlet?"),
            ("assistant", "Shakespeare"),
            ("user", "When?"),
        ]);
        store(&s, "ns", &second, "Around 1600").await;
        let found = find(&s, "ns", &second, Wants::default()).await;
        assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Exact));
        assert_eq!(found.prev_entry, Some(prev), "the previous turn's entry");
    }

    #[tokio::test]
    async fn a_paraphrase_is_a_semantic_hit_in_its_namespace_only() {
        let s = state();
        let id = store(
            &s,
            "ns",
            &ask("How do I reset my password?"),
            "Click forgot.",
        )
        .await;
        let found = find(
            &s,
            "ns",
            &ask("how do I RESET my password"),
            Wants::default(),
        )
        .await;
        let hit = found.hit.expect("a semantic hit");
        assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Semantic));
        assert!(hit.similarity.unwrap() > 0.99);
        assert_eq!(found.notes.gate, Some("pass"));
        let other = find(
            &s,
            "other",
            &ask("how do I RESET my password"),
            Wants::default(),
        )
        .await;
        assert!(other.hit.is_none(), "never across namespaces");
    }

    #[tokio::test]
    async fn text_beyond_the_embedders_window_must_match_exactly() {
        // The embedder reads five words: the rest of a question joins the partition.
        let s = state_with(FakeEmbedder::new(256).with_window(5), false);
        let stored = ask("How do I reset my password for the shop?");
        let id = store(&s, "ns", &stored, "Click forgot.").await;
        let entry = s.store.get(id).await.expect("stored");
        // Same five words read, another end: another partition, a miss.
        let found = find(
            &s,
            "ns",
            &ask("How do I reset my email for the shop?"),
            Wants::default(),
        )
        .await;
        assert!(found.hit.is_none(), "the unread end differs");
        assert_eq!(found.plan.read(), "How do I reset my ");
        assert_eq!(found.plan.prompt, "How do I reset my email for the shop?");
        assert_ne!(found.plan.partition, Some(entry.partition));
        // Another wording of what is read, the same end: matched by meaning, and the entry
        // was stored under the partition its plan computed.
        let found = find(
            &s,
            "ns",
            &ask("how do I RESET my password for the shop?"),
            Wants::default(),
        )
        .await;
        assert_eq!(found.plan.partition, Some(entry.partition));
        let hit = found.hit.expect("a semantic hit");
        assert_eq!((hit.entry.id, hit.outcome), (id, Outcome::Semantic));
    }

    #[tokio::test]
    async fn a_candidate_below_the_threshold_is_a_miss_that_notes_its_similarity() {
        let s = state();
        store(
            &s,
            "ns",
            &ask("How do I reset my password?"),
            "Click forgot.",
        )
        .await;
        let q = ask("How do I change my email address?");
        let found = find(&s, "ns", &q, Wants::default()).await;
        assert!(found.hit.is_none());
        let sim = found
            .notes
            .similarity
            .expect("the best candidate's similarity");
        assert!(sim > 0.3 && sim < 0.86, "{sim}");
        // A miss still plans its write-back: partition, prompt and embedding.
        assert!(found.plan.partition.is_some() && found.plan.embedding.is_some());
        assert_eq!(found.plan.prompt, "How do I change my email address?");
    }

    #[tokio::test]
    async fn the_gate_rejects_a_close_candidate_that_says_the_opposite() {
        // Pinned to one vector: only the gate can tell them apart.
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let e = FakeEmbedder::new(8)
            .pin("Is the museum open on Monday?", &v)
            .pin("Is the museum not open on Monday?", &v);
        let s = state_with(e, false);
        store(&s, "ns", &ask("Is the museum open on Monday?"), "Yes").await;
        let found = find(
            &s,
            "ns",
            &ask("Is the museum not open on Monday?"),
            Wants::default(),
        )
        .await;
        assert!(found.hit.is_none(), "a negation is not a paraphrase");
        assert!(
            found.notes.gate.is_some_and(|g| g != "pass"),
            "{:?}",
            found.notes.gate
        );
        assert!(found.notes.similarity.unwrap() > 0.99);
    }

    /// A refusal of a question whose neighbourhood could not be embedded (its key only)
    /// still keeps the entry from that very question by meaning.
    #[tokio::test]
    async fn a_refusal_by_key_alone_keeps_the_question_from_the_entry() {
        let (s, y, x) = stored_paraphrase().await;
        let found = find(&s, "ns", &ask(x), Wants::default()).await;
        let hit = found.hit.expect("a paraphrase hit");
        let mut refusing = (*hit.entry).clone();
        assert!(refusing.refuse(reprise_cache::entry::Refusal {
            key: found.plan.exact,
            around: None,
        }));
        s.store.update(Arc::new(refusing)).await;
        let again = find(&s, "ns", &ask(x), Wants::default()).await;
        assert!(again.hit.is_none(), "refused for this question");
        let own = find(&s, "ns", &ask(y), Wants::default()).await;
        assert_eq!(own.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }

    /// A hit matched under a canary's candidate policy is served but not linked: the same
    /// wording under the running policy is matched by meaning again (where its own rules
    /// decide), never served as an exact repeat of the candidate's match.
    #[tokio::test]
    async fn a_candidate_sides_hit_is_not_linked_to_the_wording() {
        let (s, _, x) = stored_paraphrase().await;
        let candidate = Wants {
            arm: Arm::Candidate,
            ..Wants::default()
        };
        let found = find(&s, "ns", &ask(x), candidate).await;
        let hit = found.hit.as_ref().expect("a paraphrase hit");
        assert_eq!(hit.outcome, Outcome::Semantic);
        crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
        assert!(s.store.get_by_key(&found.plan.exact).await.is_none());
        let again = find(&s, "ns", &ask(x), Wants::default()).await;
        assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Semantic));
        // Under the running policy the same hit is linked.
        let found = find(&s, "ns", &ask(x), Wants::default()).await;
        let hit = found.hit.as_ref().unwrap();
        crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
        let again = find(&s, "ns", &ask(x), Wants::default()).await;
        assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }

    #[tokio::test]
    async fn a_hit_never_repoints_a_key_that_got_its_own_answer_meanwhile() {
        let (s, _, x) = stored_paraphrase().await;
        let found = find(&s, "ns", &ask(x), Wants::default()).await;
        let hit = found.hit.as_ref().expect("a paraphrase hit");
        assert_eq!(hit.outcome, Outcome::Semantic);
        // Meanwhile a generation for the very question (say, a no-cache request) stores
        // its own answer under its key.
        let fresh = lookup(
            &s,
            Ask {
                namespace: "ns",
                endpoint: Endpoint::Chat,
                req: &ask(x),
                read: false,
                write: true,
                wants: Wants::default(),
                counted: false,
            },
        )
        .await;
        write_back(
            &s,
            fresh.plan,
            "G".into(),
            FinishReason::Stop,
            Usage::default(),
            0,
        )
        .await;
        crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
        let by_key = s.store.get_by_key(&found.plan.exact).await.unwrap();
        assert_eq!(by_key.text, "G", "the paraphrase's answer took the key");
    }

    #[tokio::test]
    async fn a_client_threshold_only_raises_the_bar() {
        let s = state();
        store(
            &s,
            "ns",
            &ask("How do I reset my password today?"),
            "Click forgot.",
        )
        .await;
        let q = ask("How do I reset my password now?");
        let strict = Wants {
            threshold: Some(0.99),
            ..Wants::default()
        };
        assert!(find(&s, "ns", &q, strict).await.hit.is_none());
        let lax = Wants {
            threshold: Some(0.1),
            ..Wants::default()
        };
        // 0.1 does not lower the configured 0.86: the same outcome as asking nothing.
        let default = find(&s, "ns", &q, Wants::default()).await.hit.is_some();
        assert_eq!(find(&s, "ns", &q, lax).await.hit.is_some(), default);
    }

    /// A wording linked to an entry by a match under the configured threshold is served
    /// that entry as an exact repeat, except to a client asking a stricter threshold, which
    /// is matched by meaning at its own; the entry's own wording stays an exact hit for it.
    #[tokio::test]
    async fn a_stricter_client_is_not_served_a_looser_matchs_alias() {
        // Two wordings about 0.95 apart: above the configured 0.86, below a strict 0.97.
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut w = v.clone();
        w[0] += 4.0;
        w[1] -= 2.0;
        let (y, x) = (
            "How do I reset my password?",
            "How can I reset my password?",
        );
        let s = state_with(FakeEmbedder::new(8).pin(y, &v).pin(x, &w), false);
        store(&s, "ns", &ask(y), "E").await;
        let found = find(&s, "ns", &ask(x), Wants::default()).await;
        let hit = found.hit.as_ref().expect("a paraphrase hit");
        let similarity = hit.similarity.unwrap();
        crate::request::write_back::link_hit(&s, &found, hit, true, None).await;
        let linked = find(&s, "ns", &ask(x), Wants::default()).await;
        assert_eq!(linked.hit.map(|h| h.outcome), Some(Outcome::Exact));
        let strict = Wants {
            threshold: Some((similarity + 1.0) / 2.0),
            ..Wants::default()
        };
        assert!(similarity < 0.999, "a paraphrase, not the same text");
        let found = find(&s, "ns", &ask(x), strict).await;
        assert!(found.hit.is_none(), "below the client's threshold");
        let own = find(&s, "ns", &ask(y), strict).await;
        assert_eq!(own.hit.map(|h| h.outcome), Some(Outcome::Exact));
        // At a threshold the two wordings pass, the entry is found by meaning.
        let passes = Wants {
            threshold: Some(similarity - 0.001),
            ..Wants::default()
        };
        let found = find(&s, "ns", &ask(x), passes).await;
        assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Semantic));
        // Without the semantic tier an entry records no wording: its own key stays an exact
        // hit for a client asking a threshold.
        let mut config = Config::default();
        config.semantic.enabled = false;
        let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
        let s = AppState::new(config, backend, None).unwrap();
        store(&s, "ns", &ask(y), "E").await;
        let found = find(&s, "ns", &ask(y), strict).await;
        assert_eq!(found.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }

    #[tokio::test]
    async fn an_answer_older_than_max_age_is_not_served_and_keeps_its_key() {
        let s = state();
        let q = ask("What time is it in Tokyo?");
        store(&s, "ns", &q, "Noon").await;
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let fresh_only = Wants {
            freshness: Freshness {
                max_age_secs: Some(0),
            },
            ..Wants::default()
        };
        let found = find(&s, "ns", &q, fresh_only).await;
        assert!(found.hit.is_none(), "too old for max-age=0");
        assert!(found.exact_taken, "the key leads to an older answer");
        let any_age = find(&s, "ns", &q, Wants::default()).await;
        assert_eq!(any_age.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }

    /// An expired answer kept for the stale windows is found by its exact key only, as
    /// stale (never as a hit), when the request takes stale answers and its `max-age`
    /// admits it; a paraphrase is not served it by meaning.
    #[tokio::test]
    async fn an_expired_answer_is_stale_by_its_exact_key_only() {
        let mut config = Config::default();
        config.semantic.enabled = true;
        config.cache.ttl_secs = 1;
        config.cache.stale_while_revalidate_secs = 60;
        let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
        let embedder = Arc::new(FakeEmbedder::new(256));
        let s = AppState::new(config, backend, Some(embedder)).unwrap();
        let q = ask("How do I reset my password?");
        let id = store(&s, "ns", &q, "Click forgot.").await;
        let paraphrase = ask("how do I RESET my password");
        assert!(find(&s, "ns", &paraphrase, Wants::default())
            .await
            .hit
            .is_some());
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        let takes_stale = Wants {
            stale: StaleWindows {
                while_revalidate_secs: 60,
                if_error_secs: 0,
            },
            ..Wants::default()
        };
        let found = find(&s, "ns", &q, takes_stale).await;
        assert!(found.hit.is_none(), "never a hit");
        assert_eq!(found.stale.map(|e| e.id), Some(id));
        let found = find(&s, "ns", &q, Wants::default()).await;
        assert!(found.hit.is_none() && found.stale.is_none(), "not taken");
        let found = find(&s, "ns", &paraphrase, takes_stale).await;
        assert!(
            found.hit.is_none() && found.stale.is_none(),
            "not by meaning"
        );
        let too_old = Wants {
            freshness: Freshness {
                max_age_secs: Some(0),
            },
            ..takes_stale
        };
        assert!(find(&s, "ns", &q, too_old).await.stale.is_none(), "max-age");
    }

    #[tokio::test]
    async fn without_read_nothing_is_served_but_the_write_is_planned() {
        let s = state();
        let q = ask("What is the capital of France?");
        store(&s, "ns", &q, "Paris").await;
        let no_read = Ask {
            namespace: "ns",
            endpoint: Endpoint::Chat,
            req: &q,
            read: false,
            write: true,
            wants: Wants::default(),
            counted: false,
        };
        let found = lookup(&s, no_read).await;
        assert!(found.hit.is_none());
        assert!(
            found.plan.embedding.is_some(),
            "a write needs the embedding"
        );
    }

    #[tokio::test]
    async fn a_failing_embedder_degrades_to_exact_only() {
        let s = state_with(FakeEmbedder::new(64).failing(), false);
        let q = ask("What is the capital of France?");
        let found = find(&s, "ns", &q, Wants::default()).await;
        assert!(found.hit.is_none());
        assert!(found.plan.partition.is_some());
        assert!(found.plan.embedding.is_none(), "nothing to index");
        let usage = Usage::default();
        write_back(&s, found.plan, "Paris".into(), FinishReason::Stop, usage, 0).await;
        let again = find(&s, "ns", &q, Wants::default()).await;
        assert_eq!(again.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }

    #[tokio::test]
    async fn the_same_follow_up_after_different_answers_never_matches() {
        let s = state();
        let about = |who: &str, answer: &str| {
            chat(&[
                ("user", &format!("Tell me about {who}")),
                ("assistant", answer),
                ("user", "How old is he?"),
            ])
        };
        store(&s, "ns", &about("Alan Turing", "A mathematician."), "41").await;
        let found = find(
            &s,
            "ns",
            &about("Isaac Newton", "A physicist."),
            Wants::default(),
        )
        .await;
        assert!(found.hit.is_none(), "another conversation context");
        let same = find(
            &s,
            "ns",
            &about("Alan Turing", "A mathematician."),
            Wants::default(),
        )
        .await;
        assert_eq!(same.hit.map(|h| h.outcome), Some(Outcome::Exact));
    }
}
