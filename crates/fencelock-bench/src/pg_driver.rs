//! The driver's floor under fencelock's sequential PostgreSQL figure: `tokio-postgres`, the
//! driver the engine uses, running the engine's two prepared statements
//! (`PostgresUrl::pair_statements`) with the values pgbench gets, on one connection and the
//! same single-threaded runtime as fencelock's round, with nothing around the calls. pgbench
//! against it tells what the Rust driver costs; it against fencelock, what fencelock's client
//! adds.

use fencelock::PgPairStatements;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls, Statement};

use crate::CLIENT_NAME;

/// The advisory key and row of the driver's pairs: apart from pgbench's (8000000000 plus its
/// client ids) and from every name fencelock hashes into the low range.
const DRIVER_KEY: i64 = 8_000_000_999;

pub(crate) struct Driver {
    client: Client,
    acquire: Statement,
    release: Statement,
    acquire_args: Vec<Box<dyn ToSql + Sync + Send>>,
    release_args: Vec<Box<dyn ToSql + Sync + Send>>,
}

impl Driver {
    /// Connects to `url` (libpq's form, without fencelock's parameters) and prepares the pair;
    /// `None` where the engine does not prepare (the driver's unnamed statements take another
    /// round trip each, so they would not be the same protocol).
    pub(crate) async fn connect(
        url: &str,
        pair: &PgPairStatements,
        prefix: &str,
        base: &str,
    ) -> Result<Driver, String> {
        if !pair.prepared {
            return Err("only measured where the engine prepares its statements".to_owned());
        }
        let (client, connection) = tokio_postgres::connect(url, NoTls)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        tokio::spawn(connection);
        let acquire = client
            .prepare(pair.acquire)
            .await
            .map_err(|e| format!("prepare the grant: {e}"))?;
        let release = client
            .prepare(pair.release)
            .await
            .map_err(|e| format!("prepare the release: {e}"))?;
        let name = format!("{base}driver");
        let value = |what: &str| -> String {
            match what {
                "row" => format!("{prefix}{name}"),
                "owner" => format!("{:032x}", 0xfedc_ba98_7654_3210_u128),
                "host" => "localhost".to_owned(),
                "pid" => std::process::id().to_string(),
                "client" => CLIENT_NAME.to_owned(),
                "acquired_at" => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis())
                    .to_string(),
                "ttl_ms" => "30000".to_owned(),
                "prefix" => prefix.to_owned(),
                "holder_id" => "fencelock-bench-reference".to_owned(),
                "channel" => pair.channel.clone(),
                "name" => name.clone(),
                _ => DRIVER_KEY.to_string(),
            }
        };
        let args = |st: &Statement, names: &[&str]| {
            names
                .iter()
                .zip(st.params())
                .map(|(what, ty)| typed(ty, &value(what)))
                .collect::<Result<Vec<_>, String>>()
        };
        Ok(Driver {
            acquire_args: args(&acquire, pair.acquire_params)?,
            release_args: args(&release, pair.release_params)?,
            client,
            acquire,
            release,
        })
    }

    /// One acquire and release. A grant whose first column is a boolean must say `true`: the
    /// driver's key is its own, so a refusal means the figure is not of the pair.
    pub(crate) async fn pair(&self) -> Result<(), String> {
        let row = self
            .client
            .query_one(&self.acquire, &params(&self.acquire_args))
            .await
            .map_err(|e| format!("grant: {e}"))?;
        if row.columns().first().map(|c| c.type_()) == Some(&Type::BOOL)
            && row.try_get::<_, Option<bool>>(0).ok().flatten() != Some(true)
        {
            return Err("the driver's own key was refused".to_owned());
        }
        self.client
            .query_one(&self.release, &params(&self.release_args))
            .await
            .map_err(|e| format!("release: {e}"))?;
        Ok(())
    }
}

fn params(v: &[Box<dyn ToSql + Sync + Send>]) -> Vec<&(dyn ToSql + Sync)> {
    v.iter().map(|b| &**b as &(dyn ToSql + Sync)).collect()
}

/// `text` as a value of the parameter's type, as pgbench sends its variables as text and the
/// server reads them as that type.
fn typed(ty: &Type, text: &str) -> Result<Box<dyn ToSql + Sync + Send>, String> {
    let bad = |e: std::num::ParseIntError| format!("{text} as {ty}: {e}");
    Ok(match *ty {
        Type::INT8 => Box::new(text.parse::<i64>().map_err(bad)?),
        Type::INT4 => Box::new(text.parse::<i32>().map_err(bad)?),
        _ => Box::new(text.to_owned()),
    })
}
