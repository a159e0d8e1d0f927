//! Several backends and the routes between them.
//!
//! A [`Router`] holds the named backends (`[[backends]]`, or the one `[backend]`) and the
//! `[[routes]]`. The request path asks it once per request ([`Router::choose`]) which backend
//! answers and as which model; the request is then looked up, generated and stored under
//! that served model, so answers of different models never mix. Everything else talks to the
//! router as to one [`Backend`]: a generation goes to the backend its route chose
//! (`GenRequest::backend`, kept by the prefetch and refresh work that follows from it), else
//! to the one that serves its model, the
//! load and readiness are those of all of them.
//!
//! A route may name a fallback: when its backend is saturated (the user requests served
//! before this one, holding or waiting, fill every slot) or refuses a generation at once (overloaded, unreachable),
//! the fallback answers instead ([`Router::generate_routed`]); such an answer is marked
//! degraded and never stored (it is not the primary's answer).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use reprise_backend::{
    Backend, BackendError, ForwardRequest, Forwarded, GenRequest, GenStream, Input, Load, Priority,
};

use crate::config::{RouteConfig, SloConfig};

/// Weight of the newest generation in a backend's recent service times.
const EWMA_WEIGHT: f64 = 0.2;

/// One named backend.
pub struct Target {
    /// Its `[[backends]]` name (`default` for `[backend]`).
    pub name: String,
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// The models it serves (empty: any model, an upstream decides).
    models: Vec<String>,
    /// Its recent service times (user generations that did not wait for a slot).
    timing: Mutex<Timing>,
}

/// Moving averages of a backend's service times, in seconds.
#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    ttft: f64,
    total: f64,
    samples: u64,
}

/// What a user request arriving now would see from a backend, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Waiting for a slot.
    pub wait: f64,
    /// Until its first token.
    pub ttft: f64,
    /// Until its whole answer.
    pub total: f64,
}

/// A route's latency targets, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    /// First token.
    pub ttft: f64,
    /// Whole answer.
    pub total: f64,
}

impl Slo {
    /// Whether `p` breaks either target.
    pub fn broken_by(&self, p: &Prediction) -> bool {
        p.ttft > self.ttft || p.total > self.total
    }
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

    /// Whether a new request at `priority` would only wait: user requests ahead of it (see
    /// [`users_ahead`]) fill every slot. Never for a backend that cannot tell its capacity.
    pub fn saturated(&self, priority: Priority) -> bool {
        let load = self.backend.load();
        load.capacity > 0 && users_ahead(&load, priority) >= load.capacity
    }

    /// Notes the service times of a user generation that did not wait for a slot.
    pub fn record(&self, ttft: Duration, total: Duration) {
        let mut t = self.timing.lock();
        let w = if t.samples == 0 { 1.0 } else { EWMA_WEIGHT };
        t.ttft += w * (ttft.as_secs_f64() - t.ttft);
        t.total += w * (total.as_secs_f64() - t.total);
        t.samples += 1;
    }

    /// When a user request at `priority` arriving now would get its first token and its
    /// answer: the recent service times, after a wait of one service time per `capacity`
    /// user requests ahead of it beyond the free slots. `None` where the backend cannot tell its capacity
    /// or has not served anything yet (nothing to predict from).
    pub fn predict(&self, priority: Priority) -> Option<Prediction> {
        let load = self.backend.load();
        let t = *self.timing.lock();
        if load.capacity == 0 || t.samples == 0 {
            return None;
        }
        let ahead = users_ahead(&load, priority);
        let wait = match (ahead + 1).checked_sub(load.capacity) {
            Some(n) if n > 0 => n as f64 / load.capacity as f64 * t.total,
            _ => 0.0,
        };
        Some(Prediction {
            wait,
            ttft: wait + t.ttft,
            total: wait + t.total,
        })
    }
}

/// User requests served before a new one at `priority`: those holding a slot (background
/// holders do not count: a user request preempts them), and those waiting that go first (an
/// interactive request waits only behind those served at interactive rank, aged batch work
/// among them, the backends serving it before batch work that has not aged; a batch request
/// behind every user request).
fn users_ahead(load: &Load, priority: Priority) -> usize {
    let holding = load.running - load.running_background.min(load.running);
    let waiting = match priority {
        Priority::Interactive => load.queued_interactive,
        Priority::Batch | Priority::Background => load.queued_user(),
    };
    holding + waiting
}

/// A generation started by [`Router::generate_routed`].
pub struct Routed {
    /// Its events.
    pub stream: GenStream,
    /// The backend that runs it.
    pub target: Arc<Target>,
    /// The fallback's model, when the fallback runs it.
    pub fell_back: Option<String>,
    /// Whether it found a free slot (its times are service times, not waits).
    pub unqueued: bool,
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
    /// The route's latency targets.
    pub slo: Slo,
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
    /// Whether a route bounds the prompt size (else requests are not measured).
    sized: bool,
    /// Latency targets of requests no route sets them for.
    slo: Slo,
    /// Until when (ms since the epoch) background work is shed.
    shed_until_ms: AtomicU64,
}

