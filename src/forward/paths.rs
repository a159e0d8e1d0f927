//! Which `/v1/...` paths pass through to the upstream: only endpoints `backend.passthrough`
//! lists, and only plain paths below the upstream's base URL.

use crate::state::AppState;

/// Whether a forwarded path is a plain path below the upstream's base URL: no empty, `.` or
/// `..` segment (also percent-encoded, which URL parsing resolves), no encoded slash, no
/// backslash. Otherwise `/v1/../admin` would reach the upstream's other paths with reprise's
/// key, and `/v1/chat/completions/` would slip past reprise's own route.
fn plain_api_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || lower.contains('\\') {
        return false;
    }
    lower
        .split('/')
        .map(|seg| seg.replace("%2e", "."))
        .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// The endpoint of a `/v1/...` path that `backend.passthrough` (of the first upstream, with
/// `[[backends]]`) opens to the upstream, if any.
pub(super) fn passthrough_endpoint<'a>(state: &'a AppState, path: &str) -> Option<&'a str> {
    if !state.backend.forwards() || !plain_api_path(path) {
        return None;
    }
    let root = path.split('/').next()?;
    // The completion endpoints are reprise's own, whatever the method or suffix.
    if matches!(root, "chat" | "completions") {
        return None;
    }
    // The first upstream's list (the router forwards a request without a model there).
    state
        .config
        .forwarding_backend()?
        .passthrough
        .iter()
        .find(|e| e.as_str() == root)
        .map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_paths_stay_below_the_base_url() {
        for ok in [
            "embeddings",
            "files/file-abc/content",
            "models/gpt-4o",
            "a.b/c..d",
        ] {
            assert!(plain_api_path(ok), "{ok}");
        }
        for bad in [
            "../admin",
            "files/../../admin",
            ".",
            "files/./x",
            "%2e%2e/admin",
            "%2E./admin",
            ".%2e/admin",
            "files%2f..%2fadmin",
            "files\\..\\admin",
            "embeddings/",
            "files//x",
            "",
        ] {
            assert!(!plain_api_path(bad), "{bad}");
        }
    }
}
