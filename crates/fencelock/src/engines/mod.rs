//! The registry: the one place that names every engine. It maps a URL scheme to the
//! engine's own URL parser (`<engine>/url.rs`) and constructor, behind the engine's cargo
//! feature, and builds clients on what it opened. Engines know the core only
//! (`crate::core`), never each other; the core knows no engine.
//!
//! Adding an engine: its folder here, one arm in [`Backend::parse`] and [`open`], its variant
//! of [`Backend`], its feature in `Cargo.toml`, and the docs.

use crate::core::client::{Client, ClientBuilder};
use crate::core::engine::{EngineConfig, Opened};
use crate::core::error::{Error, Result};
use crate::core::router::{Router, Unopened};
use crate::core::routes::Routes;
use crate::core::url::redact_url;

#[cfg(feature = "etcd")]
pub(crate) mod etcd;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
#[cfg(feature = "zookeeper")]
pub(crate) mod zookeeper;

#[cfg(test)]
mod tests;

/// A parsed backend URL, for tools that talk to the engine's servers directly (benchmarks,
/// diagnostics). Each engine's variant exists when the build has its feature.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// `sqlite:///absolute/path.db`, or `sqlite://` for the default file.
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    Sqlite(sqlite::url::SqliteUrl),
    /// `redis://` / `rediss://` (one node) and `redlock://` / `redlocks://` (N independent
    /// nodes); the second of each pair over TLS.
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    Redis(redis::url::RedisUrl),
    /// `postgres://` / `postgresql://`: PostgreSQL advisory locks, or a lease table with
    /// `?mode=lease`.
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    Postgres(postgres::url::PostgresUrl),
    /// `etcd://h1:p1,h2:p2,...` and `etcds://...` (TLS): one etcd cluster.
    #[cfg(feature = "etcd")]
    #[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
    Etcd(etcd::url::EtcdUrl),
    /// `zk://h1:p1,h2:p2,.../chroot`: one ZooKeeper ensemble, Curator's lock layout.
    #[cfg(feature = "zookeeper")]
    #[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
    Zookeeper(zookeeper::url::ZkUrl),
}

const SCHEMES: &str =
    "sqlite://, redis://, rediss://, redlock://, redlocks://, postgres://, etcd://, etcds://, zk://, zks://";

impl Backend {
    /// Parses a backend URL, with the same rules and errors as [`Client::connect`].
    pub fn parse(url: &str) -> Result<Backend> {
        let url = &with_password(url)?;
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(Error::invalid(format!(
                "backend {:?} is not a URL; use one of {SCHEMES}",
                redact_url(url)
            )));
        };
        // `rest` is unused by the arms of engines this build left out.
        let _ = rest;
        match scheme {
            #[cfg(feature = "sqlite")]
            "sqlite" => sqlite::url::parse(rest).map(Backend::Sqlite),
            #[cfg(feature = "redis")]
            "redis" | "rediss" | "redlock" | "redlocks" => {
                redis::url::parse(scheme, rest).map(Backend::Redis)
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => postgres::url::parse(scheme, rest).map(Backend::Postgres),
            #[cfg(feature = "etcd")]
            "etcd" | "etcds" => etcd::url::parse(scheme, rest).map(Backend::Etcd),
            #[cfg(feature = "zookeeper")]
            "zk" | "zks" => zookeeper::url::parse(scheme, rest).map(Backend::Zookeeper),
            #[cfg(not(feature = "sqlite"))]
            "sqlite" => Err(left_out("sqlite")),
            #[cfg(not(feature = "redis"))]
            "redis" | "rediss" | "redlock" | "redlocks" => Err(left_out("redis")),
            #[cfg(not(feature = "postgres"))]
            "postgres" | "postgresql" => Err(left_out("postgres")),
            #[cfg(not(feature = "etcd"))]
            "etcd" | "etcds" => Err(left_out("etcd")),
            #[cfg(not(feature = "zookeeper"))]
            "zk" | "zks" => Err(left_out("zookeeper")),
            other => Err(Error::invalid(format!(
                "unknown backend scheme {other:?}; use one of {SCHEMES}"
            ))),
        }
    }

