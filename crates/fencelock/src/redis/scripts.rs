//! Server-side scripts: each one atomic on its node, one round trip per call.

use std::sync::LazyLock;

use redis::Script;

/// Lua functions the scripts that grant, hand over or force-release share; each of those
/// scripts starts with them.
const SHARED: &str = r#"
-- Removes the FIFO waiters whose queue entries expired by `now` (ms).
local function prune_waiters(queue, qexp, qinfo, now)
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', qexp, '-inf', now)) do
    redis.call('ZREM', queue, w)
    redis.call('ZREM', qexp, w)
    redis.call('HDEL', qinfo, w)
  end
end
-- Advances the fencing counter to max(counter + 1, floor), with floor 0 meaning the server's
-- clock in microseconds, and returns it as text.
local function advance(fence, floor)
  if floor == 0 then
    local t = redis.call('TIME')
    floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  local tok = tonumber(redis.call('GET', fence) or '0') + 1
  if floor > tok then tok = floor end
  local s = string.format('%.0f', tok)
  redis.call('SET', fence, s)
  return s
end
"#;

/// A script whose body may call the [`SHARED`] functions.
fn with_shared(body: &str) -> Script {
    Script::new(&format!("{SHARED}{body}"))
}

/// Acquire, advancing the fencing counter in the same step.
///
/// KEYS: lock, fence, meta, node, queue, qexp, qseq, qinfo.
/// ARGV: owner, ttl_ms, floor (0: the server's clock in µs), node id candidate, host, pid,
/// client, now_ms (holder's wall clock), fair waiter ttl_ms (0: not fair), the client's own
/// wake-up channel (where a release tells this waiter it was handed the lock).
///
/// Reply: `{1, token, node_id}` when granted, `{0, pttl, node_id, holder, {meta fields}}` when
/// held. The metadata hash keeps the lease TTL (`ttl`, ms) for the stuck-lock runbook, which
/// reads the time since the last renewal as `ttl - PTTL`. A grant to the owner that already holds the key (a retried attempt whose answer was
/// lost) refreshes it and returns the token it was granted.
///
/// Tokens are `max(counter + 1, floor)`: with the floor at the current time in microseconds,
/// a node that restarted empty still hands out tokens above everything it granted before, as
/// long as its clock did not step back across the restart.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    with_shared(
        r#"
local node = redis.call('GET', KEYS[4])
if not node then
  node = ARGV[4]
  redis.call('SET', KEYS[4], node)
end
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  local tok = redis.call('HGET', KEYS[3], 'token') or redis.call('GET', KEYS[2]) or '0'
  return {1, tok, node}
end
local function held()
  local meta = redis.call('HMGET', KEYS[3], 'owner', 'token', 'host', 'pid', 'client', 'acquired_at', 'renewed_at', 'ttl')
  if meta[1] then
    -- Someone waits: the holder's release must announce itself.
    redis.call('HSET', KEYS[3], 'waiting', '1')
  end
  return {0, redis.call('PTTL', KEYS[1]), node, cur, meta}
end
local fair = tonumber(ARGV[9])
if fair > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  prune_waiters(KEYS[5], KEYS[6], KEYS[8], now)
  local head = redis.call('ZRANGE', KEYS[5], 0, 0)[1]
  if cur or (head and head ~= ARGV[1]) then
    if not redis.call('ZSCORE', KEYS[5], ARGV[1]) then
      redis.call('ZADD', KEYS[5], redis.call('INCR', KEYS[7]), ARGV[1])
    end
    redis.call('ZADD', KEYS[6], now + fair, ARGV[1])
    -- What a release needs to hand the lock straight to this waiter.
    redis.call('HSET', KEYS[8], ARGV[1], cmsgpack.pack(ARGV[2], ARGV[5], ARGV[6], ARGV[7], ARGV[10]))
    for i = 5, 8 do redis.call('PEXPIRE', KEYS[i], 2 * fair) end
    return held()
  end
  if head then
    redis.call('ZREM', KEYS[5], ARGV[1])
    redis.call('ZREM', KEYS[6], ARGV[1])
    redis.call('HDEL', KEYS[8], ARGV[1])
  end
elseif cur then
  return held()
end
local s = advance(KEYS[2], tonumber(ARGV[3]))
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[3], 'owner', ARGV[1], 'token', s, 'host', ARGV[5], 'pid', ARGV[6],
  'client', ARGV[7], 'acquired_at', ARGV[8], 'renewed_at', ARGV[8], 'ttl', ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return {1, s, node}
"#,
    )
});

