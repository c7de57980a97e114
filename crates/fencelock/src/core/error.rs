//! The one error type of the library.

use std::fmt;
use std::time::Duration;

use crate::core::holder::Holder;
use crate::core::token::FencingToken;

/// What went wrong, for callers to match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Another owner holds the lock (a single attempt found it held).
    HeldByAnother,
    /// The lease was lost: it expired, renewals failed, or another owner took the resource.
    LeaseLost,
    /// The caller is not (or no longer) the holder, so it may not extend or release.
    NotHolder,
    /// A write carried a fencing token lower than one the resource has already seen.
    StaleToken,
    /// The wait deadline passed before the lock could be acquired.
    TimedOut,
    /// A name, duration, URL or option was rejected before any I/O.
    InvalidInput,
    /// The engine failed, misbehaved or could not be reached.
    Engine,
    /// A limit stored in the engine under the prefix refused the grant or renewal: a TTL
    /// above its `max-ttl`, or a client already holding its `max-held-per-client` leases.
    /// The message names the limit and its value.
    LimitExceeded,
}

impl ErrorKind {
    fn describe(self) -> &'static str {
        match self {
            ErrorKind::HeldByAnother => "held by another owner",
            ErrorKind::LeaseLost => "lease lost",
            ErrorKind::NotHolder => "not the holder",
            ErrorKind::StaleToken => "stale fencing token",
            ErrorKind::TimedOut => "timed out",
            ErrorKind::InvalidInput => "invalid input",
            ErrorKind::Engine => "engine error",
            ErrorKind::LimitExceeded => "limit exceeded",
        }
    }
}

/// The library's error: a matchable [`ErrorKind`], the resource and engine it concerns, and a
/// message that says what to do next.
pub struct Error {
    inner: Box<Inner>,
}

