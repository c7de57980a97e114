//! The fence as a service, for resources that cannot host one: the sidecar admits a token for
//! a resource through the configured fence (`--fence memory`, `redis://...`, `postgres://...`)
//! and answers accepted or stale, with both tokens.

use std::time::Duration;

use fencelock::fence::MemoryFence;
use fencelock::{ErrorKind, FencingToken};

/// Where the highest token per resource is kept.
// One value for the life of the process: the size of its largest variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Fence {
    /// In the sidecar's memory: lost when it restarts, so for tests and demos.
    Memory(MemoryFence),
    #[cfg(feature = "redis")]
    Redis(fencelock::fence::RedisFence),
    #[cfg(feature = "postgres")]
    Postgres {
        fence: fencelock::fence::PgFence,
        client: tokio::sync::Mutex<tokio_postgres::Client>,
    },
}

/// The outcome of one admission.
pub enum Admitted {
    Accepted,
    /// Refused: the highest token already seen.
    Stale(FencingToken),
}

impl Fence {
    /// Opens the fence `spec` names: `memory`, or a Redis or PostgreSQL URL. A refusal says
    /// whether the spec was wrong ([`ErrorKind::InvalidInput`]) or the fence unreachable.
    pub async fn open(
        spec: &str,
        prefix: &str,
        timeout: Duration,
    ) -> Result<Fence, (ErrorKind, String)> {
        if spec == "memory" {
            return Ok(Fence::Memory(MemoryFence::new()));
        }
        let scheme = spec.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            #[cfg(feature = "redis")]
            "redis" | "rediss" => fencelock::fence::RedisFence::connect(spec, prefix)
                .await
                .map(Fence::Redis)
                .map_err(|e| (e.kind(), e.to_string())),
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                let client = fencelock::fence::PgFence::connect(spec, timeout)
                    .await
                    .map_err(|e| (e.kind(), e.to_string()))?;
                let fence = fencelock::fence::PgFence::new();
                fence
                    .install(&client)
                    .await
                    .map_err(|e| (e.kind(), e.to_string()))?;
                Ok(Fence::Postgres {
                    fence,
                    client: tokio::sync::Mutex::new(client),
                })
            }
            _ => {
                let _ = (prefix, timeout);
                Err((
                    ErrorKind::InvalidInput,
                    format!(
                        "--fence {}: write memory, redis://host:port or postgres://user@host/db",
                        fencelock::redact_url(spec)
                    ),
                ))
            }
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Fence::Memory(_) => "memory",
            #[cfg(feature = "redis")]
            Fence::Redis(_) => "redis",
            #[cfg(feature = "postgres")]
            Fence::Postgres { .. } => "postgres",
        }
    }

    /// Admits `token` for `resource`: accepted when not lower than the highest seen. An
    /// error is the fence's failure (unreachable, refused), told in one sentence.
    pub async fn admit(&self, resource: &str, token: FencingToken) -> Result<Admitted, String> {
        let outcome = match self {
            Fence::Memory(f) => f.admit(resource, token),
            #[cfg(feature = "redis")]
            Fence::Redis(f) => f.admit(resource, token).await,
            #[cfg(feature = "postgres")]
            Fence::Postgres { fence, client } => {
                let mut client = client.lock().await;
                let tx = client
                    .transaction()
                    .await
                    .map_err(|e| pg_failure(resource, &e))?;
                match fence.admit(&tx, resource, token).await {
                    Ok(()) => {
                        tx.commit().await.map_err(|e| pg_failure(resource, &e))?;
                        Ok(())
                    }
                    // Dropping the transaction rolls it back.
                    Err(e) => Err(e),
                }
            }
        };
        match outcome {
            Ok(()) => Ok(Admitted::Accepted),
            Err(e) if e.kind() == ErrorKind::StaleToken => {
                Ok(Admitted::Stale(e.stale_tokens().map_or(token, |(_, h)| h)))
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(feature = "postgres")]
fn pg_failure(resource: &str, e: &tokio_postgres::Error) -> String {
    format!("the PostgreSQL fence failed for {resource:?}: {e}")
}
