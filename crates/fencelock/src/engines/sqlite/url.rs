//! `sqlite:///absolute/path.db`, and `sqlite://` for the default file.

use std::path::PathBuf;

use crate::core::error::{Error, Result};

/// A parsed `sqlite://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SqliteUrl {
    /// The database file.
    pub path: PathBuf,
}

/// The default SQLite file: `$XDG_STATE_HOME/fencelock/locks.db`, else
/// `~/.local/state/fencelock/locks.db`.
pub fn default_sqlite_path() -> Result<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(state) => PathBuf::from(state),
        None => {
            let home = std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    Error::invalid(
                        "neither XDG_STATE_HOME nor HOME is set, so there is no default SQLite \
                     file; pass --backend sqlite:///path/to/locks.db",
                    )
                })?;
            PathBuf::from(home).join(".local").join("state")
        }
    };
    Ok(base.join("fencelock").join("locks.db"))
}

/// Parses what follows `sqlite://`.
pub(crate) fn parse(rest: &str) -> Result<SqliteUrl> {
    if rest.is_empty() {
        return Ok(SqliteUrl {
            path: default_sqlite_path()?,
        });
    }
    // A `?` or `#` would otherwise end up in the file name (`q.db?mode=ro` creating a file of
    // that name), and no SQLite option is read from the URL.
    if let Some(c) = rest.chars().find(|c| matches!(c, '?' | '#')) {
        return Err(Error::invalid(format!(
            "the SQLite URL sqlite://{rest} has a {}; sqlite:// takes a path only (write \
             {} as %{:02X} if it is part of the file name)",
            if c == '?' { "query" } else { "fragment" },
            c,
            c as u32
        )));
    }
    let path = percent_encoding::percent_decode_str(rest)
        .decode_utf8()
        .map_err(|_| Error::invalid("the SQLite path is not valid UTF-8 once decoded"))?;
    let path = PathBuf::from(path.as_ref());
    if !path.is_absolute() {
        return Err(Error::invalid(format!(
            "SQLite path {:?} is not absolute; write sqlite:///absolute/path.db",
            path.display()
        )));
    }
    Ok(SqliteUrl { path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls() {
        assert_eq!(
            parse("/tmp/x.db").ok(),
            Some(SqliteUrl {
                path: "/tmp/x.db".into()
            })
        );
        assert!(parse("relative.db").is_err());
        assert!(parse("/tmp/q.db?foo=bar").is_err());
        assert!(parse("/tmp/q.db#x").is_err());
        assert_eq!(
            parse("/tmp/q%3F.db").ok().map(|u| u.path),
            Some("/tmp/q?.db".into())
        );
        assert!(parse("").is_ok());
    }
}
