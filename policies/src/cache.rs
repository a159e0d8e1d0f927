//! Whether a request may read and write the cache, from the configuration and the request's
//! `Cache-Control` directives, and how old an answer it accepts.
//!
//! [`Directives::parse`] reads the request's `Cache-Control` header values, [`access`] turns
//! the directives into what the request may do with the cache, [`Freshness`] says
//! whether a stored answer is young enough for its `max-age`, and [`StaleWindows`] how long
//! past its expiry an answer may still be served (RFC 5861).

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
    /// `stale-while-revalidate=N` (RFC 5861): an answer at most N seconds past its expiry
    /// may be served while a fresh one is generated; narrows the policy's window, never
    /// widens it (capped at [`MAX_AGE_CAP_SECS`]).
    pub stale_while_revalidate_secs: Option<u64>,
    /// `stale-if-error=N` (RFC 5861): an answer at most N seconds past its expiry may be
    /// served when the backend fails; narrows the policy's window, never widens it (capped
    /// at [`MAX_AGE_CAP_SECS`]).
    pub stale_if_error_secs: Option<u64>,
}

/// A `Cache-Control` header the request cannot be served under. Its `Display` text is the
/// reason given to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheControlError {
    /// A `max-age` whose value is empty or not all digits.
    BadMaxAge,
    /// A `stale-while-revalidate` whose value is empty or not all digits.
    BadStaleWhileRevalidate,
    /// A `stale-if-error` whose value is empty or not all digits.
    BadStaleIfError,
    /// A value with bytes other than visible ASCII, space and tab: unreadable, and a
    /// `no-store` in it must not be lost.
    NotVisibleAscii,
}

impl std::fmt::Display for CacheControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheControlError::BadMaxAge => "max-age must be a whole number of seconds",
            CacheControlError::BadStaleWhileRevalidate => {
                "stale-while-revalidate must be a whole number of seconds"
            }
            CacheControlError::BadStaleIfError => {
                "stale-if-error must be a whole number of seconds"
            }
            CacheControlError::NotVisibleAscii => "must be visible ASCII",
        })
    }
}

impl std::error::Error for CacheControlError {}

