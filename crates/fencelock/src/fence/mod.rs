//! The protected resource: guards that remember the highest fencing token seen per resource
//! and refuse writes carrying a lower one.
//!
//! A token equal to the highest seen is accepted: one holder makes many writes with the token
//! of its one grant. A lower token means its writer's lease was lost and someone else has been
//! granted the resource since; its write is refused with [`ErrorKind::StaleToken`], carrying the
//! presented and the highest token, and counted in `fencelock_stale_token_rejections_total`.
//!
//! [`ErrorKind::StaleToken`]: crate::ErrorKind::StaleToken

mod memory;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
mod redis;

pub use memory::MemoryFence;
#[cfg(feature = "redis")]
pub use redis::RedisFence;
