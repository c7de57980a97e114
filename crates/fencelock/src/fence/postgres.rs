//! A fence kept in PostgreSQL, checked inside the caller's own transaction.

use std::future::Future;
use std::pin::Pin;

use tokio_postgres::{Client, Transaction};

use crate::core::error::{Error, Result};
use crate::core::token::FencingToken;

const ENGINE: &str = "postgres";

/// The fence table's name unless [`PgFence::with_table`] says otherwise.
pub const DEFAULT_FENCE_TABLE: &str = "fencelock_fence";

/// The longest identifier PostgreSQL keeps without truncating it (`NAMEDATALEN - 1`).
const MAX_IDENTIFIER_BYTES: usize = 63;

/// The future a [`PgFence::write`] body returns: it borrows the transaction.
pub type WriteFuture<'t, T> =
    Pin<Box<dyn Future<Output = std::result::Result<T, tokio_postgres::Error>> + Send + 't>>;

/// Runs the caller's statements in PostgreSQL only with a fencing token at least as high as
/// any seen for the resource, in the caller's transaction.
///
/// The fence table (`fencelock_fence` by default, see [`PgFence::schema_sql`]) has one row per
/// resource: `resource text PRIMARY KEY, token bigint NOT NULL`. Create it once with
/// [`PgFence::install`] or with your migrations.
///
/// ```no_run
/// # async fn demo(client: &mut tokio_postgres::Client, lease: fencelock::Lease)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// use fencelock::fence::PgFence;
/// let fence = PgFence::new();
/// fence.install(client).await?;
///
/// // Either the helper: begin, admit, the statements, commit (rolled back on any error) ...
/// fence
///     .write(client, "ledger", lease.token(), |tx| {
///         Box::pin(async move {
///             tx.execute("UPDATE accounts SET balance = balance - 100 WHERE id = 7", &[]).await
///         })
///     })
///     .await?;
///
/// // ... or the same written out, with statements and error handling of your own.
/// let tx = client.transaction().await?;
/// fence.admit(&tx, "ledger", lease.token()).await?; // if stale, dropping tx rolls it back
/// tx.execute("UPDATE accounts SET balance = balance + 100 WHERE id = 8", &[]).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
///
/// # A token column on your own rows
/// Where the protected data is one row, the row can carry the token itself and needs no
/// fence table: a conditional update writes only with a token at least as high as the row's.
/// ```sql
/// ALTER TABLE accounts ADD COLUMN fence_token bigint NOT NULL DEFAULT 0;
/// UPDATE accounts SET balance = $1, fence_token = $2 WHERE id = $3 AND fence_token <= $2;
/// ```
/// No row updated means a stale token (or no such row); [`PgFence::stale_row`] turns that
/// outcome into the same error [`PgFence::admit`] returns. The row lock the `UPDATE` takes
/// serialises writers of that row as the fence row does.
///
/// # Why the check and the write are atomic
/// [`PgFence::admit`] advances the fence row with one conditional upsert:
/// ```sql
/// INSERT INTO fencelock_fence (resource, token) VALUES ($1, $2)
/// ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token
/// WHERE fencelock_fence.token <= EXCLUDED.token RETURNING token
/// ```
/// The upsert locks the row, also when it leaves it alone, until the caller's transaction
/// ends. A writer with another token for the same resource waits at its own `admit` until
/// this one commits or rolls back, and then compares against the token this one left. So
/// the check and the caller's statements commit together or not at all, and a stale writer's
/// statements never take effect, even if its transaction began first.
///
/// Writers of one resource are thus serialised from `admit` to commit: keep those
/// transactions short, and set `lock_timeout` (or `statement_timeout`) on the connection if a
/// writer must not wait behind a stuck one; the fence runs on the caller's client and adds no
/// deadline of its own. Under `REPEATABLE READ` or `SERIALIZABLE`, a writer that meets a row
/// advanced after its snapshot gets a serialisation failure ([`ErrorKind::Engine`],
/// retryable) instead of a wait.
///
/// [`ErrorKind::Engine`]: crate::ErrorKind::Engine
#[derive(Debug, Clone)]
pub struct PgFence {
    table: String,
    advance: String,
    read: String,
}

impl Default for PgFence {
    fn default() -> PgFence {
        PgFence::for_table(DEFAULT_FENCE_TABLE)
    }
}

impl PgFence {
    /// A fence on the table `fencelock_fence` (in the connection's `search_path`).
    pub fn new() -> PgFence {
        PgFence::default()
    }

    /// A client for the fence's statements, from the same URLs as the PostgreSQL engine
    /// (`postgres://...?sslmode=verify-full&sslrootcert=PATH[&sslcert=PATH&sslkey=PATH]`,
    /// with libpq's meaning for each `sslmode`); its connection is driven by a task of its
    /// own. Any other client of the caller's works as well.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a URL that is not a
    /// PostgreSQL one or TLS files that cannot be read;
    /// [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the server cannot be reached within
    /// `timeout`, refuses the session or fails the TLS handshake.
    pub async fn connect(url: &str, timeout: std::time::Duration) -> Result<Client> {
        // The fence reads URLs through the library's public parser, as any caller would.
        match crate::Backend::parse(url)? {
            crate::Backend::Postgres(u) => u.connect(timeout).await,
            #[allow(unreachable_patterns)]
            _ => Err(Error::invalid(format!(
                "fence URL {}: a PgFence needs a postgres:// URL",
                crate::core::url::redact_url(url)
            ))),
        }
    }

