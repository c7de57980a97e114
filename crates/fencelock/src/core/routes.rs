//! Routes by prefix: which backend each resource name goes to. A [`Routes`] table names
//! backends (name -> URL), maps name prefixes to them (the longest matching prefix wins) and
//! may name a default backend for the names no prefix matches. A client built on it
//! ([`Client::routed`](crate::Client::routed)) opens each backend once and sends every call
//! for a name to that name's backend, so a backend's outage fails only its own names.
//!
//! The table is checked before anything is opened: every route names a known backend, no
//! prefix appears twice, a default exists unless the routes cover every name, and every URL
//! parses (the registry supplies the URL check, the core knows no engine).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::core::error::{Error, Result};
use crate::core::name::MAX_NAME_BYTES;
use crate::core::url::redact_url;

/// The backend label of a client opened on one URL, in metrics and listings.
pub const SINGLE_BACKEND: &str = "default";

/// A routing table: named backends, prefix routes and an optional default backend.
///
/// # Examples
/// ```
/// use fencelock::Routes;
///
/// let routes = Routes::new()
///     .backend("payments", "redlock://p1:6379,p2:6379,p3:6379")
///     .backend("jobs", "redis://jobs:6379")
///     .route("payments/", "payments")
///     .default_backend("jobs");
/// assert_eq!(routes.backend_for("payments/invoice-7").unwrap(), "payments");
/// assert_eq!(routes.backend_for("jobs/nightly").unwrap(), "jobs");
/// ```
#[derive(Clone, Default)]
pub struct Routes {
    backends: BTreeMap<String, String>,
    routes: Vec<(String, String)>,
    default: Option<String>,
    /// Where the table came from (a file path), for error messages.
    origin: Option<String>,
}

/// URLs shown with their passwords as `***`: a table is logged and printed in errors.
impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backends: BTreeMap<&str, String> = self
            .backends
            .iter()
            .map(|(n, u)| (n.as_str(), redact_url(u)))
            .collect();
        f.debug_struct("Routes")
            .field("backends", &backends)
            .field("routes", &self.routes)
            .field("default", &self.default)
            .field("origin", &self.origin)
            .finish()
    }
}

