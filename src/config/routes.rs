//! `[[backends]]` and `[[routes]]`: several named backends, and which one answers a request
//! (by the model it names, its tenant and its prompt size), with a fallback for when that one
//! is saturated or refuses.

use serde::Deserialize;

use super::{invalid, BackendConfig, Config, ConfigError};

/// Most `[[backends]]`; each holds a model or an upstream connection pool.
pub const MAX_BACKENDS: usize = 16;
/// Most `[[routes]]`; every request scans them in order.
pub const MAX_ROUTES: usize = 256;

/// One `[[routes]]` table: the requests it matches (every condition set must hold; none set:
/// every request) and the backend that answers them. The first route that matches decides.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteConfig {
    /// The model the request names: one a backend serves, or an alias such as `auto` that
    /// only routes know (clients see it in `/v1/models`; an alias only routes of other
    /// tenants name is not listed to a tenant). Absent: any model.
    pub model: Option<String>,
    /// The tenant the request comes from (a `[[tenants]]` name). Absent: any tenant.
    pub tenant: Option<String>,
    /// Matches only prompts of at least this many characters (every message counted).
    pub min_prompt_chars: Option<usize>,
    /// Matches only prompts of at most this many characters.
    pub max_prompt_chars: Option<usize>,
    /// The backend that answers (a `[[backends]]` name; `default` without them). The request
    /// is served, cached and answered as this backend's model: the one it names when the
    /// backend serves it, else the backend's first model.
    pub backend: String,
    /// The backend that answers instead when `backend` is saturated (user requests that would
    /// be served first fill every slot: holders, and those waiting at the request's priority
    /// or above) or refuses at once (overloaded, unreachable). Such answers
    /// are marked degraded (`x-reprise-degraded: fallback`) and not stored.
    pub fallback: Option<String>,
    /// Its time-to-first-token target in seconds (`[degrade]` compares the predicted wait
    /// with it); absent: `slo.ttft_secs`.
    pub slo_ttft_secs: Option<f64>,
    /// Its whole-answer target in seconds; absent: `slo.total_secs`.
    pub slo_total_secs: Option<f64>,
}

impl RouteConfig {
    /// Whether a request for `model` from `tenant` with a prompt of `chars` characters
    /// matches.
    pub fn matches(&self, model: &str, tenant: &str, chars: usize) -> bool {
        self.model.as_deref().is_none_or(|m| m == model)
            && self.tenant.as_deref().is_none_or(|t| t == tenant)
            && self.min_prompt_chars.is_none_or(|n| chars >= n)
            && self.max_prompt_chars.is_none_or(|n| chars <= n)
    }
}

impl Config {
    /// The backends this configuration describes: `[[backends]]`, or `[backend]` alone.
    pub fn backend_tables(&self) -> Vec<&BackendConfig> {
        if self.backends.is_empty() {
            vec![&self.backend]
        } else {
            self.backends.iter().collect()
        }
    }

    /// The table of the backend other endpoints pass through to (`backend.passthrough`): the
    /// first upstream.
    pub fn forwarding_backend(&self) -> Option<&BackendConfig> {
        self.backend_tables()
            .into_iter()
            .find(|b| b.kind == super::BackendKind::Openai)
    }
}

