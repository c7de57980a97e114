//! `fencelock doctor` against real Redis servers and a SQLite file.
#![allow(clippy::unwrap_used)]

mod common;

use common::{fencelock, fencelock_at, Finished, FINISH};
use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};

fn doctor(args: &[&str]) -> (Finished, String) {
    let out = fencelock(&["doctor"]).args(args).run(FINISH).unwrap();
    let text = out.stdout.clone();
    (out, text)
}

#[test]
fn a_node_without_fsync_always_is_flagged_and_one_with_it_is_not() {
    let plain = RedisServer::start().unwrap();
    let (out, text) = doctor(&["--backend", &plain.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("WARN  appendonly no"), "{text}");
    assert!(text.contains("reachable, Redis"), "{text}");
    assert!(text.contains("clock offset"), "{text}");

    let durable =
        RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).unwrap();
    let (out, text) = doctor(&["--backend", &durable.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("ok    appendonly yes, appendfsync always"),
        "{text}"
    );
    // The one problem left: the default user may run everything (see tests/acl.rs).
    assert!(
        text.contains("@all") && text.contains("1 problem(s)"),
        "{text}"
    );
}

#[test]
fn redlock_with_a_dead_node_reports_it_and_exits_69() {
    let mut nodes = start_redis_nodes(3).unwrap();
    nodes[1].kill();
    let (out, text) = doctor(&["--backend", &redlock_url(&nodes)]);
    assert_eq!(out.status.code(), Some(69), "{text}");
    assert!(
        text.contains(&format!("node {}\n  WARN  unreachable", nodes[1].addr())),
        "{text}"
    );
    assert!(text.contains("clocks within"), "{text}");
    assert!(text.contains("1 node(s) unreachable"), "{text}");
}

#[test]
fn ttl_advice_is_three_times_the_hold_p99() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/l.db", dir.path().display());
    let (out, text) = doctor(&["--backend", &url, "--hold-p99", "2s", "--ttl", "5s"]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("a TTL of at least 6s (3 x p99); the TTL in use, 5s, is shorter"),
        "{text}"
    );
    let (_, text) = doctor(&["--backend", &url, "--hold-p99", "2s", "--ttl", "6s"]);
    assert!(
        text.contains("ok    hold p99 2s: a TTL of at least 6s"),
        "{text}"
    );
}

#[test]
fn bad_urls_exit_64() {
    let (out, _) = doctor(&["--backend", "ftp://x"]);
    assert_eq!(out.status.code(), Some(64));
}

/// The lines of the doctor's output that say what it found under one node or section.
fn warnings(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.starts_with("  WARN")).collect()
}