/// The file format, as serde reads it: unknown sections and fields are errors, so that a
/// misspelt `[[routes]]` is reported rather than silently routing nothing.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    backends: BTreeMap<String, String>,
    #[serde(default)]
    route: Vec<RouteEntry>,
    default: Option<DefaultEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteEntry {
    prefix: String,
    backend: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DefaultEntry {
    backend: String,
}

impl Routes {
    /// An empty table; add backends, routes and a default.
    pub fn new() -> Routes {
        Routes::default()
    }

    /// Names a backend. A second URL for the same name replaces the first.
    pub fn backend(mut self, name: impl Into<String>, url: impl Into<String>) -> Routes {
        self.backends.insert(name.into(), url.into());
        self
    }

    /// Routes the names that start with `prefix` to `backend`.
    pub fn route(mut self, prefix: impl Into<String>, backend: impl Into<String>) -> Routes {
        self.routes.push((prefix.into(), backend.into()));
        self
    }

    /// The backend of the names no route matches. Without one, such names are refused.
    pub fn default_backend(mut self, backend: impl Into<String>) -> Routes {
        self.default = Some(backend.into());
        self
    }

    /// The backends, name and URL (as given, passwords included), in name order.
    pub fn backends(&self) -> impl Iterator<Item = (&str, &str)> {
        self.backends.iter().map(|(n, u)| (n.as_str(), u.as_str()))
    }

    /// The routes, prefix and backend, longest prefix first.
    pub fn routes(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut sorted: Vec<_> = self.routes.iter().collect();
        sorted.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        sorted.into_iter().map(|(p, b)| (p.as_str(), b.as_str()))
    }

    /// The default backend, if any.
    pub fn default_backend_name(&self) -> Option<&str> {
        self.default.as_deref()
    }

    /// The file this table was read from, if it was.
    pub fn origin(&self) -> Option<&str> {
        self.origin.as_deref()
    }

    /// The backend `name` routes to: the one of the longest prefix `name` starts with, else
    /// the default.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) when no route matches and
    /// there is no default.
    pub fn backend_for(&self, name: &str) -> Result<&str> {
        let best = self
            .routes
            .iter()
            .filter(|(prefix, _)| name.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len());
        match (best, &self.default) {
            (Some((_, backend)), _) => Ok(backend),
            (None, Some(default)) => Ok(default),
            (None, None) => Err(Error::invalid(format!(
                "no route matches {name:?} and {} names no default backend; add a [default] \
                 backend or a [[route]] whose prefix the name starts with",
                self.origin_or("the routing table")
            ))
            .with_resource(name)),
        }
    }

    /// The backends some name starting with `prefix` routes to, in name order: those of the
    /// routes whose prefix starts with `prefix` (longer, more specific routes), and the one that
    /// the longest route `prefix` itself starts with gives (or the default) to every other
    /// name. `""` gives every backend a route or the default names.
    pub fn backends_under(&self, prefix: &str) -> Vec<&str> {
        let mut out: BTreeSet<&str> = self
            .routes()
            .filter(|(p, _)| p.starts_with(prefix))
            .map(|(_, b)| b)
            .collect();
        let enclosing = self
            .routes()
            .find(|(p, _)| prefix.starts_with(p))
            .map(|(_, b)| b)
            .or(self.default_backend_name());
        out.extend(enclosing);
        out.into_iter().collect()
    }

    /// The URL of the backend named `name`.
    pub fn url_of(&self, name: &str) -> Option<&str> {
        self.backends.get(name).map(String::as_str)
    }

    fn origin_or<'a>(&'a self, otherwise: &'a str) -> &'a str {
        self.origin.as_deref().unwrap_or(otherwise)
    }

    /// Reads a table from TOML text (see `docs/routing.md`), checking it with `check_url`
    /// for each backend URL. `origin` names the file in errors.
    pub(crate) fn parse_toml(
        text: &str,
        origin: Option<&str>,
        check_url: &dyn Fn(&str) -> Result<()>,
    ) -> Result<Routes> {
        let at = origin.unwrap_or("the routing configuration");
        let file: File = toml::from_str(text).map_err(|e| {
            // The toml crate's message names the line, column and field already.
            Error::invalid(format!("{at}: {}", e.to_string().trim_end()))
        })?;
        let routes = Routes {
            backends: file.backends,
            routes: file
                .route
                .into_iter()
                .map(|r| (r.prefix, r.backend))
                .collect(),
            default: file.default.map(|d| d.backend),
            origin: origin.map(str::to_owned),
        };
        routes.check(check_url)?;
        Ok(routes)
    }

    /// Reads and checks a table from a TOML file.
    pub(crate) fn load_with(path: &Path, check_url: &dyn Fn(&str) -> Result<()>) -> Result<Routes> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::invalid(format!("cannot read the configuration file {shown}: {e}"))
        })?;
        Routes::parse_toml(&text, Some(&shown), check_url)
    }

    /// Checks the table: backends exist and their URLs parse, prefixes are unique, and
    /// every name has a backend.
    pub(crate) fn check(&self, check_url: &dyn Fn(&str) -> Result<()>) -> Result<()> {
        let at = self.origin_or("the routing table");
        if self.backends.is_empty() {
            return Err(Error::invalid(format!(
                "{at}: [backends] names no backend; add one such as jobs = \"redis://host:6379\""
            )));
        }
        for (name, url) in &self.backends {
            if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
                return Err(Error::invalid(format!(
                    "{at}: backends.{name:?}: a backend name must be 1 to 64 bytes without \
                     control characters"
                )));
            }
            check_url(url).map_err(|e| {
                Error::invalid(format!(
                    "{at}: backends.{name} = {:?}: {e}",
                    redact_url(url)
                ))
            })?;
        }
        let known = || {
            self.backends
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (i, (prefix, backend)) in self.routes.iter().enumerate() {
            let here = format!("{at}: route #{} (prefix {prefix:?})", i + 1);
            if prefix.is_empty() {
                return Err(Error::invalid(format!(
                    "{here}: prefix is empty; the names no prefix matches go to [default]"
                )));
            }
            if prefix.len() > MAX_NAME_BYTES || prefix.chars().any(char::is_control) {
                return Err(Error::invalid(format!(
                    "{here}: prefix must be at most {MAX_NAME_BYTES} bytes without control \
                     characters"
                )));
            }
            if !self.backends.contains_key(backend) {
                return Err(Error::invalid(format!(
                    "{here}: backend {backend:?} is not in [backends] (known: {})",
                    known()
                )));
            }
            if let Some(j) = self.routes[..i].iter().position(|(p, _)| p == prefix) {
                return Err(Error::invalid(format!(
                    "{here}: duplicate prefix, route #{} has it already",
                    j + 1
                )));
            }
        }
        if let Some(default) = &self.default {
            if !self.backends.contains_key(default) {
                return Err(Error::invalid(format!(
                    "{at}: [default] backend {default:?} is not in [backends] (known: {})",
                    known()
                )));
            }
        } else if self.routes.is_empty() {
            return Err(Error::invalid(format!(
                "{at}: neither [[route]] nor [default] names a backend, so no name has one; \
                 add [default] backend = \"...\""
            )));
        }
        Ok(())
    }
}

