//! Test support: real `redis-server` processes on free ports (feature `testing`).
//!
//! Tests run against the real server rather than a fake, each with its own process on its
//! own port so they can run in parallel. The processes keep nothing on disk (`--save ""`,
//! `--appendonly no`, working directory in a temporary folder) and die with their handle.
//! These helpers panic on failure: they are for tests only.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How long a fresh server may take to answer PING.
const START_WAIT: Duration = Duration::from_secs(10);
/// Ports tried before giving up (another process may grab a port between our probe and the
/// server's bind).
const PORT_ATTEMPTS: usize = 20;

/// One `redis-server` process on 127.0.0.1.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    dir: TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers PING.
    pub fn start() -> RedisServer {
        Self::start_with(&[], false)
    }

    /// Starts a server with extra arguments; `bus` also reserves `port + 10000` (the cluster
    /// bus port).
    fn start_with(extra: &[String], bus: bool) -> RedisServer {
        let mut dir = tempfile::tempdir().expect("temporary directory for redis-server");
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port(bus);
            let mut server = RedisServer {
                port,
                child: None,
                dir,
                extra: extra.to_vec(),
            };
            if server.spawn() {
                return server;
            }
            dir = server.take_dir();
        }
        panic!("could not start redis-server on a free port");
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server; the port stays reserved for [`RedisServer::restart`] (nothing else
    /// in this process will pick it).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (empty: nothing is persisted).
    pub fn restart(&mut self) {
        self.stop();
        // The old socket may linger for a moment; redis-server retries nothing by itself.
        let deadline = Instant::now() + START_WAIT;
        while !self.spawn() {
            assert!(
                Instant::now() < deadline,
                "redis-server did not restart on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Launches the process; true once it answers PING, false if it exited (port taken).
    fn spawn(&mut self) -> bool {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--save")
            .arg("")
            .arg("--appendonly")
            .arg("no")
            .arg("--dir")
            .arg(self.dir.path())
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd
            .spawn()
            .expect("redis-server must be installed to run these tests");
        let deadline = Instant::now() + START_WAIT;
        loop {
            if ping(self.port) {
                self.child = Some(child);
                return true;
            }
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Moves the temporary directory out (to retry on another port).
    fn take_dir(mut self) -> TempDir {
        self.stop();
        let placeholder = tempfile::tempdir().expect("temporary directory");
        std::mem::replace(&mut self.dir, placeholder)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis Cluster of masters only, each a [`RedisServer`].
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` servers in cluster mode, joins them with `redis-cli --cluster
    /// create` and waits until every node reports `cluster_state:ok`.
    pub fn start(masters: usize) -> RedisCluster {
        assert!(masters >= 3, "redis-cli --cluster create needs 3 masters");
        let nodes: Vec<RedisServer> = (0..masters)
            .map(|_| {
                // The config file path must exist before the server starts writing it; a
                // fixed name inside each server's own temporary directory.
                let args = vec![
                    "--cluster-enabled".to_string(),
                    "yes".to_string(),
                    "--cluster-config-file".to_string(),
                    "nodes.conf".to_string(),
                    "--cluster-node-timeout".to_string(),
                    "5000".to_string(),
                ];
                RedisServer::start_with(&args, true)
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port()));
        }
        let out = create
            .arg("--cluster-replicas")
            .arg("0")
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli must be installed to run these tests");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_ok();
        cluster
    }

    /// `redis://127.0.0.1:<port>` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    fn wait_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all_ok = self.nodes.iter().all(|n| {
                command(n.port(), "CLUSTER INFO").is_some_and(|info| {
                    info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
                })
            });
            if all_ok {
                return;
            }
            assert!(Instant::now() < deadline, "cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A port nobody listens on now (and, with `bus`, `port + 10000` too).
fn free_port(bus: bool) -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local addr").port();
        if !bus {
            return port;
        }
        if port <= u16::MAX - 10_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Whether a server answers PING on `port`.
fn ping(port: u16) -> bool {
    command(port, "PING").is_some_and(|r| r.starts_with("+PONG"))
}

/// Sends one inline command and returns the raw reply (enough for PING and CLUSTER INFO).
fn command(port: u16, line: &str) -> Option<String> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(format!("{line}\r\n").as_bytes()).ok()?;
    let mut buf = vec![0u8; 8192];
    let mut out = Vec::new();
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if reply_complete(&out) {
            break;
        }
    }
    String::from_utf8(out).ok()
}

/// Whether `buf` holds one whole simple, error or bulk-string reply.
fn reply_complete(buf: &[u8]) -> bool {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        return false;
    };
    match buf.first() {
        Some(b'$') => {
            let len: i64 = std::str::from_utf8(&buf[1..eol])
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(-1);
            len < 0 || buf.len() >= eol + 2 + len as usize + 2
        }
        _ => true,
    }
}

/// What the heap a store given `budget` bytes may hold: the entries' budget plus the keys'
/// eighth. [`assert_heap_within`] adds a 2 % slack for the caches' fixed tables.
pub fn heap_allowed(budget: u64) -> u64 {
    budget + budget / 8
}

/// Asserts that `peak` bytes of heap are within what a store given `budget` bytes may hold
/// ([`heap_allowed`]), with 2 % slack for the caches' fixed tables (moka's frequency
/// sketches, hash table buckets).
pub fn assert_heap_within(peak: isize, budget: u64) {
    let allowed = heap_allowed(budget);
    let slack = allowed / 50;
    assert!(
        peak as u64 <= allowed + slack,
        "heap held by the store at peak ({peak} B) within its budget ({allowed} B + {slack} B slack)"
    );
}

/// A global allocator that counts the bytes live, for tests that measure what a structure
/// really holds: a test binary declares it as its `#[global_allocator]` and reads
/// [`CountingAllocator::live`] before and after (one test per binary, so nothing else
/// allocates meanwhile). Forwards to the system allocator; counts requested sizes.
pub struct CountingAllocator {
    live: std::sync::atomic::AtomicIsize,
}

impl CountingAllocator {
    /// A counter at zero.
    pub const fn new() -> Self {
        CountingAllocator {
            live: std::sync::atomic::AtomicIsize::new(0),
        }
    }

    /// Bytes allocated and not yet freed since the program started.
    pub fn live(&self) -> isize {
        self.live.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn add(&self, bytes: isize) {
        self.live
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// `GlobalAlloc` is an unsafe trait; every call forwards to the system allocator unchanged.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        self.add(layout.size() as isize);
        std::alloc::System.alloc(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        self.add(-(layout.size() as isize));
        std::alloc::System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        self.add(new_size as isize - layout.size() as isize);
        std::alloc::System.realloc(ptr, layout, new_size)
    }
}

/// A unit vector of `dim` components whose first `random` are pseudo-random (xorshift,
/// advancing `seed`, which must not be 0) and the rest zero: index test data whose effective
/// dimension the test chooses.
pub fn unit_vector(dim: usize, random: usize, seed: &mut u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..random.min(dim))
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed % 1000) as f32 / 1000.0 - 0.5
        })
        .collect();
    v.resize(dim, 0.0);
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
    v.iter().map(|x| x / norm).collect()
}

/// The `i`-th of a run of test answers: about 8 KiB of text, no embedding, of `origin`,
/// living an hour (in partition `[1; 32]`).
pub fn big_answer(i: usize, origin: crate::Origin) -> std::sync::Arc<crate::Entry> {
    std::sync::Arc::new(crate::Entry {
        id: crate::EntryId::random(),
        namespace: "ns".into(),
        model: "m".into(),
        text: format!("{i} {}", "a".repeat(8 * 1024)),
        finish_reason: "stop".into(),
        prompt_tokens: 1,
        completion_tokens: 1,
        prompt: format!("question {i}"),
        partition: [1; 32],
        embedding: None,
        embedder: None,
        origin,
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: crate::now_ms(),
        expires_ms: crate::now_ms() + 3_600_000,
        gen_ms: 1,
    })
}
