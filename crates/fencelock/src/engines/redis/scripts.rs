//! Server-side scripts: each one atomic on its node, one round trip per call.

use std::sync::LazyLock;

use redis::Script;

/// Lua functions the scripts that renew and force-release share; each of those scripts starts
/// with them. The scripts of every acquisition and release define none: a function defined in
/// a script is a closure made on every call that runs it.
///
/// The lock's value is the holder: `owner\nWQ\nttl\nacquired_at\nwho`, where `who` is the
/// client's `pid\nhost\nclient` (the host without newlines, the client name last so it may hold
/// any byte), and `W` and `Q` are flags, `0` or `1`: `W` is set while someone waits, so that
/// the release announces itself, and `Q` when the grant is counted in its client's set of held
/// leases (a quota), so that the release takes it out. The `SET NX PX` that takes the lock
/// writes the whole holder, and the release's one `GET` reads the owner and both flags: where
/// the metadata and the flag were keys of their own, a grant and its release cost four more
/// calls. The owner's own scripts know it by the value's first line (owners are 32 hex digits,
/// never a newline). A value of this layout has a newline two bytes after the first one, with
/// two flag bytes, each `0` or `1`, between (the same test the client makes); a script changes
/// a value it does not own only when it has that shape, so a value another client wrote with
/// `SET NX PX` is never rewritten.
const SHARED: &str = r#"
-- Advances the fencing counter to max(counter + 1, floor), with floor 0 meaning the server's
-- clock in microseconds, and returns it as text. The floor is written first, reading the old
-- counter in the same call: above the old counter (the usual case, as the floor is a clock in
-- microseconds) that one call is the whole advance.
local function advance(fence, floor)
  if floor == 0 then
    local t = redis.call('TIME')
    floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  local s = string.format('%.0f', floor)
  local old = tonumber(redis.call('SET', fence, s, 'GET') or '0')
  if old >= floor then
    s = string.format('%.0f', old + 1)
    redis.call('SET', fence, s)
  end
  return s
end
-- The limits stored under the prefix (`fencelock limits set`), `max_ttl_ms max_held` with 0
-- for none: two numbers, both 0 when the key is absent or malformed.
local function parse_limits(lim)
  if not lim then
    return 0, 0
  end
  local mt, mh = string.match(lim, '^(%d+) (%d+)$')
  return tonumber(mt) or 0, tonumber(mh) or 0
end
-- The server's clock in ms.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Counts a grant of `owner` (expiring at `expires` ms) in its client's set of held leases,
-- which lives as long as its longest entry.
local function count_held(held, owner, expires, ttl)
  redis.call('ZADD', held, expires, owner)
  if redis.call('PTTL', held) < tonumber(ttl) then
    redis.call('PEXPIRE', held, ttl)
  end
