//! The sidecar's dashboard in a real headless Chromium, driven over WebDriver: it lists a
//! lock held by an application with its token, shows it free once the killed holder's TTL
//! has passed, refuses a forced release of a live holder and, with the confirmation,
//! releases a dead one, which the audit log then shows. Screenshots are kept under
//! `target/tmp/sidecar/` for a person to look at.
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
