//! reprise as a process, killed with SIGKILL and started again: without Redis it keeps what
//! its periodic snapshot saved (so a crash loses at most one `snapshot_interval_secs`), with
//! Redis everything Redis was written; and a shutdown does not wait for open streams beyond
//! `server.shutdown_timeout_secs`.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use reprise_cache::testing::RedisServer;

/// A `reprise serve` process on a free loopback port; killed (SIGKILL) when dropped.
struct Process {
    child: Child,
    base: String,
}

impl Process {
    async fn start(config: &Path) -> Process {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(env!("CARGO_BIN_EXE_reprise"))
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("reprise starts");
        let p = Process {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let client = reqwest::Client::new();
        for _ in 0..600 {
            if let Ok(r) = client.get(format!("{}/readyz", p.base)).send().await {
                if r.status() == 200 {
                    return p;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("reprise never became ready");
    }

    async fn ask(&self, question: &str) -> String {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.base))
            .json(&chat_body(question))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        cache_status(&r)
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const QUESTIONS: [&str; 4] = [
    "How do I reset my password?",
    "What is the capital of France?",
    "How do I export a PNG?",
    "Which plans include priority support?",
];

fn write_config(dir: &Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("reprise.toml");
    std::fs::write(
        &path,
        format!("[backend]\nkind = \"fake\"\n\n[semantic]\nenabled = false\n\n{extra}"),
    )
    .unwrap();
    path
}

#[tokio::test]
async fn a_killed_server_keeps_what_its_last_snapshot_saved() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("cache.snapshot");
    let config = write_config(
        dir.path(),
        &format!(
            "[cache]\nsnapshot_path = {:?}\nsnapshot_interval_secs = 1\n",
            snapshot.display().to_string()
        ),
    );
    let p = Process::start(&config).await;
    for q in QUESTIONS {
        assert_eq!(p.ask(q).await, "miss");
    }
    // A periodic snapshot (no shutdown happens) holds every answer.
    let mut saved = 0;
    for _ in 0..300 {
        saved = std::fs::read_to_string(&snapshot)
            .map(|s| s.lines().filter(|l| l.starts_with("{\"entry\"")).count())
            .unwrap_or(0);
        if saved >= QUESTIONS.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        saved,
        QUESTIONS.len(),
        "no periodic snapshot with every answer"
    );
    p.kill();
    let p = Process::start(&config).await;
    for q in QUESTIONS {
        assert_eq!(p.ask(q).await, "exact", "{q} was lost");
    }
}

/// An admin delete is saved within seconds, not at the next periodic snapshot (an hour away, or
/// none at all with the interval 0): killed right after, the restarted server has the answers
/// kept and not the one deleted.
#[tokio::test]
async fn a_delete_is_saved_at_once_so_a_crash_cannot_bring_it_back() {
    const TOKEN_VAR: &str = "REPRISE_TEST_RESTART_ADMIN_TOKEN";
    std::env::set_var(TOKEN_VAR, "r3start");
    for interval in [3600, 0] {
        let dir = tempfile::tempdir().unwrap();
        let snapshot = dir.path().join("cache.snapshot");
        let config = write_config(
            dir.path(),
            &format!(
                "[cache]\nsnapshot_path = {:?}\nsnapshot_interval_secs = {interval}\n\n\
                 [server]\nadmin_token_env = {TOKEN_VAR:?}\n",
                snapshot.display().to_string()
            ),
        );
        let p = Process::start(&config).await;
        let client = reqwest::Client::new();
        let r = client
            .post(format!("{}/v1/chat/completions", p.base))
            .json(&chat_body(QUESTIONS[0]))
            .send()
            .await
            .unwrap();
        let doomed = header(&r, "x-reprise-entry").unwrap();
        assert_eq!(p.ask(QUESTIONS[1]).await, "miss");
        let r = client
            .delete(format!("{}/admin/entries/{doomed}", p.base))
            .bearer_auth("r3start")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let saved = eventually(Duration::from_secs(30), || {
            std::fs::read_to_string(&snapshot)
                .is_ok_and(|s| s.lines().filter(|l| l.starts_with("{\"entry\"")).count() == 1)
        })
        .await;
        assert!(
            saved,
            "interval {interval}: the delete asked for no snapshot"
        );
        p.kill();
        let p = Process::start(&config).await;
        assert_eq!(p.ask(QUESTIONS[1]).await, "exact");
        assert_eq!(
            p.ask(QUESTIONS[0]).await,
            "miss",
            "interval {interval}: the deleted answer came back"
        );
    }
}

/// A snapshot is read within the memory budget: a snapshot of a bigger budget loads what
/// fits, and lines no entry could be (longer than the budget, a file without line ends) are
/// skipped without being held.
#[tokio::test]
async fn a_snapshot_loads_within_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.snapshot");
    let script = reprise_backend::fake::ScriptConfig {
        default_max_tokens: 20_000,
        ..Default::default()
    };
    let (app, _backend) = spawn_fake(test_config(), script).await;
    // Thirty answers of about 40 KB each (the fake backend repeats the question).
    for i in 0..30 {
        let question = format!("{i} {}", "word ".repeat(8_000));
        assert_eq!(
            cache_status(&app.chat(&chat_body(&question), &[]).await),
            "miss"
        );
    }
    assert_eq!(
        reprise::snapshot::save(&app.state, &path).unwrap().entries,
        30
    );
    drop(app);
    // A line of junk longer than the budget, and one without an end.
    let mut text = std::fs::read_to_string(&path).unwrap();
    let header_end = text.find('\n').unwrap() + 1;
    text.insert_str(header_end, &format!("{}\n", "x".repeat(2 << 20)));
    text.push_str(&"y".repeat(2 << 20));
    std::fs::write(&path, text).unwrap();

    let mut small = test_config();
    small.cache.memory_bytes = 1 << 20;
    let (app, _backend) = spawn_fake(small, reprise_backend::fake::ScriptConfig::default()).await;
    let loaded = reprise::snapshot::load(&app.state, &path).await.unwrap();
    assert!(
        loaded.entries > 0 && loaded.entries < 30,
        "{loaded:?}: thirty answers of 80 KB held within 1 MiB"
    );
    assert_eq!(loaded.skipped, 2, "{loaded:?}");
    assert!(loaded.keys > 0, "{loaded:?}");
    for (_, id) in app.state.store.keys() {
        assert!(
            app.state.store.get(id).await.is_some(),
            "a key of an entry not held"
        );
    }
    app.state.store.run_pending_tasks().await;
    assert!(app.state.store.weighted_size() <= 1 << 20);
}

/// Without Redis, the verdicts learned thresholds stand on survive a restart in the
/// snapshot: a threshold wrong verdicts raised stays raised (it fell back to the configured
/// one, serving again what had been found wrong), a scope's and an entry's own.
#[tokio::test]
async fn learned_thresholds_survive_a_restart_in_the_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.snapshot");
    let mut config = test_config();
    config.semantic.delta = 0.05;
    let threshold = |app: &TestApp| app.state.bounds.threshold("", "*/*", 0.05, 0.8, 0.5);
    let (app, _backend) = spawn_fake(config.clone(), Default::default()).await;
    assert_eq!(threshold(&app).threshold, 0.8);
    // A real id: 128 bits, past what a JSON number holds exactly.
    let entry = reprise_cache::EntryId::random();
    let own = |app: &TestApp| app.state.bounds.entry_threshold(entry, 0.05, 0.8, 0.5);
    for _ in 0..6 {
        app.state.bounds.record(
            &app.state,
            "",
            "*/*",
            Some(entry),
            0.85,
            true,
            reprise::bounds::Source::Feedback,
        );
    }
    let raised = threshold(&app).threshold;
    assert!(raised > 0.85, "{raised}");
    let entry_raised = own(&app).expect("the entry's own").threshold;
    assert!(entry_raised > 0.85, "{entry_raised}");
    reprise::snapshot::save(&app.state, &path).unwrap();
    drop(app);
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    assert_eq!(own(&app), None, "nothing before the snapshot is loaded");
    reprise::snapshot::load(&app.state, &path).await.unwrap();
    assert_eq!(threshold(&app).threshold, raised);
    assert_eq!(own(&app).map(|l| l.threshold), Some(entry_raised));
}

/// A save that fails (its directory missing, a full disk) is tried again: a delete asked to
/// be saved is saved once the disk takes it, with no periodic save to fall back on.
#[tokio::test]
async fn a_failed_save_is_tried_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("later").join("cache.snapshot");
    let mut config = test_config();
    config.cache.snapshot_path = Some(path.clone());
    config.cache.snapshot_interval_secs = 0;
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    app.chat(&chat_body("Saved at last?"), &[]).await;
    // As a delete does: the save fails, the directory is not there yet.
    app.state.snapshot_wanted.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!path.exists());
    std::fs::create_dir(dir.path().join("later")).unwrap();
    let saved = eventually(Duration::from_secs(30), || path.exists()).await;
    assert!(saved, "saved on a later try");
}

