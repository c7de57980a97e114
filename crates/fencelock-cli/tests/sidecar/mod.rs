//! Helpers for the sidecar tests: a real `fencelock serve` process on a free port, and a
//! small HTTP client (JSON requests, an event-stream reader in a thread).
// Each test binary uses part of this module.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fencelock_testkit::{wait_until, BinCommand, Proc};
use serde_json::Value;

/// A running `fencelock serve`.
pub struct Sidecar {
    pub proc: Proc,
    pub base: String,
    pub token: Option<String>,
    agent: ureq::Agent,
}

/// `fencelock ARGS` with a clean environment, output into `dir/NAME.{out,err}`.
pub fn fencelock_in(dir: &Path, name: &str, args: &[&str]) -> BinCommand {
    let mut cmd = BinCommand::new(env!("CARGO_BIN_EXE_fencelock"));
    cmd.args(args)
        .current_dir(dir)
        .env("XDG_STATE_HOME", dir.join("state"))
        .output_to(
            dir.join(format!("{name}.out")),
            dir.join(format!("{name}.err")),
        );
    cmd
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

impl Sidecar {
    /// Starts `fencelock serve --backend URL --listen 127.0.0.1:0 EXTRA...` and waits until it
    /// says where it listens.
    pub fn start(dir: &Path, url: &str, extra: &[&str]) -> Sidecar {
        Sidecar::start_on(dir, url, "127.0.0.1:0", extra)
    }

    /// [`Sidecar::start`] listening on `listen`.
    pub fn start_on(dir: &Path, url: &str, listen: &str, extra: &[&str]) -> Sidecar {
        let mut args = vec!["--backend", url];
        args.extend_from_slice(extra);
        Sidecar::launch(dir, listen, &args)
    }

    /// Starts `fencelock serve --listen 127.0.0.1:0 ARGS...` (a `--backend` or `--config`
    /// among them) and waits until it says where it listens.
    pub fn start_with(dir: &Path, extra: &[&str]) -> Sidecar {
        Sidecar::launch(dir, "127.0.0.1:0", extra)
    }

    fn launch(dir: &Path, listen: &str, extra: &[&str]) -> Sidecar {
        let mut args = vec!["serve", "--listen", listen];
        args.extend_from_slice(extra);
        let name = format!("serve-{}", fencelock_testkit::free_port());
        let proc = fencelock_in(dir, &name, &args).spawn().unwrap();
        let mut base = String::new();
        let up = wait_until(Duration::from_secs(20), || {
            let err = proc.stderr();
            // Only a whole line: the file may be read while the line is being written.
            let whole = err.rsplit_once('\n').map_or("", |(done, _)| done);
            if let Some(line) = whole.lines().find(|l| l.contains(" on http")) {
                let url = line
                    .split(" on ")
                    .nth(1)
                    .unwrap_or("")
                    .split(' ')
                    .next()
                    .unwrap_or("");
                base = url.trim_end_matches('/').to_owned();
                return true;
            }
            false
        });
        assert!(up, "fencelock serve did not start: {}", proc.stderr());
        Sidecar {
            proc,
            base,
            token: None,
            agent: agent(),
        }
    }

    pub fn with_token(mut self, token: &str) -> Sidecar {
        self.token = Some(token.to_owned());
        self
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `METHOD path` with an optional JSON body; returns the status and the JSON answer
    /// (`Value::Null` when the body is not JSON).
    pub fn call_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let url = self.url(path);
        let auth = token.map(|t| format!("Bearer {t}"));
        let resp = match (method, body) {
            ("GET", _) => {
                let mut r = self.agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            (_, body) => {
                let mut r = self
                    .agent
                    .post(&url)
                    .header("Content-Type", "application/json");
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send(body.map(|b| b.to_string()).unwrap_or_default())
            }
        }
        .map_err(|e| format!("{method} {url}: {e}"));
        assert!(
            resp.is_ok(),
            "{}",
            resp.as_ref().err().cloned().unwrap_or_default()
        );
        let mut resp = resp.unwrap();
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub fn get(&self, path: &str) -> (u16, Value) {
        self.call_as(self.token.as_deref(), "GET", path, None)
    }

    pub fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call_as(self.token.as_deref(), "POST", path, Some(body))
    }

    /// The port the sidecar listens on.
    pub fn port(&self) -> u16 {
        self.base.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// One HTTP/1.1 request written by hand, so that any header can be sent as it is (a
    /// foreign `Host`, an `Origin`, any `Content-Type` or none): `headers` are sent as given,
    /// with `Host: 127.0.0.1:PORT` unless they carry a `Host` (or `host_absent`), and
    /// `Content-Length` when there is a body. Returns the status and the JSON answer
    /// (`Value::Null` when the body is not JSON).
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> (u16, Value) {
        self.raw_request(method, path, headers, body, false)
    }

    /// [`Sidecar::raw`] without any `Host` header.
    pub fn raw_without_host(&self, method: &str, path: &str) -> (u16, Value) {
        self.raw_request(method, path, &[], None, true)
    }

    fn raw_request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
        host_absent: bool,
    ) -> (u16, Value) {
        use std::io::{Read, Write};
        let addr = format!("127.0.0.1:{}", self.port());
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        conn.set_write_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
        if !host_absent && !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
            head.push_str(&format!("Host: {addr}\r\n"));
        }
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!("Content-Length: {}\r\n", b.len()));
        }
        head.push_str("\r\n");
        conn.write_all(head.as_bytes()).unwrap();
        // A server that refuses early may close before the whole body is written, or reset
        // the connection after answering: what it answered is what counts.
        if let Some(b) = body {
            let _ = conn.write_all(b);
        }
        let mut answer = Vec::new();
        let _ = conn.read_to_end(&mut answer);
        let split = answer.windows(4).position(|w| w == b"\r\n\r\n");
        let (head, body) = match split {
            Some(at) => (&answer[..at], &answer[at + 4..]),
            None => (&answer[..], &[][..]),
        };
        let head = String::from_utf8_lossy(head);
        let status = head.split(' ').nth(1).and_then(|s| s.parse::<u16>().ok());
        assert!(status.is_some(), "not an HTTP answer: {head:?}");
        let status = status.unwrap();
        let chunked = head.lines().any(|l| {
            l.to_ascii_lowercase()
                .starts_with("transfer-encoding: chunked")
        });
        let body = if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        };
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    /// Acquires `resource`, which must succeed; returns the lease.
    pub fn acquire(&self, resource: &str, ttl_ms: u64, wait_ms: u64) -> Value {
        let (status, lease) = self.post(
            "/v1/acquire",
            serde_json::json!({"resource": resource, "ttl_ms": ttl_ms, "wait_ms": wait_ms}),
        );
        assert_eq!(status, 200, "acquire {resource}: {lease}");
        lease
    }

    pub fn release(&self, lease: &Value) -> (u16, Value) {
        self.post(
            &format!("/v1/leases/{}/release", lease["lease_id"].as_str().unwrap()),
            Value::Null,
        )
    }

    /// Whether `resource` is held, as the sidecar's inspect says.
    pub fn held(&self, resource: &str) -> bool {
        let (status, lock) = self.get(&format!("/v1/lock?name={resource}"));
        assert_eq!(status, 200, "{lock}");
        lock["held"].as_bool().unwrap()
    }

    /// Opens the lease's event stream; its events arrive on the returned channel as
    /// `(event name, data)`, the channel closing with the stream.
    pub fn events(&self, lease: &Value) -> mpsc::Receiver<(String, Value)> {
        self.events_as(self.token.as_deref(), lease)
    }

    /// [`Sidecar::events`] with the bearer token `token`.
    pub fn events_as(&self, token: Option<&str>, lease: &Value) -> mpsc::Receiver<(String, Value)> {
        let url = self.url(&format!(
            "/v1/leases/{}/events",
            lease["lease_id"].as_str().unwrap()
        ));
        let mut req = agent().get(&url);
        if let Some(t) = token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        let resp = req.call().unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let reader = BufReader::new(resp.into_body().into_reader());
            let mut name = String::new();
            for line in reader.lines() {
                let Ok(line) = line else { return };
                if let Some(n) = line.strip_prefix("event: ") {
                    name = n.to_owned();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    let data = serde_json::from_str(d).unwrap_or(Value::Null);
                    let lost = name == "lost";
                    if tx.send((std::mem::take(&mut name), data)).is_err() || lost {
                        // Closed once `lost` is read, as an application does: the sidecar
                        // takes the closing as its proof the application was told.
                        return;
                    }
                }
            }
        });
        rx
    }
}