struct Inner {
    kind: ErrorKind,
    message: String,
    resource: Option<String>,
    engine: Option<&'static str>,
    backend: Option<String>,
    holder: Option<Holder>,
    stale: Option<(FencingToken, FencingToken)>,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            inner: Box::new(Inner {
                kind,
                message: message.into(),
                resource: None,
                engine: None,
                backend: None,
                holder: None,
                stale: None,
                source: None,
            }),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidInput, message)
    }

    pub(crate) fn engine_failure(engine: &'static str, message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Engine, message).with_engine(engine)
    }

    /// A write was refused because `presented` is lower than `highest`, the highest token the
    /// resource has seen.
    pub fn stale_token(resource: &str, presented: FencingToken, highest: FencingToken) -> Error {
        let mut e = Error::new(
            ErrorKind::StaleToken,
            format!(
                "fencing token {presented} is stale: the resource has already seen {highest}; \
                 this writer lost its lease and must stop"
            ),
        )
        .with_resource(resource);
        e.inner.stale = Some((presented, highest));
        e
    }

    pub(crate) fn with_resource(mut self, resource: &str) -> Error {
        self.inner.resource = Some(resource.to_owned());
        self
    }

    pub(crate) fn with_engine(mut self, engine: &'static str) -> Error {
        self.inner.engine = Some(engine);
        self
    }

    /// Names the backend of a routed client the error came from.
    pub(crate) fn with_backend(mut self, backend: &str) -> Error {
        self.inner.backend = Some(backend.to_owned());
        self
    }

    pub(crate) fn with_holder(mut self, holder: Option<Holder>) -> Error {
        self.inner.holder = holder;
        self
    }

    #[cfg_attr(
        not(any(feature = "sqlite", feature = "redis", feature = "postgres")),
        allow(dead_code)
    )]
    pub(crate) fn with_source(
        mut self,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        self.inner.source = Some(Box::new(source));
        self
    }

    /// A copy that reads the same, for a failure several callers share (an attempt to open a
    /// backend that others were waiting on): the source error becomes its text.
    pub(crate) fn duplicate(&self) -> Error {
        let i = &self.inner;
        Error {
            inner: Box::new(Inner {
                kind: i.kind,
                message: i.message.clone(),
                resource: i.resource.clone(),
                engine: i.engine,
                backend: i.backend.clone(),
                holder: i.holder.clone(),
                stale: i.stale,
                source: i
                    .source
                    .as_ref()
                    .map(|s| Box::new(SourceText(s.to_string())) as Box<_>),
            }),
        }
    }

    pub(crate) fn held(resource: &str, engine: &'static str, holder: Option<Holder>) -> Error {
        Error::new(ErrorKind::HeldByAnother, "held by another owner")
            .with_resource(resource)
            .with_engine(engine)
            .with_holder(holder)
    }

    pub(crate) fn timed_out(
        resource: &str,
        engine: &'static str,
        waited: Duration,
        holder: Option<Holder>,
    ) -> Error {
        Error::new(
            ErrorKind::TimedOut,
            format!(
                "still held after waiting {}; retry later or raise the wait deadline",
                crate::core::options::display_duration(waited)
            ),
        )
        .with_resource(resource)
        .with_engine(engine)
        .with_holder(holder)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The resource name the error concerns, when there is one.
    pub fn resource(&self) -> Option<&str> {
        self.inner.resource.as_deref()
    }

    /// The engine (`sqlite`, `redis`, ...) the error concerns, when there is one.
    pub fn engine(&self) -> Option<&'static str> {
        self.inner.engine
    }

    /// The backend the error came from, for a client that routes names among several
    /// ([`Client::routed`](crate::Client::routed)).
    pub fn backend(&self) -> Option<&str> {
        self.inner.backend.as_deref()
    }

    /// The current holder, when the lock was found held by another owner.
    pub fn holder(&self) -> Option<&Holder> {
        self.inner.holder.as_ref()
    }

    /// For [`ErrorKind::StaleToken`]: the token presented and the highest token already seen.
    pub fn stale_tokens(&self) -> Option<(FencingToken, FencingToken)> {
        self.inner.stale
    }

    /// Whether trying the same call again later can succeed: true for a held lock, a timeout or
    /// an engine failure; false for invalid input, a lost lease, a stale token or a caller that is
    /// not the holder.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.inner.kind,
            ErrorKind::HeldByAnother | ErrorKind::TimedOut | ErrorKind::Engine
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        if let Some(resource) = &i.resource {
            write!(f, "lock {resource:?}")?;
            if let Some(engine) = i.engine {
                write!(f, " on {engine}")?;
            }
            if let Some(backend) = &i.backend {
                write!(f, " (backend {backend})")?;
            }
            write!(f, ": ")?;
        } else if let Some(backend) = &i.backend {
            write!(f, "backend {backend}")?;
            if let Some(engine) = i.engine {
                write!(f, " ({engine})")?;
            }
            write!(f, ": ")?;
        } else if let Some(engine) = i.engine {
            write!(f, "{engine}: ")?;
        }
        if i.message.is_empty() {
            f.write_str(i.kind.describe())?;
        } else {
            f.write_str(&i.message)?;
        }
        if let Some(holder) = &i.holder {
            write!(f, " (holder: {holder})")?;
        }
        if let Some(source) = &i.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.inner.kind)
            .field("message", &self.to_string())
            .finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// The text of a source error, kept by [`Error::duplicate`].
#[derive(Debug)]
struct SourceText(String);

impl fmt::Display for SourceText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SourceText {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_resource_engine_and_next_step() {
        let e = Error::timed_out("invoices", "sqlite", Duration::from_secs(2), None);
        let text = e.to_string();
        assert!(text.contains("\"invoices\""), "{text}");
        assert!(text.contains("sqlite"), "{text}");
        assert!(text.contains("retry later"), "{text}");
        assert!(e.is_retryable());
        assert_eq!(e.kind(), ErrorKind::TimedOut);
    }

    #[test]
    fn stale_token_carries_both_tokens_and_is_final() {
        let e = Error::stale_token("ledger", FencingToken::new(3), FencingToken::new(9));
        assert_eq!(e.kind(), ErrorKind::StaleToken);
        assert_eq!(
            e.stale_tokens(),
            Some((FencingToken::new(3), FencingToken::new(9)))
        );
        assert!(!e.is_retryable());
    }

    #[test]
    fn a_duplicate_reads_the_same() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = Error::engine_failure("redis", "cannot connect")
            .with_backend("payments")
            .with_source(io);
        let d = e.duplicate();
        assert_eq!(d.to_string(), e.to_string());
        assert_eq!(d.kind(), e.kind());
        assert_eq!(d.backend(), Some("payments"));
    }
}
