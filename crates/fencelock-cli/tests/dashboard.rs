//! The sidecar's dashboard in a real headless Chromium, driven over WebDriver: it lists a
//! lock held by an application with its token, shows it free once the killed holder's TTL
//! has passed, refuses a forced release of a live holder and, with the confirmation,
//! releases a dead one, which the audit log then shows; with a routing configuration whose
//! payments backend dies, it keeps showing the other backend's locks and names the failed one.
//! Screenshots are kept under `target/tmp/sidecar/` for a person to look at.
#![allow(clippy::unwrap_used)]

mod sidecar;

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use fencelock_testkit::{free_port, wait_until, BinCommand, Proc};
use nix::sys::signal::{kill, Signal};
use sidecar::{artifact_dir, fencelock_in, sqlite_url, tempdir, Sidecar};

/// `chromedriver --port=P` in a process group of its own, so that the browsers it starts are
/// stopped with it whatever happens to the test.
fn chromedriver(dir: &std::path::Path) -> (Proc, u16) {
    let port = free_port();
    let mut cmd = std::process::Command::new("chromedriver");
    cmd.arg(format!("--port={port}")).process_group(0);
    let mut bin = BinCommand::from(cmd);
    bin.output_to(dir.join("chromedriver.out"), dir.join("chromedriver.err"));
    let mut proc = bin.spawn().unwrap();
    let pid = proc.pid();
    proc.adopt_group(pid);
    let status = format!("http://127.0.0.1:{port}/status");
    let agent = sidecar::agent();
    let up = wait_until(Duration::from_secs(20), || {
        agent
            .get(&status)
            .call()
            .map(|r| r.status().as_u16() == 200)
            .unwrap_or(false)
    });
    assert!(up, "chromedriver did not start: {}", proc.stderr());
    (proc, port)
}

async fn browser(port: u16, profile: &std::path::Path) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                format!("--user-data-dir={}", profile.display()), "--window-size=1280,1000",
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

/// Waits (up to `limit`) until the text of the first element matching `css` satisfies `ok`;
/// returns it.
async fn wait_text(c: &Client, css: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        if let Ok(el) = c.find(Locator::Css(css)).await {
            if let Ok(text) = el.text().await {
                if ok(&text) {
                    return text;
                }
                last = text;
            }
        }
        // The page refreshes once a second; look a few times per refresh.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(ok(&last), "{css}: {last:?} after {limit:?}");
    last
}

/// Clicks the element `at` finds. The page redraws its table once a second, so the element
/// found may be replaced before the click lands (a stale element): it is found again.
async fn click(c: &Client, at: Locator<'_>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let tried = match c.find(at).await {
            Ok(el) => el.click().await.map(|_| ()),
            Err(e) => Err(e),
        };
        if tried.is_ok() || Instant::now() >= deadline {
            return tried.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    let path = artifact_dir().join(name);
    std::fs::write(&path, png).unwrap();
    eprintln!("screenshot: {}", path.display());
}

