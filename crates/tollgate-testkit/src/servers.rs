//! A private `redis-server` for tests: started on a
//! free loopback port with no persistence, verified to be ours, stopped on
//! drop.
//!
//! Without `redis-server` on `PATH`, [`RedisServer::start`] returns `None`
//! after printing a loud skip message — except under `CI=true`, where it
//! panics, so CI can never pass by skipping.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running private Redis server.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

impl RedisServer {
    /// Starts a server, or returns `None` (loudly) when `redis-server` is
    /// not installed and `CI` is not `true`.
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// Like [`RedisServer::start`], with extra `redis-server` arguments.
    pub fn start_with(extra: &[&str]) -> Option<Self> {
        if Command::new("redis-server")
            .arg("--version")
            .output()
            .is_err()
        {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("redis-server is not on PATH, and CI=true requires the Redis tests to run");
            }
            eprintln!(
                "\n*** SKIPPED: redis-server is not on PATH; install it (apt-get install redis-server) to run the Redis tests ***\n"
            );
            return None;
        }
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {dir:?}: {e}"));
        let mut server = RedisServer {
            child: None,
            port,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        server.launch();
        Some(server)
    }

    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting redis-server: {e}"));
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(info) = self.query(&["INFO", "server"]) {
                let theirs = info
                    .lines()
                    .find_map(|l| l.strip_prefix("process_id:"))
                    .and_then(|p| p.trim().parse::<u32>().ok());
                assert_eq!(
                    theirs,
                    Some(pid),
                    "port {} is served by another redis-server",
                    self.port
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not start within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The URL the helpers connect with: with the password of a server
    /// started with `--requirepass`.
    fn admin_url(&self) -> String {
        let password = self
            .extra
            .iter()
            .position(|a| a == "--requirepass")
            .and_then(|i| self.extra.get(i + 1));
        match password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => self.url(),
        }
    }

    /// Runs one command and returns its reply as text (arrays joined by
    /// newlines, nil as empty).
    pub fn query(&self, args: &[&str]) -> Result<String, String> {
        query(&self.admin_url(), args)
    }

    /// The raw value stored at `key`, if any.
    pub fn get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, String> {
        let client = redis::Client::open(self.admin_url()).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .map_err(|e| e.to_string())?;
        redis::cmd("GET")
            .arg(key)
            .query(&mut conn)
            .map_err(|e| e.to_string())
    }

    /// Kills the server with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (after [`RedisServer::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Sends a signal (e.g. `STOP`, `CONT`) to the server.
    pub fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status();
        }
    }
}

/// A stored state decoded: (level, prior, era, offset), the first four of
/// the script's nine little-endian doubles (the rest are the numbers that
/// wrote it; earlier versions stored the four alone); `None` if `bytes` is
/// neither 72 nor 32 bytes.
pub fn decode_state(bytes: &[u8]) -> Option<(u64, u64, i64, u64)> {
    if bytes.len() != 72 && bytes.len() != 32 {
        return None;
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
        f64::from_le_bytes(b)
    };
    Some((
        word(0) as u64,
        word(1) as u64,
        word(2) as i64,
        word(3) as u64,
    ))
}

