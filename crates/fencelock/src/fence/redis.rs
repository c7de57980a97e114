//! A fence kept in Redis: the check and the write run in one server-side script, so no write
//! with a stale token can land between them.

use redis::aio::ConnectionManager;

use crate::core::error::{Error, Result};
use crate::core::token::FencingToken;

const ENGINE: &str = "redis";

/// The error code a fenced script answers with when the token is stale.
const STALE: &str = "FENCELOCK_STALE";

/// Checks and records the token (KEYS[1] = fence key, ARGV[1] = token), then hands the rest
/// of KEYS and ARGV to the body that follows.
const PRELUDE: &str = r#"
local seen = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < seen then
  return redis.error_reply('FENCELOCK_STALE ' .. string.format('%.0f', seen))
end
redis.call('SET', KEYS[1], ARGV[1])
local KEYS, ARGV = {unpack(KEYS, 2)}, {unpack(ARGV, 2)}
"#;

/// Writes to Redis only with a fencing token at least as high as any seen for the resource.
///
/// The highest token per resource lives in `<prefix>seen:<resource>` (default prefix
/// `fencelock:v1:`, a key category of its own, so it never collides with the lock keys).
///
/// ```no_run
/// # async fn demo(lease: fencelock::Lease) -> fencelock::Result<()> {
/// let fence = fencelock::fence::RedisFence::connect("redis://127.0.0.1:6379", "fencelock:v1:").await?;
/// fence.set("ledger", lease.token(), "ledger:balance", "100").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisFence {
    conn: ConnectionManager,
    prefix: String,
}

impl RedisFence {
    /// Connects to one Redis node: `redis://[user:pass@]host:port[/db]`, or over TLS
    /// `rediss://...[?ca=PATH&cert=PATH&key=PATH]`, as the engine reads them (the URL
    /// rules are those of [`RedisUrl`](crate::RedisUrl)).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a URL that is not one
    /// node's, or TLS files that cannot be read;
    /// [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the node cannot be reached (or the
    /// TLS handshake fails).
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisFence> {
        // The fence reads URLs through the library's public parser, as any caller would.
        let client = match crate::Backend::parse(url)? {
            crate::Backend::Redis(u) if !u.quorum => u.clients()?.pop(),
            _ => None,
        }
        .ok_or_else(|| {
            Error::invalid(format!(
                "fence URL {}: a fence lives on one Redis node; write redis://host:port or \
                 rediss://host:port",
                crate::core::url::redact_url(url)
            ))
        })?;
        let conn = ConnectionManager::new(client).await.map_err(|e| {
            Error::engine_failure(ENGINE, "cannot connect the fence").with_source(e)
        })?;
        Ok(RedisFence {
            conn,
            prefix: prefix.to_owned(),
        })
    }

    /// The key holding the highest token seen for `resource`.
    pub fn fence_key(&self, resource: &str) -> String {
        format!("{}seen:{resource}", self.prefix)
    }

    /// Records `token` for `resource` if it is not stale, writing nothing else: the check for
    /// callers whose own write happens elsewhere (the HTTP fence, for one). The check and the
    /// record are atomic, but nothing ties them to that later write; for that, use
    /// [`set`](Self::set), [`hset`](Self::hset) or [`script`](Self::script).
    pub async fn admit(&self, resource: &str, token: FencingToken) -> Result<()> {
        self.script(resource, token, "", &[], &[]).await.map(drop)
    }

    /// `SET key value`, only with a token that is not stale.
    pub async fn set(
        &self,
        resource: &str,
        token: FencingToken,
        key: &str,
        value: &str,
    ) -> Result<()> {
        self.script(
            resource,
            token,
            "return redis.call('SET', KEYS[1], ARGV[1])",
            &[key],
            &[value],
        )
        .await
        .map(drop)
    }

    /// `HSET key field value`, only with a token that is not stale.
    pub async fn hset(
        &self,
        resource: &str,
        token: FencingToken,
        key: &str,
        field: &str,
        value: &str,
    ) -> Result<()> {
        self.script(
            resource,
            token,
            "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])",
            &[key],
            &[field, value],
        )
        .await
        .map(drop)
    }

    /// Runs the caller's Lua `body` with its own `keys` and `args` as `KEYS` and `ARGV`, only
    /// with a token that is not stale; the check, the token's record and the body are one
    /// atomic script. Returns what the body returns.
    pub async fn script(
        &self,
        resource: &str,
        token: FencingToken,
        body: &str,
        keys: &[&str],
        args: &[&str],
    ) -> Result<redis::Value> {
        let script = redis::Script::new(&format!("{PRELUDE}\n{body}"));
        let mut inv = script.prepare_invoke();
        inv.key(self.fence_key(resource)).arg(token.get());
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(*a);
        }
        let mut conn = self.conn.clone();
        match inv.invoke_async::<redis::Value>(&mut conn).await {
            Ok(v) => {
                crate::core::metrics::fence_met(resource);
                Ok(v)
            }
            Err(e) if e.code() == Some(STALE) => {
                let highest = e
                    .detail()
                    .and_then(|d| d.trim().parse::<u64>().ok())
                    .unwrap_or(0);
                crate::core::metrics::stale_token_rejected(resource);
                Err(Error::stale_token(
                    resource,
                    token,
                    FencingToken::new(highest),
                ))
            }
            Err(e) => Err(
                Error::engine_failure(ENGINE, format!("fenced write to {resource:?}"))
                    .with_source(e),
            ),
        }
    }

    /// The highest token seen for `resource`.
    pub async fn highest(&self, resource: &str) -> Result<Option<FencingToken>> {
        let mut conn = self.conn.clone();
        let v: Option<u64> = redis::cmd("GET")
            .arg(self.fence_key(resource))
            .query_async(&mut conn)
            .await
            .map_err(|e| Error::engine_failure(ENGINE, "reading a fence").with_source(e))?;
        Ok(v.map(FencingToken::new))
    }
}
