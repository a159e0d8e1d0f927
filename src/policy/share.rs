//! Live policies shared by every replica through Redis.
//!
//! A change applied on one replica (`PUT /admin/policies`, `SIGHUP`) is published as the
//! policy sections it now runs, every section whole ([`PolicyDocument::of_config`]), as JSON
//! under `{prefix}:policies`, with a version Redis hands out, and announced on the event stream
//! (op `policies`). The version only grows, whichever replica publishes
//! ([`RedisTier::publish_policies`]). Every replica applies the stored version when it is newer
//! than the last shared version it applied: on the announcement (the replication task), at
//! start, and after a resync. It is validated there like any change, so a document that is
//! not valid on that replica (a variable or key file missing there, the semantic tier off
//! there) leaves its policies as they are, logged and counted
//! (`reprise_policy_sync_failures_total`). A replica that applied a version runs under its
//! number, so `GET /admin/policies` and `reprise_policy_version` agree across replicas.
//!
//! Keys never reach Redis as they are: each configured key is written as its digest
//! (`sha256:<hex>`), which every replica accepts as a key. `api_keys_env`, `api_keys_file` and
//! `admin_token_env` are names, read on each replica.
//!
//! A publication builds on the newest shared version this replica knows. If another replica
//! stored a newer one meanwhile, that one is applied here first and the change is made again
//! on top of it (at most three times; a replica that cannot apply the shared version is
//! refused rather than publishing over it), so two concurrent changes to different sections
//! both hold, and every replica ends on the same, last version. When Redis cannot be
//! reached the change holds on this replica only (`"shared": false`), under a version number of
//! its own, until the next shared version replaces it.

use reprise_cache::redis::{PolicyPublish, RedisTier, SharedPolicies};

use super::{install, Applied, Policies, PolicyDocument};
use crate::auth::KeyDigest;
use crate::state::AppState;

/// Publications tried when other replicas keep storing newer versions first.
const ATTEMPTS: usize = 3;

/// Applies `change` here and publishes the result (the caller holds the change lock). The
/// change is made again on top of each newer version another replica stored meanwhile, so
/// what it did not touch is never written back as it was.
pub(super) async fn publish(
    state: &AppState,
    redis: &RedisTier,
    change: &(dyn Fn(&Policies) -> anyhow::Result<PolicyDocument> + Send + Sync),
) -> anyhow::Result<Applied> {
    let semantic_loaded = state.embedder.is_some();
    let mut known = 0;
    for _ in 0..ATTEMPTS {
        let current = state.policies.load_full();
        let mut next = current.next(change(&current)?, semantic_loaded)?;
        known = known.max(current.shared);
        // Above every version this replica ran or knows of (a stored one above `known`
        // refuses it): the number is signed with the document.
        let version = current.version.max(known) + 1;
        let published = match encode(&next, version, state.policy_key.as_ref()) {
            // The other replicas read at most this much: refused, so none drifts.
            Ok(bytes) if bytes.len() > redis.max_value_bytes() => anyhow::bail!(
                "the policy document takes {} bytes, over `redis.max_value_bytes` ({}): \
                 the other replicas could not read it",
                bytes.len(),
                redis.max_value_bytes()
            ),
            Ok(bytes) => redis
                .publish_policies(Some(known), version, &bytes)
                .await
                .map_err(anyhow::Error::from),
            Err(e) => Err(e.into()),
        };
        match published {
            Ok(PolicyPublish::Stored(version)) => {
                next.version = version;
                next.shared = version;
                install(state, next);
                tracing::info!(version, "policies changed and shared through redis");
                return Ok(Applied {
                    version,
                    shared: true,
                });
            }
            Ok(PolicyPublish::Behind(newer)) => {
                tracing::info!(
                    newer,
                    "policies: another replica shared a newer version; applying it first"
                );
                // Only a version applied here may be built on; otherwise the next attempt is
                // refused again rather than overwriting what it could not read. A version not
                // signed with this replica's key is no one's change (a forgery, or a document
                // from before the key or its format): it is written over.
                match adopt(state, redis).await {
                    Adopt::Answered => known = known.max(state.policies.load().shared),
                    Adopt::Unsigned(version) => known = known.max(version),
                    Adopt::Unreachable => {}
                }
            }
            Err(e) => return Ok(keep_here(state, next, &e)),
        }
    }
    anyhow::bail!("policies kept changing on other replicas; try again")
}