    /// The engine keys a resource name maps to under `prefix`, labelled (`lock`, `fence`,
    /// `advisory`, ...), exactly as [`Client::keys_for`] gives them, but computed from the URL
    /// alone: nothing is opened or contacted.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid name or
    /// prefix.
    pub fn keys(&self, prefix: &str, name: &str) -> Result<Vec<(&'static str, String)>> {
        crate::core::name::validate_name(name)?;
        Client::builder("").prefix(prefix).config()?;
        let _ = (prefix, name);
        Ok(match *self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => sqlite::labelled_keys(prefix, name),
            #[cfg(feature = "redis")]
            Backend::Redis(_) => redis::labelled_keys(prefix, name),
            #[cfg(feature = "postgres")]
            Backend::Postgres(ref u) => postgres::labelled_keys(u.mode, prefix, name),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => etcd::labelled_keys(prefix, name),
            #[cfg(feature = "zookeeper")]
            Backend::Zookeeper(_) => zookeeper::labelled_keys(prefix, name)?,
        })
    }

    /// What an operator runs to create a `user` that may use fencelock under `prefix` and
    /// nothing else, and a `read_only` user for `inspect`, `list` and `audit`
    /// (`fencelock acl`). No plan holds a password: see each plan's notes.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for an invalid prefix or
    /// user name.
    pub fn access_plan(
        &self,
        prefix: &str,
        user: &str,
        read_only: &str,
    ) -> Result<crate::core::access::AccessPlan> {
        Client::builder("").prefix(prefix).config()?;
        let _ = (user, read_only);
        match *self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => Ok(crate::core::access::AccessPlan {
                engine: "sqlite",
                runs_in: "none",
                setup: Vec::new(),
                users: Vec::new(),
                notes: vec![
                    "SQLite has no users: the lock file's permissions are the access control. \
                     Every process that can write the file (and its directory) can take and \
                     release every lock in it; give each service its own file, or share one \
                     through a group-writable directory and file"
                        .into(),
                ],
            }),
            #[cfg(feature = "redis")]
            Backend::Redis(ref u) => redis::acl::plan(u.engine(), prefix, user, read_only, u.db),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => postgres::acl::plan(prefix, user, read_only),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => etcd::acl::plan(prefix, user, read_only),
            #[cfg(feature = "zookeeper")]
            Backend::Zookeeper(_) => zookeeper::acl::plan(prefix, user, read_only),
        }
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres`, `postgres-lease`
    /// `etcd` or `zookeeper`.
    pub fn engine(&self) -> &'static str {
        match *self {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => "sqlite",
            #[cfg(feature = "redis")]
            Backend::Redis(ref u) => u.engine(),
            #[cfg(feature = "postgres")]
            Backend::Postgres(ref u) => u.engine(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(_) => "etcd",
            #[cfg(feature = "zookeeper")]
            Backend::Zookeeper(_) => "zookeeper",
        }
    }
}

/// The one place passwords come from, for every engine with a server: the URL's own
/// (`user:password@`), else the file named by the URL option `password_file=PATH`, else the
/// file named by `$FENCELOCK_PASSWORD_FILE`, else `$FENCELOCK_PASSWORD`. A file's trailing
/// newline is dropped. The password found is put into the URL's authority, so each engine's
/// parser reads it as if it had been written there, and `password_file` is taken out of the
/// query before the engine sees it. Keeping passwords out of the URL keeps them out of
/// `ps` and shell histories.
fn with_password(url: &str) -> Result<String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(url.to_owned());
    };
    if scheme == "sqlite" {
        return Ok(url.to_owned());
    }
    let (body, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let mut file = None;
    let kept: Vec<&str> = query
        .map(|q| {
            q.split('&')
                .filter(|kv| match kv.strip_prefix("password_file=") {
                    Some(path) => {
                        file = Some(path);
                        false
                    }
                    None => true,
                })
                .collect()
        })
        .unwrap_or_default();
    let (authority, path) = match body.find('/') {
        Some(i) => body.split_at(i),
        None => (body, ""),
    };
    let (creds, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let env_file = std::env::var("FENCELOCK_PASSWORD_FILE")
        .ok()
        .filter(|f| !f.is_empty());
    let env_password = std::env::var("FENCELOCK_PASSWORD")
        .ok()
        .filter(|p| !p.is_empty());
    let elsewhere = file.is_some() || env_file.is_some() || env_password.is_some();
    // `redis://secret@host` is Redis' password-only spelling, but only when no password comes
    // from elsewhere: with `password_file=` or the variables, `user@host` names the ACL user
    // (the spelling `fencelock acl` users are given), as it does for every other engine.
    let in_url = match creds.map(|c| c.split_once(':')) {
        Some(Some((_, p))) => !p.is_empty(),
        Some(None) => matches!(scheme, "redis" | "rediss" | "redlock" | "redlocks") && !elsewhere,
        None => false,
    };
    let read = |path: &str, what: &str| -> Result<String> {
        let decoded = crate::core::url::decode(path, "password file")?;
        std::fs::read_to_string(&decoded)
            .map(|p| p.trim_end_matches(['\n', '\r']).to_owned())
            .map_err(|e| {
                Error::invalid(format!(
                    "cannot read the password file {decoded:?} ({what}): {e}"
                ))
            })
    };
    let password = if in_url {
        None
    } else if let Some(f) = file {
        Some(read(f, "password_file= in the URL")?)
    } else if let Some(f) = env_file {
        Some(read(&f, "$FENCELOCK_PASSWORD_FILE")?)
    } else {
        env_password
    };
    let creds = match (creds, password) {
        (c, None) => c.map(str::to_owned),
        (c, Some(p)) => {
            use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
            let user = c
                .map(|c| c.split_once(':').map_or(c, |(u, _)| u))
                .unwrap_or("");
            Some(format!(
                "{user}:{}",
                utf8_percent_encode(&p, NON_ALPHANUMERIC)
            ))
        }
    };
    let mut out = format!("{scheme}://");
    if let Some(c) = creds {
        out.push_str(&c);
        out.push('@');
    }
    out.push_str(hosts);
    out.push_str(path);
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    Ok(out)
}