/// Checks `[[backends]]` (each as `[backend]`, unique names) and `[[routes]]` (backends that
/// exist, tenants that exist, sane bounds).
pub(super) fn validate(config: &Config) -> Result<(), ConfigError> {
    if config.backends.len() > MAX_BACKENDS {
        return Err(invalid(
            "backends",
            format!("at most {MAX_BACKENDS} backends"),
        ));
    }
    for (i, b) in config.backends.iter().enumerate() {
        if b.name.is_empty() || b.name.len() > 64 || b.name.chars().any(char::is_control) {
            return Err(invalid(
                "backends.name",
                "must be 1 to 64 characters, no control characters",
            ));
        }
        if config.backends[..i].iter().any(|o| o.name == b.name) {
            return Err(invalid(
                "backends.name",
                format!("`{}` names two backends", b.name),
            ));
        }
        b.validate(Some(&b.name))?;
    }
    if config.routes.len() > MAX_ROUTES {
        return Err(invalid("routes", format!("at most {MAX_ROUTES} routes")));
    }
    let names: Vec<&str> = config
        .backend_tables()
        .iter()
        .map(|b| b.name.as_str())
        .collect();
    let known = |name: &str| names.contains(&name);
    for (i, r) in config.routes.iter().enumerate() {
        let at = format!("route {}", i + 1);
        if !known(&r.backend) {
            return Err(invalid(
                "routes.backend",
                format!(
                    "{at}: no backend `{}` (backends: {})",
                    r.backend,
                    names.join(", ")
                ),
            ));
        }
        if let Some(f) = &r.fallback {
            if !known(f) {
                return Err(invalid(
                    "routes.fallback",
                    format!("{at}: no backend `{f}` (backends: {})", names.join(", ")),
                ));
            }
            if *f == r.backend {
                return Err(invalid(
                    "routes.fallback",
                    format!("{at}: the fallback must be another backend than `{f}`"),
                ));
            }
        }
        if r.model.as_deref().is_some_and(str::is_empty) {
            return Err(invalid("routes.model", format!("{at}: must not be empty")));
        }
        if let Some(t) = &r.tenant {
            if !config.tenants.iter().any(|c| c.name == *t) {
                return Err(invalid(
                    "routes.tenant",
                    format!("{at}: no tenant `{t}` in [[tenants]]"),
                ));
            }
        }
        for (key, secs) in [
            ("routes.slo_ttft_secs", r.slo_ttft_secs),
            ("routes.slo_total_secs", r.slo_total_secs),
        ] {
            if secs.is_some_and(|s| !(s > 0.0 && s <= super::observe::MAX_SLO_SECS)) {
                let most = super::observe::MAX_SLO_SECS;
                return Err(invalid(
                    key,
                    format!("{at}: must be in (0, {most}] seconds"),
                ));
            }
        }
        if let (Some(lo), Some(hi)) = (r.min_prompt_chars, r.max_prompt_chars) {
            if lo > hi {
                return Err(invalid(
                    "routes.min_prompt_chars",
                    format!("{at}: more than max_prompt_chars"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"
[[backends]]
name = "small"
kind = "fake"
model_name = "small-model"

[[backends]]
name = "large"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
model_name = "large-model"
"#;

    #[test]
    fn backends_and_routes_parse() {
        let c = Config::from_toml(&format!(
            "{TWO}\n[[routes]]\nmodel = \"auto\"\nmax_prompt_chars = 200\nbackend = \"small\"\nfallback = \"large\"\n"
        ))
        .unwrap();
        assert_eq!(c.backends.len(), 2);
        assert_eq!(c.backend_tables()[1].name, "large");
        assert_eq!(c.forwarding_backend().unwrap().name, "large");
        let r = &c.routes[0];
        assert!(r.matches("auto", "", 200));
        assert!(
            !r.matches("auto", "", 201),
            "a longer prompt is not this route's"
        );
        assert!(!r.matches("small-model", "", 10), "another model is not");
    }

    #[test]
    fn without_backends_the_one_backend_is_default() {
        let c = Config::from_toml("[[routes]]\nmodel = \"auto\"\nbackend = \"default\"\n").unwrap();
        assert_eq!(c.backend_tables().len(), 1);
        assert!(c.forwarding_backend().is_none());
        let err = Config::from_toml("[[routes]]\nbackend = \"large\"\n").unwrap_err();
        assert!(err.to_string().contains("routes.backend"), "{err}");
    }

    #[test]
    fn bad_backends_and_routes_are_refused_by_key() {
        for (extra, key) in [
            (
                "[[backends]]\nname = \"small\"\nkind = \"fake\"\n",
                "backends.name",
            ),
            ("[[routes]]\nbackend = \"nope\"\n", "routes.backend"),
            (
                "[[routes]]\nbackend = \"small\"\nfallback = \"small\"\n",
                "routes.fallback",
            ),
            (
                "[[routes]]\nbackend = \"small\"\nfallback = \"gone\"\n",
                "routes.fallback",
            ),
            (
                "[[routes]]\nbackend = \"small\"\ntenant = \"nobody\"\n",
                "routes.tenant",
            ),
            (
                "[[routes]]\nbackend = \"small\"\nmin_prompt_chars = 10\nmax_prompt_chars = 5\n",
                "routes.min_prompt_chars",
            ),
            (
                "[[routes]]\nbackend = \"small\"\nmodel = \"\"\n",
                "routes.model",
            ),
        ] {
            let err = Config::from_toml(&format!("{TWO}\n{extra}")).unwrap_err();
            assert!(err.to_string().contains(key), "{extra}: {err}");
        }
        // Each backend is checked as [backend] is, and named.
        let err = Config::from_toml("[[backends]]\nname = \"up\"\nkind = \"openai\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("backends.base_url") && err.contains("`up`"),
            "{err}"
        );
    }
}