#[test]
fn a_node_without_scripting_is_reported_and_run_fails_clearly_holding_nothing() {
    // `rename-command EVALSHA ""` as a configuration line: the node has no EVALSHA at all.
    let renamed = RedisServer::start_with(&["--rename-command", "EVALSHA", ""]).unwrap();
    let (out, text) = doctor(&["--backend", &renamed.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains(
            "WARN  scripting unavailable: EVALSHA is not a command on this server: renamed or \
             disabled by rename-command"
        ),
        "{text}"
    );
    let run = fencelock_at(&renamed.url(), &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(run.status.code(), Some(69), "{run:?}");
    assert!(
        run.stderr
            .contains("has no EVALSHA command (renamed or disabled by rename-command"),
        "{}",
        run.stderr
    );
    // Nothing was written, so nothing is held.
    let keys = renamed.cli(&["--scan"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&keys.stdout).trim(), "", "{keys:?}");

    // Denied by the ACL rather than renamed: said so, for that user.
    let plain = RedisServer::start().unwrap();
    let acl = plain
        .cli(&[
            "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-evalsha",
        ])
        .unwrap();
    assert!(acl.status.success(), "{acl:?}");
    let as_app = format!("redis://app:pw@{}", plain.addr());
    let (_, text) = doctor(&["--backend", &as_app]);
    assert!(
        text.contains("scripting unavailable: the ACL user may not run EVALSHA"),
        "{text}"
    );
    let run = fencelock_at(&as_app, &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(run.status.code(), Some(69), "{run:?}");
    assert!(run.stderr.contains("may not run EVALSHA"), "{}", run.stderr);

    // On Redlock every node is checked: the one without scripting is named.
    let nodes = [RedisServer::start().unwrap(), renamed, plain];
    let (_, text) = doctor(&["--backend", &redlock_url(&nodes)]);
    let node_of_warning = text
        .split("\nnode ")
        .filter(|section| section.contains("scripting unavailable"))
        .map(|section| section.lines().next().unwrap_or_default().to_owned())
        .collect::<Vec<_>>();
    assert_eq!(node_of_warning, [nodes[1].addr()], "{text}");
}

#[test]
fn a_redis_open_to_anyone_is_flagged_and_loopback_plaintext_is_not() {
    // protected-mode on, no password: a note, not a problem, on loopback.
    let usual = RedisServer::start().unwrap();
    let (_, text) = doctor(&["--backend", &usual.url()]);
    assert!(
        text.contains("ok    plaintext, on a loopback address"),
        "{text}"
    );
    assert!(text.contains("note  no password"), "{text}");
    assert!(!text.contains("TLS on a non-loopback"), "{text}");

    let open = RedisServer::start_with(&["--protected-mode", "no"]).unwrap();
    let (out, text) = doctor(&["--backend", &open.url()]);
    assert_eq!(out.status.code(), Some(0), "warnings keep exit 0: {text}");
    assert!(
        text.contains("WARN  no password and protected-mode no: anyone who reaches this port"),
        "{text}"
    );

    // CONFIG denied to the user, and the node lets anyone in: it could not be checked.
    let acl = open
        .cli(&[
            "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-config",
        ])
        .unwrap();
    assert!(acl.status.success(), "{acl:?}");
    let (_, text) = doctor(&["--backend", &format!("redis://app:pw@{}", open.addr())]);
    assert!(
        text.contains("no password, and protected-mode could not be checked"),
        "{text}"
    );

    // Set once the server runs: the test kit's readiness check pings without a password.
    let locked = RedisServer::start().unwrap();
    let set = locked
        .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let (_, text) = doctor(&["--backend", &format!("redis://:s3cret@{}", locked.addr())]);
    assert!(
        text.contains("ok    a client without a password is refused"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_is_connected_to_and_each_missing_privilege_is_named() {
    use fencelock_testkit::PgServer;
    let server = PgServer::start().unwrap();
    let app = server.add_password_role("app", "apppw").unwrap();
    let app = app.replace("app@", "app:apppw@");
    let psql = |sql: &str| {
        let out = server.psql(sql).unwrap();
        assert!(out.status.success(), "{sql}: {out:?}");
    };

    // Before any table exists: PostgreSQL 15 grants no CREATE on public to other roles.
    let (out, text) = doctor(&["--backend", &app]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("reachable, PostgreSQL 15"), "{text}");
    assert!(text.contains("round trip p50"), "{text}");
    assert!(
        text.contains("and app may not create them (no CREATE on schema public)"),
        "{text}"
    );
    assert!(text.contains("ok    plaintext"), "{text}");
    let superuser = server.url();
    let (_, text) = doctor(&["--backend", &superuser]);
    assert!(text.contains("the first client creates them"), "{text}");

    // The tables made by a first client; app gets part of what advisory mode needs.
    let made = fencelock_at(&superuser, &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(made.status.code(), Some(0), "{made:?}");
    psql("GRANT SELECT, INSERT, UPDATE ON fencelock_tokens TO app");
    psql("GRANT SELECT ON fencelock_audit TO app");
    psql("GRANT SELECT ON fencelock_limits TO app");
    let (out, text) = doctor(&["--backend", &app]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert_eq!(
        warnings(&text),
        [
            "  WARN  app lacks INSERT on table fencelock_audit (needed for release --force)",
            "  WARN  app lacks USAGE on sequence fencelock_audit_id_seq (needed for release --force)",
        ],
        "{text}"
    );
    // What it has is enough to lock, though it may not create the tables.
    let run = fencelock_at(&app, &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(run.status.code(), Some(0), "{run:?}");
    let lease = format!("{app}?mode=lease");
    let (_, text) = doctor(&["--backend", &lease]);
    for privilege in ["SELECT", "INSERT", "UPDATE"] {
        assert!(
            text.contains(&format!(
                "WARN  app lacks {privilege} on table fencelock_leases"
            )),
            "{text}"
        );
    }
    psql("GRANT SELECT, INSERT, UPDATE ON fencelock_leases TO app");
    psql("GRANT INSERT ON fencelock_audit TO app");
    psql("GRANT USAGE ON SEQUENCE fencelock_audit_id_seq TO app");
    for url in [&app, &lease] {
        let (_, text) = doctor(&["--backend", url]);
        assert!(warnings(&text).is_empty(), "{text}");
        assert!(
            text.contains("app has every privilege this mode needs"),
            "{text}"
        );
    }

    // Refusals are the server's own words, and exit 69.
    for (url, says) in [
        (
            app.replace("apppw", "wrong"),
            "password authentication failed",
        ),
        (
            app.replace("/postgres", "/nodb"),
            "database \"nodb\" does not exist",
        ),
        (
            superuser.replace("postgres@", "nobody@"),
            "role \"nobody\" does not exist",
        ),
    ] {
        let (out, text) = doctor(&["--backend", &url]);
        assert_eq!(out.status.code(), Some(69), "{text}");
        assert!(
            text.contains("WARN  unreachable:") && text.contains(says),
            "{text}"
        );
        assert!(!text.contains("apppw") && !text.contains("wrong"), "{text}");
    }
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_without_authentication_is_flagged_and_with_it_is_not() {
    use fencelock_testkit::EtcdCluster;
    let cluster = EtcdCluster::start(1).unwrap();
    let (out, text) = doctor(&["--backend", &cluster.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("WARN  authentication is off"), "{text}");
    assert!(
        text.contains("ok    plaintext, on a loopback address"),
        "{text}"
    );
    for args in [&["user", "add", "root:rootpw"][..], &["auth", "enable"]] {
        let out = cluster.ctl(args).unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
    }
    // Without credentials the cluster refuses every read: said so, and exit 69.
    let (out, text) = doctor(&["--backend", &cluster.url()]);
    assert_eq!(out.status.code(), Some(69), "{text}");
    assert!(
        text.contains("refused the read, as authentication is on"),
        "{text}"
    );
    let with_root = cluster.url().replace("etcd://", "etcd://root:rootpw@");
    let (out, text) = doctor(&["--backend", &with_root]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("ok    authentication on: the cluster authenticated root"),
        "{text}"
    );
    assert!(warnings(&text).is_empty(), "{text}");

    // Over TLS: the version negotiated and the verified certificate, per endpoint.
    let certs = tempfile::tempdir().unwrap();
    let tls = fencelock_testkit::EtcdTls::generate(certs.path()).unwrap();
    let secure = EtcdCluster::start_tls(1, &tls).unwrap();
    let (out, text) = doctor(&["--backend", &secure.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("ok    TLS 1."), "{text}");
    assert!(
        text.contains("); server certificate verified: chain against ca="),
        "{text}"
    );
    assert!(!text.contains("plaintext"), "{text}");
}