#[test]
fn the_dashboard_shows_holders_frees_dead_ones_and_audits_forced_releases() {
    let dir = tempdir();
    let url = sqlite_url(dir.path());
    // With an auth file, as in production: the page asks for a token.
    let token = "ops-token-0123456789abcdef0123";
    let auth = dir.path().join("auth");
    std::fs::write(&auth, format!("{token} ops *\n")).unwrap();
    let sc = Sidecar::start(dir.path(), &url, &["--auth-file", auth.to_str().unwrap()])
        .with_token(token);
    let (_driver, port) = chromedriver(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = browser(port, &dir.path().join("profile")).await;

        // An application (the Python example: keep-alives and the event stream) holds a lock.
        let app = sidecar::python_app(dir.path(), &sc, "nightly-invoices", 100_000, 1500, "app");
        assert!(wait_until(Duration::from_secs(20), || app
            .stdout()
            .contains("write 0 accepted")));
        let fencing = sidecar::granted_token(&app).unwrap().to_string();

        c.goto(&sc.url("/")).await.unwrap();
        let field = c
            .wait()
            .for_element(Locator::Id("auth-token"))
            .await
            .unwrap();
        wait_text(&c, "#auth", Duration::from_secs(5), |t| {
            t.contains("bearer token")
        })
        .await;
        field.send_keys(token).await.unwrap();
        click(&c, Locator::Css("#auth-form button")).await;
        let row = "tr[data-resource='nightly-invoices']";
        wait_text(&c, &format!("{row} .token"), Duration::from_secs(10), |t| {
            t == fencing
        })
        .await;
        // Read through wait_text: the table is redrawn every second, and an element found just
        // before a redraw is stale when its text is asked for.
        wait_text(&c, &format!("{row} .state"), Duration::from_secs(5), |t| {
            t == "held"
        })
        .await;
        click(&c, Locator::Css(row)).await;
        wait_text(&c, "#detail", Duration::from_secs(5), |t| {
            t.contains(&fencing) && t.contains("stream")
        })
        .await;

        // The forced release of a live holder is refused, and the page says why.
        c.find(Locator::Id("fr-reason"))
            .await
            .unwrap()
            .send_keys("invoices stuck")
            .await
            .unwrap();
        click(&c, Locator::Id("fr-submit")).await;
        let refusal = wait_text(&c, "#fr-result .note", Duration::from_secs(5), |t| {
            !t.is_empty()
        })
        .await;
        assert!(
            refusal.starts_with("Refused: the holder looks alive"),
            "{refusal}"
        );
        assert!(
            sc.held("nightly-invoices"),
            "a refused release leaves the lock held"
        );
        screenshot(&c, "dashboard-held-and-refused.png").await;

        // The application dies; once its TTL has passed the row shows the lock free.
        kill(app.pid(), Signal::SIGKILL).unwrap();
        let killed = Instant::now();
        wait_text(
            &c,
            &format!("{row} .state"),
            Duration::from_millis(1500 + 1500),
            |t| t == "free",
        )
        .await;
        assert!(killed.elapsed() < Duration::from_millis(3000));

        // A holder that died without releasing: `fencelock run` killed, its lease left for
        // its 30 s TTL. With the confirmation the form releases it, and the audit log says so.
        let mut run = fencelock_in(
            dir.path(),
            "dead",
            &[
                "run",
                "--backend",
                &url,
                "--ttl",
                "30s",
                "dead-job",
                "--",
                "sleep",
                "60",
            ],
        );
        let dead = run.spawn().unwrap();
        assert!(wait_until(Duration::from_secs(20), || sc.held("dead-job")));
        kill(dead.pid(), Signal::SIGKILL).unwrap();
        let dead_row = "tr[data-resource='dead-job']";
        wait_text(
            &c,
            &format!("{dead_row} .verdict"),
            Duration::from_secs(10),
            |t| t == "suspect",
        )
        .await;
        click(&c, Locator::Css(dead_row)).await;
        let reason = c.find(Locator::Id("fr-reason")).await.unwrap();
        reason.clear().await.unwrap();
        reason.send_keys("worker VM deleted").await.unwrap();
        click(&c, Locator::Id("fr-dead")).await;
        click(&c, Locator::Id("fr-submit")).await;
        let done = wait_text(&c, "#fr-result .note", Duration::from_secs(5), |t| {
            t.starts_with("Released")
        })
        .await;
        assert!(done.contains("the old token is stale"), "{done}");
        assert!(!sc.held("dead-job"));
        let audit = wait_text(
            &c,
            "#audit tr[data-resource='dead-job'] .reason",
            Duration::from_secs(5),
            |t| !t.is_empty(),
        )
        .await;
        assert_eq!(audit, "worker VM deleted (holder declared dead)");
        wait_text(
            &c,
            &format!("{dead_row} .state"),
            Duration::from_secs(5),
            |t| t == "free",
        )
        .await;
        wait_text(&c, "#chart-acquire svg", Duration::from_secs(5), |_| true).await;
        // Tall enough to show the audit log below the charts.
        c.set_window_size(1280, 1400).await.unwrap();
        screenshot(&c, "dashboard-released-and-audited.png").await;

        // The same page on a phone-sized screen.
        c.set_window_size(390, 844).await.unwrap();
        let phone = sc.acquire("phone-check", 30_000, 0);
        c.goto(&sc.url("/")).await.unwrap();
        let fencing = phone["token"].as_u64().unwrap().to_string();
        wait_text(
            &c,
            "tr[data-resource='phone-check'] .token",
            Duration::from_secs(5),
            |t| t == fencing,
        )
        .await;
        wait_text(
            &c,
            "#audit tr[data-resource='dead-job'] .reason",
            Duration::from_secs(5),
            |t| !t.is_empty(),
        )
        .await;
        screenshot(&c, "dashboard-phone.png").await;
        c.close().await.unwrap();
    });
}

