"""The buffer's Redis scripts. Each runs atomically inside Redis, so any number of buffer
replicas (and rollout workers behind them) see one consistent gate, and a buffer process can
die between any two calls without losing or duplicating anything: all state lives in Redis.

Keys: each script gets the job's key prefix and appends the suffixes of the one layout,
asyncrl.platform.redis_keys.LAYOUT.
Times come from Redis (TIME), never from the caller, so replicas cannot disagree about leases.
A group's bytes never pass through a script: Redis copies every argument and reply of a script
into Lua strings, which for a group of long samples costs more than all else a put does. They
are SET beside the script in one transaction (`group:<slot>`), the stream entry names the slot,
and a batch's bytes are read with plain GETs.

Each granted slot carries a prompt cursor (asyncrl.data.prompt_order maps it to a prompt), so that
every prompt is generated for once per epoch across replicas and restarts. The cursor is
state beside the gate's counters, changed by the same scripts: a slot that is lost (its lease
expired, or it was released unused) puts its cursor on the reissue list, which grants take
from before they take a new cursor; a slot whose group was accepted, skipped as uniform or
dropped by its worker uses its prompt up. Generation is thus at least once and acceptance
exactly once (an expired slot's put is refused).
"""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The prompt cursor of the slots (see the top): what becomes of a slot's prompt when the slot
# goes, and where the dataset stands.
_CURSOR = """
-- A slot gone without its prompt used: the prompt is handed out again, before new ones.
local function lose(p, slot)
  local cursor = redis.call('HGET', p .. 'cursors', slot)
  if cursor then
    redis.call('HDEL', p .. 'cursors', slot)
    redis.call('RPUSH', p .. 'reissue', cursor)
  end
end
-- A slot gone with its prompt used (accepted, skipped, dropped): the prompt's cursor, if any.
local function use(p, slot)
  local cursor = redis.call('HGET', p .. 'cursors', slot)
  if cursor then redis.call('HDEL', p .. 'cursors', slot) end
  return cursor
end
-- {next new cursor, the end (N x epochs; 0: none, N not told yet or epochs unset), prompts
-- to reissue, slots holding a prompt, 1 when every prompt of every epoch is used else 0}.
-- A held slot may still be lost, and its prompt come back: used up needs none held.
local function dataset(p)
  local cfg = redis.call('HMGET', p .. 'config', 'prompts', 'epochs')
  local last = tonumber(cfg[1] or '0') * tonumber(cfg[2] or '0')
  local cursor = tonumber(redis.call('HGET', p .. 'state', 'cursor') or '0')
  local reissue = redis.call('LLEN', p .. 'reissue')
  local held = redis.call('HLEN', p .. 'cursors')
  local used_up = last > 0 and cursor >= last and reissue == 0 and held == 0
  return {cursor, last, reissue, held, used_up and 1 or 0}
end
"""

