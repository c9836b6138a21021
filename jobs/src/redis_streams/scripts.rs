//! The Lua scripts of the Redis backend. Each moves jobs between states in one
//! atomic step on the Redis server, whichever replica sends it: reading stream
//! entries and marking their jobs `running` is one step (no entry is ever read
//! without its job claimed), and storing a result and acknowledging its entry is
//! one step (no entry is acknowledged before its result is stored).
//!
//! Keys, under a prefix `p` (`kiln:jobs:`): `p..job:ID` (hash: model, state,
//! priority, submitted_ms, request, response | error, finished_ms, attempts,
//! consumer, entry: the stream entry of the current run), `p..stream:PRIO` (a
//! stream per priority 1..9, one entry per queued job, field `id`; the request
//! stays in the hash, so the streams hold ids only), `p..index` (sorted set: every
//! job by id, for listing), `p..finished` (sorted set: finished jobs by finishing
//! time, for expiry), `p..counts` (hash: jobs by state), `p..next_id`.
//!
//! Every script gets the prefix as ARGV[1] and the group as ARGV[2], and touches
//! keys under that prefix only (one Redis server or one primary; not Redis
//! Cluster, where a script's keys must be declared and share a slot).

/// Claims up to ARGV[4] jobs for consumer ARGV[3] at time ARGV[5] (ms), priority
/// 1 first, then stream order: `XREADGROUP >` on each priority's stream; each
/// entry of a `queued` job makes it `running` (its entry noted), any other (a
/// cancelled job, or one already finished by an earlier run) is acknowledged and
/// deleted unrun. Answers a flat list: id, model, priority, request, ... .
pub const CLAIM: &str = r#"
local p, g, c, max, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local out, n = {}, 0
if tonumber(redis.call('HGET', p .. 'counts', 'queued') or '0') <= 0 then return out end
for prio = 1, 9 do
  local stream = p .. 'stream:' .. prio
  while n < max do
    local want = max - n
    local r = redis.call('XREADGROUP', 'GROUP', g, c, 'COUNT', want, 'STREAMS', stream, '>')
    if not r then break end
    local entries = r[1][2]
    for _, e in ipairs(entries) do
      local eid, id = e[1], e[2][2]
      local key = p .. 'job:' .. id
      if redis.call('HGET', key, 'state') == 'queued' then
        redis.call('HINCRBY', p .. 'counts', 'queued', -1)
        redis.call('HINCRBY', p .. 'counts', 'running', 1)
        redis.call('HSET', key, 'state', 'running', 'consumer', c, 'claimed_ms', now, 'entry', eid)
        redis.call('HINCRBY', key, 'attempts', 1)
        local f = redis.call('HMGET', key, 'model', 'request')
        out[#out + 1] = id
        out[#out + 1] = f[1]
        out[#out + 1] = tostring(prio)
        out[#out + 1] = f[2] or ''
        n = n + 1
      else
        redis.call('XACK', stream, g, eid)
        redis.call('XDEL', stream, eid)
      end
    end
    if #entries < want then break end
  end
  if n >= max then break end
end
return out
"#;

/// A running job goes back to the queue: its entry is acknowledged and deleted
/// and a new one added at the end of its priority's stream. Answers 1 when it
/// was running (under `only_entry`, when given), -1 when it runs under consumer
/// `c` claimed at or after `since` (ms: that consumer's own live job, left as it
/// is), else 0 (the caller drops the entry). `undo`: the job was not run, its last
/// claim does not count in its attempts (as the embedded store does).
const REQUEUE_ONE: &str = r#"
local function requeue(p, g, id, only_entry, c, since, undo)
  local key = p .. 'job:' .. id
  local f = redis.call('HMGET', key, 'state', 'priority', 'entry', 'consumer', 'claimed_ms')
  if f[1] ~= 'running' then return 0 end
  if only_entry and f[3] ~= only_entry then return 0 end
  if c and f[4] == c and tonumber(f[5] or '0') >= tonumber(since) then return -1 end
  local stream = p .. 'stream:' .. f[2]
  if f[3] then
    redis.call('XACK', stream, g, f[3])
    redis.call('XDEL', stream, f[3])
  end
  redis.call('HSET', key, 'state', 'queued')
  if undo then redis.call('HINCRBY', key, 'attempts', -1) end
  redis.call('HDEL', key, 'consumer', 'claimed_ms', 'entry')
  redis.call('XADD', stream, '*', 'id', id)
  redis.call('HINCRBY', p .. 'counts', 'running', -1)
  redis.call('HINCRBY', p .. 'counts', 'queued', 1)
  return 1
end
"#;

/// Puts the running jobs ARGV[3..] back in the queue (they were not run).
pub fn release() -> String {
    format!(
        "{REQUEUE_ONE}
local n = 0
for i = 3, #ARGV do n = n + math.max(0, requeue(ARGV[1], ARGV[2], ARGV[i], nil, nil, 0, true)) end
return n
"
    )
}

/// Takes over, for consumer ARGV[3], the entries of the priority ARGV[5]'s stream
/// pending for at least ARGV[4] ms from the cursor ARGV[6] (`XAUTOCLAIM`, up to
/// 200): the job of each, when still running under that entry, goes back to the
/// queue, unless it is ARGV[3]'s own claimed since ARGV[7] (ms; this process's
/// start: older ones are a previous life's under the same name); any other entry
/// (its job ended, or queued again under a newer entry) is acknowledged and
/// deleted. Answers {next cursor, jobs queued again}.
pub fn reclaim() -> String {
    format!(
        "{REQUEUE_ONE}
local p, g, c, idle, prio, cursor, since = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local stream = p .. 'stream:' .. prio
local r = redis.call('XAUTOCLAIM', stream, g, c, idle, cursor, 'COUNT', 200)
local moved = 0
for _, e in ipairs(r[2]) do
  local eid = e[1]
  local back = 0
  if e[2] then back = requeue(p, g, e[2][2], eid, c, since) end
  if back == 0 then
    redis.call('XACK', stream, g, eid)
    redis.call('XDEL', stream, eid)
  end
  moved = moved + math.max(0, back)
end
return {{r[1], moved}}
"
    )
}

/// Stores results, once each: ARGV[4..] are triples (id, state `done`/`failed`,
/// response or error). A job still `queued` or `running` takes its result (the
/// first one wins; a later run's is dropped), its request is freed and it enters
/// the finished set at ARGV[3] (ms); then the entry of its run is acknowledged
/// and deleted, in the same step. Unknown ids (expired) are skipped. Answers how
/// many results were stored.
pub const FINISH: &str = r#"
local p, g, now = ARGV[1], ARGV[2], ARGV[3]
local stored = 0
for i = 4, #ARGV, 3 do
  local id, to, value = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local key = p .. 'job:' .. id
  local f = redis.call('HMGET', key, 'state', 'priority', 'entry')
  local s = f[1]
  if s == 'queued' or s == 'running' then
    local field = 'response'
    if to == 'failed' then field = 'error' end
    redis.call('HINCRBY', p .. 'counts', s, -1)
    redis.call('HINCRBY', p .. 'counts', to, 1)
    redis.call('HSET', key, 'state', to, field, value, 'finished_ms', now)
    redis.call('HDEL', key, 'request', 'consumer', 'claimed_ms', 'entry')
    redis.call('ZADD', p .. 'finished', now, id)
    stored = stored + 1
  end
  if f[3] then
    local stream = p .. 'stream:' .. f[2]
    redis.call('XACK', stream, g, f[3])
    redis.call('XDEL', stream, f[3])
  end
end
return stored
"#;

/// Cancels the queued job ARGV[3] at ARGV[4] (ms). Answers its state before:
/// `queued` (now cancelled), another state (left as it is), or nil (no such
/// job). Its stream entry stays until a consumer reads it and drops it unrun.
pub const CANCEL: &str = r#"
local p, id, now = ARGV[1], ARGV[3], ARGV[4]
local key = p .. 'job:' .. id
local secret = redis.call('HGET', key, 'secret') or ''
if secret ~= ARGV[5] then return false end
local s = redis.call('HGET', key, 'state')
if s ~= 'queued' then return s end
redis.call('HINCRBY', p .. 'counts', 'queued', -1)
redis.call('HINCRBY', p .. 'counts', 'cancelled', 1)
redis.call('HSET', key, 'state', 'cancelled', 'finished_ms', now)
redis.call('HDEL', key, 'request')
redis.call('ZADD', p .. 'finished', now, id)
return s
"#;

/// Removes up to ARGV[4] jobs that finished at or before ARGV[3] (ms): their
/// hash, their place in the listing and in the finished set. Answers how many.
pub const EXPIRE: &str = r#"
local p = ARGV[1]
local ids = redis.call('ZRANGEBYSCORE', p .. 'finished', '-inf', ARGV[3], 'LIMIT', 0, tonumber(ARGV[4]))
for _, id in ipairs(ids) do
  local key = p .. 'job:' .. id
  local s = redis.call('HGET', key, 'state')
  if s then redis.call('HINCRBY', p .. 'counts', s, -1) end
  redis.call('DEL', key)
  redis.call('ZREM', p .. 'index', id)
  redis.call('ZREM', p .. 'finished', id)
end
return #ids
"#;

// A submission's life (`submit.rs`): staged in chunks under a token, invisible to
// every reader (its hashes are in no stream, listing or count), then committed by
// one O(1) step, then published in chunks (stream entries and listing places).
// Keys: `p..sub:TOKEN` (list: the staged ids, in order, popped as they are
// published or dropped), and three sorted sets of tokens scored by a lease (ms,
// renewed at each chunk): `p..staging`, `p..publishing` (committed, being made
// claimable), `p..aborting` (failed or abandoned, being deleted). A token moves
// staging → publishing (COMMIT) or staging → aborting (ABORT), each an atomic
// `ZREM` that only one of the two wins.

/// Stages one chunk of submission ARGV[3] at ARGV[4] (ms): ARGV[5] is `new` (the
/// first chunk: the token is created) or `more` (the token must still be staging:
/// else it was abandoned, answer -1); then quadruples (model, priority, request,
/// secret) from ARGV[6]. Takes the ids (`INCRBY next_id`), lists them under the
/// token and writes each job's hash, `queued`, in no stream: nobody reads it.
/// Answers the first id.
pub const STAGE: &str = r#"
local p, t, now, how = ARGV[1], ARGV[3], ARGV[4], ARGV[5]
if how ~= 'new' and not redis.call('ZSCORE', p .. 'staging', t) then return -1 end
redis.call('ZADD', p .. 'staging', now, t)
local n = (#ARGV - 5) / 4
local first = redis.call('INCRBY', p .. 'next_id', n) - n + 1
local list = p .. 'sub:' .. t
for i = 0, n - 1 do
  local a = 6 + 4 * i
  local id = first + i
  redis.call('RPUSH', list, id)
  redis.call('HSET', p .. 'job:' .. id, 'model', ARGV[a], 'state', 'queued',
    'priority', ARGV[a + 1], 'submitted_ms', now, 'attempts', 0,
    'request', ARGV[a + 2], 'secret', ARGV[a + 3])
end
return first
"#;

/// Commits submission ARGV[3] at ARGV[4] (ms), in O(1): when still staging, its
/// jobs are counted as queued and it is to be published. Answers how many jobs it
/// holds, or -1 when it was abandoned (ABORT won).
pub const COMMIT: &str = r#"
local p, t, now = ARGV[1], ARGV[3], ARGV[4]
if redis.call('ZREM', p .. 'staging', t) == 0 then return -1 end
local n = redis.call('LLEN', p .. 'sub:' .. t)
redis.call('HINCRBY', p .. 'counts', 'queued', n)
redis.call('ZADD', p .. 'publishing', now, t)
return n
"#;

/// Publishes up to ARGV[5] more jobs of committed submission ARGV[3] at ARGV[4]
/// (ms): each takes its place in the listing and, still queued (not cancelled
/// meanwhile), an entry in its priority's stream. Popped from the list in the
/// same step, so two publishers (the submitter, a janitor) never add one twice.
/// Answers how many are left.
pub const PUBLISH: &str = r#"
local p, t, now, max = ARGV[1], ARGV[3], ARGV[4], tonumber(ARGV[5])
local list = p .. 'sub:' .. t
local ids = redis.call('LPOP', list, max)
if ids then
  for _, id in ipairs(ids) do
    local f = redis.call('HMGET', p .. 'job:' .. id, 'state', 'priority')
    if f[1] then
      redis.call('ZADD', p .. 'index', id, id)
      if f[1] == 'queued' then
        redis.call('XADD', p .. 'stream:' .. f[2], '*', 'id', id)
      end
    end
  end
end
local left = redis.call('LLEN', list)
if left == 0 then
  redis.call('ZREM', p .. 'publishing', t)
else
  redis.call('ZADD', p .. 'publishing', 'XX', now, t)
end
return left
"#;

/// Abandons submission ARGV[3] at ARGV[4] (ms) when it is still staging (never
/// committed): it is to be deleted. Answers 1, or 0 when it was not staging.
pub const ABORT: &str = r#"
local p, t, now = ARGV[1], ARGV[3], ARGV[4]
if redis.call('ZREM', p .. 'staging', t) == 0 then return 0 end
redis.call('ZADD', p .. 'aborting', now, t)
return 1
"#;

/// Deletes up to ARGV[5] more staged jobs of abandoned submission ARGV[3] at
/// ARGV[4] (ms). Answers how many are left.
pub const DROP: &str = r#"
local p, t, now, max = ARGV[1], ARGV[3], ARGV[4], tonumber(ARGV[5])
local list = p .. 'sub:' .. t
local ids = redis.call('LPOP', list, max)
if ids then
  for _, id in ipairs(ids) do redis.call('DEL', p .. 'job:' .. id) end
end
local left = redis.call('LLEN', list)
if left == 0 then
  redis.call('ZREM', p .. 'aborting', t)
else
  redis.call('ZADD', p .. 'aborting', 'XX', now, t)
end
return left
"#;