end
-- Whether the lock's value `cur` is `owner`'s: it starts with the owner and a newline (`find`
-- makes no string, where comparing a prefix would).
local function owns(cur, owner)
  return cur and string.find(cur, owner, 1, true) == 1 and string.byte(cur, #owner + 1) == 10
end
-- `owner`'s value `cur`, marked as counted in its client's set of held leases.
local function counted_value(cur, owner)
  return string.sub(cur, 1, #owner + 2) .. '1' .. string.sub(cur, #owner + 4)
end
-- Its fields: owner, flags, ttl, acquired_at, pid, host, client; nil when malformed.
local function meta_fields(meta)
  local f, pos = {}, 1
  for i = 1, 6 do
    local nl = string.find(meta, '\n', pos, true)
    if not nl then
      return nil
    end
    f[i] = string.sub(meta, pos, nl - 1)
    pos = nl + 1
  end
  f[7] = string.sub(meta, pos)
  return f
end
"#;

/// A script whose body may call the [`SHARED`] functions.
fn with_shared(body: &str) -> Script {
    Script::new(&format!("{SHARED}{body}"))
}

/// Acquire outside fair mode, advancing the fencing counter in the same step: the script every
/// uncontended acquisition runs, so it carries only what such a grant needs.
///
/// KEYS: lock, fence, node, limits, and this client's set of held leases under the prefix
/// (`held`) only once the client knows of a quota (see below).
/// ARGV: the lock's value with both flags down ([`holder_value`](super::values::holder_value),
/// built by the client: a value the script assembled would cost it a string made and hashed
/// on every call; the owner is its first line), ttl_ms, the node id the client last saw on
/// this node (empty when none), and, on Redlock only, the token floor.
///
/// Reply:
/// - **the token** alone (an integer, or its digits as text) when granted by a node whose id
///   is the one the client passed;
/// - **`H<pttl> <counter>\n<holder>`** when held by another, from a node of that id (`holder`:
///   the lock's value, see [`SHARED`]; `counter`: the holder's token, empty when there is
///   none);
/// - otherwise a table whose third item is the node's id: `{1, token, node_id}` when granted,
///   `{0, pttl, node_id, holder, counter}` when held, `{2, 0, node_id, max_ttl_ms}` when the
///   TTL is above the stored cap, `{3, retry_ms, node_id, max_held}` when the client holds its
///   quota (`retry_ms`: until its first lease expires), and `{4, 0, node_id}` when a quota is
///   stored but the call carried no `held` set: the client sends the attempt again with it.
///
/// Each item a call carries, and each item of a table reply, costs the server more than most
/// of the script's own work (see `scripts/redis-script-cost`): a key about 1,900 instructions,
/// an argument 1,200, a three-item table reply 7,000 against 500 for one value. So the owner
/// is read from the value, the floor goes only where it means something, the `held` set only
/// where a quota needs it (a script called without it when one is stored refuses, so no
/// caller skips the quota), and the node id comes back only when it is news to the client.
/// The script defines no functions: a Lua closure is created on every call of a script whose
/// body defines it. An uncontended grant is four calls: the node id, the limits, the `SET NX
/// PX GET` that takes the lock and writes its holder, and the counter.
///
/// Tokens:
/// - **Redlock** passes the client's clock in µs as the floor, so that healthy nodes answer
///   the same token: `max(counter + 1, floor)`, in one `SET ... GET` when the floor is above
///   the counter (the usual case).
/// - **One node** advances the counter with `INCR`, and only when the counter is missing (its
///   first grant, or a node that restarted without its data) sets it to the server's clock in
///   µs. That is still above every token the node granted before: each token is at most the
///   server's clock (in µs) at its grant, because it is either such a clock reading or one
///   more than the previous token, and two grants of one name are more than a microsecond
///   apart on a single-threaded server whose scripts take longer than that. So as long as the
///   server's clock does not step back across the restart, a counter rebuilt from it starts
///   above everything granted before.
///
/// The token is not kept in the lock's value: only a grant, a handoff and a forced release
/// (which deletes the lock) move the counter, so while the lock is held the counter is its
/// holder's token (on Redlock, raised to the lease's token on a majority), and what needs the
/// token reads the counter.
///
/// Taking the lock and reading who held it are one `SET NX PX GET`, which needs Redis 7.0;
/// older servers get a clear error instead. A new node's id is its clock at the first grant.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(&acquire_source()));

/// The text of [`ACQUIRE`].
pub(crate) fn acquire_source() -> String {
    format!(
        "{GRANT_PROLOGUE}{}",
        ACQUIRE_BODY.replace("{REFUSE}", REFUSE)
    )
}

/// How both acquire scripts refuse a lock held by another (its value `cur`, or nil when the
/// lock is free and another fair waiter heads the queue): the holder's wait flag goes up, so
/// that its release announces itself, and the reply names the holder, its time left and its
/// token (see [`ACQUIRE`]). A value not in this layout (another client's, or an older layout's
/// bare owner) is left as it is: its holder could not release it otherwise. Shared as text,
/// as [`GRANT_PROLOGUE`] is.
const REFUSE: &str = r#"
local pttl = redis.call('PTTL', KEYS[1])
local nl = cur and string.find(cur, '\n', 1, true)
local q = nl and string.byte(cur, nl + 2)
if nl and string.byte(cur, nl + 1) == 48 and (q == 48 or q == 49)
    and string.byte(cur, nl + 3) == 10 and pttl > 0 then
  redis.call('SET', KEYS[1], string.sub(cur, 1, nl) .. '1' .. string.sub(cur, nl + 2), 'KEEPTTL')
end
local counter = redis.call('GET', KEYS[2])
if node == ARGV[3] then
  if not cur then
    return 'H' .. pttl
  end
  return 'H' .. pttl .. ' ' .. (counter or '') .. '\n' .. cur
end
return {0, pttl, node, cur, counter}
"#;

/// The start both acquire scripts share: the version check, the node id (made at a node's
/// first grant), the value and TTL, and the limits: the TTL cap, and the quota when one is
/// stored (the client's `held` set then needed, and the grant counted in it). Shared as text,
/// not as a Lua function, as a function defined in a script is a closure made on every call.
/// It leaves `owner` unset when no quota needed it.
const GRANT_PROLOGUE: &str = r#"
if not redis.REDIS_VERSION_NUM then
  return redis.error_reply('fencelock needs Redis 7.0 or later')
end
local node = redis.call('GET', KEYS[3])
if not node then
  local t = redis.call('TIME')
  node = t[1] .. '.' .. t[2]
  redis.call('SET', KEYS[3], node)
end
local value, ttl = ARGV[1], ARGV[2]
local quota_now, owner
local lim = redis.call('GET', KEYS[4])
if lim then
  local mt, mh = string.match(lim, '^(%d+) (%d+)$')
  mt, mh = tonumber(mt) or 0, tonumber(mh) or 0
  if mt > 0 and tonumber(ttl) > mt then
    return {2, 0, node, mt}
  end
  if mh > 0 then
    if not KEYS[5] then
      return {4, 0, node}
    end
    owner = string.sub(value, 1, string.find(value, '\n', 1, true) - 1)
    local t = redis.call('TIME')
    quota_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', quota_now)
    if not (redis.call('ZSCORE', KEYS[5], owner) or redis.call('ZCARD', KEYS[5]) < mh) then
      local first = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
      return {3, math.max(1, tonumber(first[2]) - quota_now), node, mh}
    end
    -- The grant is counted: its release takes it out of the set.
    value = string.sub(value, 1, #owner + 2) .. '1' .. string.sub(value, #owner + 4)
  end
end
"#;

/// What [`ACQUIRE`] runs after [`GRANT_PROLOGUE`].
const ACQUIRE_BODY: &str = r#"
local cur = redis.call('SET', KEYS[1], value, 'NX', 'PX', ttl, 'GET')
if cur then
  owner = owner or string.sub(value, 1, string.find(value, '\n', 1, true) - 1)
end
-- The owner's own value starts with the owner and a newline: `find` tells it without making
-- a string, where comparing a prefix would make one on every call.
if cur and (string.find(cur, owner, 1, true) ~= 1 or string.byte(cur, #owner + 1) ~= 10) then
  -- Refused (see REFUSE).
  {REFUSE}
end
if quota_now then
  redis.call('ZADD', KEYS[5], quota_now + tonumber(ttl), owner)
  if redis.call('PTTL', KEYS[5]) < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[5], ttl)
  end
end
if cur then
  -- A retried attempt whose answer was lost: the grant it already has, refreshed (and marked
  -- as counted, if a quota came since).
  if quota_now and string.byte(cur, #owner + 3) ~= 49 then
    redis.call('SET', KEYS[1], string.sub(cur, 1, #owner + 2) .. '1' .. string.sub(cur, #owner + 4),
      'PX', ttl)
  else
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {1, redis.call('GET', KEYS[2]) or '0', node}
end
local s = ARGV[4]
if not s then
  -- A number, which the reply carries as an integer: exact, as tokens stay below 2^53.
  s = redis.call('INCR', KEYS[2])
  if s == 1 then
    local t = redis.call('TIME')
    s = t[1] .. string.format('%06d', tonumber(t[2]))
    redis.call('SET', KEYS[2], s)
  end
else
  local old = tonumber(redis.call('SET', KEYS[2], s, 'GET') or '0')
  if old >= tonumber(s) then
    s = string.format('%.0f', old + 1)
    redis.call('SET', KEYS[2], s)
  end
end
if node == ARGV[3] then
  return s
end
return {1, s, node}
"#;

/// Acquire in fair (FIFO) mode, advancing the fencing counter in the same step.
///
/// KEYS: lock, fence, node, limits, and this client's set of held leases (`held`) only once
/// the client knows of a quota (as [`ACQUIRE`]).
/// ARGV: the lock's value with both flags down (as [`ACQUIRE`]: the owner is its first line,
/// `pid\nhost\nclient` its last three), ttl_ms, the node id the client last saw on this node
/// (empty when none), the queue entry's ttl_ms, the client's own wake-up channel (where a
/// release tells this waiter it was handed the lock), the length of the prefix, and on
/// Redlock only the waiter's place in the queue (the acquisition's start in µs, so that every
/// node orders the waiters alike; one node numbers its waiters in arrival order with `qseq`)
/// and the token floor (one node: the server's clock in µs).
///
/// The queue's keys (`queue`, `qexp`, `qseq`, `qinfo`) are built from the lock key and the
/// prefix's length: after the first, each costs the script less than a passed key costs the
/// server (see [`ACQUIRE`] for what each item of a call costs).
///
/// Reply as [`ACQUIRE`]; a refusal by a node of the id passed is `H<pttl> <counter>\n<holder>`,
/// or `H<pttl>` alone when the lock is free and another waiter heads the queue.
/// The limits are one `GET` of the `limits` key, and nothing more when it is absent; with a
/// quota, every grant is counted in the client's `held` set (owner -> expiry). The lock's
/// value keeps the lease TTL for the stuck-lock runbook, which reads the time since the last
/// renewal as `ttl - PTTL`. A grant to the owner that already holds the key (a retried
/// attempt whose answer was lost) refreshes it and returns the token it was granted.
///
/// A refused attempt raises the holder's wait flag, so its release announces itself; an
/// uncontended release finds no flag and publishes nothing. The flag lives as long as the lock
/// it is part of: a grant to the head of the queue, with waiters behind it, raises its own.
///
/// Tokens are `max(counter + 1, floor)`: with the floor at the current time in microseconds,
/// a node that restarted empty still hands out tokens above everything it granted before, as
/// long as its clock did not step back across the restart.
///
/// A fair waiter is queued when the lock is held or another waiter is ahead of it; [`ACQUIRE`]
/// is the same grant without the queue, and the two share their start ([`GRANT_PROLOGUE`]).
/// Like it, this script defines no Lua function, since a definition costs a closure on every
/// call that runs it.
pub(crate) static ACQUIRE_FAIR: LazyLock<Script> =
    LazyLock::new(|| Script::new(&acquire_fair_source()));

/// The text of [`ACQUIRE_FAIR`].
pub(crate) fn acquire_fair_source() -> String {
    format!(
        "{GRANT_PROLOGUE}{}",
        ACQUIRE_FAIR_BODY.replace("{REFUSE}", REFUSE)
    )
}

/// What [`ACQUIRE_FAIR`] runs after [`GRANT_PROLOGUE`].
const ACQUIRE_FAIR_BODY: &str = r#"
owner = owner or string.sub(value, 1, string.find(value, '\n', 1, true) - 1)
-- Redlock passes the place and the floor; one node neither.
local redlock = ARGV[8] ~= nil
local plen = tonumber(ARGV[6])
local prefix, name = string.sub(KEYS[1], 1, plen), string.sub(KEYS[1], plen + 6)
local queue, qexp = prefix .. 'queue:' .. name, prefix .. 'qexp:' .. name
local qinfo = prefix .. 'qinfo:' .. name
local fair = tonumber(ARGV[4])
local cur = redis.call('GET', KEYS[1])
local ours = cur and string.find(cur, owner, 1, true) == 1 and string.byte(cur, #owner + 1) == 10
local waiting, t = '0', nil
if not ours then
  t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- Expired entries are pruned, and the head read, where they decide a grant: when the lock
  -- is free. A held lock refuses whoever heads the queue. Only Redlock prunes on a refusal
  -- too, since its release names the head in the wake-up and a dead head would wake nobody;
  -- one node's release passes over a dead head itself before it hands the lock on.
  local head
  if not cur or redlock then
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', qexp, '-inf', now)) do
      redis.call('ZREM', queue, w)
      redis.call('ZREM', qexp, w)
      redis.call('HDEL', qinfo, w)
    end
  end
  if not cur then
    head = redis.call('ZRANGE', queue, 0, 0)[1]
  end
  if cur or (head and head ~= owner) then
    local qseq = prefix .. 'qseq:' .. name
    local place = ARGV[7]
    if not place then
      -- Spent even when the waiter is queued already: a number skipped costs nothing, and
      -- asking first would cost a newcomer a call.
      place = redis.call('INCR', qseq)
    end
    -- NX: a waiter queued already keeps its place.
    redis.call('ZADD', queue, 'NX', place, owner)
    redis.call('ZADD', qexp, now + fair, owner)
    -- What a release needs to hand the lock straight to this waiter: only one node's release
    -- does, as a Redlock grant needs a majority. `who` is the value's last three lines.
    if not redlock then
      local p = 0
      for _ = 1, 4 do
        p = string.find(value, '\n', p + 1, true)
      end
      redis.call('HSET', qinfo, owner,
        cmsgpack.pack(ttl, string.sub(value, p + 1), ARGV[5], KEYS[5]))
    end
    -- The queue's keys outlive its entries by a window. They are extended together, and only
    -- here, where every one of them is created beside the expiry set (`qexp`) or kept while it
    -- lives, so the expiry set's time left stands for all of them: one PTTL read instead of
    -- one per key, and the writes only when less than two windows are left.
    if redis.call('PTTL', qexp) < 2 * fair then
      redis.call('PEXPIRE', queue, 3 * fair)
      redis.call('PEXPIRE', qexp, 3 * fair)
      redis.call('PEXPIRE', qseq, 3 * fair)
      if not redlock then
        redis.call('PEXPIRE', qinfo, 3 * fair)
      end
    end
    -- Refused (see REFUSE).
    {REFUSE}
  end
  if head then
    redis.call('ZREM', queue, owner)
    redis.call('ZREM', qexp, owner)
    if not redlock then
      redis.call('HDEL', qinfo, owner)
    end
    if redis.call('ZCARD', queue) > 0 then
      -- The waiters behind are owed a wake-up by this holder's release.
      waiting = '1'
    end
  end
end
if quota_now then
  redis.call('ZADD', KEYS[5], quota_now + tonumber(ttl), owner)
  if redis.call('PTTL', KEYS[5]) < tonumber(ttl) then
    redis.call('PEXPIRE', KEYS[5], ttl)
  end
end
if ours then
  if quota_now and string.byte(cur, #owner + 3) ~= 49 then
    redis.call('SET', KEYS[1], string.sub(cur, 1, #owner + 2) .. '1' .. string.sub(cur, #owner + 4),
      'PX', ttl)
  else
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {1, redis.call('GET', KEYS[2]) or '0', node}
end
-- The counter becomes max(counter + 1, floor), written in one call when the floor is above it
-- (the usual case: the floor is a clock in microseconds).
local floor = tonumber(ARGV[8] or (tonumber(t[1]) * 1000000 + tonumber(t[2])))
local s = string.format('%.0f', floor)
local old = tonumber(redis.call('SET', KEYS[2], s, 'GET') or '0')
if old >= floor then
  s = string.format('%.0f', old + 1)
  redis.call('SET', KEYS[2], s)
end
if waiting == '1' or quota_now then
  value = string.sub(value, 1, #owner + 1) .. waiting .. (quota_now and '1' or '0')
    .. string.sub(value, #owner + 4)
end
redis.call('SET', KEYS[1], value, 'PX', ttl)
if node == ARGV[3] then
  return s
end
return {1, s, node}
"#;

/// Owner-checked extension of many leases in one call.
///
/// KEYS: limits, held (the client's set of held leases), lock1, lock2, ...
/// ARGV: owner1, ttl1, owner2, ttl2, ...
/// Reply: one integer per lease, 1 when extended, 0 when not the holder, and minus the cap
/// (ms) when its TTL is above the stored `max-ttl`: such a renewal is refused, not cut to the
/// cap, so the expiry never falls short of the validity the client counts. With a quota, each
/// renewal moves its entry in the `held` set (and adds one for a lease granted before the
/// quota was set, whose value is then marked as counted). The time of the last renewal is not
/// stored: the runbook reads it from the TTL and what is left of it.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    with_shared(
        r#"
local max_ttl, max_held = parse_limits(redis.call('GET', KEYS[1]))
local now = max_held > 0 and now_ms()
local out = {}
for i = 1, #KEYS - 2 do
  local lock = KEYS[i + 2]
  local owner, ttl = ARGV[2 * i - 1], ARGV[2 * i]
  local capped = max_ttl > 0 and tonumber(ttl) > max_ttl
  local cur = not capped and redis.call('GET', lock)
  if capped then
    out[i] = -max_ttl
  elseif owns(cur, owner) then
    if now then
      count_held(KEYS[2], owner, now + tonumber(ttl), ttl)
    end
    if now and string.byte(cur, #owner + 3) ~= 49 then
      redis.call('SET', lock, counted_value(cur, owner), 'PX', ttl)
    else
      redis.call('PEXPIRE', lock, ttl)
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"#,
    )
});

/// Owner-checked release; also removes the owner from the FIFO queue (a cancelled waiter) and
/// announces the change to waiters.
///
/// KEYS: lock, and this client's set of held leases (`held`) when the client knows of a quota.
/// ARGV: owner, and the mode: the length of the prefix times 4, plus 2 for handoff (hand the
/// lock to the head of the FIFO queue), plus 1 for keep waiting (a Redlock attempt rolled back
/// on a split vote, whose owner keeps its place in the queue). One number instead of three
/// arguments, as each argument costs the server about as much to take in as a `GET`.
/// Reply: 1 when the lock was this owner's and is now deleted (or handed on); 2, with nothing
/// changed, when the grant was counted under a quota and the call carried no `held` set: the
/// client sends the release again with it.
///
/// The keys only a contended release touches (the queue's, the fence, the limits, the wake
/// channel) are built in the script from the lock key and the prefix's length, not passed:
/// every key or argument a call carries costs the server as much to parse as building it
/// costs the script, and the uncontended release needs none of them.
///
/// The announcement goes out only when someone waits (the wait flag a refused attempt or a
/// queued fair waiter raised in the lock's value): an uncontended release is one read and one
/// delete (and a removal from the `held` set when the grant was counted there) and publishes
/// nothing, which spares every subscribed client a wake-up. Its payload is the owner at the
/// head of the FIFO queue (empty without one), so that in fair mode only the waiter that can
/// win retries. The holder itself is never queued (a grant takes the owner out of the queue),
/// so only a release by someone other than the holder looks at the queue for its owner.
///
/// With `handoff` (one node only: a Redlock grant needs a majority, which one node's script
/// cannot give), the lock goes straight to the oldest waiter still in the queue, as its own
/// attempt would have taken it (counter advanced, metadata written), and only the waiter's
/// own client hears of it, on its client channel, with the payload `owner token wake-channel`:
/// the waiter holds the lock without another round trip, and no other client is woken. The
/// grant's expiry is the waiter's TTL, cut to what is left of its queue entry, so a waiter that
/// died while queued blocks the lock no longer than its entry would have; the waiter's client
/// renews the lease to its full TTL at once. The limits are checked for the waiter as its own
/// attempt would: over them, it is woken instead and its retry hears the refusal.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(&release_source()));

/// The text of [`RELEASE`].
pub(crate) fn release_source() -> String {
    RELEASE_BODY.to_owned()
}

/// [`RELEASE`]. It defines no Lua function: the branch that hands the lock on writes out the
/// few steps of the grant it needs (the counter, the limits, the holder), where the [`SHARED`]
/// functions would cost their closures on every handoff; and it builds the times it writes as
/// text from the clock's digits, where a number turned into text is a formatted print.
const RELEASE_BODY: &str = r#"
local owner = ARGV[1]
local cur = redis.call('GET', KEYS[1])
-- The owner's value starts with the owner and a newline (see ACQUIRE for `find`).
local ours = cur and string.find(cur, owner, 1, true) == 1 and string.byte(cur, #owner + 1) == 10
-- A grant counted under a quota leaves its client's set with its release.
if ours and string.byte(cur, #owner + 3) == 49 then
  if not KEYS[2] then
    return 2
  end
  redis.call('ZREM', KEYS[2], owner)
end
if ours and string.byte(cur, #owner + 2) ~= 49 then
  redis.call('DEL', KEYS[1])
  return 1
end
-- Below, a waiter is involved: this owner's own queue entry, or someone waiting for the lock.
local mode = tonumber(ARGV[2])
local plen = math.floor(mode / 4)
local handoff = math.floor(mode / 2) % 2 == 1
-- A key of this name in another category: the lock key is the prefix, `lock:`, the name.
local function key(category)
  return string.sub(KEYS[1], 1, plen) .. category .. string.sub(KEYS[1], plen + 6)
end
if not ours then
  if mode % 2 == 0 then
    local queue = key('queue:')
    if redis.call('ZREM', queue, owner) == 1 then
      redis.call('ZREM', key('qexp:'), owner)
      if handoff then
        -- Only one node keeps what a handoff needs (see ACQUIRE_FAIR).
        redis.call('HDEL', key('qinfo:'), owner)
      end
      redis.call('PUBLISH', key('wake:'), redis.call('ZRANGE', queue, 0, 0)[1] or '')
    end
  end
  return 0
end
-- Someone waits. A lock handed on is overwritten with its new holder, so the key is deleted
-- only when it is not, at the end.
local queue, wake = key('queue:'), key('wake:')
-- The head, and whether anyone waits behind it (the new holder's wait flag).
local heads = redis.call('ZRANGE', queue, 0, 1)
local head = heads[1]
-- Without a queue (waiters in the default mode only) there is nobody to hand the lock to, and
-- the handoff's functions and reads would only cost the release.
if handoff and head then
  local qexp, qinfo = key('qexp:'), key('qinfo:')
  local t = redis.call('TIME')
  -- The clock's microseconds, six digits: the time as text is built from them, where a
  -- number turned into text costs the script a formatted print.
  local us = string.rep('0', 6 - #t[2]) .. t[2]
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  -- The head's entry is read anyway (its expiry cuts the grant's); the queue is pruned only
  -- when that entry has expired. An expired entry further back is pruned once it heads the
  -- queue, or by an attempt that finds the lock free.
  local left = tonumber(redis.call('ZSCORE', qexp, head) or '0') - now
  if left <= 0 then
    for _, w in ipairs(redis.call('ZRANGEBYSCORE', qexp, '-inf', now)) do
      redis.call('ZREM', queue, w)
      redis.call('ZREM', qexp, w)
      redis.call('HDEL', qinfo, w)
    end
    heads = redis.call('ZRANGE', queue, 0, 1)
    head = heads[1]
    left = head and tonumber(redis.call('ZSCORE', qexp, head) or '0') - now or 0
  end
  local info = head and left > 0 and redis.call('HGET', qinfo, head)
  local ttl, who, channel, held
  local counted = '0'
  if info then
    ttl, who, channel, held = cmsgpack.unpack(info)
    -- The limits, checked for the head as its own attempt would (see GRANT_PROLOGUE).
    local lim = redis.call('GET', string.sub(KEYS[1], 1, plen) .. 'limits')
    if lim then
      local mt, mh = string.match(lim, '^(%d+) (%d+)$')
      mt, mh = tonumber(mt) or 0, tonumber(mh) or 0
      if mt > 0 and tonumber(ttl) > mt then
        info = nil
      elseif mh > 0 then
        if held then
          redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
        end
        if held and (redis.call('ZSCORE', held, head) or redis.call('ZCARD', held) < mh) then
          redis.call('ZADD', held, now + tonumber(ttl), head)
          if redis.call('PTTL', held) < tonumber(ttl) then
            redis.call('PEXPIRE', held, ttl)
          end
          counted = '1'
        else
          info = nil
        end
      end
    end
  end
  if info then
    -- The token: max(counter + 1, the clock in µs), the clock written in the same call that
    -- reads the counter (see ACQUIRE).
    local fence = key('fence:')
    local s = t[1] .. us
    local old = redis.call('SET', fence, s, 'GET')
    if old and tonumber(old) >= tonumber(s) then
      s = string.format('%.0f', tonumber(old) + 1)
      redis.call('SET', fence, s)
    end
    redis.call('ZREM', queue, head)
    redis.call('ZREM', qexp, head)
    redis.call('HDEL', qinfo, head)
    -- The waiters behind are owed a wake-up by the new holder's release. The grant expires
    -- with the head's queue entry when that comes before its TTL.
    local waiting = heads[2] and '1' or '0'
    local px = ttl
    if left < tonumber(ttl) then
      px = left
    end
    redis.call('SET', KEYS[1], head .. '\n' .. waiting .. counted .. '\n' .. ttl .. '\n'
      .. t[1] .. string.sub(us, 1, 3) .. '\n' .. who, 'PX', px)
    redis.call('PUBLISH', channel, head .. ' ' .. s .. ' ' .. wake)
    return 1
  end
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', wake, head or '')
return 1
"#;

/// Raises the fencing counter to at least a token (Redlock's second step).
///
/// KEYS: fence. ARGV: token. Reply: 1.
pub(crate) static RAISE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
if c < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"#,
    )
});

/// Forced release: deletes the lock whatever its owner (if the expected one holds it), advances
/// the fencing counter past every token granted so far, appends the audit record and wakes the
/// waiters, in one step.
///
/// KEYS: lock, fence, queue, audit. ARGV: expected owner (empty: whoever holds it), floor (0:
/// the server's clock in µs), wake channel, audit max length, then the record's own fields as
/// name, value pairs.
///
/// Reply: `{1, counter, old owner, old value, renewed_at (ms) or nil, old counter or nil}` when
/// released, `{0}` when the lock is free or held by another owner. The counter becomes
/// `max(counter + 1, floor)`, as a grant would make it, so the next grant's token is above it.
/// The record gets the old holder's fields from the lock's value, its token from the counter
/// before the advance (the holder's, see [`ACQUIRE`]), its last renewal read from the TTL and
/// what was left of it, and the new counter.
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    with_shared(
        r#"
local cur = redis.call('GET', KEYS[1])
if not cur then
  return {0}
end
-- A value of this layout starts with the owner and its flags (see SHARED); any other is a
-- bare owner, whoever wrote it.
local nl = string.find(cur, '\n', 1, true)
local w, q = nl and string.byte(cur, nl + 1), nl and string.byte(cur, nl + 2)
local ours = nl and (w == 48 or w == 49) and (q == 48 or q == 49)
  and string.byte(cur, nl + 3) == 10
local owner = ours and string.sub(cur, 1, nl - 1) or cur
if ARGV[1] ~= '' and owner ~= ARGV[1] then
  return {0}
end
-- The release and its audit record happen together or not at all: scripts are not rolled
-- back, so a command the caller's ACL denies must be found before the first write.
if redis.acl_check_cmd then
  local writes = {{'XADD', KEYS[4], '*', 'f', 'v'}, {'SET', KEYS[2], '1', 'GET'},
    {'DEL', KEYS[1]}, {'PUBLISH', ARGV[3], ''}}
  for _, c in ipairs(writes) do
    if not redis.acl_check_cmd(unpack(c)) then
      return redis.error_reply('NOPERM this user may not run ' .. c[1] .. ' on ' .. c[2] ..
        '; nothing was released (a forced release writes its audit record with the release)')
    end
  end
end
local pttl = redis.call('PTTL', KEYS[1])
local token = redis.call('GET', KEYS[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local s = advance(KEYS[2], tonumber(ARGV[2]))
redis.call('DEL', KEYS[1])
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
fields[#fields + 1] = 'owner'
fields[#fields + 1] = owner
local m = ours and meta_fields(cur)
local renewed = false
if m then
  renewed = now
  if pttl > 0 and tonumber(m[3]) then
    renewed = now - (tonumber(m[3]) - pttl)
  end
  renewed = string.format('%.0f', renewed)
  local record = {{'token', token or '0'}, {'holder_host', m[6]}, {'pid', m[5]},
    {'client', m[7]}, {'acquired_at', m[4]}, {'renewed_at', renewed}, {'ttl', m[3]}}
  for _, kv in ipairs(record) do
    fields[#fields + 1] = kv[1]
    fields[#fields + 1] = kv[2]
  end
end
fields[#fields + 1] = 'counter'
fields[#fields + 1] = s
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', unpack(fields))
local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
redis.call('PUBLISH', ARGV[3], head or '')
return {1, s, owner, cur, renewed, token}
"#,
    )
});