# The staleness gate: grants `slot` if the bound and the concurrency limit allow, with a
# prompt cursor. `prompts`: N as the worker counts it ('' or '0': not told); the first one
# told is kept in the job's config (the buffer cannot count prompts without building the
# dataset, which needs the model's tokenizer: the workers have both).
# -> {-1} unknown job | {-2, N kept} the worker counts other prompts | {0, reason} refused |
# {1, expires_ms, cursor}
_GRANT = _CURSOR + """
local function grant(p, slot, prompts)
  local cfg = redis.call('HMGET', p .. 'config', 'max_staleness', 'batch_size', 'max_concurrent',
                         'lease_ms', 'prompts', 'oversample')
  if not cfg[1] then return {-1} end
  local told = tonumber(prompts) or 0
  if told > 0 then
    if not cfg[5] then redis.call('HSET', p .. 'config', 'prompts', told)
    elseif tonumber(cfg[5]) ~= told then return {-2, cfg[5]} end
  end
  local expired = redis.call('ZRANGEBYSCORE', p .. 'slots', '-inf', now)
  for _, gone in ipairs(expired) do
    redis.call('ZREM', p .. 'slots', gone)
    lose(p, gone)
  end
  if #expired > 0 then redis.call('HINCRBY', p .. 'state', 'expired', #expired) end
  local d = dataset(p)
  if d[5] == 1 then return {0, 'exhausted'} end
  if d[2] > 0 and d[1] >= d[2] and d[3] == 0 then return {0, 'draining'} end
  local running = redis.call('ZCARD', p .. 'slots')
  local st = redis.call('HMGET', p .. 'state', 'trainer_version', 'accepted', 'dropped_stale')
  local version = tonumber(st[1] or '0')
  -- Groups dropped as too stale are never trained: their budget is given back, or a job whose
  -- every slot went to a dropped group would wait forever.
  local kept = tonumber(st[2] or '0') - tonumber(st[3] or '0')
  -- Over-generation (algorithm.oversampleGroups) widens admission only: an extra group that
  -- ends up staler than the bound is dropped when consumed, as any other.
  local capacity = (tonumber(cfg[1]) + version + 1) * tonumber(cfg[2]) + tonumber(cfg[6] or '0')
                   - (kept + running)
  if capacity <= 0 then return {0, 'staleness'} end
  local max_concurrent = tonumber(cfg[3])
  if max_concurrent > 0 and running >= max_concurrent then return {0, 'concurrency'} end
  local cursor = redis.call('LPOP', p .. 'reissue')
  if not cursor then
    cursor = d[1]
    redis.call('HSET', p .. 'state', 'cursor', cursor + 1)
  end
  local expires = now + tonumber(cfg[4])
  redis.call('ZADD', p .. 'slots', expires, slot)
  redis.call('HSET', p .. 'cursors', slot, cursor)
  return {1, expires, tonumber(cursor)}
end
"""

# ARGV: prefix, slot id, the worker's training prompts.  -> as _GRANT
ACQUIRE = _NOW + _GRANT + """
return grant(ARGV[1], ARGV[2], ARGV[3])
"""

# ARGV: prefix, slot id.  -> {0} gone | {1, expires_ms}
HEARTBEAT = _NOW + _CURSOR + """
local p = ARGV[1]
local score = redis.call('ZSCORE', p .. 'slots', ARGV[2])
if not score then return {0} end
if tonumber(score) <= now then
  redis.call('ZREM', p .. 'slots', ARGV[2])
  redis.call('HINCRBY', p .. 'state', 'expired', 1)
  lose(p, ARGV[2])
  return {0}
end
local expires = now + tonumber(redis.call('HGET', p .. 'config', 'lease_ms'))
redis.call('ZADD', p .. 'slots', 'XX', expires, ARGV[2])
return {1, expires}
"""

# ARGV: prefix, slot id, '1' when its group was skipped (every reward equal) else '', '1' when
# its prompt counts as used anyway (dropped by the worker) else ''. A slot released otherwise
# (generation failed, the worker stopping) has its prompt handed out again.
# -> 1 released | 0 not held
RELEASE = _CURSOR + """
local p, slot, skipped = ARGV[1], ARGV[2], ARGV[3] == '1'
local released = redis.call('ZREM', p .. 'slots', slot)
if released == 1 then
  if skipped then redis.call('HINCRBY', p .. 'state', 'skipped_uniform', 1) end
  if skipped or ARGV[4] == '1' then use(p, slot) else lose(p, slot) end
end
return released
"""