/// The error for a URL whose engine this build was compiled without.
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "etcd",
        feature = "zookeeper"
    ),
    allow(dead_code)
)]
fn left_out(feature: &str) -> Error {
    Error::invalid(format!(
        "this build of fencelock lacks the `{feature}` feature"
    ))
}

/// Opens the engine a URL names, with the capabilities it hands out.
pub(crate) async fn open(url: &str, cfg: &EngineConfig) -> Result<Opened> {
    // Unused when the build has no engine at all.
    let _ = cfg;
    match Backend::parse(url)? {
        #[cfg(feature = "sqlite")]
        Backend::Sqlite(u) => sqlite::open(u, cfg).await,
        #[cfg(feature = "redis")]
        Backend::Redis(u) => {
            // Two names of one server would count its vote twice; the URL check sees only
            // identical spellings.
            if u.quorum {
                crate::core::url::distinct_addresses(&u.nodes, cfg.op_timeout).await?;
            }
            redis::open(u, cfg).await
        }
        #[cfg(feature = "postgres")]
        Backend::Postgres(u) => postgres::open(u, cfg).await,
        #[cfg(feature = "etcd")]
        Backend::Etcd(u) => etcd::open(u, cfg).await,
        #[cfg(feature = "zookeeper")]
        Backend::Zookeeper(u) => zookeeper::open(u, cfg).await,
    }
}

/// The backend used when none is given: `$FENCELOCK_URL`, else the default SQLite file.
pub fn default_url() -> Result<String> {
    if let Some(url) = std::env::var("FENCELOCK_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        return Ok(url);
    }
    #[cfg(feature = "sqlite")]
    return Ok(format!(
        "sqlite://{}",
        sqlite::url::default_sqlite_path()?.display()
    ));
    #[cfg(not(feature = "sqlite"))]
    Err(Error::invalid(
        "no backend given ($FENCELOCK_URL is unset) and this build has no embedded default; \
         pass a backend URL",
    ))
}

impl ClientBuilder {
    /// Parses the URL, opens the engine and starts the renewal task. Must be called inside a
    /// tokio runtime. A routed client ([`Client::routed`]) checks its table, every URL
    /// included, and opens nothing: each backend is opened by the first call that needs it,
    /// so that a backend that is down fails only the calls about its own names.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a URL, routing table or
    /// setting that is not valid (or names an engine this build left out);
    /// [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the engine of a client on one URL
    /// cannot be reached.
    pub async fn connect(self) -> Result<Client> {
        let cfg = self.config()?;
        if let Some(routes) = self.routing() {
            return connect_routed(&self, routes, &cfg);
        }
        let opened = open(self.url(), &cfg).await?;
        Ok(self.start(cfg, opened))
    }
}

