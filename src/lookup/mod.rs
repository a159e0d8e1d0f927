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
                    // `msgs` as sent, for what context equivalence rewrote.
                    let ctx =
                        context::resolve(state, namespace, &req.model, &conv, msgs, turns).await;
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
mod tests;
