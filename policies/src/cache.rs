//! Whether a request may read and write the cache, from the configuration and the request's
//! `Cache-Control` directives, and how old an answer it accepts.
//!
//! [`Directives::parse`] reads the request's `Cache-Control` header values, [`access`] turns
//! the directives into what the request may do with the cache, and [`Freshness`] says
//! whether a stored answer is young enough for its `max-age`.

/// The largest `max-age` kept, in seconds: RFC 9111 1.2.2 has values too large to represent
/// count as 2^31 seconds (about 68 years).
pub const MAX_AGE_CAP_SECS: u64 = 1 << 31;

/// The request's cache directives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Directives {
    /// `no-cache`: do not answer from the cache; do store the fresh answer.
    pub no_cache: bool,
    /// `no-store`: neither read nor write.
    pub no_store: bool,
    /// `only-if-cached`: answer from the cache or not at all; never store.
    pub only_if_cached: bool,
    /// `max-age=N`: only answers at most N seconds old may be served (capped at
    /// [`MAX_AGE_CAP_SECS`]).
    pub max_age_secs: Option<u64>,
}

/// A `Cache-Control` header the request cannot be served under. Its `Display` text is the
/// reason given to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheControlError {
    /// A `max-age` whose value is empty or not all digits.
    BadMaxAge,
}

impl std::fmt::Display for CacheControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheControlError::BadMaxAge => "max-age must be a whole number of seconds",
        })
    }
}

impl std::error::Error for CacheControlError {}

impl Directives {
    /// Reads the directives of every `Cache-Control` header value of a request, in order.
    ///
    /// Directives are split on ',', trimmed and compared case-insensitively; unknown ones are
    /// ignored. A `max-age` value may be quoted; one that is empty or not all digits is an
    /// error; one too large counts as [`MAX_AGE_CAP_SECS`]; of several, the smallest wins.
    /// A value that is not visible ASCII (what `http::HeaderValue::to_str` refuses) counts as
    /// empty, so callers may pass `to_str().unwrap_or("")`.
    pub fn parse<'a>(
        values: impl IntoIterator<Item = &'a str>,
    ) -> Result<Directives, CacheControlError> {
        let mut d = Directives::default();
        for value in values {
            if !value.bytes().all(visible_ascii) {
                continue;
            }
            for directive in value.split(',') {
                let directive = directive.trim().to_ascii_lowercase();
                match directive.as_str() {
                    "no-cache" => d.no_cache = true,
                    "no-store" => d.no_store = true,
                    "only-if-cached" => d.only_if_cached = true,
                    other => {
                        if let Some(value) = other.strip_prefix("max-age=") {
                            let value = value.trim_matches('"');
                            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                                return Err(CacheControlError::BadMaxAge);
                            }
                            // All digits, so a parse error can only be an overflow.
                            let secs = value
                                .parse::<u64>()
                                .map_or(MAX_AGE_CAP_SECS, |s| s.min(MAX_AGE_CAP_SECS));
                            // Several max-age directives: the strictest wins.
                            d.max_age_secs = Some(d.max_age_secs.map_or(secs, |m| m.min(secs)));
                        }
                    }
                }
            }
        }
        Ok(d)
    }

    /// The age limit these directives put on a served answer.
    pub fn freshness(&self) -> Freshness {
        Freshness {
            max_age_secs: self.max_age_secs,
        }
    }
}

/// The bytes `http::HeaderValue::to_str` accepts: visible ASCII, space and tab.
fn visible_ascii(b: u8) -> bool {
    (32..127).contains(&b) || b == b'\t'
}

/// How old an answer a request accepts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Freshness {
    /// Oldest answer accepted, in seconds (`Cache-Control: max-age`); any age when absent.
    pub max_age_secs: Option<u64>,
}

impl Freshness {
    /// Whether an answer created at `created_ms` may be served at `now_ms` (both Unix
    /// milliseconds): at most `max_age_secs` old, to the millisecond. A creation time in
    /// the future counts as age zero.
    pub fn admits(&self, created_ms: u64, now_ms: u64) -> bool {
        self.max_age_secs
            .is_none_or(|max| now_ms.saturating_sub(created_ms) <= max.saturating_mul(1000))
    }
}

/// What the request may do with the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Look the request up.
    pub read: bool,
    /// Store its answer.
    pub write: bool,
    /// Have the backend generate an answer on a miss (else 504: `only-if-cached`).
    pub generate: bool,
}

