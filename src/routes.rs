//! Several backends and the routes between them.
//!
//! A [`Router`] holds the named backends (`[[backends]]`, or the one `[backend]`) and the
//! `[[routes]]`. The request path asks it once per request ([`Router::choose`]) which backend
//! answers and as which model; the request is then looked up, generated and stored under
//! that served model, so answers of different models never mix. Everything else talks to the
//! router as to one [`Backend`]: a generation goes to the backend that serves its model, the
//! load and readiness are those of all of them.
//!
//! A route may name a fallback: when its backend is saturated (every slot and the waiting
//! line taken by user requests) or refuses a generation at once (overloaded, unreachable),
//! the fallback answers instead ([`Router::generate_routed`]); such an answer is marked
//! degraded and never stored (it is not the primary's answer).

use std::sync::Arc;

use reprise_backend::{
    Backend, BackendError, ForwardRequest, Forwarded, GenRequest, GenStream, Input, Load,
};

use crate::config::RouteConfig;

/// One named backend.
pub struct Target {
    /// Its `[[backends]]` name (`default` for `[backend]`).
    pub name: String,
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// The models it serves (empty: any model, an upstream decides).
    models: Vec<String>,
}

impl Target {
    /// Whether it serves `model` by name.
    fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }

    /// The model a request naming `asked` is served as here: `asked` when this backend
    /// serves it (or serves any model), else its first model.
    pub fn served_model(&self, asked: &str) -> String {
        if self.models.is_empty() || self.serves(asked) {
            asked.to_string()
        } else {
            self.models[0].clone()
        }
    }

    /// Whether user requests hold every slot and the waiting line: a new one would only
    /// wait. Background holders do not count (a user request preempts them). Never for a
    /// backend that cannot tell its capacity.
    pub fn saturated(&self) -> bool {
        let load = self.backend.load();
        let users = load.running - load.running_background.min(load.running);
        load.capacity > 0 && users + load.queued_user() >= load.capacity
    }
}

/// The backend a request goes to, and where it goes when that one cannot take it.
#[derive(Clone)]
pub struct Choice {
    /// The backend that answers.
    pub primary: Arc<Target>,
    /// The model the request is served (and cached) as.
    pub model: String,
    /// The backend that answers instead when the primary is saturated or refuses.
    pub fallback: Option<Arc<Target>>,
}

struct Route {
    config: RouteConfig,
    primary: Arc<Target>,
    fallback: Option<Arc<Target>>,
}

/// The backends and the routes between them.
pub struct Router {
    targets: Vec<Arc<Target>>,
    routes: Vec<Route>,
}

