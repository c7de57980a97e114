//! The protected resource: guards that remember the highest fencing token seen per resource
//! and refuse writes carrying a lower one.
//!
//! A token equal to the highest seen is accepted: one holder makes many writes with the token
//! of its one grant. A lower token means its writer's lease was lost and someone else has been
//! granted the resource since; its write is refused with [`ErrorKind::StaleToken`], carrying the
//! presented and the highest token, and counted in `fencelock_stale_token_rejections_total`.
//!
//! The guards, by where the protected data lives:
//! - [`MemoryFence`]: in this process, the check and the write under one lock;
//! - `RedisFence` (feature `redis`): in one Redis node, the check and the write in one script;
//! - `PgFence` (feature `postgres`): in PostgreSQL, the check as the first statement of the
//!   caller's own transaction, holding a row lock that serialises writers of the resource
//!   until commit; or a token column on the caller's own rows.
//!
//! [`ErrorKind::StaleToken`]: crate::ErrorKind::StaleToken

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
mod memory;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
mod redis;

pub use memory::MemoryFence;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PgFence, WriteFuture, DEFAULT_FENCE_TABLE};
#[cfg(feature = "redis")]
pub use redis::RedisFence;
