//! Configuration of the Redis tier (the `[redis]` section), with a `Debug` that keeps the
//! credentials in urls out of logs.

use std::fmt;

use serde::Deserialize;

/// Configuration of the Redis tier (the `[redis]` section).
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// Address of a single Redis server, e.g. `redis://127.0.0.1:6379` (credentials as
    /// `redis://user:password@host:port`). Absent, with `cluster_urls` empty: memory only.
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster; when non-empty, cluster mode is used and `url` ignored.
    pub cluster_urls: Vec<String>,
    /// Prefix of every key, so several deployments can share one Redis.
    pub prefix: String,
    /// Bound on each Redis command, milliseconds. A slower answer counts as a failure.
    pub timeout_ms: u64,
    /// Bound on establishing a connection, milliseconds.
    pub connect_timeout_ms: u64,
    /// Writes waiting for the background writer; beyond this they are dropped (and counted)
    /// rather than buffered without limit while Redis is slow.
    pub write_queue: usize,
    /// Bytes of writes waiting for the background writer (entries, keys, blobs); a write
    /// that would pass it is dropped (and counted) like one past `write_queue`.
    pub write_queue_bytes: u64,
    /// Consecutive failures (errors or timeouts) that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker fails calls fast before letting one probe through,
    /// milliseconds.
    pub breaker_cooldown_ms: u64,
    /// Approximate length the replication event stream is trimmed to (`XADD MAXLEN ~`).
    pub events_maxlen: usize,
    /// Largest value read from Redis (an entry, a record, the shared policy document),
    /// bytes. A larger value is never fetched: it reads as absent and counts in
    /// `reprise_redis_skipped_total`.
    pub max_value_bytes: usize,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            url: None,
            cluster_urls: Vec::new(),
            prefix: "reprise".into(),
            timeout_ms: 200,
            connect_timeout_ms: 1000,
            write_queue: 10_000,
            write_queue_bytes: 64 * 1024 * 1024,
            breaker_failures: 5,
            breaker_cooldown_ms: 2000,
            events_maxlen: 100_000,
            max_value_bytes: 8 << 20,
        }
    }
}

impl RedisConfig {
    /// Whether a Redis tier is configured at all.
    pub fn is_enabled(&self) -> bool {
        self.url.is_some() || !self.cluster_urls.is_empty()
    }
}

// Written by hand so that passwords in urls never reach logs.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field(
                "cluster_urls",
                &self
                    .cluster_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("prefix", &self.prefix)
            .field("timeout_ms", &self.timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("write_queue", &self.write_queue)
            .field("write_queue_bytes", &self.write_queue_bytes)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown_ms", &self.breaker_cooldown_ms)
            .field("events_maxlen", &self.events_maxlen)
            .field("max_value_bytes", &self.max_value_bytes)
            .finish()
    }
}

/// `redis://user:pass@host:6379/0` → `redis://***@host:6379/0`.
fn redact_url(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    match authority.rfind('@') {
        Some(at) => format!("{}***@{}", &url[..start], &rest[at + 1..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_credentials() {
        let cfg = RedisConfig {
            url: Some("redis://user:s3cret@10.0.0.1:6379/0".into()),
            cluster_urls: vec!["redis://:pw@h1:7000".into(), "redis://h2:7001".into()],
            ..RedisConfig::default()
        };
        let s = format!("{cfg:?}");
        assert!(!s.contains("s3cret") && !s.contains(":pw@"), "{s}");
        assert!(s.contains("redis://***@10.0.0.1:6379/0"), "{s}");
        assert!(s.contains("redis://h2:7001"), "{s}");
    }

    #[test]
    fn config_defaults_and_unknown_fields() {
        let cfg: RedisConfig = serde_json::from_str(r#"{"url":"redis://x"}"#).unwrap();
        assert_eq!(cfg.prefix, "reprise");
        assert_eq!(cfg.timeout_ms, 200);
        assert_eq!(cfg.write_queue, 10_000);
        assert!(serde_json::from_str::<RedisConfig>(r#"{"urll":"x"}"#).is_err());
    }
}
