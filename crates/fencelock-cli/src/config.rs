//! Which backend a command talks to: one URL, or a routing configuration file that sends each
//! resource name to a backend by prefix (`docs/routing.md`).
//!
//! Precedence, highest first (explicit beats ambient, flags beat the environment, the
//! environment beats files, as with git and kubectl): `--backend URL`, `--config PATH`,
//! `$FENCELOCK_URL`, `$FENCELOCK_CONFIG`, `$XDG_CONFIG_HOME/fencelock/config.toml` when it
//! exists, the default SQLite file. `--backend` and `--config` together are refused.
//!
//! Every command goes through [`target`] and [`connect`]; a command added later (`serve`)
//! gets the same flags by flattening [`BackendArg`](crate::BackendArg) and the same client by
//! one call to [`connect`](crate::connect).

use fencelock::{Client, ClientBuilder, Routes};

use crate::BackendArg;

/// The backend(s) of a command.
#[derive(Debug, Clone)]
pub enum Target {
    /// One backend URL.
    Url(String),
    /// A routing table, read from a file.
    Routes(Routes),
}

/// The target [`BackendArg`] selects, configuration file read and checked (every URL
/// parsed) but nothing opened.
///
/// # Errors
/// Invalid input (exit 64) for an unreadable or invalid configuration, naming the file and
/// the field.
pub fn target(args: &BackendArg) -> Result<Target, fencelock::Error> {
    if let Some(url) = &args.backend {
        return Ok(Target::Url(url.clone()));
    }
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if args.config.is_none() {
        if let Some(url) = env("FENCELOCK_URL") {
            return Ok(Target::Url(url));
        }
    }
    match fencelock::config_path(args.config.as_deref()) {
        Some(path) => Routes::load(&path).map(Target::Routes),
        None => fencelock::default_url().map(Target::Url),
    }
}

/// The client builder of a target.
pub fn builder(target: Target) -> ClientBuilder {
    match target {
        Target::Url(url) => Client::builder(url),
        Target::Routes(routes) => Client::routed(routes),
    }
}