impl Router {
    /// The router over `backends` (in configuration order) and `routes`, whose backend names
    /// must be among them. Two backends serving one model by name would make the model's
    /// answers ambiguous: refused.
    pub fn new(
        backends: Vec<(String, Arc<dyn Backend>)>,
        routes: &[RouteConfig],
        slo: &SloConfig,
    ) -> anyhow::Result<Router> {
        anyhow::ensure!(!backends.is_empty(), "no backend");
        let targets: Vec<Arc<Target>> = backends
            .into_iter()
            .map(|(name, backend)| {
                let models = backend.models();
                crate::metrics::register_backend(&name);
                Arc::new(Target {
                    name,
                    backend,
                    models,
                    timing: Mutex::default(),
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
        let sized = routes
            .iter()
            .any(|r| r.config.min_prompt_chars.is_some() || r.config.max_prompt_chars.is_some());
        Ok(Router {
            targets,
            routes,
            sized,
            slo: Slo {
                ttft: slo.ttft_secs,
                total: slo.total_secs,
            },
            shed_until_ms: AtomicU64::new(0),
        })
    }

    /// One backend, no routes.
    pub fn single(backend: Arc<dyn Backend>) -> Router {
        Router::new(
            vec![("default".into(), backend)],
            &[],
            &SloConfig::default(),
        )
        .expect("one backend")
    }

    /// Sheds background work for `period` (from now; a later end is kept).
    pub fn shed_background(&self, period: Duration) {
        let until = reprise_cache::now_ms() + period.as_millis() as u64;
        self.shed_until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether background work is shed now.
    pub fn shedding(&self) -> bool {
        reprise_cache::now_ms() < self.shed_until_ms.load(Ordering::Relaxed)
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

    /// Whether `name` is a route alias only other tenants' routes know (not a served model):
    /// not listed to `tenant`, whose requests for it find no route.
    pub fn alias_of_others(&self, name: &str, tenant: &str) -> bool {
        let served = self
            .targets
            .iter()
            .any(|t| t.models.iter().any(|m| m == name));
        let mut naming = self
            .routes
            .iter()
            .filter(|r| r.config.model.as_deref() == Some(name))
            .peekable();
        !served
            && naming.peek().is_some()
            && naming.all(|r| r.config.tenant.as_deref().is_some_and(|t| t != tenant))
    }

    /// Which backend answers a request for `model` from `tenant` with a prompt of
    /// `prompt_chars` characters: the first route that matches, else the backend serving
    /// the model by name, else the first that serves any model. `None`: nothing serves it.
    /// `prompt_chars` is only counted when a route bounds the prompt size.
    pub fn choose(
        &self,
        model: &str,
        tenant: &str,
        prompt_chars: impl FnOnce() -> usize,
    ) -> Option<Choice> {
        let chars = if self.sized { prompt_chars() } else { 0 };
        if let Some(r) = self
            .routes
            .iter()
            .find(|r| r.config.matches(model, tenant, chars))
        {
            return Some(Choice {
                model: r.primary.served_model(model),
                primary: r.primary.clone(),
                fallback: r.fallback.clone(),
                slo: Slo {
                    ttft: r.config.slo_ttft_secs.unwrap_or(self.slo.ttft),
                    total: r.config.slo_total_secs.unwrap_or(self.slo.total),
                },
            });
        }
        let primary = self.serving(model)?;
        Some(Choice {
            model: model.to_string(),
            primary,
            fallback: None,
            slo: self.slo,
        })
    }

    /// Whether some backend is up.
    pub fn any_ready(&self) -> bool {
        self.targets.iter().any(|t| t.backend.ready())
    }

    /// Each backend's name and whether it is up.
    pub fn readiness(&self) -> Vec<(&str, bool)> {
        self.targets
            .iter()
            .map(|t| (t.name.as_str(), t.backend.ready()))
            .collect()
    }

    /// The backend a generation of `req` goes to: the one its route chose
    /// (`GenRequest::backend`), else the one serving its model ([`Router::serving`]).
    pub fn target_for(&self, req: &GenRequest) -> Option<Arc<Target>> {
        let chosen = req.backend.as_deref().and_then(|name| self.named(name));
        chosen.or_else(|| self.serving(&req.model))
    }

    /// The backend configured as `name`.
    fn named(&self, name: &str) -> Option<Arc<Target>> {
        self.targets.iter().find(|t| t.name == name).cloned()
    }

    /// The backend a generation for `model` goes to when no route chose one (user and
    /// background alike): the one serving it by name, else the first that serves any model.
    pub fn serving(&self, model: &str) -> Option<Arc<Target>> {
        self.targets
            .iter()
            .find(|t| t.serves(model))
            .or_else(|| self.targets.iter().find(|t| t.models.is_empty()))
            .cloned()
    }

    /// Starts a generation on the backend serving `req.model`, or on the fallback when
    /// that one is saturated or refuses at once (overloaded, unreachable), or always when
    /// `to.force` (a degraded request). With the fallback, the request is sent as the
    /// fallback's model, which comes back with the stream.
    pub async fn generate_routed(
        &self,
        req: GenRequest,
        to: Option<&Fallback>,
    ) -> Result<Routed, BackendError> {
        let Some(primary) = self.target_for(&req) else {
            crate::metrics::backend_error("none", "unknown_model");
            return Err(BackendError::UnknownModel(req.model.clone()));
        };
        // Calls and refusals are counted here, by the backend asked; errors of a stream
        // once started are counted by its driver (`generate::spawn`).
        let start = |target: Arc<Target>, req: GenRequest, fell_back: Option<String>| async move {
            let unqueued = !target.saturated(req.priority);
            crate::metrics::backend_call(&target.name);
            let stream = target.backend.generate(req).await.inspect_err(|e| {
                crate::metrics::backend_error(&target.name, e.kind());
            })?;
            Ok::<_, BackendError>(Routed {
                stream,
                target,
                fell_back,
                unqueued,
            })
        };
        let Some(to) = to else {
            return start(primary, req, None).await;
        };
        if !to.force && !primary.saturated(req.priority) {
            match start(primary, req.clone(), None).await {
                Err(BackendError::Overloaded { .. } | BackendError::Unavailable(_)) => {}
                other => return other,
            }
        }
        let mut req = req;
        req.model = to.target.served_model(&req.model);
        let model = req.model.clone();
        start(to.target.clone(), req, Some(model)).await
    }
}

/// Where a generation goes when its backend cannot take it.
#[derive(Clone)]
pub struct Fallback {
    /// The backend.
    pub target: Arc<Target>,
    /// Go there without asking the primary (the request was degraded to it).
    pub force: bool,
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
        self.generate_routed(req, None).await.map(|r| r.stream)
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

    /// The sum over the backends; capacity 0 (unknown) when one cannot tell its own.
    /// Background work asks the backend its own generation goes to instead
    /// ([`crate::generate::room`]).
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

    /// To the upstream its route chose, else the one serving the request's model, else the
    /// first upstream.
    async fn forward(&self, req: ForwardRequest) -> Result<Forwarded, BackendError> {
        let upstreams = || self.targets.iter().filter(|t| t.backend.forwards());
        let chosen = req
            .backend
            .as_deref()
            .and_then(|name| upstreams().find(|t| t.name == name));
        let by_model = || {
            req.model
                .as_deref()
                .and_then(|m| upstreams().find(|t| t.serves(m)))
        };
        match chosen.or_else(by_model).or_else(|| upstreams().next()) {
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
            &SloConfig::default(),
        )
        .unwrap();
        let c = r.choose("auto", "", || 5).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("small", "s"));
        assert_eq!(c.fallback.unwrap().name, "large");
        let c = r.choose("auto", "", || 11).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("large", "l"));
        assert!(c.fallback.is_none());
        // A tenant's route sends a model another way, served as that backend's model.
        let c = r.choose("s", "acme", || 1).unwrap();
        assert_eq!((c.primary.name.as_str(), c.model.as_str()), ("large", "l"));
        // No route: the backend serving the model by name; nothing serving it: none.
        assert_eq!(r.choose("s", "other", || 1).unwrap().primary.name, "small");
        assert!(r.choose("unknown", "", || 1).is_none());
        assert_eq!(r.model_names(), ["s", "l", "auto"]);
    }

    #[test]
    fn two_backends_serving_one_model_are_refused() {
        let err = Router::new(
            vec![("a".into(), scripted("m")), ("b".into(), scripted("m"))],
            &[],
            &SloConfig::default(),
        )
        .err()
        .unwrap();
        assert!(
            err.to_string().contains("both serve the model `m`"),
            "{err}"
        );
    }

    #[test]
    fn batch_work_waiting_is_not_ahead_of_an_interactive_request() {
        let load = Load {
            capacity: 2,
            running: 2,
            running_background: 0,
            queued: 21,
            queued_interactive: 1,
            queued_batch: 20,
            kept_free: 0,
        };
        assert_eq!(users_ahead(&load, Priority::Interactive), 3);
        assert_eq!(users_ahead(&load, Priority::Batch), 23);
        // A user request preempts background holders.
        let load = Load {
            running_background: 2,
            queued: 0,
            queued_interactive: 0,
            queued_batch: 0,
            ..load
        };
        assert_eq!(users_ahead(&load, Priority::Interactive), 0);
    }

    #[test]
    fn prompt_size_counts_every_message() {
        use reprise_backend::ChatMessage;
        let msg = |c: &str| ChatMessage::new("user", c);
        assert_eq!(prompt_chars(&Input::Chat(vec![msg("héllo"), msg("ab")])), 7);
        assert_eq!(prompt_chars(&Input::Prompt("abc".into())), 3);
    }
}