/// What broke: with one backend of a routing configuration down, the dashboard said "No lock
/// held" while the healthy backends held locks, and did not say which backend had failed.
#[test]
fn the_dashboard_shows_held_locks_and_names_a_failed_backend() {
    let dir = tempdir();
    let (mut payments, jobs) = (
        fencelock_testkit::RedisServer::start().unwrap(),
        fencelock_testkit::RedisServer::start().unwrap(),
    );
    let config = dir.path().join("routes.toml");
    std::fs::write(
        &config,
        format!(
            "[backends]\npayments = \"{}\"\njobs = \"{}\"\n[[route]]\nprefix = \"payments/\"\n\
             backend = \"payments\"\n[default]\nbackend = \"jobs\"\n",
            payments.url(),
            jobs.url()
        ),
    )
    .unwrap();
    let sc = Sidecar::start_with(dir.path(), &["--config", config.to_str().unwrap()]);
    let (_driver, port) = chromedriver(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = browser(port, &dir.path().join("profile")).await;
        let job = sc.acquire("jobs/nightly", 30_000, 0);
        let fencing = job["token"].as_u64().unwrap().to_string();
        sc.acquire("payments/settle", 30_000, 0);
        c.goto(&sc.url("/")).await.unwrap();
        let paid = "tr[data-resource='payments/settle']";
        wait_text(
            &c,
            &format!("{paid} .state"),
            Duration::from_secs(10),
            |t| t == "held",
        )
        .await;

        payments.kill();
        let failed = wait_text(
            &c,
            "#locks-failed .failed-backend",
            Duration::from_secs(10),
            |t| !t.is_empty(),
        )
        .await;
        assert!(
            failed.starts_with("Backend payments did not answer; its locks are not shown"),
            "{failed}"
        );
        let row = "tr[data-resource='jobs/nightly']";
        wait_text(&c, &format!("{row} .token"), Duration::from_secs(5), |t| {
            t == fencing
        })
        .await;
        wait_text(&c, &format!("{row} .state"), Duration::from_secs(5), |t| {
            t == "held"
        })
        .await;
        // A lock seen on the failed backend is not shown free: nobody knows.
        wait_text(&c, &format!("{paid} .state"), Duration::from_secs(5), |t| {
            t == "unknown (backend payments failed)"
        })
        .await;
        let empty = c.find(Locator::Id("locks-empty")).await.unwrap();
        assert!(
            !empty.is_displayed().await.unwrap(),
            "\"No lock held\" shown"
        );
        wait_text(
            &c,
            "#audit-failed .failed-backend",
            Duration::from_secs(5),
            |t| t.starts_with("Backend payments did not answer; its records are not shown"),
        )
        .await;
        screenshot(&c, "dashboard-failed-backend.png").await;
        c.close().await.unwrap();
    });
}

/// Serves `page` as HTML to every request on a free loopback port, from a thread that lives as
/// long as the test: the page of another site, on another origin than the sidecar's.
fn serve_page(page: String) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                page.len()
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(page.as_bytes());
        }
    });
    port
}

/// The page of another site that tries the attacks of a cross-site request: no-cors posts with
/// `text/plain` bodies (a forced release, a day-long acquire, a raised fence, a Dapr lock), a
/// CORS post with the JSON type, and a form whose one field is spelled so that its
/// `text/plain` body reads as JSON. It sets its title to `done: RESULTS` when all have run.
fn attack_page(sidecar: &str) -> String {
    format!(
        r#"<!doctype html><html><head><title>attacking</title></head><body>
<form id="f" method="POST" enctype="text/plain" target="sink" action="{sidecar}/v1/acquire">
<input type="hidden" name='{{"resource":"form-taken","ttl_ms":86400000,"client":"' value='x"}}'>
</form>
<iframe name="sink" id="sink"></iframe>
<script>
const S = "{sidecar}";
const post = (path, body) => fetch(S + path, {{method: "POST", mode: "no-cors", body: JSON.stringify(body)}})
  .then(() => path + " sent", (e) => path + " failed: " + e);
(async () => {{
  const results = [];
  results.push(await post("/v1/force-release", {{resource: "victim", reason: "csrf", holder_is_dead: true}}));
  results.push(await post("/v1/acquire", {{resource: "nightly-invoices", ttl_ms: 86400000}}));
  results.push(await post("/v1/fence", {{resource: "ledger", token: 999999999999}}));
  results.push(await post("/v1.0-alpha1/lock/store", {{resourceId: "dapr-taken", lockOwner: "evil", expiryInSeconds: 86400}}));
  results.push(await fetch(S + "/v1/acquire", {{method: "POST", headers: {{"Content-Type": "application/json"}},
      body: JSON.stringify({{resource: "cors-taken", ttl_ms: 86400000}})}})
    .then((r) => "cors answered " + r.status, (e) => "cors failed: " + e));
  const sink = document.getElementById("sink");
  await new Promise((done) => {{ sink.onload = done; document.getElementById("f").submit(); setTimeout(done, 5000); }});
  document.title = "done: " + results.join("; ");
}})();
</script></body></html>"#
    )
}

async fn wait_title(c: &Client, prefix: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        last = c.title().await.unwrap_or_default();
        if last.starts_with(prefix) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        last.starts_with(prefix),
        "title {last:?} after {limit:?}, waiting for {prefix:?}"
    );
    last
}

