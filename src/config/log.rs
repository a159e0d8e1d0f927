//! `[log]`: the request log and how it is rotated, and their validation.

use std::path::PathBuf;

use serde::Deserialize;

use super::{invalid, ConfigError};

/// `[log]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// Write one JSON line per request to this file (off when absent).
    pub request_log: Option<PathBuf>,
    /// Size in bytes past which the request log is rotated: the line that passes it is the
    /// file's last, then the file is renamed `FILE.1` (older ones shift to `.2`, ...) and a
    /// fresh one started. At least 4096.
    pub request_log_max_bytes: u64,
    /// Rotated files kept beside the current one (`FILE.1` to `FILE.N`); the oldest beyond
    /// that is deleted. At least 1.
    pub request_log_files: usize,
    /// The first characters of each question kept in the request log and the stats (top
    /// missed questions, most-served pairs); 0 keeps no question text anywhere.
    pub question_chars: usize,
}

/// The smallest `request_log_max_bytes` accepted: a few lines per file at least.
const MIN_MAX_BYTES: u64 = 4096;

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            request_log: None,
            request_log_max_bytes: 100 * 1024 * 1024,
            request_log_files: 5,
            question_chars: 200,
        }
    }
}

impl LogConfig {
    /// Checks the rotation bounds.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.request_log_max_bytes < MIN_MAX_BYTES {
            return Err(invalid(
                "log.request_log_max_bytes",
                format!("must be at least {MIN_MAX_BYTES}"),
            ));
        }
        // The rotating writer counts bytes in a usize.
        if usize::try_from(self.request_log_max_bytes).is_err() {
            return Err(invalid(
                "log.request_log_max_bytes",
                format!("must be at most {}", usize::MAX),
            ));
        }
        if self.request_log_files == 0 {
            return Err(invalid("log.request_log_files", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;

    #[test]
    fn rotation_defaults_and_bounds() {
        let c = Config::from_toml("[log]\nrequest_log = \"r.jsonl\"\n").unwrap();
        assert_eq!(c.log.request_log_max_bytes, 100 * 1024 * 1024);
        assert_eq!(c.log.request_log_files, 5);
        let c = Config::from_toml("[log]\nrequest_log_max_bytes = 4096\nrequest_log_files = 1\n")
            .unwrap();
        assert_eq!(
            (c.log.request_log_max_bytes, c.log.request_log_files),
            (4096, 1)
        );
        for (text, key) in [
            (
                "[log]\nrequest_log_max_bytes = 4095\n",
                "log.request_log_max_bytes",
            ),
            ("[log]\nrequest_log_files = 0\n", "log.request_log_files"),
        ] {
            let err = Config::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        let example = Config::from_toml(include_str!("../../reprise.example.toml")).unwrap();
        let d = super::LogConfig::default();
        assert_eq!(example.log.request_log_max_bytes, d.request_log_max_bytes);
        assert_eq!(example.log.request_log_files, d.request_log_files);
    }
}