/// Swaps in a change that could not be published: it holds here, under a local version.
fn keep_here(state: &AppState, next: Policies, why: &anyhow::Error) -> Applied {
    let version = install(state, next);
    tracing::warn!(
        version,
        error = %format!("{why:#}"),
        "policies changed on this replica only: not shared through redis"
    );
    Applied {
        version,
        shared: false,
    }
}

/// Applies the version of the policies shared through Redis when it is newer than the last
/// one this replica applied (at start, on a policy event, after a resync). Never fails: when
/// Redis cannot be reached, or the document is not valid here, it is logged and the running
/// policies stay. Returns whether Redis answered (without Redis: true, nothing to read).
pub async fn sync(state: &AppState) -> bool {
    let Some(redis) = state.store.redis() else {
        return true;
    };
    let _guard = state.policy_change.lock().await;
    !matches!(adopt(state, redis).await, Adopt::Unreachable)
}

/// What [`adopt`] found in Redis.
enum Adopt {
    /// Redis answered: nothing shared, nothing newer, applied, or not valid here (logged).
    Answered,
    /// The stored version (this number) is not signed with this replica's policy key.
    Unsigned(u64),
    /// Redis could not be read.
    Unreachable,
}

/// [`sync`] with the change lock held.
async fn adopt(state: &AppState, redis: &RedisTier) -> Adopt {
    let stored = match redis.get_policies().await {
        Ok(Some(stored)) => stored,
        Ok(None) => return Adopt::Answered,
        Err(e) => {
            tracing::warn!(error = %e, "policies: cannot read the shared version from redis");
            return Adopt::Unreachable;
        }
    };
    let current = state.policies.load_full();
    let key = state.policy_key.as_ref();
    let unsigned = key.is_some_and(|k| !verifies(&stored.doc, stored.version, k));
    if unsigned && stored.version > current.shared {
        state.metrics.policy_sync_failures.increment(1);
        tracing::error!(
            version = stored.version,
            "policies: the shared version is not signed with this replica's policy key; ignored (a change made here writes over it)"
        );
        return Adopt::Unsigned(stored.version);
    }
    match next_shared(&current, &stored, state.embedder.is_some(), key) {
        None => {}
        Some(Ok(next)) => {
            let version = install(state, next);
            tracing::info!(version, "policies: shared version applied");
        }
        Some(Err(e)) => {
            state.metrics.policy_sync_failures.increment(1);
            tracing::error!(
                version = stored.version,
                running = current.version,
                error = %format!("{e:#}"),
                "policies: the shared version is not valid on this replica; keeping the running policies"
            );
        }
    }
    Adopt::Answered
}

/// The policies `stored` makes of `current`, under the stored version; `None` when it is not
/// newer than the last shared version `current` includes.
fn next_shared(
    current: &Policies,
    stored: &SharedPolicies,
    semantic_loaded: bool,
    key: Option<&PolicyKey>,
) -> Option<anyhow::Result<Policies>> {
    if stored.version <= current.shared {
        return None;
    }
    let next =
        decode(&stored.doc, stored.version, key).and_then(|doc| current.next(doc, semantic_loaded));
    Some(next.map(|mut next| {
        next.version = stored.version;
        next.shared = stored.version;
        next
    }))
}

/// The secret that signs shared policy versions (`server.policy_key_env`).
pub struct PolicyKey([u8; 32]);

impl PolicyKey {
    /// The key derived from a shared secret.
    pub fn new(secret: &str) -> PolicyKey {
        PolicyKey(blake3::derive_key(
            "reprise shared policies v2",
            secret.as_bytes(),
        ))
    }

    /// The MAC of `doc` stored as `version`: an older signed document written back under a
    /// newer number does not verify.
    fn sign(&self, version: u64, doc: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&version.to_le_bytes());
        h.update(doc);
        h.finalize()
    }
}

/// Prefix of a signed document: `mac:<64 hex digits>\n`, then the JSON.
const MAC_PREFIX: &[u8] = b"mac:";
const MAC_LEN: usize = 4 + 64 + 1;

/// The document every replica applies to run `policies`: its policy sections, keys as
/// digests; signed (with the `version` it is stored as) when a key is configured.
fn encode(
    policies: &Policies,
    version: u64,
    key: Option<&PolicyKey>,
) -> serde_json::Result<Vec<u8>> {
    let doc = serde_json::to_vec(&without_plain_keys(PolicyDocument::of_config(
        &policies.config,
    )))?;
    Ok(match key {
        Some(k) => {
            let mut out = format!("mac:{}\n", k.sign(version, &doc).to_hex()).into_bytes();
            out.extend_from_slice(&doc);
            out
        }
        None => doc,
    })
}