    /// A fence on another table, `name` or `schema.name`: lowercase ASCII letters, digits
    /// and `_`, not starting with a digit, at most 63 bytes each. Anything else is
    /// [`ErrorKind::InvalidInput`], so the name is safe to put into SQL unquoted.
    ///
    /// [`ErrorKind::InvalidInput`]: crate::ErrorKind::InvalidInput
    pub fn with_table(table: &str) -> Result<PgFence> {
        let parts: Vec<&str> = table.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| is_plain_identifier(p)) {
            return Err(Error::invalid(format!(
                "fence table {table:?}: use `name` or `schema.name` in lowercase ASCII letters, \
                 digits and `_`, not starting with a digit, at most {MAX_IDENTIFIER_BYTES} \
                 bytes each"
            )));
        }
        Ok(PgFence::for_table(table))
    }

    fn for_table(table: &str) -> PgFence {
        PgFence {
            table: table.to_owned(),
            advance: format!(
                "INSERT INTO {table} (resource, token) VALUES ($1, $2) \
                 ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token \
                 WHERE {table}.token <= EXCLUDED.token RETURNING token"
            ),
            read: format!("SELECT token FROM {table} WHERE resource = $1"),
        }
    }

    /// The fence table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The statement that creates the fence table if it does not exist, for migration tools.
    pub fn schema_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (\
             resource text PRIMARY KEY, \
             token bigint NOT NULL CHECK (token >= 0))",
            self.table
        )
    }

    /// Creates the fence table if it does not exist ([`PgFence::schema_sql`]). Run it once,
    /// at deployment: PostgreSQL's `IF NOT EXISTS` is not safe against two sessions creating
    /// the same table at the same moment.
    pub async fn install(&self, client: &Client) -> Result<()> {
        client.batch_execute(&self.schema_sql()).await.map_err(|e| {
            Error::engine_failure(
                ENGINE,
                format!("cannot create the fence table {}", self.table),
            )
            .with_source(e)
        })
    }

    /// Admits `token` for `resource` in the transaction `tx`, or refuses it as stale.
    ///
    /// On success the fence row holds `token` and stays locked until `tx` ends, so the
    /// statements that follow in `tx` commit only together with the check, and other writers
    /// of `resource` wait for `tx` at their own `admit`. A token equal to the highest seen is
    /// admitted (one holder, many writes).
    ///
    /// A stale token is [`ErrorKind::StaleToken`] with the presented and the highest token,
    /// counted in `fencelock_stale_token_rejections_total`; nothing changed, and the caller
    /// must roll `tx` back (dropping it does) rather than run its statements. A PostgreSQL
    /// failure is [`ErrorKind::Engine`] naming the resource, and aborts `tx`.
    ///
    /// Cancel safety: dropping the future midway leaves the statement's outcome unknown
    /// within `tx`; roll `tx` back.
    ///
    /// [`ErrorKind::StaleToken`]: crate::ErrorKind::StaleToken
    /// [`ErrorKind::Engine`]: crate::ErrorKind::Engine
    pub async fn admit(
        &self,
        tx: &Transaction<'_>,
        resource: &str,
        token: FencingToken,
    ) -> Result<()> {
        let presented = to_bigint(resource, token)?;
        let advanced = tx
            .query_opt(&self.advance, &[&resource, &presented])
            .await
            .map_err(|e| self.failure(resource, "checking the fencing token", e))?;
        if advanced.is_some() {
            return Ok(());
        }
        // The upsert locked the row even though it left it alone, so it cannot move before
        // this read.
        let row = tx
            .query_opt(&self.read, &[&resource])
            .await
            .map_err(|e| self.failure(resource, "reading the highest fencing token", e))?;
        let highest = match row {
            Some(row) => row
                .try_get::<_, i64>(0)
                .map_err(|e| self.failure(resource, "reading the highest fencing token", e))?,
            None => 0,
        };
        crate::core::metrics::stale_token_rejected(resource);
        Err(Error::stale_token(resource, token, from_bigint(highest)))
    }

    /// Runs `statements` in a new transaction on `client` after [`PgFence::admit`], and
    /// commits. A stale token, a failing statement or a failed commit rolls the transaction
    /// back and returns the error; a statement's error is [`ErrorKind::Engine`] naming the
    /// resource, with the PostgreSQL error as its source.
    ///
    /// For statements that need their own error type or several round trips of logic, write
    /// the pattern out: `client.transaction()`, `admit`, the statements, `commit`.
    ///
    /// Cancel safety: dropping the future midway drops the transaction, which rolls it back
    /// (tokio-postgres queues the `ROLLBACK` on the connection).
    ///
    /// [`ErrorKind::Engine`]: crate::ErrorKind::Engine
    pub async fn write<T, F>(
        &self,
        client: &mut Client,
        resource: &str,
        token: FencingToken,
        statements: F,
    ) -> Result<T>
    where
        F: for<'t> FnOnce(&'t Transaction<'t>) -> WriteFuture<'t, T>,
    {
        let tx = client
            .transaction()
            .await
            .map_err(|e| self.failure_in(resource, "beginning a transaction", e))?;
        let outcome = match self.admit(&tx, resource, token).await {
            Ok(()) => statements(&tx)
                .await
                .map_err(|e| self.failure_in(resource, "running the fenced statements", e)),
            Err(e) => Err(e),
        };
        match outcome {
            Ok(value) => {
                tx.commit()
                    .await
                    .map_err(|e| self.failure_in(resource, "committing the fenced write", e))?;
                Ok(value)
            }
            Err(e) => {
                // The error that stopped the write says more than a failed rollback could.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// The highest token admitted for `resource`, `None` if it was never fenced.
    pub async fn highest(&self, client: &Client, resource: &str) -> Result<Option<FencingToken>> {
        let row = client
            .query_opt(&self.read, &[&resource])
            .await
            .map_err(|e| self.failure(resource, "reading the highest fencing token", e))?;
        row.map(|row| {
            row.try_get::<_, i64>(0)
                .map(from_bigint)
                .map_err(|e| self.failure(resource, "reading the highest fencing token", e))
        })
        .transpose()
    }

    /// For the token-column pattern (see the type's docs): when a conditional
    /// `UPDATE ... WHERE ... AND fence_token <= $token` updated no row and the row's
    /// `fence_token` is `highest`, the stale-token error for `presented`, counted like the
    /// fence table's; `None` if `presented` is not stale, so the row must be missing instead.
    pub fn stale_row(resource: &str, presented: FencingToken, highest: i64) -> Option<Error> {
        let highest = from_bigint(highest);
        (presented < highest).then(|| {
            crate::core::metrics::stale_token_rejected(resource);
            Error::stale_token(resource, presented, highest)
        })
    }

    fn failure(&self, resource: &str, doing: &str, e: tokio_postgres::Error) -> Error {
        self.failure_in(
            resource,
            &format!("{doing} in fence table {}", self.table),
            e,
        )
    }

    fn failure_in(&self, resource: &str, doing: &str, e: tokio_postgres::Error) -> Error {
        // tokio-postgres displays a server's error as a bare "db error"; what the server said
        // is what tells the caller what to fix.
        let message = match e.as_db_error() {
            Some(db) => format!("{doing}: {} ({})", db.message(), db.code().code()),
            None => doing.to_owned(),
        };
        Error::engine_failure(ENGINE, message)
            .with_resource(resource)
            .with_source(e)
    }
}

fn is_plain_identifier(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && s.len() <= MAX_IDENTIFIER_BYTES
}

/// PostgreSQL has no unsigned 64-bit type; tokens (counters, or microseconds since 1970 for
/// time-floored ones) stay far below `i64::MAX`, and a larger one is refused, not wrapped.
fn to_bigint(resource: &str, token: FencingToken) -> Result<i64> {
    i64::try_from(token.get()).map_err(|_| {
        Error::invalid(format!(
            "fencing token {token} does not fit PostgreSQL's bigint"
        ))
        .with_resource(resource)
    })
}

fn from_bigint(v: i64) -> FencingToken {
    // The table's CHECK keeps tokens non-negative; a negative one written around it by hand
    // is below every real token.
    FencingToken::from_stored(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn table_names_are_plain_identifiers_only() {
        for ok in ["fencelock_fence", "app.fence", "_f1", &"a".repeat(63)] {
            assert_eq!(PgFence::with_table(ok).unwrap().table(), ok);
        }
        for bad in [
            "",
            "1fence",
            "Fence",
            "a.b.c",
            "a.",
            "fence; DROP TABLE x",
            "\"quoted\"",
            &"a".repeat(64),
        ] {
            let e = PgFence::with_table(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn statements_use_the_configured_table() {
        let f = PgFence::with_table("app.fence").unwrap();
        assert!(f.schema_sql().contains("app.fence ("), "{}", f.schema_sql());
        assert!(f
            .advance
            .contains("WHERE app.fence.token <= EXCLUDED.token"));
        assert_eq!(PgFence::new().table(), DEFAULT_FENCE_TABLE);
    }

    #[test]
    fn a_token_beyond_bigint_is_refused_not_wrapped() {
        let e = to_bigint("r", FencingToken::new(u64::MAX)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(to_bigint("r", FencingToken::new(42)).unwrap(), 42);
        assert_eq!(from_bigint(-1), FencingToken::new(0));
    }

    #[test]
    fn stale_row_only_for_a_lower_token() {
        assert!(PgFence::stale_row("r", FencingToken::new(5), 5).is_none());
        let e = PgFence::stale_row("r", FencingToken::new(4), 5).unwrap();
        assert_eq!(
            e.stale_tokens(),
            Some((FencingToken::new(4), FencingToken::new(5)))
        );
    }
}
