//! `[tracing]`: OpenTelemetry traces of requests, exported by OTLP/HTTP (protobuf) when an
//! endpoint is set ([`crate::otel`]).

use serde::Deserialize;

use super::{invalid, Config, ConfigError};

/// `[tracing]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// The OTLP/HTTP collector, e.g. `http://127.0.0.1:4318` (`/v1/traces` is added unless the
    /// URL already ends with it); no traces when absent.
    pub otlp_endpoint: Option<String>,
    /// The share of requests within `slo.total_secs` that are traced (0 to 1); a slower
    /// request is always traced.
    pub sample_share: f64,
    /// The `service.name` the traces carry.
    pub service_name: String,
    /// Spans waiting for export; past that, new ones are dropped (the request path never
    /// waits for the exporter).
    pub queue_spans: usize,
    /// Seconds one export may take (retries included).
    pub export_timeout_secs: f64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            sample_share: 0.01,
            service_name: "reprise".into(),
            queue_spans: 2048,
            export_timeout_secs: 10.0,
        }
    }
}

/// The URL `/v1/traces` is posted to.
pub fn traces_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        base.to_string()
    } else {
        format!("{base}/v1/traces")
    }
}

/// Most spans queued for export (about 1 KiB each).
pub const MAX_QUEUE_SPANS: usize = 1 << 20;

pub(super) fn validate(config: &Config) -> Result<(), ConfigError> {
    let t = &config.tracing;
    if let Some(endpoint) = &t.otlp_endpoint {
        match reqwest::Url::parse(&traces_url(endpoint)) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
            _ => {
                return Err(invalid(
                    "tracing.otlp_endpoint",
                    "must be an http:// or https:// URL",
                ))
            }
        }
    }
    if !(0.0..=1.0).contains(&t.sample_share) {
        return Err(invalid("tracing.sample_share", "must be in [0, 1]"));
    }
    if t.service_name.is_empty() {
        return Err(invalid("tracing.service_name", "must not be empty"));
    }
    if !(1..=MAX_QUEUE_SPANS).contains(&t.queue_spans) {
        return Err(invalid(
            "tracing.queue_spans",
            format!("must be in [1, {MAX_QUEUE_SPANS}]"),
        ));
    }
    if !(t.export_timeout_secs > 0.0 && t.export_timeout_secs <= 600.0) {
        return Err(invalid(
            "tracing.export_timeout_secs",
            "must be more than 0 and at most 600 seconds",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::traces_url;
    use crate::Config;

    #[test]
    fn the_endpoint_gets_its_path_and_bad_values_are_refused() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318"),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("https://c/otlp/v1/traces"),
            "https://c/otlp/v1/traces"
        );
        let c = Config::from_toml(
            "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_share = 0.5",
        )
        .unwrap();
        assert_eq!(c.tracing.sample_share, 0.5);
        assert_eq!(c.tracing.service_name, "reprise");
        for bad in [
            "[tracing]\notlp_endpoint = \"127.0.0.1:4318\"",
            "[tracing]\notlp_endpoint = \"grpc://c:4317\"",
            "[tracing]\nsample_share = 1.5",
            "[tracing]\nsample_share = nan",
            "[tracing]\nservice_name = \"\"",
            "[tracing]\nqueue_spans = 0",
            "[tracing]\nexport_timeout_secs = 0",
        ] {
            let e = Config::from_toml(bad).unwrap_err().to_string();
            assert!(e.contains("tracing."), "{bad}: {e}");
        }
    }

    #[test]
    fn example_file_matches_the_defaults() {
        let c = Config::from_toml(include_str!("../../reprise.example.toml")).unwrap();
        let (e, d) = (&c.tracing, &super::TracingConfig::default());
        assert_eq!(e.otlp_endpoint, d.otlp_endpoint);
        assert_eq!(e.sample_share, d.sample_share);
        assert_eq!(e.service_name, d.service_name);
        assert_eq!(e.queue_spans, d.queue_spans);
        assert_eq!(e.export_timeout_secs, d.export_timeout_secs);
    }
}