/// Owner-checked extension of many leases in one call.
///
/// KEYS: lock1, meta1, lock2, meta2, ... ARGV: now_ms, owner1, ttl1, owner2, ttl2, ...
/// Reply: one integer per lease, 1 when extended.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local out = {}
for i = 1, #KEYS / 2 do
  local lock, meta = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('GET', lock) == ARGV[2 * i] then
    local ttl = ARGV[2 * i + 1]
    redis.call('PEXPIRE', lock, ttl)
    if redis.call('PEXPIRE', meta, ttl) == 1 then
      redis.call('HSET', meta, 'renewed_at', ARGV[1])
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
/// KEYS: lock, meta, queue, qexp, fence, qinfo. ARGV: owner, wake channel, handoff (1: hand
/// the lock to the head of the FIFO queue). Reply: 1 when the lock was this owner's and is now
/// deleted (or handed on).
///
/// The announcement goes out only when someone waits (a refused attempt marked the metadata,
/// or the FIFO queue is not empty): an uncontended release publishes nothing, which spares
/// every subscribed client a wake-up. Its payload is the owner at the head of the FIFO queue
/// (empty without one), so that in fair mode only the waiter that can win retries.
///
/// With `handoff` (one node only: a Redlock grant needs a majority, which one node's script
/// cannot give), the lock goes straight to the oldest waiter still in the queue, as its own
/// attempt would have taken it (counter advanced, metadata written), and only the waiter's
/// own client hears of it, on its client channel, with the payload `owner token wake-channel`:
/// the waiter holds the lock without another round trip, and no other client is woken. The grant's expiry is
/// the waiter's TTL, cut to what is left of its queue entry, so a waiter that died while queued
/// blocks the lock no longer than its entry would have; the waiter's client renews the lease
/// to its full TTL at once.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    with_shared(
        r#"
local queued = 0
local queue = redis.call('EXISTS', KEYS[3]) == 1
if queue then
  queued = redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[6], ARGV[1])
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  if queued == 1 then
    redis.call('PUBLISH', ARGV[2], redis.call('ZRANGE', KEYS[3], 0, 0)[1] or '')
  end
  return 0
end
local waiting = redis.call('HGET', KEYS[2], 'waiting')
redis.call('DEL', KEYS[1], KEYS[2])
if queue and ARGV[3] == '1' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  prune_waiters(KEYS[3], KEYS[4], KEYS[6], now)
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  local info = head and redis.call('HGET', KEYS[6], head)
  if info then
    local ttl, host, pid, client, channel = cmsgpack.unpack(info)
    local left = tonumber(redis.call('ZSCORE', KEYS[4], head)) - now
    local px = math.min(tonumber(ttl), left)
    local s = advance(KEYS[5], tonumber(t[1]) * 1000000 + tonumber(t[2]))
    redis.call('SET', KEYS[1], head, 'PX', px)
    redis.call('HSET', KEYS[2], 'owner', head, 'token', s, 'host', host, 'pid', pid,
      'client', client, 'acquired_at', now, 'renewed_at', now, 'ttl', ttl)
    redis.call('PEXPIRE', KEYS[2], px)
    redis.call('ZREM', KEYS[3], head)
    redis.call('ZREM', KEYS[4], head)
    redis.call('HDEL', KEYS[6], head)
    redis.call('PUBLISH', channel, head .. ' ' .. s .. ' ' .. ARGV[2])
    return 1
  end
end
local head = queue and redis.call('ZRANGE', KEYS[3], 0, 0)[1]
if waiting or head then
  redis.call('PUBLISH', ARGV[2], head or '')
end
return 1
"#,
    )
});

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

/// The holder of a lock, atomically with its metadata.
///
/// KEYS: lock, meta. Reply: `{holder or nil, pttl, {meta fields}}`.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local meta = redis.call('HMGET', KEYS[2], 'owner', 'token', 'host', 'pid', 'client', 'acquired_at', 'renewed_at', 'ttl')
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), meta}
"#,
    )
});

/// Forced release: deletes the lock whatever its owner (if the expected one holds it), advances
/// the fencing counter past every token granted so far, appends the audit record and wakes the
/// waiters, in one step.
///
/// KEYS: lock, meta, fence, queue, audit. ARGV: expected owner (empty: whoever holds it), floor
/// (0: the server's clock in µs), wake channel, audit max length, then the record's own fields
/// as name, value pairs.
///
/// Reply: `{1, counter, old owner, {meta fields}}` when released, `{0}` when the lock is free
/// or held by another owner. The counter becomes `max(counter + 1, floor)`, as a grant would
/// make it, so the next grant's token is above it. The record gets the old holder's fields
/// from the metadata hash (only if that hash belongs to the owner being deleted) and the new
/// counter.
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    with_shared(
        r#"
local cur = redis.call('GET', KEYS[1])
if not cur or (ARGV[1] ~= '' and cur ~= ARGV[1]) then
  return {0}
end
local meta = redis.call('HMGET', KEYS[2], 'owner', 'token', 'host', 'pid', 'client', 'acquired_at', 'renewed_at', 'ttl')
local s = advance(KEYS[3], tonumber(ARGV[2]))
redis.call('DEL', KEYS[1], KEYS[2])
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
fields[#fields + 1] = 'owner'
fields[#fields + 1] = cur
if meta[1] == cur then
  local names = {'token', 'holder_host', 'pid', 'client', 'acquired_at', 'renewed_at', 'ttl'}
  for i, name in ipairs(names) do
    if meta[i + 1] then
      fields[#fields + 1] = name
      fields[#fields + 1] = meta[i + 1]
    end
  end
end
fields[#fields + 1] = 'counter'
fields[#fields + 1] = s
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', unpack(fields))
local head = redis.call('ZRANGE', KEYS[4], 0, 0)[1]
redis.call('PUBLISH', ARGV[3], head or '')
return {1, s, cur, meta}
"#,
    )
});
