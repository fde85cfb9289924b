"""The buffer's Redis scripts. Each runs atomically inside Redis, so any number of buffer
replicas (and rollout workers behind them) see one consistent gate, and a buffer process can
die between any two calls without losing or duplicating anything: all state lives in Redis.

Keys: each script gets the job's key prefix and appends the suffixes of the one layout,
asyncrl.redis_keys.LAYOUT.
Times come from Redis (TIME), never from the caller, so replicas cannot disagree about leases.
A group's bytes never pass through a script: Redis copies every argument and reply of a script
into Lua strings, which for a group of long samples costs more than all else a put does. They
are SET beside the script in one transaction (`group:<slot>`), the stream entry names the slot,
and a batch's bytes are read with plain GETs.
"""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# The staleness gate: grants `slot` if the bound and the concurrency limit allow.
# -> {-1} unknown job | {0, reason} refused | {1, expires_ms}
_GRANT = """
local function grant(p, slot)
  local cfg = redis.call('HMGET', p .. 'config', 'max_staleness', 'batch_size', 'max_concurrent', 'lease_ms')
  if not cfg[1] then return {-1} end
  local expired = redis.call('ZREMRANGEBYSCORE', p .. 'slots', '-inf', now)
  if expired > 0 then redis.call('HINCRBY', p .. 'state', 'expired', expired) end
  local running = redis.call('ZCARD', p .. 'slots')
  local st = redis.call('HMGET', p .. 'state', 'trainer_version', 'accepted', 'dropped_stale')
  local version = tonumber(st[1] or '0')
  -- Groups dropped as too stale are never trained: their budget is given back, or a job whose
  -- every slot went to a dropped group would wait forever.
  local kept = tonumber(st[2] or '0') - tonumber(st[3] or '0')
  local capacity = (tonumber(cfg[1]) + version + 1) * tonumber(cfg[2]) - (kept + running)
  if capacity <= 0 then return {0, 'staleness'} end
  local max_concurrent = tonumber(cfg[3])
  if max_concurrent > 0 and running >= max_concurrent then return {0, 'concurrency'} end
  local expires = now + tonumber(cfg[4])
  redis.call('ZADD', p .. 'slots', expires, slot)
  return {1, expires}
end
"""

# ARGV: prefix, slot id.  -> as _GRANT
ACQUIRE = _NOW + _GRANT + """
return grant(ARGV[1], ARGV[2])
"""

# ARGV: prefix, slot id.  -> {0} gone | {1, expires_ms}
HEARTBEAT = _NOW + """
local p = ARGV[1]
local score = redis.call('ZSCORE', p .. 'slots', ARGV[2])
if not score then return {0} end
if tonumber(score) <= now then
  redis.call('ZREM', p .. 'slots', ARGV[2])
  redis.call('HINCRBY', p .. 'state', 'expired', 1)
  return {0}
end
local expires = now + tonumber(redis.call('HGET', p .. 'config', 'lease_ms'))
redis.call('ZADD', p .. 'slots', 'XX', expires, ARGV[2])
return {1, expires}
"""

# ARGV: prefix, slot id, '1' when its group was skipped (every reward equal) else ''.
# -> 1 released | 0 not held
RELEASE = """
local released = redis.call('ZREM', ARGV[1] .. 'slots', ARGV[2])
if released == 1 and ARGV[3] == '1' then
  redis.call('HINCRBY', ARGV[1] .. 'state', 'skipped_uniform', 1)
end
return released
"""

# Runs in one transaction right after the `SET group:<slot> <bytes> NX EX <seconds>` of each
# of its puts, whose bytes it keeps (PERSIST) if it accepts the group and deletes otherwise.
# One run takes all the puts of a transaction, in order: a script run costs Redis far more
# than the commands in it (about 150 us against 40 for one put's).
# ARGV: prefix, then per put: slot id, oldest token version, group id, next slot id ('' for
# none). -> per put, {0, 'unknown'|'expired'} | {1, stream id, accepted, next} |
# {2, stream id, 0, next} (a retry of a done put), `next` as _GRANT answers for the next slot,
# or 0.
PUT = _NOW + _GRANT + """
local p = ARGV[1]
local function put(slot, oldest, group_id, next_id)
  local function next_slot() return next_id ~= '' and grant(p, next_id) or 0 end
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
    return {0, 'expired'}
  end
  redis.call('PERSIST', bytes)
  local id = redis.call('XADD', p .. 'groups', '*', 'slot', slot, 'v', oldest, 'id', group_id)
  redis.call('SET', p .. 'put:' .. slot, id, 'EX', 86400)
  local accepted = redis.call('HINCRBY', p .. 'state', 'accepted', 1)
  return {1, id, accepted, next_slot()}
end
local replies = {}
for i = 2, #ARGV, 4 do
  replies[#replies + 1] = put(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
end
return replies
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
GET_BATCH = _NOW + """
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
-- again and again. Not yet batched = never read (stream length - pending) + staged.
local pending = redis.call('XPENDING', p .. 'groups', 'trainer')[1]
if redis.call('XLEN', p .. 'groups') - pending + redis.call('LLEN', p .. 'staged') < n then
  return {'wait', 0}
end
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

# ARGV: prefix, version, uri, channel.  -> {0, current} older than current | {1, updated_ms}
SET_VERSION = _NOW + """
local p = ARGV[1]
local current = tonumber(redis.call('HGET', p .. 'state', 'trainer_version') or '0')
local version = tonumber(ARGV[2])
if version < current then return {0, current} end
redis.call('HSET', p .. 'state', 'trainer_version', version, 'trainer_step', ARGV[5])
redis.call('HSET', p .. 'weights', 'version', version, 'uri', ARGV[3], 'updated_unix_ms', now)
redis.call('PUBLISH', ARGV[4], version)
return {1, now}
"""
