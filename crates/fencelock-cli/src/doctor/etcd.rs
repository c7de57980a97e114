//! etcd: a linearizable read through the library, the server version, whether authentication
//! is on, and TLS per endpoint.

use super::{net, DoctorArgs, Finding, Findings, ANSWER_WITHIN};

pub(super) async fn etcd(args: &DoctorArgs, url: &fencelock::EtcdUrl, f: &mut Findings) {
    outln!("cluster");
    let started = std::time::Instant::now();
    // `connect` reports its own error; etcd connections are lazy, so it rarely fails here.
    let Ok(client) = crate::connect(&args.backend, "fencelock-doctor").await else {
        f.unreachable += 1;
        return;
    };
    match client.inspect("fencelock-doctor").await {
        Ok(_) => f.ok(&format!(
            "cluster answered a linearizable read in {}",
            crate::human_duration(started.elapsed())
        )),
        Err(e) => {
            let text = e.to_string();
            if AUTH_REFUSALS.iter().any(|m| text.contains(m)) {
                f.unreachable_node(&format!(
                    "the cluster refused the read, as authentication is on: {text}; give the \
                     user and password of a role that may use the prefix \
                     (etcd://user:password@...)"
                ));
            } else {
                f.unreachable_node(&format!("unreachable: {text}"));
            }
            client.close().await;
            return;
        }
    }
    client.close().await;
    match url.connect(ANSWER_WITHIN).await {
        Ok(mut c) => {
            if let Ok(Ok(s)) = tokio::time::timeout(ANSWER_WITHIN, c.status()).await {
                f.ok(&format!("etcd {}", s.version()));
            }
            let refused = if url.user.is_some() {
                // etcd refuses to authenticate anyone while authentication is off.
                Ok(None)
            } else {
                match tokio::time::timeout(ANSWER_WITHIN, c.user_list()).await {
                    Ok(Ok(_)) => Ok(Some(false)),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err("no answer within 5s".to_owned()),
                }
            };
            f.add(authentication(url.user.as_deref(), refused));
        }
        Err(e) => f.note(&format!(
            "could not open a second client to check authentication: {e}"
        )),
    }
    for (i, ep) in url.endpoints.iter().enumerate() {
        outln!("endpoint {ep}");
        if !url.tls {
            let loopback = net::on_loopback(&ep.host, ep.port).await;
            match net::plaintext_warning(&format!("endpoint {ep}"), loopback, "etcds://") {
                Some(w) => f.warn(&w),
                None => f.ok("plaintext, on a loopback address"),
            }
            continue;
        }
        match url.tls_session(i, ANSWER_WITHIN).await {
            Ok(Some(s)) => f.ok(&format!(
                "{} ({}); server certificate verified: chain against {}, name {}",
                s.version,
                s.cipher,
                url.ca
                    .as_ref()
                    .map(|p| format!("ca={}", p.display()))
                    .unwrap_or_else(|| "the system's roots".into()),
                ep.host
            )),
            Ok(None) => {}
            Err(e) => f.warn(&format!("TLS: {e}")),
        }
    }
    f.note("tokens are etcd revisions; lease TTLs are whole seconds (rounded up)");
}

/// What etcd says to a call that lacks the credentials authentication requires.
const AUTH_REFUSALS: [&str; 3] = [
    "user name is empty",
    "permission denied",
    "invalid auth token",
];

/// What the answer to a user listing without credentials says about authentication: `Ok(None)`
/// when the doctor authenticated as `user` itself, `Ok(Some(false))` when the listing was
/// answered (anyone may read the users, so authentication is off), `Err` with the refusal.
fn authentication(user: Option<&str>, listing: Result<Option<bool>, String>) -> Finding {
    match (user, listing) {
        (Some(u), Ok(None)) => {
            Finding::Ok(format!("authentication on: the cluster authenticated {u}"))
        }
        (_, Ok(_)) => Finding::Warn(
            "authentication is off: any client that reaches the cluster may read, write and \
             delete every key, fencelock's locks included; enable it (etcdctl user add root; \
             etcdctl auth enable) with a role per service on its prefix"
                .into(),
        ),
        (_, Err(e))
            if [
                "user name is empty",
                "permission denied",
                "invalid auth token",
            ]
            .iter()
            .any(|m| e.contains(m)) =>
        {
            Finding::Ok("authentication on: a client without credentials is refused".into())
        }
        (_, Err(e)) => Finding::Note(format!("could not tell whether authentication is on: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authentication_is_judged_from_the_refusal() {
        assert!(matches!(
            authentication(Some("app"), Ok(None)),
            Finding::Ok(_)
        ));
        assert!(matches!(
            authentication(None, Ok(Some(false))),
            Finding::Warn(_)
        ));
        assert!(matches!(
            authentication(None, Err("etcdserver: user name is empty".into())),
            Finding::Ok(_)
        ));
        assert!(matches!(
            authentication(None, Err("transport error".into())),
            Finding::Note(_)
        ));
    }
}
