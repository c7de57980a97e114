//! `fencelock run --metrics-addr`: the running process serves its metrics in Prometheus text
//! format, scraped here with a plain HTTP/1.0 request while the command waits.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use common::{poll_until, wait_for_line, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock_testkit::free_port;

const USAGE: i32 = 64;

/// The body of `GET /metrics`, after checking the status line.
fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    body.to_owned()
}

#[test]
fn metrics_addr_serves_prometheus_text_while_the_command_runs() {
    let sb = Sandbox::new();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let script = format!("echo up > started; {WAIT_FOR_RELEASE}");
    let mut run = sb.spawn(sb.run_sh(
        &["--ttl", "1500ms", "--metrics-addr", &addr.to_string()],
        "scraped",
        &script,
    ));
    wait_for_line(&sb.path("started"), FINISH);

    let text = scrape(addr);
    assert!(
        text.contains("# TYPE fencelock_acquire_duration_seconds histogram"),
        "{text}"
    );
    assert!(
        text.contains(
            "fencelock_acquire_duration_seconds_count\
             {engine=\"sqlite\",backend=\"default\",resource=\"scraped\",outcome=\"acquired\"} 1"
        ),
        "{text}"
    );
    assert!(
        text.contains("fencelock_acquire_duration_seconds_bucket{engine=\"sqlite\",backend=\"default\",resource=\"scraped\",outcome=\"acquired\",le=\"+Inf\"} 1"),
        "histograms are served with buckets: {text}"
    );
    assert!(
        text.contains("fencelock_lease_ttl_seconds{engine=\"sqlite\",backend=\"default\",resource=\"scraped\"} 1.5"),
        "{text}"
    );
    // Renewals every 500 ms show up while the command runs.
    let mut last = String::new();
    let renewed = poll_until(FINISH, || {
        last = scrape(addr);
        last.lines().any(|l| {
            l.starts_with("fencelock_renewals_total{engine=\"sqlite\",backend=\"default\",resource=\"scraped\"} ")
                && !l.ends_with(" 0")
        })
    });
    assert!(renewed, "no renewal counted: {last}");
    assert!(
        last.contains("fencelock_renewal_failures_total{engine=\"sqlite\",backend=\"default\",resource=\"scraped\"} 0"),
        "{last}"
    );

    std::fs::write(sb.path("release"), "").unwrap();
    let out = run.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
        "the endpoint lives only as long as the run"
    );
}

#[test]
fn an_unusable_metrics_addr_is_a_usage_error_before_anything_runs() {
    let sb = Sandbox::new();
    let out = sb.run(sb.run_sh(&["--metrics-addr", "localhost"], "m", "echo ran > ran"));
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
    assert!(out.stderr.contains("--metrics-addr"), "{}", out.stderr);

    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let out = sb.run(sb.run_sh(&["--metrics-addr", &addr], "m", "echo ran > ran"));
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
    assert!(
        out.stderr
            .contains(&format!("cannot serve metrics on {addr}")),
        "{}",
        out.stderr
    );
    assert!(!sb.path("ran").exists(), "the command must not run");
    assert_eq!(sb.inspect("m"), "m: free");
}