impl Router {
    /// The router over `backends` (in configuration order) and `routes`, whose backend names
    /// must be among them. Two backends serving one model by name would make the model's
    /// answers ambiguous: refused.
    pub fn new(
        backends: Vec<(String, Arc<dyn Backend>)>,
        routes: &[RouteConfig],
    ) -> anyhow::Result<Router> {
        anyhow::ensure!(!backends.is_empty(), "no backend");
        let targets: Vec<Arc<Target>> = backends
            .into_iter()
            .map(|(name, backend)| {
                let models = backend.models();
                Arc::new(Target {
                    name,
                    backend,
                    models,
                })
            })
            .collect();
        for (i, t) in targets.iter().enumerate() {
            for o in &targets[..i] {
                if let Some(m) = t.models.iter().find(|m| o.serves(m)) {
                    anyhow::bail!(
                        "backends `{}` and `{}` both serve the model `{m}`: give one another model_name",
                        o.name,
                        t.name
                    );
                }
            }
        }
        let find = |name: &str| {
            targets
                .iter()
                .find(|t| t.name == name)
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("routes name the backend `{name}`, not built"))
        };
        let routes = routes
            .iter()
            .map(|r| {
                Ok(Route {
                    config: r.clone(),
                    primary: find(&r.backend)?,
                    fallback: r.fallback.as_deref().map(find).transpose()?,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Router { targets, routes })
    }

    /// One backend, no routes.
    pub fn single(backend: Arc<dyn Backend>) -> Router {
        Router::new(vec![("default".into(), backend)], &[]).expect("one backend")
    }

    /// The backends, in configuration order.
    pub fn targets(&self) -> &[Arc<Target>] {
        &self.targets
    }

    /// The model names clients may ask for: every backend's and every route's (aliases);
    /// empty when some backend serves any model (an upstream decides).
    pub fn model_names(&self) -> Vec<String> {
        if self.targets.iter().any(|t| t.models.is_empty()) {
            return Vec::new();
        }
        let mut names: Vec<String> = Vec::new();
        let all = self.targets.iter().flat_map(|t| t.models.iter());
        let aliases = self.routes.iter().filter_map(|r| r.config.model.as_ref());
        for m in all.chain(aliases) {
            if !names.contains(m) {
                names.push(m.clone());
            }
        }
        names
    }

    /// Which backend answers a request for `model` from `tenant` with a prompt of
    /// `prompt_chars` characters: the first route that matches, else the backend serving
    /// the model by name, else the first that serves any model. `None`: nothing serves it.
    pub fn choose(&self, model: &str, tenant: &str, prompt_chars: usize) -> Option<Choice> {
        if let Some(r) = self
            .routes
            .iter()
            .find(|r| r.config.matches(model, tenant, prompt_chars))
        {
            return Some(Choice {
                model: r.primary.served_model(model),
                primary: r.primary.clone(),
                fallback: r.fallback.clone(),
            });
        }
        let primary = self.serving(model)?;
        Some(Choice {
            model: model.to_string(),
            primary,
            fallback: None,
        })
    }

    /// The backend that serves `model`: by name, else the first that serves any model.
    fn serving(&self, model: &str) -> Option<Arc<Target>> {
        self.targets
            .iter()
            .find(|t| t.serves(model))
            .or_else(|| self.targets.iter().find(|t| t.models.is_empty()))
            .cloned()
    }

    /// Starts a generation on the backend serving `req.model`, or on `fallback` when that
    /// one is saturated or refuses at once (overloaded, unreachable). With the fallback, the
    /// request is sent as the fallback's model, which comes back with the stream.
    pub async fn generate_routed(
        &self,
        req: GenRequest,
        fallback: Option<&Target>,
    ) -> Result<(GenStream, Option<String>), BackendError> {
        let primary = self
            .serving(&req.model)
            .ok_or_else(|| BackendError::UnknownModel(req.model.clone()))?;
        let Some(fallback) = fallback else {
            return Ok((primary.backend.generate(req).await?, None));
        };
        if !primary.saturated() {
            match primary.backend.generate(req.clone()).await {
                Err(BackendError::Overloaded { .. } | BackendError::Unavailable(_)) => {}
                other => return other.map(|s| (s, None)),
            }
        }
        let mut req = req;
        req.model = fallback.served_model(&req.model);
        let model = req.model.clone();
        let stream = fallback.backend.generate(req).await?;
        Ok((stream, Some(model)))
    }
}

/// The size a route's prompt bounds measure: the characters of every message (or of the
/// raw prompt).
pub fn prompt_chars(input: &Input) -> usize {
    match input {
        Input::Prompt(p) => p.chars().count(),
        Input::Chat(msgs) => msgs.iter().map(|m| m.content.chars().count()).sum(),
    }
}

#[async_trait::async_trait]
impl Backend for Router {
    async fn generate(&self, req: GenRequest) -> Result<GenStream, BackendError> {
        self.generate_routed(req, None).await.map(|(s, _)| s)
    }

    fn models(&self) -> Vec<String> {
        self.model_names()
    }

    fn ready(&self) -> bool {
        self.targets.iter().all(|t| t.backend.ready())
    }

    fn interactive_load(&self) -> usize {
        self.targets
            .iter()
            .map(|t| t.backend.interactive_load())
            .sum()
    }

    /// The sum over the backends; capacity 0 (unknown) when one cannot tell its own, so
    /// background work keeps to the rules for an unknown capacity.
    fn load(&self) -> Load {
        let mut sum = Load::default();
        let mut unknown = false;
        for t in &self.targets {
            let l = t.backend.load();
            unknown |= l.capacity == 0;
            sum.capacity += l.capacity;
            sum.running += l.running;
            sum.running_background += l.running_background;
            sum.queued += l.queued;
            sum.queued_interactive += l.queued_interactive;
            sum.queued_batch += l.queued_batch;
        }
        if unknown {
            sum.capacity = 0;
        }
        sum
    }

    fn forwards(&self) -> bool {
        self.targets.iter().any(|t| t.backend.forwards())
    }

    /// To the upstream serving the request's model, else the first upstream.
    async fn forward(&self, req: ForwardRequest) -> Result<Forwarded, BackendError> {
        let upstreams = || self.targets.iter().filter(|t| t.backend.forwards());
        let by_model = req
            .model
            .as_deref()
            .and_then(|m| upstreams().find(|t| t.serves(m)));
        match by_model.or_else(|| upstreams().next()) {
            Some(t) => t.backend.forward(req).await,
            None => Err(BackendError::InvalidRequest {
                message: format!("no backend answers `{}`", req.path),
                param: None,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reprise_backend::fake::{ScriptConfig, ScriptedBackend};

    fn scripted(model: &str) -> Arc<dyn Backend> {
        Arc::new(ScriptedBackend::new(ScriptConfig {
            model: model.into(),
            ..ScriptConfig::default()
        }))
    }

    fn route(toml: &str) -> RouteConfig {
        toml::from_str(toml).unwrap()
    }

    #[test]
    fn routes_decide_in_order_then_models_by_name() {
        let r = Router::new(
            vec![
                ("small".into(), scripted("s")),
                ("large".into(), scripted("l")),
            ],
            &[
                route("model = \"auto\"\nmax_prompt_chars = 10\nbackend = \"small\"\nfallback = \"large\""),
                route("model = \"auto\"\nbackend = \"large\""),
                route("tenant = \"acme\"\nmodel = \"s\"\nbackend = \"large\""),
            ],
        )
        .unwrap();
        let c = r.choose("auto", "", 5).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("small", "s"));
        assert_eq!(c.fallback.unwrap().name, "large");
        let c = r.choose("auto", "", 11).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("large", "l"));
        assert!(c.fallback.is_none());
        // A tenant's route sends a model another way, served as that backend's model.
        let c = r.choose("s", "acme", 1).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("large", "l"));
        // No route: the backend serving the model by name; nothing serving it: none.
        assert_eq!(r.choose("s", "other", 1).unwrap().primary.name, "small");
        assert!(r.choose("unknown", "", 1).is_none());
        assert_eq!(r.model_names(), ["s", "l", "auto"]);
    }

    #[test]
    fn two_backends_serving_one_model_are_refused() {
        let err = Router::new(
            vec![("a".into(), scripted("m")), ("b".into(), scripted("m"))],
            &[],
        )
        .err()
        .unwrap();
        assert!(
            err.to_string().contains("both serve the model `m`"),
            "{err}"
        );
    }

    #[test]
    fn prompt_size_counts_every_message() {
        use reprise_backend::ChatMessage;
        let msg = |c: &str| ChatMessage::new("user", c);
        assert_eq!(prompt_chars(&Input::Chat(vec![msg("héllo"), msg("ab")])), 7);
        assert_eq!(prompt_chars(&Input::Prompt("abc".into())), 3);
    }
}