# Runs in one transaction right after the `SET group:<slot> <bytes> NX EX <seconds>` of each
# of its puts, whose bytes it keeps (PERSIST) if it accepts the group and deletes otherwise.
# One run takes all the puts of a transaction, in order: a script run costs Redis far more
# than the commands in it (about 150 us against 40 for one put's).
# ARGV: prefix, then per put: slot id, oldest token version, group id, next slot id ('' for
# none), the worker's training prompts (for the next slot's grant). -> per put,
# {0, 'unknown'|'expired'} | {1, stream id, accepted, next} | {2, stream id, 0, next} (a retry
# of a done put), `next` as _GRANT answers for the next slot, or 0.
# The stream entry names the slot's prompt cursor (c) too: which prompt each group is for.
PUT = _NOW + _GRANT + """
local p = ARGV[1]
local function put(slot, oldest, group_id, next_id, prompts)
  local function next_slot() return next_id ~= '' and grant(p, next_id, prompts) or 0 end
  local bytes = p .. 'group:' .. slot
  local done = redis.call('GET', p .. 'put:' .. slot)
  if done then
    -- A retry: its SET changed nothing while the group waits; once the group was trained or
    -- dropped, its SET made a copy nobody will read.
    if not redis.call('XRANGE', p .. 'groups', done, done)[1] then redis.call('DEL', bytes) end
    return {2, done, 0, next_slot()}
  end
  local score = redis.call('ZSCORE', p .. 'slots', slot)
  if not score then
    redis.call('DEL', bytes)
    return {0, 'unknown'}
  end
  redis.call('ZREM', p .. 'slots', slot)
  if tonumber(score) <= now then
    redis.call('HINCRBY', p .. 'state', 'expired', 1)
    redis.call('DEL', bytes)
    lose(p, slot)
    return {0, 'expired'}
  end
  redis.call('PERSIST', bytes)
  -- c is '' only for a slot granted by a buffer from before slots had cursors.
  local id = redis.call('XADD', p .. 'groups', '*', 'slot', slot, 'v', oldest, 'id', group_id,
                        'c', use(p, slot) or '')
  redis.call('SET', p .. 'put:' .. slot, id, 'EX', 86400)
  local accepted = redis.call('HINCRBY', p .. 'state', 'accepted', 1)
  return {1, id, accepted, next_slot()}
end
local replies = {}
for i = 2, #ARGV, 5 do
  replies[#replies + 1] = put(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4])
end
return replies
"""

# Accepted groups not yet in a batch: never read (stream length - pending) + staged.
_UNBATCHED = """
local function unbatched(p)
  local pending = redis.call('XPENDING', p .. 'groups', 'trainer')[1]
  return redis.call('XLEN', p .. 'groups') - pending + redis.call('LLEN', p .. 'staged')
end
"""

_ENTRIES = """
local function entries(ids)
  local out = {}
  for _, id in ipairs(ids) do
    local found = redis.call('XRANGE', p .. 'groups', id, id)
    if found[1] then table.insert(out, found[1]) end
  end
  return out
end
local function field(entry, name)
  local f = entry[2]
  for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end
end
-- An entry written before groups had keys of their own holds its bytes itself (field g).
local function drop_bytes(entry)
  local slot = field(entry, 'slot')
  if slot then redis.call('DEL', p .. 'group:' .. slot) end
end
"""

