//! ZooKeeper: a session and one read of a lock path through the library.

use super::{DoctorArgs, Findings};
use crate::connect;

pub(super) async fn zookeeper(args: &DoctorArgs, f: &mut Findings) {
    let started = std::time::Instant::now();
    let client = match connect(&args.backend, "fencelock-doctor").await {
        Ok(c) => c,
        Err(e) => {
            f.unreachable += 1;
            f.warn(&format!("unreachable: {e}"));
            return;
        }
    };
    match client.inspect("fencelock-doctor").await {
        Ok(_) => f.ok(&format!(
            "ensemble opened a session and answered a read in {}",
            crate::human_duration(started.elapsed())
        )),
        Err(e) => {
            f.unreachable += 1;
            f.warn(&format!("unreachable: {e}"));
        }
    }
    client.close().await;
    f.note(
        "tokens are czxids; a TTL may not exceed the session timeout the servers grant \
         (2 to 20 ticks)",
    );
}
