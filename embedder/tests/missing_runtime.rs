//! A missing ONNX Runtime library is an error naming the path, not a panic.
//!
//! Its own test binary: ort keeps the first library it loads for the life of the process,
//! so this must run where nothing has loaded one yet.

use reprise_embedder::{EmbedderConfig, FastEmbedder};

#[test]
fn a_missing_runtime_library_is_an_error_naming_it() {
    let cfg = EmbedderConfig {
        onnx_runtime: "/nonexistent/libonnxruntime.so".into(),
        ..EmbedderConfig::default()
    };
    let err = FastEmbedder::load(cfg).unwrap_err();
    assert_eq!(err.kind(), "runtime_missing");
    assert!(
        err.to_string().contains("/nonexistent/libonnxruntime.so"),
        "{err}"
    );
}

#[test]
fn a_file_that_is_not_a_library_is_an_error_naming_it() {
    let path = std::env::temp_dir().join(format!("reprise-not-a-lib-{}.so", std::process::id()));
    std::fs::write(&path, b"not a shared library").unwrap();
    let cfg = EmbedderConfig {
        onnx_runtime: path.clone(),
        ..EmbedderConfig::default()
    };
    let err = FastEmbedder::load(cfg).unwrap_err();
    std::fs::remove_file(&path).ok();
    assert_eq!(err.kind(), "runtime_load");
    assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");
}