# ARGV: prefix, consumer, batch size, new batch id.
# -> {'redelivered', batch id, entries} | {'new', batch id, entries, dropped} | {'wait', dropped}
GET_BATCH = _NOW + _UNBATCHED + """
local p = ARGV[1]
local consumer, n, new_id = ARGV[2], tonumber(ARGV[3]), ARGV[4]
""" + _ENTRIES + """
local cfg = redis.call('HMGET', p .. 'config', 'max_staleness', 'ack_timeout_ms')
-- A restarted trainer reclaims its own batch; any batch past the ack timeout is taken over.
local reclaim = redis.call('HGET', p .. 'owned', consumer)
if not reclaim then
  reclaim = redis.call('ZRANGEBYSCORE', p .. 'batches', '-inf', now - tonumber(cfg[2]), 'LIMIT', 0, 1)[1]
end
if reclaim then
  local previous = redis.call('HGET', p .. 'owner', reclaim)
  if previous then redis.call('HDEL', p .. 'owned', previous) end
  redis.call('HSET', p .. 'owner', reclaim, consumer)
  redis.call('HSET', p .. 'owned', consumer, reclaim)
  redis.call('ZADD', p .. 'batches', now, reclaim)
  redis.call('HINCRBY', p .. 'state', 'redelivered', 1)
  return {'redelivered', reclaim, entries(redis.call('LRANGE', p .. 'batch:' .. reclaim, 0, -1))}
end
-- Too few groups for a batch: answer before touching any, since a waiting trainer asks
-- again and again.
if unbatched(p) < n then return {'wait', 0} end
local eta = tonumber(cfg[1])
local version = tonumber(redis.call('HGET', p .. 'state', 'trainer_version') or '0')
local kept, dropped = {}, 0
while #kept < n do
  local read
  local id = redis.call('LPOP', p .. 'staged')
  if id then
    read = redis.call('XRANGE', p .. 'groups', id, id)
  else
    read = redis.call('XREADGROUP', 'GROUP', 'trainer', consumer, 'COUNT', n - #kept,
                      'STREAMS', p .. 'groups', '>')
    if not read then break end
    read = read[1][2]
  end
  for _, entry in ipairs(read) do
    if version - tonumber(field(entry, 'v')) > eta then
      redis.call('XACK', p .. 'groups', 'trainer', entry[1])
      redis.call('XDEL', p .. 'groups', entry[1])
      drop_bytes(entry)
      dropped = dropped + 1
    else
      table.insert(kept, entry)
    end
  end
end
if dropped > 0 then redis.call('HINCRBY', p .. 'state', 'dropped_stale', dropped) end
if #kept < n then
  for i = #kept, 1, -1 do redis.call('LPUSH', p .. 'staged', kept[i][1]) end
  return {'wait', dropped}
end
for _, entry in ipairs(kept) do
  redis.call('RPUSH', p .. 'batch:' .. new_id, entry[1])
  redis.call('HINCRBY', p .. 'staleness', version - tonumber(field(entry, 'v')), 1)
end
redis.call('ZADD', p .. 'batches', now, new_id)
redis.call('HSET', p .. 'owner', new_id, consumer)
redis.call('HSET', p .. 'owned', consumer, new_id)
return {'new', new_id, kept, dropped}
"""

# ARGV: prefix, batch id.  -> {0} unknown | {1, groups} | {2} already acknowledged
ACK = """
local p, id = ARGV[1], ARGV[2]
""" + _ENTRIES + """
if redis.call('EXISTS', p .. 'acked:' .. id) == 1 then return {2} end
local ids = redis.call('LRANGE', p .. 'batch:' .. id, 0, -1)
if #ids == 0 then return {0} end
for _, entry in ipairs(entries(ids)) do drop_bytes(entry) end
redis.call('XACK', p .. 'groups', 'trainer', unpack(ids))
redis.call('XDEL', p .. 'groups', unpack(ids))
redis.call('DEL', p .. 'batch:' .. id)
redis.call('ZREM', p .. 'batches', id)
local owner = redis.call('HGET', p .. 'owner', id)
redis.call('HDEL', p .. 'owner', id)
if owner and redis.call('HGET', p .. 'owned', owner) == id then redis.call('HDEL', p .. 'owned', owner) end
redis.call('HINCRBY', p .. 'state', 'consumed', #ids)
redis.call('SET', p .. 'acked:' .. id, 1, 'EX', 86400)
return {1, #ids}
"""

# ARGV: prefix, version, uri, channel, step, '1' for the job's final weights else ''.
# -> {0, current} older than current | {1, updated_ms}
SET_VERSION = _NOW + """
local p = ARGV[1]
local current = tonumber(redis.call('HGET', p .. 'state', 'trainer_version') or '0')
local version = tonumber(ARGV[2])
if version < current then return {0, current} end
redis.call('HSET', p .. 'state', 'trainer_version', version, 'trainer_step', ARGV[5],
           'trainer_finished', ARGV[6] == '1' and 1 or 0)
redis.call('HSET', p .. 'weights', 'version', version, 'uri', ARGV[3], 'updated_unix_ms', now)
redis.call('PUBLISH', ARGV[4], version)
return {1, now}
"""

# What GetStats reads besides the state hash, in one run so the figures agree with each other
# (the trainer decides from them that the job is done). ARGV: prefix.
# -> {groups not yet batched, batches outstanding, then dataset()'s five figures}
PROGRESS = _CURSOR + _UNBATCHED + """
local p = ARGV[1]
local d = dataset(p)
return {unbatched(p), redis.call('ZCARD', p .. 'batches'), d[1], d[2], d[3], d[4], d[5]}
"""
