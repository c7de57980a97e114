//! Access control: bearer tokens mapped to a client name and the name prefixes it may use.
//!
//! The auth file has one client per line, fields separated by spaces or tabs:
//!
//! ```text
//! # token                              client    prefixes (any number; * = every name)
//! 9f86d081884c7d659a2feaa0c55ad015a3bf  billing   billing/ invoices/
//! 60303ae22b998861bce3b28f33eec1be758a  ops       *
//! ```
//!
//! Blank lines and lines starting with `#` are ignored. A token is at least 16 characters;
//! two lines may not share a token. The file is read at start-up and again on SIGHUP; a file
//! that does not parse on reload leaves the previous one in force.
//!
//! Only the SHA-256 digest of each token is kept. A presented token is hashed and its digest
//! compared in constant time (`subtle`) with every entry's: digests all have one length, so
//! the time an answer takes tells neither how much of a guessed token was right nor how long
//! the real tokens are.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The client name recorded with the leases it takes; `""` without an auth file.
    pub client: String,
    /// Name prefixes it may lock and see; `None` for every name.
    pub prefixes: Option<Vec<String>>,
}

impl Principal {
    /// Everyone, when there is no auth file (the server then listens on loopback only).
    pub fn local() -> Principal {
        Principal {
            client: String::new(),
            prefixes: None,
        }
    }

    /// Whether this principal may lock and see `name`.
    pub fn may(&self, name: &str) -> bool {
        match &self.prefixes {
            None => true,
            Some(p) => p.iter().any(|p| name.starts_with(p.as_str())),
        }
    }
}

struct Entry {
    /// SHA-256 of the token.
    digest: [u8; 32],
    principal: Principal,
}

fn digest(token: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&Sha256::digest(token.as_bytes()));
    out
}

impl std::fmt::Debug for Entry {
    /// Never the token itself: it is a secret, and debug output ends up in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("digest", &"<redacted>")
            .field("principal", &self.principal)
            .finish()
    }
}

/// The parsed auth file, swapped whole on reload.
pub struct AuthFile {
    path: PathBuf,
    entries: RwLock<Arc<Vec<Entry>>>,
}

/// Shortest token accepted: anything shorter can be guessed.
const MIN_TOKEN: usize = 16;

impl AuthFile {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<AuthFile, String> {
        let entries = parse_file(path)?;
        Ok(AuthFile {
            path: path.to_owned(),
            entries: RwLock::new(Arc::new(entries)),
        })
    }

    /// Reads the file again; on error the previous contents stay in force.
    pub fn reload(&self) -> Result<usize, String> {
        let entries = parse_file(&self.path)?;
        let n = entries.len();
        *self.entries.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(entries);
        Ok(n)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The principal a bearer token stands for.
    pub fn check(&self, token: &str) -> Option<Principal> {
        let entries = self
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let presented = digest(token);
        let mut found = None;
        // Every entry is compared, whatever matched, so timing says nothing about which one.
        for e in entries.iter() {
            if bool::from(e.digest[..].ct_eq(&presented[..])) {
                found = Some(e.principal.clone());
            }
        }
        found
    }
}

impl AuthFile {
    /// Whether the file, as last read, still lets the client named `client` use `name`: the
    /// test a lease taken before a reload must pass to live on.
    pub fn allows(&self, client: &str, name: &str) -> bool {
        let entries = self
            .entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        entries
            .iter()
            .any(|e| e.principal.client == client && e.principal.may(name))
    }
}

fn parse_file(path: &Path) -> Result<Vec<Entry>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the auth file {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("auth file {}: {e}", path.display()))
}

fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let mut entries: Vec<Entry> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(token), Some(client)) = (fields.next(), fields.next()) else {
            return Err(format!(
                "line {n}: write TOKEN CLIENT PREFIX... (at least one prefix, * for every name)"
            ));
        };
        let prefixes: Vec<String> = fields.map(str::to_owned).collect();
        if prefixes.is_empty() {
            return Err(format!(
                "line {n}: client {client:?} has no name prefix; give at least one, or * for every name"
            ));
        }
        if token.len() < MIN_TOKEN {
            return Err(format!(
                "line {n}: the token is {} characters; use at least {MIN_TOKEN} random ones",
                token.len()
            ));
        }
        fencelock::validate_name(client)
            .map_err(|_| format!("line {n}: {client:?} is not a valid client name"))?;
        let token_digest = digest(token);
        if entries.iter().any(|e| e.digest == token_digest) {
            return Err(format!(
                "line {n}: this token is already given to another line"
            ));
        }
        let prefixes = if prefixes.iter().any(|p| p == "*") {
            None
        } else {
            Some(prefixes)
        };
        entries.push(Entry {
            digest: token_digest,
            principal: Principal {
                client: client.to_owned(),
                prefixes,
            },
        });
    }
    Ok(entries)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_format_parses() {
        let e = parse(
            "# comment\n\n9f86d081884c7d659a2feaa0c55ad015a3bf  billing   billing/ invoices/\n\
             60303ae22b998861bce3b28f33eec1be758a\tops *\n",
        )
        .unwrap();
        assert_eq!(e.len(), 2);
        assert!(e[0].principal.may("billing/run"));
        assert!(!e[0].principal.may("jobs/x"));
        assert!(e[1].principal.may("anything"));
    }

    /// The comparison returned early when the lengths differed, which told a token's length.
    #[test]
    fn tokens_are_kept_and_compared_as_digests_of_one_length() {
        let token = "9f86d081884c7d659a2feaa0c55ad015a3bf";
        let e = parse(&format!("{token} billing billing/\n")).unwrap();
        assert_eq!(e[0].digest, digest(token));
        assert!(!format!("{:?}", e[0]).contains(token));
        let file = AuthFile {
            path: PathBuf::new(),
            entries: RwLock::new(Arc::new(e)),
        };
        assert!(file.check(token).is_some());
        for wrong in ["", "9f86", &format!("{token}0"), &token[..token.len() - 1]] {
            assert!(file.check(wrong).is_none(), "{wrong}");
        }
    }

    #[test]
    fn bad_lines_are_named() {
        assert!(parse("short billing x/").unwrap_err().contains("line 1"));
        assert!(parse("9f86d081884c7d659a2feaa0c55ad015a3bf billing")
            .unwrap_err()
            .contains("no name prefix"));
        let dup =
            "9f86d081884c7d659a2feaa0c55ad015a3bf a x/\n9f86d081884c7d659a2feaa0c55ad015a3bf b y/";
        assert!(parse(dup).unwrap_err().contains("line 2"));
    }
}