fn text(v: &redis::Value) -> String {
    match v {
        redis::Value::Nil => String::new(),
        redis::Value::Int(i) => i.to_string(),
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Okay => "OK".to_owned(),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().map(text).collect::<Vec<_>>().join("\n")
        }
        redis::Value::VerbatimString { text, .. } => text.clone(),
        other => format!("{other:?}"),
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.signal("CONT");
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A private three-node Redis Cluster (no replicas) on free loopback ports.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers and joins them, or returns
    /// `None` (loudly) as [`RedisServer::start`] does.
    pub fn start() -> Option<Self> {
        Self::start_with(|_| Vec::new())
    }

    /// Like [`RedisCluster::start`], with extra `redis-server` arguments for
    /// node `i` (0..3), e.g. `--cluster-announce-port` so that clients
    /// reach the node through a proxy the test runs.
    pub fn start_with(extra: impl Fn(usize) -> Vec<String>) -> Option<Self> {
        let mut nodes = Vec::new();
        for i in 0..3 {
            let mut args = vec!["--cluster-enabled".to_owned(), "yes".to_owned()];
            args.extend(extra(i));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let node = RedisServer::start_with(&args)?;
            nodes.push(node);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("running redis-cli --cluster create: {e}"));
        assert!(status.success(), "redis-cli --cluster create failed");
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &nodes {
            loop {
                let info = node.query(&["CLUSTER", "INFO"]).unwrap_or_default();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster did not become ok: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(Self { nodes })
    }

    /// `redis://127.0.0.1:PORT` of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The nodes, in start order.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }
}

/// Certificates for TLS tests, made with the `openssl` command in a fresh
/// directory: a CA, a server certificate for `127.0.0.1` it signed, an
/// expired one, and an unrelated CA (for the wrong-CA case).
#[derive(Debug)]
pub struct TestCertificates {
    dir: PathBuf,
}

impl TestCertificates {
    /// Makes the files, or returns `None` (loudly) when `openssl` is not
    /// installed — except under `CI=true`, where it panics.
    pub fn generate() -> Option<Self> {
        if Command::new("openssl").arg("version").output().is_err() {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("openssl is not on PATH, and CI=true requires the TLS tests to run");
            }
            eprintln!(
                "\n*** SKIPPED: openssl is not on PATH; install it (apt-get install openssl) to run the TLS tests ***\n"
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "tollgate-tls-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {dir:?}: {e}"));
        let certs = Self { dir };
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&certs.dir)
                .output()
                .unwrap_or_else(|e| panic!("openssl {args:?}: {e}"));
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        for ca in ["ca", "other-ca"] {
            run(&[
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=tollgate {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ]);
        }
        std::fs::write(
            certs.dir.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .unwrap_or_else(|e| panic!("writing san.ext: {e}"));
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        for (name, days) in [("server", "2"), ("expired", "-1")] {
            run(&[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                days,
                "-extfile",
                "san.ext",
                "-out",
                &format!("{name}.pem"),
            ]);
        }
        Some(certs)
    }

    /// The path of one of the files: `ca.pem`, `other-ca.pem`,
    /// `server.pem`, `server.key`, `expired.pem`.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// A file's contents.
    pub fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.path(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"))
    }

    /// `redis-server` arguments for a TLS port serving `cert` (e.g.
    /// `server.pem` or `expired.pem`), clients not asked for certificates.
    pub fn server_args(&self, tls_port: u16, cert: &str) -> Vec<String> {
        let path = |f: &str| self.path(f).to_string_lossy().into_owned();
        vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            path(cert),
            "--tls-key-file".into(),
            path("server.key"),
            "--tls-ca-cert-file".into(),
            path("ca.pem"),
            "--tls-auth-clients".into(),
            "no".into(),
        ]
    }
}

impl Drop for TestCertificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A free loopback port.
pub fn free_loopback_port() -> u16 {
    free_port()
}

/// A private `redis-sentinel` monitoring one master (quorum 1, the master
/// judged down after 1 s), stopped on drop.
#[derive(Debug)]
pub struct RedisSentinel {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl RedisSentinel {
    /// Starts a sentinel for the master `name` at `master_port`, or returns
    /// `None` (loudly) when `redis-sentinel` is not installed — except under
    /// `CI=true`, where it panics.
    pub fn start(name: &str, master_port: u16) -> Option<Self> {
        Self::start_with_auth(name, master_port, None)
    }

    /// As [`RedisSentinel::start`], for a master that requires `password`
    /// (`sentinel auth-pass`).
    pub fn start_with_auth(name: &str, master_port: u16, password: Option<&str>) -> Option<Self> {
        if Command::new("redis-sentinel")
            .arg("--version")
            .output()
            .is_err()
        {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!(
                    "redis-sentinel is not on PATH, and CI=true requires the Sentinel tests to run"
                );
            }
            eprintln!(
                "\n*** SKIPPED: redis-sentinel is not on PATH; install it (apt-get install redis-sentinel) to run the Sentinel tests ***\n"
            );
            return None;
        }
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {dir:?}: {e}"));
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\n\
                 sentinel monitor {name} 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 3000\n\
                 sentinel parallel-syncs {name} 1\n{}",
                dir.display(),
                password.map_or_else(String::new, |pw| format!(
                    "sentinel auth-pass {name} {pw}\n"
                )),
            ),
        )
        .unwrap_or_else(|e| panic!("writing {conf:?}: {e}"));
        let child = Command::new("redis-sentinel")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting redis-sentinel: {e}"));
        let sentinel = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while sentinel.query(&["PING"]).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-sentinel did not start within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(sentinel)
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs one command on the sentinel and returns its reply as text.
    pub fn query(&self, args: &[&str]) -> Result<String, String> {
        query(&self.url(), args)
    }

    /// The port of the master the sentinel believes in now.
    pub fn master_port(&self, name: &str) -> Option<u16> {
        let reply = self
            .query(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", name])
            .ok()?;
        reply.lines().nth(1)?.trim().parse().ok()
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs one command on the server at `url` and returns its reply as text
/// (arrays joined by newlines, nil as empty).
fn query(url: &str, args: &[&str]) -> Result<String, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(2))
        .map_err(|e| e.to_string())?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    let value: redis::Value = cmd.query(&mut conn).map_err(|e| e.to_string())?;
    Ok(text(&value))
}
