//! Helpers for end-to-end tests: a raw HTTP/1.1 client that can choose its
//! loopback source address and send any header, and a quickstart launcher.
#![allow(dead_code, unreachable_pub)]

pub mod driven;
pub mod logs;
pub mod nginx;

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;

/// Serves an axum app on a free loopback port with connect info.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    addr
}

/// Test-only authentication, a stand-in for a verifying middleware:
/// `X-Test-User: tenant/account` is the principal and `X-Test-Plan` its
/// plan (as if read from the account's record).
pub async fn test_auth(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if let Some(p) = test_principal(req.headers()) {
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

/// The principal [`test_auth`] reads from `headers`.
pub fn test_principal(headers: &HeaderMap) -> Option<tollgate::Principal> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (tenant, account) = header("x-test-user")?.split_once('/')?;
    let p = tollgate::Principal::new(tenant, account);
    Some(match header("x-test-plan") {
        Some(plan) => p.with_plan(plan),
        None => p,
    })
}

/// A parsed response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Every line of a header, joined as one structured-field list.
    pub fn header_joined(&self, name: &str) -> Option<String> {
        let lines: Vec<&str> = self
            .headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        (!lines.is_empty()).then(|| lines.join(", "))
    }
}

/// Opens a request and returns the stream once the response head and at
/// least `min_body` body bytes have arrived, with what was read.
pub async fn open(
    server: SocketAddr,
    from: IpAddr,
    path: &str,
    headers: &[(&str, &str)],
    min_body: usize,
) -> (tokio::net::TcpStream, String) {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let mut stream = socket.connect(server).await.unwrap();
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: test\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n")
            && seen.len() >= end + 4 + min_body
        {
            break;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("data within 10 s")
            .unwrap();
        assert!(
            n > 0,
            "connection closed early: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, String::from_utf8_lossy(&seen).into_owned())
}

/// Sends one request with `Connection: close` from `from` (any 127.0.0.0/8
/// address) and reads the whole response.
pub async fn send(
    server: SocketAddr,
    from: IpAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let raw: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    send_bytes(server, from, method, path, &raw, body).await
}

/// Like [`send`], with header values as raw bytes (anything a client can
/// put on the wire, e.g. obs-text such as 0xFF).
pub async fn send_bytes(
    server: SocketAddr,
    from: IpAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Reply {
    send_raw(server, from, &request_bytes(method, path, headers, body)).await
}

/// An HTTP/1.1 request asking for `Connection: close`, as bytes, with a
/// `Content-Length` unless `headers` frame the body themselves.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &[u8])], body: &[u8]) -> Vec<u8> {
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n").into_bytes();
    for (k, v) in headers {
        request.extend_from_slice(k.as_bytes());
        request.extend_from_slice(b": ");
        request.extend_from_slice(v);
        request.extend_from_slice(b"\r\n");
    }
    let framed = headers.iter().any(|(k, _)| {
        k.eq_ignore_ascii_case("content-length") || k.eq_ignore_ascii_case("transfer-encoding")
    });
    if !framed && (!body.is_empty() || method == "POST") {
        request.extend_from_slice(format!("Content-Length: {}\r\n", body.len()).as_bytes());
    }
    request.extend_from_slice(b"\r\n");
    request.extend_from_slice(body);
    request
}

/// Sends `request` (whole, as bytes; it should ask for `Connection: close`)
/// from `from` and reads the whole response.
pub async fn send_raw(server: SocketAddr, from: IpAddr, request: &[u8]) -> Reply {
    parse(&exchange_raw(server, from, request).await)
}

/// Sends `request` like [`send_raw`]; the response as it came, unparsed.
pub async fn exchange_raw(server: SocketAddr, from: IpAddr, request: &[u8]) -> Vec<u8> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(from, 0)).unwrap();
    let mut stream = socket.connect(server).await.unwrap();
    // The server may answer before reading a body and close.
    let _ = stream.write_all(request).await;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response within 10 s")
        .unwrap();
    raw
}

