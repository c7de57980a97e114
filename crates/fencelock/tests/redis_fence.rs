//! The Redis fence against a real redis-server: stale tokens never write.
#![allow(clippy::unwrap_used)]

use fencelock::fence::RedisFence;
use fencelock::{ErrorKind, FencingToken};
use fencelock_testkit::RedisServer;

fn cli(server: &RedisServer, args: &[&str]) -> String {
    let out = server.cli(args).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test]
async fn a_stale_token_never_writes_and_says_what_it_saw() {
    let server = RedisServer::start().unwrap();
    let fence = RedisFence::connect(&server.url(), "fencelock:v1:")
        .await
        .unwrap();
    let (old, new) = (FencingToken::new(41), FencingToken::new(42));

    fence.set("ledger", new, "balance", "100").await.unwrap();
    // The same holder writes again with the same token: accepted.
    fence
        .hset("ledger", new, "invoice:7", "status", "paid")
        .await
        .unwrap();
    let e = fence.set("ledger", old, "balance", "0").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleToken);
    assert_eq!(e.stale_tokens(), Some((old, new)));
    assert_eq!(cli(&server, &["GET", "balance"]), "100");
    assert_eq!(cli(&server, &["HGET", "invoice:7", "status"]), "paid");
    assert_eq!(fence.highest("ledger").await.unwrap(), Some(new));
    assert_eq!(cli(&server, &["GET", &fence.fence_key("ledger")]), "42");
    // Another resource has a fence of its own.
    fence.set("other", old, "x", "1").await.unwrap();
}

#[tokio::test]
async fn a_callers_script_runs_only_with_a_fresh_token() {
    let server = RedisServer::start().unwrap();
    let fence = RedisFence::connect(&server.url(), "p:").await.unwrap();
    let body = "return redis.call('INCRBY', KEYS[1], ARGV[1])";
    let v = fence
        .script("ledger", FencingToken::new(5), body, &["total"], &["10"])
        .await
        .unwrap();
    assert_eq!(v, redis::Value::Int(10));
    let v = fence
        .script("ledger", FencingToken::new(6), body, &["total"], &["5"])
        .await
        .unwrap();
    assert_eq!(v, redis::Value::Int(15));
    let e = fence
        .script("ledger", FencingToken::new(5), body, &["total"], &["1000"])
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleToken);
    assert_eq!(cli(&server, &["GET", "total"]), "15");
}

#[tokio::test]
async fn admit_records_the_token_and_refuses_a_stale_one_without_writing() {
    let server = RedisServer::start().unwrap();
    let fence = RedisFence::connect(&server.url(), "p:").await.unwrap();
    fence.admit("ledger", FencingToken::new(7)).await.unwrap();
    fence.admit("ledger", FencingToken::new(7)).await.unwrap();
    let e = fence
        .admit("ledger", FencingToken::new(6))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleToken);
    assert_eq!(
        e.stale_tokens(),
        Some((FencingToken::new(6), FencingToken::new(7)))
    );
    assert_eq!(
        fence.highest("ledger").await.unwrap(),
        Some(FencingToken::new(7))
    );
    // Only the fence key was written.
    assert_eq!(cli(&server, &["DBSIZE"]), "1");
}