/// A routed client on the checked table. Nothing is opened here: each backend is opened by
/// the first call that needs it (`crate::core::router`), so that a backend that is down fails
/// only the calls about its own names, not the client's start.
fn connect_routed(builder: &ClientBuilder, routes: &Routes, cfg: &EngineConfig) -> Result<Client> {
    routes.check(&check_url)?;
    let mut backends = Vec::new();
    for (name, url) in routes.backends() {
        let parsed = Backend::parse(url).map_err(|e| e.with_backend(name))?;
        let one = builder.for_backend(name, url);
        let prefix = cfg.prefix.clone();
        let (url, cfg) = (url.to_owned(), cfg.clone());
        let keyed = parsed.clone();
        let unopened = Unopened {
            engine: parsed.engine(),
            keys: Box::new(move |name| keyed.keys(&prefix, name)),
            open: Box::new(move || {
                let (url, cfg) = (url.clone(), cfg.clone());
                Box::pin(async move { open(&url, &cfg).await })
            }),
        };
        backends.push((name.to_owned(), one, unopened));
    }
    Ok(Client::on_router(Router::new(
        routes.clone(),
        cfg,
        backends,
    )?))
}

fn check_url(url: &str) -> Result<()> {
    Backend::parse(url).map(drop)
}

impl Routes {
    /// Reads a routing table from TOML text (format in `docs/routing.md`) and checks it,
    /// every backend URL included, before anything is opened.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) naming the line or field:
    /// a syntax error, an unknown field, a route to an unknown backend, a duplicate prefix,
    /// an invalid URL, no default where one is needed.
    pub fn from_toml(text: &str) -> Result<Routes> {
        Routes::parse_toml(text, None, &check_url)
    }

    /// [`Routes::from_toml`] on the contents of a file, whose path errors name.
    pub fn load(path: &std::path::Path) -> Result<Routes> {
        Routes::load_with(path, &check_url)
    }
}

impl Client {
    /// A client with default settings for `url`; see [`ClientBuilder::connect`].
    pub async fn connect(url: &str) -> Result<Client> {
        Client::builder(url).connect().await
    }
}

#[cfg(test)]
mod url_tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn password_file_goes_into_the_url_and_out_of_the_query() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "p@ss w\n").unwrap();
        let f = file.display();
        assert_eq!(
            with_password(&format!("postgres://u@h/db?password_file={f}&mode=lease")).unwrap(),
            "postgres://u:p%40ss%20w@h/db?mode=lease"
        );
        assert_eq!(
            with_password(&format!("redlock://a:1,b:2,c:3?password_file={f}")).unwrap(),
            "redlock://:p%40ss%20w@a:1,b:2,c:3"
        );
        // A password written in the URL wins.
        assert_eq!(
            with_password(&format!("redis://u:x@h:1/2?password_file={f}")).unwrap(),
            "redis://u:x@h:1/2"
        );
        // A user without a password, and the password in a file: the user stays the user.
        assert_eq!(
            with_password(&format!("redis://svc@h:1?password_file={f}")).unwrap(),
            "redis://svc:p%40ss%20w@h:1"
        );
        assert_eq!(
            with_password(&format!("redlocks://svc@a:1,b:2,c:3?password_file={f}")).unwrap(),
            "redlocks://svc:p%40ss%20w@a:1,b:2,c:3"
        );
        let e = with_password("redis://h?password_file=/nonexistent/pw").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        assert_eq!(with_password("sqlite:///x?y").unwrap(), "sqlite:///x?y");
    }

    #[test]
    fn bad_urls_are_invalid_input() {
        for url in ["ftp://x", "nonsense", "redis://h:0", "sqlite://relative.db"] {
            let e = Backend::parse(url).expect_err(url);
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{url}");
        }
    }

    #[test]
    fn every_scheme_reaches_its_engine() {
        for (url, engine) in [
            ("sqlite:///tmp/x.db", "sqlite"),
            ("redis://h:1", "redis"),
            ("rediss://h:1", "redis"),
            ("redlock://a,b,c", "redlock"),
            ("redlocks://a,b,c", "redlock"),
            ("postgres://h/db", "postgres"),
            ("postgresql://h/db?mode=lease", "postgres-lease"),
            ("etcd://h", "etcd"),
            ("etcds://h", "etcd"),
            ("zk://h/app", "zookeeper"),
        ] {
            match Backend::parse(url) {
                Ok(b) => assert_eq!(b.engine(), engine, "{url}"),
                Err(e) => assert!(e.to_string().contains("lacks the"), "{url}: {e}"),
            }
        }
    }
}