/// The next event named `name` on `events` within `limit` (others are skipped).
pub fn next_event(events: &mpsc::Receiver<(String, Value)>, name: &str, limit: Duration) -> Value {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = events.recv_timeout(left);
        assert!(
            got.is_ok(),
            "no {name:?} event within {limit:?}: {:?}",
            got.err()
        );
        let (n, data) = got.unwrap();
        if n == name {
            return data;
        }
    }
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("fencelock-serve-")
        .tempdir()
        .unwrap()
}

pub fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("locks.db").display())
}

pub fn artifact_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is under target/, kept after the run.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sidecar");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The body of a chunked HTTP/1.1 answer.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&rest[..eol]);
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        let after = &rest[eol + 2..];
        if n == 0 || after.len() < n {
            break;
        }
        out.extend_from_slice(&after[..n]);
        rest = after[n..].strip_prefix(b"\r\n").unwrap_or(&after[n..]);
    }
    out
}

/// The example Python client (`examples/sidecar/client.py`) as a real application process:
/// it takes `resource` through the sidecar at `base`, keeps it alive, holds its event stream
/// and writes every 0.1 s for `steps` steps. Its output goes to `dir/NAME.{out,err}`.
pub fn python_app(
    dir: &Path,
    sc: &Sidecar,
    resource: &str,
    steps: u32,
    ttl_ms: u64,
    name: &str,
) -> Proc {
    let script = format!(
        "{}/../../examples/sidecar/client.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut cmd = BinCommand::new("python3");
    cmd.args([
        script.as_str(),
        "--sidecar",
        &sc.base,
        "--resource",
        resource,
        "--steps",
        &steps.to_string(),
        "--step-seconds",
        "0.1",
        "--ttl-ms",
        &ttl_ms.to_string(),
    ])
    .output_to(
        dir.join(format!("{name}.out")),
        dir.join(format!("{name}.err")),
    );
    if let Some(token) = &sc.token {
        cmd.env("FENCELOCK_SIDECAR_TOKEN", token);
    }
    cmd.spawn().unwrap()
}

/// The fencing token an application process printed (`granted RESOURCE token N`), once it has.
pub fn granted_token(app: &Proc) -> Option<u64> {
    app.stdout()
        .lines()
        .find_map(|l| {
            l.split_once(" token ")
                .filter(|(g, _)| g.starts_with("granted "))
        })
        .and_then(|(_, t)| t.trim().parse().ok())
}

/// Keep-alives for a lease every third of its TTL, sent from a thread until dropped: the
/// test standing in for a live application.
pub struct KeepAlive {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Sidecar {
    /// Sends keep-alives for `lease` until the guard is dropped or the lease has ended.
    pub fn keep_alive(&self, lease: &Value) -> KeepAlive {
        self.keep_alive_as(self.token.as_deref(), lease)
    }

    /// [`Sidecar::keep_alive`] with the bearer token `token`.
    pub fn keep_alive_as(&self, token: Option<&str>, lease: &Value) -> KeepAlive {
        let url = self.url(&format!(
            "/v1/leases/{}/keepalive",
            lease["lease_id"].as_str().unwrap()
        ));
        let every = Duration::from_millis(lease["ttl_ms"].as_u64().unwrap() / 3);
        let auth = token.map(|t| format!("Bearer {t}"));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let agent = agent();
            let mut next = Instant::now();
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                if Instant::now() >= next {
                    let mut req = agent.post(&url).header("Content-Type", "application/json");
                    if let Some(a) = &auth {
                        req = req.header("Authorization", a);
                    }
                    match req.send("") {
                        Ok(r) if r.status().as_u16() == 200 => {}
                        _ => return,
                    }
                    next = Instant::now() + every;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        KeepAlive {
            stop,
            thread: Some(thread),
        }
    }
}
