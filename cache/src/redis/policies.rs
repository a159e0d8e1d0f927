//! The live policies every replica shares: one document under `{prefix}:policies` with a
//! version that only grows, announced on the event stream.
//!
//! The tier does not read the document (it is bytes to it); it keeps the version rule: a
//! replica publishes on top of the newest version it knows, and a publication based on an
//! older one is refused ([`PolicyPublish::Behind`]), so a change made on a replica that has
//! not yet seen another replica's change does not silently undo it. Each stored version is
//! above every earlier one, whichever replica stored it.

use ::redis::{FromRedisValue, Value};

use super::events;
use super::metrics::Op;
use super::{RedisError, RedisTier};

/// Stores a new version of the document unless a newer one than the caller's base is there.
/// One script over one hash (`version`, `doc`, `origin`), so the check and the write see one
/// state and the script runs on a cluster too. `HGET` of a missing field is `false` in Lua.
/// ARGV: the base (the newest version the caller knows), the version to store it as (it must
/// be above the stored one), the document, the caller's replica id. Returns `{1, version}`
/// when stored, `{0, newer}` when refused.
const PUBLISH_SCRIPT: &str = "\
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0') or 0
local v = tonumber(ARGV[2])
if cur > tonumber(ARGV[1]) or cur >= v then
  return {0, cur}
end
redis.call('HSET', KEYS[1], 'version', v, 'doc', ARGV[3], 'origin', ARGV[4])
return {1, v}";

/// Reads the document unless it is over the size cap (ARGV[1]): `false` when nothing is
/// stored, `"WRONGTYPE"` when the key is not a hash, `{version, doc}`, or `{version, n}` with
/// the document's length when it is over the cap (never sent).
const CAPPED_READ_SCRIPT: &str = "\
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'none' then return false end
if t ~= 'hash' then return {ok = 'WRONGTYPE'} end
local n = redis.call('HSTRLEN', KEYS[1], 'doc')
local v = redis.call('HGET', KEYS[1], 'version')
if n > tonumber(ARGV[1]) then return {v, n} end
return {v, redis.call('HGET', KEYS[1], 'doc')}";

/// What [`RedisTier::publish_policies`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyPublish {
    /// Stored as this version and announced to the other replicas.
    Stored(u64),
    /// Not stored: another replica stored this version, newer than the caller's base.
    Behind(u64),
}

/// The shared policy document as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPolicies {
    /// Its version.
    pub version: u64,
    /// The document, as the publisher wrote it.
    pub doc: Vec<u8>,
}

impl RedisTier {
    /// Stores `doc` as `version` of the shared policies and announces it on the event
    /// stream. `base`: the newest stored version the caller's document builds on (a newer
    /// one stored meanwhile refuses the publication; `None`: any). A stored version at or
    /// above `version` refuses it too: versions only grow, and the caller knows the number
    /// before storing (a signed document covers it).
    ///
    /// The announcement is a second command (the stream lives in another cluster slot): if
    /// it fails, the version is stored all the same and is returned; the other replicas find
    /// it on their next policy event, resync or restart.
    pub async fn publish_policies(
        &self,
        base: Option<u64>,
        version: u64,
        doc: &[u8],
    ) -> Result<PolicyPublish, RedisError> {
        let shared = &self.shared;
        let cmd = ::redis::cmd("EVAL")
            .arg(PUBLISH_SCRIPT)
            .arg(1)
            .arg(shared.keys.policies())
            .arg(base.unwrap_or(u64::MAX))
            .arg(version)
            .arg(doc)
            .arg(&shared.replica_id)
            .clone();
        let (stored, version): (u8, u64) = shared
            .run(Op::Policies, |c| async move { c.query(&cmd).await })
            .await?;
        if stored == 0 {
            return Ok(PolicyPublish::Behind(version));
        }
        let event = shared.policies_event(version);
        let announced = shared
            .run(
                Op::Policies,
                |c| async move { c.query::<Value>(&event).await },
            )
            .await;
        if let Err(e) = announced {
            tracing::warn!(version, error = %e, "redis: policies stored but not announced");
        }
        Ok(PolicyPublish::Stored(version))
    }

    /// The shared policies, if any replica published some. A document over
    /// `max_value_bytes` is never sent: it is skipped (counted) and read as none, like a
    /// value that is not a hash or a version that is not a number.
    pub async fn get_policies(&self) -> Result<Option<SharedPolicies>, RedisError> {
        let shared = &self.shared;
        let key = shared.keys.policies();
        let cmd = ::redis::cmd("EVAL")
            .arg(CAPPED_READ_SCRIPT)
            .arg(1)
            .arg(&key)
            .arg(shared.max_value_bytes)
            .clone();
        let reply: Value = shared
            .run(Op::Policies, |c| async move { c.query(&cmd).await })
            .await?;
        let (version, doc) = match reply {
            Value::Array(fields) => {
                match <(Option<String>, Value)>::from_redis_value(Value::Array(fields)) {
                    Ok(fields) => fields,
                    Err(_) => {
                        shared.skip(&key, "not a policy document");
                        return Ok(None);
                    }
                }
            }
            Value::SimpleString(s) if s == "WRONGTYPE" => {
                shared.skip(&key, "not a hash");
                return Ok(None);
            }
            _ => return Ok(None),
        };
        let (Some(version), doc) = (version, doc) else {
            return Ok(None);
        };
        let doc = match doc {
            Value::Int(n) => {
                tracing::warn!(bytes = n, "redis: shared policies over max_value_bytes");
                shared.skip(&key, "over max_value_bytes");
                return Ok(None);
            }
            Value::Nil => return Ok(None),
            other => match Vec::<u8>::from_redis_value(other) {
                Ok(doc) => doc,
                Err(_) => {
                    shared.skip(&key, "not a policy document");
                    return Ok(None);
                }
            },
        };
        match version.parse() {
            Ok(version) => Ok(Some(SharedPolicies { version, doc })),
            Err(_) => {
                shared.skip(&key, "version is not a number");
                Ok(None)
            }
        }
    }
}

impl super::shared::Shared {
    /// The `XADD` announcing a new version of the shared policies.
    fn policies_event(&self, version: u64) -> ::redis::Cmd {
        self.xadd(events::OP_POLICIES)
            .arg("version")
            .arg(version)
            .arg("origin")
            .arg(&self.replica_id)
            .clone()
    }
}