pub fn parse(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("complete response head");
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let code: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (k, v) = line.split_once(':').unwrap();
        headers.append(
            HeaderName::from_bytes(k.trim().as_bytes()).unwrap(),
            HeaderValue::from_str(v.trim()).unwrap(),
        );
    }
    let mut body = raw[split + 4..].to_vec();
    if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"))
    {
        body = dechunk(&body);
    }
    Reply {
        status: StatusCode::from_u16(code).unwrap(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&data[..eol]).unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[eol + 2 + size + 2..];
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A running quickstart process, killed on drop.
pub struct Quickstart {
    child: Child,
    pub addr: SocketAddr,
    /// What the process wrote to stderr so far (its log).
    pub log: Arc<Mutex<String>>,
}

impl Quickstart {
    /// Sends `signal` (`STOP`, `CONT`, `KILL`, ...) to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal}");
    }
}

impl Drop for Quickstart {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example `name`, built once per test process.
pub fn example_binary(name: &str) -> std::path::PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap();
    if !built.iter().any(|b| b == name) {
        // `cargo test --test x` does not build examples: build it here.
        let status = Command::new(env!("CARGO"))
            .args(["build", "--quiet", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap_or_else(|e| panic!("run cargo build --example {name}: {e}"));
        assert!(status.success(), "building the {name} example failed");
        built.push(name.to_owned());
    }
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    profile_dir.join("examples").join(name)
}

/// Everything the example `name` writes (stdout, then stderr) when run
/// with `args` until it exits or `within` has passed (then it is killed).
pub fn example_output(name: &str, args: &[&str], within: std::time::Duration) -> String {
    let mut child = Command::new(example_binary(name))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    out.join().unwrap() + &err.join().unwrap()
}

/// Starts the quickstart on a free port with `args`, waiting for its
/// "listening on" line.
pub fn quickstart(args: &[&str]) -> Quickstart {
    let mut all = vec!["--addr", "127.0.0.1:0"];
    all.extend_from_slice(args);
    example("quickstart", &all)
}

/// Starts the example `name` with `args` (which make it serve on a free
/// port), waiting for its "listening on http://ADDR" line.
pub fn example(name: &str, args: &[&str]) -> Quickstart {
    let mut child = Command::new(example_binary(name))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start quickstart");
    let log = Arc::new(Mutex::new(String::new()));
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let sink = log.clone();
    std::thread::spawn(move || {
        let mut line = String::new();
        while stderr.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            eprint!("{line}");
            sink.lock().unwrap().push_str(&line);
            line.clear();
        }
    });
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
            sink.clear();
        }
    });
    Quickstart { child, addr, log }
}

/// Parses a structured-field List (RFC 9651) and returns each member's
/// string value with its integer and string parameters.
pub fn sf_list(value: &str) -> Vec<(String, Vec<(String, String)>)> {
    use sfv::{List, ListEntry, Parser};
    let list: List = Parser::new(value).parse().expect("valid RFC 9651 list");
    list.into_iter()
        .map(|entry| match entry {
            ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .unwrap_or_else(|| panic!("policy name must be a string: {value}"))
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let v = match (v.as_integer(), v.as_string()) {
                            (Some(i), _) => i64::from(i).to_string(),
                            (_, Some(s)) => s.as_str().to_owned(),
                            _ => panic!("unexpected parameter {k:?}={v:?}"),
                        };
                        (k.as_str().to_owned(), v)
                    })
                    .collect();
                (name, params)
            }
            ListEntry::InnerList(_) => panic!("unexpected inner list in {value}"),
        })
        .collect()
}

/// The named parameter of a parsed list member, as an integer.
pub fn param(member: &(String, Vec<(String, String)>), key: &str) -> Option<i64> {
    member
        .1
        .iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| v.parse().ok())
}