/// Where the configuration file is: `explicit` (a `--config` flag), else
/// `$FENCELOCK_CONFIG`, else `$XDG_CONFIG_HOME/fencelock/config.toml` (`$HOME/.config` when
/// `XDG_CONFIG_HOME` is unset) when that file exists. `None` when there is none.
pub fn config_path(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_owned());
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(p) = env("FENCELOCK_CONFIG") {
        return Some(PathBuf::from(p));
    }
    let base = env("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    let file = base.join("fencelock").join("config.toml");
    file.is_file().then_some(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(_: &str) -> Result<()> {
        Ok(())
    }

    fn parse(text: &str) -> Result<Routes> {
        Routes::parse_toml(text, Some("test.toml"), &|u| {
            if u.contains("://") {
                Ok(())
            } else {
                Err(Error::invalid("not a URL"))
            }
        })
    }

    const GOOD: &str = r#"
[backends]
payments = "redlock://p1:6379,p2:6379,p3:6379"
jobs = "redis://jobs:6379"
urgent = "redis://urgent:6379"
[[route]]
prefix = "payments/"
backend = "payments"
[[route]]
prefix = "payments/urgent/"
backend = "urgent"
[default]
backend = "jobs"
"#;

    #[test]
    fn the_longest_prefix_wins_and_the_rest_goes_to_the_default() {
        let r = parse(GOOD).unwrap();
        assert_eq!(r.backend_for("payments/x").unwrap(), "payments");
        assert_eq!(r.backend_for("payments/urgent/x").unwrap(), "urgent");
        assert_eq!(r.backend_for("payments").unwrap(), "jobs");
        assert_eq!(r.backend_for("jobs/1").unwrap(), "jobs");
        let order: Vec<_> = r.routes().map(|(p, _)| p).collect();
        assert_eq!(order, ["payments/urgent/", "payments/"]);
    }

    #[test]
    fn bad_tables_name_what_is_wrong() {
        for (text, needle) in [
            (
                "[backends]\na = \"redis://h\"\n[[route]]\nprefix = \"x/\"\nbackend = \"b\"\n",
                "route #1 (prefix \"x/\"): backend \"b\" is not in [backends]",
            ),
            (
                "[backends]\na = \"redis://h\"\n[[route]]\nprefix = \"x/\"\nbackend = \"a\"\n\
                 [[route]]\nprefix = \"x/\"\nbackend = \"a\"\n",
                "route #2 (prefix \"x/\"): duplicate prefix",
            ),
            (
                "[backends]\na = \"nonsense\"\n",
                "backends.a = \"nonsense\": not a URL",
            ),
            (
                "[backends]\na = \"redis://h\"\n[default]\nbackend = \"zz\"\n",
                "[default] backend \"zz\" is not in [backends]",
            ),
            (
                "[backends]\na = \"redis://h\"\n",
                "neither [[route]] nor [default]",
            ),
            (
                "[default]\nbackend = \"a\"\n",
                "[backends] names no backend",
            ),
            ("[backend]\na = \"redis://h\"\n", "unknown field `backend`"),
            ("[backends]\na = 5\n", "line 2"),
        ] {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains("test.toml"), "{e}");
            assert!(e.contains(needle), "{text}\n=> {e}");
        }
    }

    #[test]
    fn a_listing_asks_the_backends_its_names_can_route_to() {
        let r = parse(GOOD).unwrap();
        assert_eq!(r.backends_under(""), ["jobs", "payments", "urgent"]);
        assert_eq!(r.backends_under("payments/"), ["payments", "urgent"]);
        assert_eq!(r.backends_under("payments/urgent/x"), ["urgent"]);
        assert_eq!(r.backends_under("jobs/"), ["jobs"]);
        let no_default = Routes::new().backend("a", "redis://h").route("a/", "a");
        assert!(no_default.backends_under("b/").is_empty());
    }

    #[test]
    fn a_name_without_route_or_default_is_refused() {
        let r = Routes::new().backend("a", "redis://h").route("a/", "a");
        r.check(&ok).unwrap();
        let e = r.backend_for("b/1").unwrap_err();
        assert!(e.to_string().contains("no route matches \"b/1\""), "{e}");
    }

    #[test]
    fn urls_in_errors_are_redacted() {
        let e = Routes::new()
            .backend("a", "redis://:hunter2@h:1")
            .default_backend("a")
            .check(&|_| Err(Error::invalid("bad")))
            .unwrap_err();
        assert!(!e.to_string().contains("hunter2"), "{e}");
        let r = Routes::new().backend("a", "redis://:hunter2@h:1");
        assert!(!format!("{r:?}").contains("hunter2"), "{r:?}");
    }
}