/// Whether `bytes` (as stored) carries `key`'s MAC of its document and `version`.
fn verifies(bytes: &[u8], version: u64, key: &PolicyKey) -> bool {
    if !(bytes.starts_with(MAC_PREFIX) && bytes.len() >= MAC_LEN) {
        return false;
    }
    let mac = std::str::from_utf8(&bytes[4..MAC_LEN - 1])
        .ok()
        .and_then(|hex| blake3::Hash::from_hex(hex).ok());
    // blake3's Hash compares in constant time.
    mac == Some(key.sign(version, &bytes[MAC_LEN..]))
}

/// A document read from Redis, stored as `version`; with a key, only one signed with it for
/// that version.
fn decode(bytes: &[u8], version: u64, key: Option<&PolicyKey>) -> anyhow::Result<PolicyDocument> {
    let signed = bytes.starts_with(MAC_PREFIX) && bytes.len() >= MAC_LEN;
    let doc = if signed { &bytes[MAC_LEN..] } else { bytes };
    if let Some(k) = key {
        anyhow::ensure!(
            verifies(bytes, version, k),
            "the shared policy document is not signed with this replica's policy key"
        );
    }
    serde_json::from_slice::<PolicyDocument>(doc)
        .map(PolicyDocument::whole)
        .map_err(|e| anyhow::anyhow!("the shared policy document does not decode: {e}"))
}