impl Directives {
    /// Reads the directives of every `Cache-Control` header value of a request, in order.
    ///
    /// Directives are split on ',', trimmed and compared case-insensitively; unknown ones are
    /// ignored; `no-store`, `no-cache` and `only-if-cached` count with any value. A `max-age`, `stale-while-revalidate` or `stale-if-error` value may be quoted;
    /// one that is empty or not all digits is an error; one too large counts as
    /// [`MAX_AGE_CAP_SECS`]; of several of one name, the smallest wins.
    /// A value that is not visible ASCII (what `http::HeaderValue::to_str` refuses) is an
    /// error: skipping it could drop a `no-store` next to the bad bytes.
    pub fn parse<'a>(
        values: impl IntoIterator<Item = &'a str>,
    ) -> Result<Directives, CacheControlError> {
        let mut d = Directives::default();
        for value in values {
            if !value.bytes().all(visible_ascii) {
                return Err(CacheControlError::NotVisibleAscii);
            }
            for directive in value.split(',') {
                let directive = directive.trim().to_ascii_lowercase();
                match directive.as_str() {
                    "no-cache" => d.no_cache = true,
                    "no-store" => d.no_store = true,
                    "only-if-cached" => d.only_if_cached = true,
                    other => {
                        let Some((name, value)) = other.split_once('=') else {
                            continue;
                        };
                        // These take no value; one written with a value (`no-store=1`)
                        // still says what it names: ignoring it would store what the client
                        // asked to keep out.
                        let flag = match name.trim_end() {
                            f @ ("no-store" | "no-cache" | "only-if-cached") => f,
                            _ => name,
                        };
                        let (slot, bad) = match flag {
                            "no-store" => {
                                d.no_store = true;
                                continue;
                            }
                            "no-cache" => {
                                d.no_cache = true;
                                continue;
                            }
                            "only-if-cached" => {
                                d.only_if_cached = true;
                                continue;
                            }
                            "max-age" => (&mut d.max_age_secs, CacheControlError::BadMaxAge),
                            "stale-while-revalidate" => (
                                &mut d.stale_while_revalidate_secs,
                                CacheControlError::BadStaleWhileRevalidate,
                            ),
                            "stale-if-error" => (
                                &mut d.stale_if_error_secs,
                                CacheControlError::BadStaleIfError,
                            ),
                            _ => continue,
                        };
                        let secs = seconds(value).ok_or(bad)?;
                        // Several of one directive: the strictest wins.
                        *slot = Some(slot.map_or(secs, |m| m.min(secs)));
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

/// A delta-seconds value (RFC 9111 1.2.2), maybe quoted: `None` when empty or not all
/// digits; one too large counts as [`MAX_AGE_CAP_SECS`].
fn seconds(value: &str) -> Option<u64> {
    let value = value.trim_matches('"');
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // All digits, so a parse error can only be an overflow.
    Some(
        value
            .parse::<u64>()
            .map_or(MAX_AGE_CAP_SECS, |s| s.min(MAX_AGE_CAP_SECS)),
    )
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

/// How long past its expiry an answer may still be served (RFC 5861), in seconds; 0 turns a
/// kind off. Expired answers are never fresh: these windows are the only way one is served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StaleWindows {
    /// Served at once while a fresh answer is generated in the background
    /// (`stale-while-revalidate`).
    pub while_revalidate_secs: u64,
    /// Served instead of an error when the backend fails (`stale-if-error`).
    pub if_error_secs: u64,
}

impl StaleWindows {
    /// The policy's windows narrowed by the request's directives: a client may ask for less,
    /// never for more.
    pub fn narrowed(self, d: &Directives) -> StaleWindows {
        let narrow = |policy: u64, asked: Option<u64>| asked.map_or(policy, |a| a.min(policy));
        StaleWindows {
            while_revalidate_secs: narrow(
                self.while_revalidate_secs,
                d.stale_while_revalidate_secs,
            ),
            if_error_secs: narrow(self.if_error_secs, d.stale_if_error_secs),
        }
    }

    /// Whether an answer that expired at `expires_ms` may be served at `now_ms` (both Unix
    /// milliseconds) while a fresh one is generated: expired, at most
    /// `while_revalidate_secs` ago (to the millisecond).
    pub fn while_revalidate(&self, expires_ms: u64, now_ms: u64) -> bool {
        within(self.while_revalidate_secs, expires_ms, now_ms)
    }

    /// Whether an answer that expired at `expires_ms` may be served at `now_ms` when the
    /// backend fails: expired, at most `if_error_secs` ago.
    pub fn if_error(&self, expires_ms: u64, now_ms: u64) -> bool {
        within(self.if_error_secs, expires_ms, now_ms)
    }

    /// Whether either kind may serve an answer that expired at `expires_ms`.
    pub fn any(&self, expires_ms: u64, now_ms: u64) -> bool {
        self.while_revalidate(expires_ms, now_ms) || self.if_error(expires_ms, now_ms)
    }

    /// The longer window, in seconds.
    pub fn longest_secs(&self) -> u64 {
        self.while_revalidate_secs.max(self.if_error_secs)
    }
}

/// Expired (`now_ms >= expires_ms`) at most `window_secs` ago; never with a window of 0.
fn within(window_secs: u64, expires_ms: u64, now_ms: u64) -> bool {
    window_secs > 0
        && now_ms >= expires_ms
        && now_ms - expires_ms <= window_secs.saturating_mul(1000)
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
        // One that takes no value, written with one, still counts (the safe side).
        for v in ["no-store=1", "No-Store=\"true\"", "no-store =x"] {
            assert!(parse(&[v]).unwrap().no_store, "{v}");
        }
        assert!(parse(&["no-cache=\"authorization\""]).unwrap().no_cache);
        assert!(parse(&["only-if-cached=1"]).unwrap().only_if_cached);
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
    fn stale_directives_are_read_like_max_age() {
        let d = parse(&["Stale-While-Revalidate=30, stale-if-error=\"600\""]).unwrap();
        assert_eq!(d.stale_while_revalidate_secs, Some(30));
        assert_eq!(d.stale_if_error_secs, Some(600));
        // Several: the strictest wins; too large: the cap.
        let d = parse(&[
            "stale-if-error=60",
            "stale-if-error=5, stale-while-revalidate=1e3",
        ]);
        assert_eq!(d, Err(CacheControlError::BadStaleWhileRevalidate));
        let d = parse(&["stale-if-error=60", "stale-if-error=5"]).unwrap();
        assert_eq!(d.stale_if_error_secs, Some(5));
        let d = parse(&["stale-while-revalidate=99999999999999999999999"]).unwrap();
        assert_eq!(d.stale_while_revalidate_secs, Some(MAX_AGE_CAP_SECS));
        for (bad, err) in [
            (
                "stale-while-revalidate=",
                CacheControlError::BadStaleWhileRevalidate,
            ),
            (
                "stale-while-revalidate=-1",
                CacheControlError::BadStaleWhileRevalidate,
            ),
            ("stale-if-error=soon", CacheControlError::BadStaleIfError),
            ("stale-if-error=1.5", CacheControlError::BadStaleIfError),
        ] {
            assert_eq!(parse(&[bad]), Err(err), "{bad}");
        }
        assert_eq!(
            CacheControlError::BadStaleIfError.to_string(),
            "stale-if-error must be a whole number of seconds"
        );
        // Without a value they are unknown directives, ignored like any other.
        assert_eq!(parse(&["stale-if-error"]), Ok(Directives::default()));
    }

    #[test]
    fn a_client_narrows_the_stale_windows_never_widens_them() {
        let policy = StaleWindows {
            while_revalidate_secs: 60,
            if_error_secs: 3600,
        };
        let asked = |v: &str| policy.narrowed(&parse(&[v]).unwrap());
        assert_eq!(asked(""), policy);
        assert_eq!(
            asked("stale-while-revalidate=10, stale-if-error=999999"),
            StaleWindows {
                while_revalidate_secs: 10,
                if_error_secs: 3600,
            }
        );
        assert_eq!(asked("stale-if-error=0").if_error_secs, 0);
        let off = StaleWindows::default();
        assert_eq!(off.narrowed(&parse(&["stale-if-error=60"]).unwrap()), off);
    }

    #[test]
    fn stale_window_boundaries() {
        let w = StaleWindows {
            while_revalidate_secs: 10,
            if_error_secs: 0,
        };
        let expired = 1_000_000;
        assert!(!w.while_revalidate(expired, expired - 1), "not expired yet");
        assert!(w.while_revalidate(expired, expired));
        assert!(w.while_revalidate(expired, expired + 10_000));
        assert!(!w.while_revalidate(expired, expired + 10_001));
        assert!(!w.if_error(expired, expired), "a window of 0 is off");
        assert!(w.any(expired, expired + 1));
        assert_eq!(w.longest_secs(), 10);
        let huge = StaleWindows {
            while_revalidate_secs: u64::MAX,
            if_error_secs: u64::MAX,
        };
        assert!(huge.if_error(0, u64::MAX));
    }

    #[test]
    fn a_value_that_is_not_visible_ascii_is_refused() {
        let bad = Err(CacheControlError::NotVisibleAscii);
        assert_eq!(parse(&["no-store, café"]), bad);
        assert_eq!(parse(&["max-age=x\u{7f}"]), bad);
        assert_eq!(parse(&["no-cache", "café"]), bad);
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