/// A snapshot holds every tenant's prompts and answers: it is readable by its owner only,
/// each save again (a save renames a new file into place).
#[cfg(unix)]
#[tokio::test]
async fn a_snapshot_is_readable_by_its_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache.snapshot");
    let (app, _backend) = spawn_fake(test_config(), Default::default()).await;
    app.chat(&chat_body("What is private?"), &[]).await;
    // A temporary file a crash left behind, readable by all.
    std::fs::write(path.with_extension("tmp"), "left").unwrap();
    let all = std::fs::Permissions::from_mode(0o644);
    std::fs::set_permissions(path.with_extension("tmp"), all.clone()).unwrap();
    for _ in 0..2 {
        reprise::snapshot::save(&app.state, &path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
        std::fs::set_permissions(&path, all.clone()).unwrap();
    }
}

#[tokio::test]
async fn a_killed_replica_loses_nothing_redis_was_written() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &format!("[redis]\nurl = {:?}\n", redis.url()));
    let p = Process::start(&config).await;
    for q in QUESTIONS {
        assert_eq!(p.ask(q).await, "miss");
    }
    // Writes are queued off the request path: wait until Redis holds them, then kill.
    let entries = || {
        let out = Command::new("redis-cli")
            .args([
                "-p",
                &redis.port().to_string(),
                "--scan",
                "--pattern",
                "reprise:e:*",
            ])
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    for _ in 0..300 {
        if entries() >= QUESTIONS.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(entries(), QUESTIONS.len());
    p.kill();
    let p = Process::start(&config).await;
    for q in QUESTIONS {
        assert_eq!(p.ask(q).await, "exact", "{q} was lost");
    }
}

/// `reprise::run` on a free loopback port, ready; it shuts down when told through the sender.
async fn run_until_told(
    config: reprise::Config,
) -> (
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(reprise::run(listener, config, async move {
        let _ = stopped.await;
    }));
    let ready = format!("http://{addr}/readyz");
    for _ in 0..600 {
        if matches!(reqwest::get(&ready).await, Ok(r) if r.status() == 200) {
            return (addr, stop, server);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("reprise never became ready");
}

/// A stream that would run for minutes does not hold a shutdown beyond
/// `server.shutdown_timeout_secs`, and the shutdown still saves the snapshot.
#[tokio::test]
async fn shutdown_does_not_wait_for_open_streams_forever() {
    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("cache.snapshot");
    let mut config = test_config();
    config.backend.kind = reprise::config::BackendKind::Fake;
    // About two seconds a token: the answer below would stream for more than half a minute.
    config.backend.fake_token_delay_ms = 2_000;
    config.server.shutdown_timeout_secs = 0.5;
    config.cache.snapshot_path = Some(snapshot.clone());
    let (addr, stop, server) = run_until_told(config).await;
    let client = reqwest::Client::new();
    let mut body = chat_body("Tell me a long story about a lighthouse keeper and the sea");
    body["stream"] = serde_json::json!(true);
    let mut stream = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    // The stream is open (its first token arrived); then the signal.
    assert!(stream.chunk().await.unwrap().is_some());
    stop.send(()).unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(20), server).await;
    let ended = ended.expect("shutdown waited for the open stream");
    ended.unwrap().unwrap();
    assert!(snapshot.exists(), "the shutdown saved no snapshot");
}

/// On shutdown the Redis write queue is written out before `run` returns: an answer given
/// just before the signal, while Redis was not taking writes, is in Redis afterwards.
#[tokio::test]
async fn shutdown_flushes_the_redis_write_queue() {
    let redis = RedisServer::start();
    let mut config = test_config();
    config.backend.kind = reprise::config::BackendKind::Fake;
    config.redis.url = Some(redis.url());
    config.redis.timeout_ms = 10_000;
    let (addr, stop, server) = run_until_told(config).await;
    let client = reqwest::Client::new();
    // Redis holds writes back for two seconds; the answer's write waits in the queue.
    let port = redis.port().to_string();
    let paused = Command::new("redis-cli")
        .args(["-p", port.as_str(), "CLIENT", "PAUSE", "2000", "WRITE"])
        .status()
        .expect("redis-cli runs");
    assert!(paused.success());
    let r = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&chat_body("What is the capital of France?"))
        .send()
        .await
        .unwrap();
    assert_eq!(cache_status(&r), "miss");
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
    let out = Command::new("redis-cli")
        .args(["-p", port.as_str(), "--scan", "--pattern", "reprise:e:*"])
        .output()
        .expect("redis-cli runs");
    let entries = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(entries, 1, "the queued write was not flushed on shutdown");
}