/// Decides the cache access of one request.
pub fn access(enabled: bool, d: Directives) -> Access {
    Access {
        read: enabled && !d.no_cache && !d.no_store,
        write: enabled && !d.no_store && !d.only_if_cached,
        generate: !d.only_if_cached,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(values: &[&str]) -> Result<Directives, CacheControlError> {
        Directives::parse(values.iter().copied())
    }

    #[test]
    fn each_directive_is_read() {
        assert_eq!(parse(&[]), Ok(Directives::default()));
        assert!(parse(&["no-cache"]).unwrap().no_cache);
        assert!(parse(&["no-store"]).unwrap().no_store);
        assert!(parse(&["only-if-cached"]).unwrap().only_if_cached);
        assert_eq!(parse(&["max-age=60"]).unwrap().max_age_secs, Some(60));
        assert_eq!(parse(&["max-age=0"]).unwrap().max_age_secs, Some(0));
        // Case-insensitive, trimmed, unknown directives ignored.
        assert_eq!(
            parse(&[" No-Cache ,PRIVATE, max-stale=5,  MAX-AGE=7 "]),
            Ok(Directives {
                no_cache: true,
                max_age_secs: Some(7),
                ..Default::default()
            })
        );
        // A directive must stand alone between commas.
        assert_eq!(parse(&["no-cache-please"]), Ok(Directives::default()));
        assert_eq!(parse(&["max-age = 5"]), Ok(Directives::default()));
    }

    #[test]
    fn several_headers_add_up() {
        assert_eq!(
            parse(&["no-store", "only-if-cached, max-age=10"]),
            Ok(Directives {
                no_store: true,
                only_if_cached: true,
                max_age_secs: Some(10),
                ..Default::default()
            })
        );
    }

    #[test]
    fn max_age_values() {
        let age = |v: &str| parse(&[v]).map(|d| d.max_age_secs);
        assert_eq!(age("max-age=\"30\""), Ok(Some(30)));
        // Several: the strictest wins, whatever the order or header.
        assert_eq!(age("max-age=30, max-age=5, max-age=60"), Ok(Some(5)));
        assert_eq!(
            parse(&["max-age=5", "max-age=30"]).map(|d| d.max_age_secs),
            Ok(Some(5))
        );
        // Too large to represent: 2^31 (RFC 9111 1.2.2).
        assert_eq!(age("max-age=4294967296"), Ok(Some(1 << 31)));
        assert_eq!(
            age("max-age=99999999999999999999999999"),
            Ok(Some(MAX_AGE_CAP_SECS))
        );
        assert_eq!(age("max-age=2147483647"), Ok(Some(2_147_483_647)));
    }

    #[test]
    fn bad_max_age_is_an_error() {
        for bad in [
            "max-age=",
            "max-age=\"\"",
            "max-age=-1",
            "max-age=1.5",
            "max-age=10s",
            "max-age=+3",
            "no-cache, max-age=abc",
        ] {
            assert_eq!(parse(&[bad]), Err(CacheControlError::BadMaxAge), "{bad}");
        }
        assert_eq!(
            CacheControlError::BadMaxAge.to_string(),
            "max-age must be a whole number of seconds"
        );
    }

    #[test]
    fn a_value_that_is_not_visible_ascii_counts_as_empty() {
        assert_eq!(parse(&["no-store, café"]), Ok(Directives::default()));
        assert_eq!(parse(&["max-age=x\u{7f}"]), Ok(Directives::default()));
        assert!(parse(&["café", "no-cache"]).unwrap().no_cache);
        // Tabs are allowed.
        assert!(parse(&["\tno-cache"]).unwrap().no_cache);
    }

    #[test]
    fn freshness_boundary() {
        let f = Freshness {
            max_age_secs: Some(10),
        };
        let created = 1_000_000;
        assert!(f.admits(created, created));
        assert!(f.admits(created, created + 10_000));
        assert!(!f.admits(created, created + 10_001));
        // Created "in the future" (clock skew between nodes): age zero.
        assert!(f.admits(created, created - 5));
        let zero = Freshness {
            max_age_secs: Some(0),
        };
        assert!(zero.admits(created, created));
        assert!(!zero.admits(created, created + 1));
        // No max-age: any age.
        assert!(Freshness::default().admits(0, u64::MAX));
        // The cap does not overflow.
        let capped = Freshness {
            max_age_secs: Some(u64::MAX),
        };
        assert!(capped.admits(0, u64::MAX));
        assert_eq!(
            parse(&["max-age=3"]).unwrap().freshness(),
            Freshness {
                max_age_secs: Some(3)
            }
        );
    }

    #[test]
    fn directives() {
        let all = access(true, Directives::default());
        assert!(all.read && all.write && all.generate);
        let nc = access(
            true,
            Directives {
                no_cache: true,
                ..Default::default()
            },
        );
        assert!(!nc.read && nc.write);
        let ns = access(
            true,
            Directives {
                no_store: true,
                ..Default::default()
            },
        );
        assert!(!ns.read && !ns.write && ns.generate);
        let oic = access(
            true,
            Directives {
                only_if_cached: true,
                ..Default::default()
            },
        );
        assert!(oic.read && !oic.write && !oic.generate);
        let off = access(false, Directives::default());
        assert!(!off.read && !off.write && off.generate);
    }
}
