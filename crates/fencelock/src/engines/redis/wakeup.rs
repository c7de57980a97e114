//! The wake-up listener: one pattern subscription per node.
//!
//! - **Wake-ups.** A refused attempt sets the resource's `wait` flag; a release that finds it
//!   publishes on the resource's wake channel (an uncontended release publishes nothing). Each
//!   client keeps one pattern subscription per node and wakes the waiters of that resource. A
//!   waiter subscribes before it sends its attempt, so a release right after a refusal is never
//!   missed; without a message it sleeps no longer than the holder's remaining TTL.

use std::sync::Arc;

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::keys;
use crate::core::token::FencingToken;
use crate::core::wake::{keep_listening, Wakers};

/// Keeps one pattern subscription to every wake channel under the prefix on one node, and one
/// to this client's own channel, and reconnects when they drop. While they are down, waiters
/// fall back to sleeping.
pub(super) async fn listen_for_wakeups(
    client: redis::Client,
    prefix: String,
    channel: String,
    node: usize,
    wakers: Arc<Wakers>,
    shutdown: CancellationToken,
) {
    let pattern = keys::wake_pattern(&prefix);
    keep_listening("wake-up subscription", shutdown, || async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.psubscribe(&pattern).await?;
        pubsub.subscribe(&channel).await?;
        let mut stream = pubsub.on_message();
        while let Some(msg) = stream.next().await {
            let payload = msg.get_payload_bytes();
            if msg.get_channel_name() == channel {
                if let Some((name, owner, token)) = handoff_payload(&prefix, payload) {
                    wakers.wake(name, node, Some(owner.to_owned()), Some(token));
                }
            } else if let Some(name) = keys::name_of_wake_channel(&prefix, msg.get_channel_name()) {
                let only =
                    Some(String::from_utf8_lossy(payload).into_owned()).filter(|o| !o.is_empty());
                wakers.wake(name, node, only, None);
            }
        }
        Ok::<(), redis::RedisError>(())
    })
    .await;
}

/// A handoff's payload on a client channel, `owner token wake-channel`: the resource (from its
/// wake channel, whose name may hold spaces), the waiter the lock was handed to, and its token.
fn handoff_payload<'a>(
    prefix: &str,
    payload: &'a [u8],
) -> Option<(&'a str, &'a str, FencingToken)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (owner, rest) = text.split_once(' ')?;
    let (token, channel) = rest.split_once(' ')?;
    let name = keys::name_of_wake_channel(prefix, channel)?;
    Some((name, owner, FencingToken::new(token.parse().ok()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_payload_names_resource_owner_and_token() {
        let p = "fencelock:v1:";
        assert_eq!(
            handoff_payload(
                p,
                b"abc 1700000000000001 fencelock:v1:wake:a name: with spaces"
            ),
            Some((
                "a name: with spaces",
                "abc",
                FencingToken::new(1_700_000_000_000_001)
            ))
        );
        assert_eq!(handoff_payload(p, b"abc 17 other:v1:wake:x"), None);
        assert_eq!(handoff_payload(p, b"abc def fencelock:v1:wake:x"), None);
        assert_eq!(handoff_payload(p, b"abc"), None);
        assert_eq!(handoff_payload(p, b""), None);
    }
}