/// `doc` with every configured key written as its digest.
fn without_plain_keys(mut doc: PolicyDocument) -> PolicyDocument {
    for tenant in doc.tenants.iter_mut().flatten() {
        tenant.api_keys = tenant
            .api_keys
            .iter()
            // Keys were validated with the document; one that did not parse would be left
            // out rather than written as it is.
            .filter_map(|k| KeyDigest::parse(k).ok())
            .map(|d| d.to_string())
            .collect();
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, TenantConfig};

    fn config() -> Config {
        let mut c = Config::default();
        c.semantic.enabled = false;
        c
    }

    /// A document shared at the defaults is one an earlier release reads (its `[semantic]`
    /// refuses keys it does not know); read back, a key left out is at its default, so a
    /// change back to the default reaches every replica.
    #[test]
    fn keys_at_their_defaults_are_left_out_and_read_back_as_defaults() {
        let mut c = config();
        let policies = Policies::build(&c, 1, None).unwrap();
        let bytes = encode(&policies, 1, None).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        for key in ["standalone", "context_equivalence", "followup_threshold"] {
            assert!(!text.contains(key), "{text}");
        }
        let read = decode(&bytes, 1, None).unwrap().semantic.unwrap();
        assert_eq!(read.standalone, Some(c.semantic.standalone));
        assert_eq!(read.followup_threshold, Some(-1.0));
        // Changed: written, and read as written.
        c.semantic.context_equivalence = !c.semantic.context_equivalence;
        c.semantic.followup_threshold = Some(0.8);
        let policies = Policies::build(&c, 2, None).unwrap();
        let bytes = encode(&policies, 2, None).unwrap();
        let read = decode(&bytes, 2, None).unwrap().semantic.unwrap();
        assert_eq!(
            read.context_equivalence,
            Some(c.semantic.context_equivalence)
        );
        assert_eq!(read.followup_threshold, Some(0.8));
        // Applied on a replica that runs another value: back to what the document says.
        let elsewhere = Policies::build(&c, 3, None).unwrap();
        let default_doc = decode(
            &encode(&Policies::build(&config(), 4, None).unwrap(), 4, None).unwrap(),
            4,
            None,
        )
        .unwrap();
        let next = elsewhere.next(default_doc, false).unwrap();
        assert_eq!(next.config.semantic.followup_threshold, None);
        assert_eq!(
            next.config.semantic.context_equivalence,
            config().semantic.context_equivalence
        );
    }

    fn tenant(keys: &[&str]) -> TenantConfig {
        TenantConfig {
            name: "acme".into(),
            api_keys: keys.iter().map(|k| k.to_string()).collect(),
            api_keys_env: Some("REPRISE_TEST_SHARE_KEYS_UNSET".into()),
            api_keys_file: None,
            sub_namespaces: true,
            admin_token_env: None,
            policy: Default::default(),
            candidate: None,
        }
    }

    fn bearer(key: &str) -> axum::http::HeaderMap {
        let mut h = axum::http::HeaderMap::new();
        h.insert("authorization", format!("Bearer {key}").parse().unwrap());
        h
    }

    #[test]
    fn keys_are_shared_as_digests_and_still_name_their_tenant() {
        let digest = KeyDigest::of("sk-two").to_string();
        let mut t = tenant(&["sk-one", &digest]);
        t.api_keys_env = None;
        let mut c = config();
        c.tenants = vec![t];
        let running = Policies::from_config(&c, 1).unwrap();
        let bytes = encode(&running, 2, None).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(
            !text.contains("sk-one") && !text.contains("sk-two"),
            "{text}"
        );
        assert!(
            text.contains(&KeyDigest::of("sk-one").to_string()),
            "{text}"
        );

        let fresh = Policies::from_config(&config(), 1).unwrap();
        let stored = SharedPolicies {
            version: 2,
            doc: bytes,
        };
        let next = next_shared(&fresh, &stored, false, None).unwrap().unwrap();
        for key in ["sk-one", "sk-two"] {
            let who = next.tenants.identify(&bearer(key)).unwrap();
            assert_eq!(who.name(), "acme", "{key}");
        }
    }

    #[test]
    fn a_shared_version_is_applied_only_when_newer_and_valid() {
        let mut c = config();
        c.semantic.threshold = 0.5;
        let stored = |version| SharedPolicies {
            version,
            doc: encode(&Policies::from_config(&c, 1).unwrap(), version, None).unwrap(),
        };
        // A replica at start (version 1, nothing shared yet) takes any shared version, and
        // then runs under its number.
        let start = Policies::from_config(&config(), 1).unwrap();
        let v4 = next_shared(&start, &stored(4), false, None)
            .unwrap()
            .unwrap();
        assert_eq!((v4.version, v4.shared), (4, 4));
        assert_eq!(v4.semantic.threshold, 0.5);
        assert!(next_shared(&v4, &stored(4), false, None).is_none());
        assert!(next_shared(&v4, &stored(3), false, None).is_none());
        // A change made here only (Redis down) counts locally, but the next shared version
        // replaces it.
        let local = v4.next(PolicyDocument::default(), false).unwrap();
        assert_eq!((local.version, local.shared), (5, 4));
        let v5 = next_shared(&local, &stored(5), false, None)
            .unwrap()
            .unwrap();
        assert_eq!((v5.version, v5.shared), (5, 5));
        // Not valid here: refused with the reason.
        let missing_var = SharedPolicies {
            version: 6,
            doc: serde_json::to_vec(&PolicyDocument {
                tenants: Some(vec![tenant(&["sk-one"])]),
                ..PolicyDocument::default()
            })
            .unwrap(),
        };
        let err = next_shared(&v5, &missing_var, false, None)
            .unwrap()
            .err()
            .unwrap();
        assert!(
            format!("{err:#}").contains("REPRISE_TEST_SHARE_KEYS_UNSET"),
            "{err:#}"
        );
        let garbage = SharedPolicies {
            version: 7,
            doc: b"{\"semantic\": 3}".to_vec(),
        };
        assert!(next_shared(&v5, &garbage, false, None).unwrap().is_err());
    }

    #[test]
    fn with_a_policy_key_only_documents_signed_with_it_are_taken() {
        let running = Policies::from_config(&config(), 1).unwrap();
        let key = PolicyKey::new("shared secret");
        let signed = encode(&running, 7, Some(&key)).unwrap();
        assert!(signed.starts_with(b"mac:"));
        assert!(decode(&signed, 7, Some(&key)).is_ok());
        // Unsigned, signed with another key, altered, or stored under another version (an
        // old signed document written back as a newer one): refused.
        let plain = encode(&running, 7, None).unwrap();
        assert!(decode(&plain, 7, Some(&key)).is_err());
        let other = encode(&running, 7, Some(&PolicyKey::new("another"))).unwrap();
        assert!(decode(&other, 7, Some(&key)).is_err());
        let mut altered = signed.clone();
        let last = altered.len() - 2;
        altered[last] ^= 1;
        assert!(decode(&altered, 7, Some(&key)).is_err());
        assert!(decode(&signed, 8, Some(&key)).is_err());
        // Without a key of its own a replica reads either.
        assert!(decode(&signed, 7, None).is_ok() && decode(&plain, 7, None).is_ok());
    }
}