/// A page on another site released a live lock, took others for a day and raised the fence,
/// through the user's browser, from a sidecar without an auth file (no-cors posts with
/// `text/plain` bodies, a form post); the dashboard's own buttons must keep working.
#[test]
fn a_page_from_another_origin_cannot_drive_the_sidecar_but_its_dashboard_can() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let victim = sc.acquire("victim", 60_000, 0);
    let ledger = sc.acquire("ledger", 60_000, 0);
    let token = ledger["token"].as_u64().unwrap();
    let (status, _) = sc.post(
        "/v1/fence",
        serde_json::json!({"resource": "ledger", "token": token}),
    );
    assert_eq!(status, 200);
    let evil = serve_page(attack_page(&sc.base));
    let (_driver, port) = chromedriver(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = browser(port, &dir.path().join("profile")).await;
        c.goto(&format!("http://127.0.0.1:{evil}/")).await.unwrap();
        let results = wait_title(&c, "done", Duration::from_secs(30)).await;
        eprintln!("the attacking page: {results}");
        assert!(sc.held("victim"), "a page released a live lock: {results}");
        for name in ["nightly-invoices", "form-taken", "dapr-taken", "cors-taken"] {
            assert!(!sc.held(name), "a page took {name}: {results}");
        }
        let (status, fence) = sc.post(
            "/v1/fence",
            serde_json::json!({"resource": "ledger", "token": token}),
        );
        assert_eq!(status, 200, "a page raised the fence: {fence}");

        // The dashboard, on the sidecar's own origin by both its names, still releases a lock.
        for (origin, name) in [
            (sc.base.clone(), "victim"),
            (format!("http://localhost:{}", sc.port()), "ledger"),
        ] {
            c.goto(&format!("{origin}/")).await.unwrap();
            let row = format!("tr[data-resource='{name}']");
            wait_text(&c, &format!("{row} .state"), Duration::from_secs(10), |t| {
                t == "held"
            })
            .await;
            click(&c, Locator::Css(&row)).await;
            let reason = c.find(Locator::Id("fr-reason")).await.unwrap();
            reason.clear().await.unwrap();
            reason
                .send_keys("released from the dashboard")
                .await
                .unwrap();
            click(&c, Locator::Id("fr-dead")).await;
            click(&c, Locator::Id("fr-submit")).await;
            let done = wait_text(&c, "#fr-result .note", Duration::from_secs(5), |t| {
                !t.is_empty()
            })
            .await;
            assert!(done.starts_with("Released"), "from {origin}: {done}");
            assert!(!sc.held(name), "{name} released from {origin}");
        }
        c.close().await.unwrap();
    });
    let _ = victim;
}

/// The verdict column wrapped "healthy" over two lines beside a long name, and a routed
/// sidecar's dashboard said "engine sqlite", its default backend's.
#[test]
fn the_verdict_stays_on_one_line_and_a_routed_sidecar_names_its_backends() {
    let dir = tempdir();
    let config = dir.path().join("routes.toml");
    let jobs = dir.path().join("jobs.db");
    std::fs::write(
        &config,
        format!(
            "[backends]\njobs = \"sqlite://{}\"\nlocal = \"{}\"\n\n[[route]]\nprefix = \"jobs/\"\n\
             backend = \"jobs\"\n\n[default]\nbackend = \"local\"\n",
            jobs.display(),
            sqlite_url(dir.path())
        ),
    )
    .unwrap();
    let sc = Sidecar::start_with(dir.path(), &["--config", config.to_str().unwrap()]);
    let long = format!(
        "jobs/{}",
        "nightly-invoices-for-the-whole-region-".repeat(3)
    );
    sc.acquire(&long, 60_000, 0);
    sc.acquire("short", 60_000, 0);
    let (_driver, port) = chromedriver(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = browser(port, &dir.path().join("profile")).await;
        c.goto(&sc.url("/")).await.unwrap();
        let engine = wait_text(&c, "#engine", Duration::from_secs(10), |t| {
            t.contains("lease")
        })
        .await;
        assert!(
            engine.contains("routed")
                && engine.contains("jobs (sqlite)")
                && engine.contains("local (sqlite)"),
            "{engine}"
        );
        for width in [1280, 1024, 800] {
            c.set_window_size(width, 1000).await.unwrap();
            for name in [long.as_str(), "short"] {
                let row = format!("tr[data-resource='{name}']");
                wait_text(
                    &c,
                    &format!("{row} .verdict"),
                    Duration::from_secs(10),
                    |t| t == "healthy",
                )
                .await;
                let lines = c
                    .execute(
                        "const td = document.querySelector(arguments[0]);\
                         const r = document.createRange(); r.selectNodeContents(td);\
                         return r.getClientRects().length;",
                        vec![serde_json::json!(format!("{row} .verdict"))],
                    )
                    .await
                    .unwrap();
                assert_eq!(lines, 1, "the verdict of {name} at {width} px wraps");
            }
        }
        screenshot(&c, "dashboard-routed.png").await;
        c.close().await.unwrap();
    });
}
