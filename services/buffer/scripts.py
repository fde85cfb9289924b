"""The buffer's Redis scripts. Each runs atomically inside Redis, so any number of buffer
replicas (and rollout workers behind them) see one consistent gate, and a buffer process can
die between any two calls without losing or duplicating anything: all state lives in Redis.

Keys: each script gets the job's key prefix and appends the suffixes of the one layout,
asyncrl.redis_keys.LAYOUT.
Times come from Redis (TIME), never from the caller, so replicas cannot disagree about leases.
"""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# ARGV: prefix, slot id.  -> {-1} unknown job | {0, reason} refused | {1, expires_ms}
ACQUIRE = _NOW + """
local p = ARGV[1]
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
redis.call('ZADD', p .. 'slots', expires, ARGV[2])
return {1, expires}
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

# ARGV: prefix, slot id.  -> 1 released | 0 not held
RELEASE = """
return redis.call('ZREM', ARGV[1] .. 'slots', ARGV[2])
"""

# ARGV: prefix, slot id, group bytes, oldest token version, group id.
# -> {0, 'unknown'|'expired'} | {1, stream id, accepted} | {2, stream id} (a retry of a done put)
PUT = _NOW + """
local p = ARGV[1]
local done = redis.call('GET', p .. 'put:' .. ARGV[2])
if done then return {2, done} end
local score = redis.call('ZSCORE', p .. 'slots', ARGV[2])
if not score then return {0, 'unknown'} end
redis.call('ZREM', p .. 'slots', ARGV[2])
if tonumber(score) <= now then
  redis.call('HINCRBY', p .. 'state', 'expired', 1)
  return {0, 'expired'}
end
local id = redis.call('XADD', p .. 'groups', '*', 'g', ARGV[3], 'v', ARGV[4], 'id', ARGV[5])
redis.call('SET', p .. 'put:' .. ARGV[2], id, 'EX', 86400)
local accepted = redis.call('HINCRBY', p .. 'state', 'accepted', 1)
return {1, id, accepted}
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
local eta = tonumber(cfg[1])
local version = tonumber(redis.call('HGET', p .. 'state', 'trainer_version') or '0')
local kept, dropped = {}, 0
while #kept < n do
  local entry
  local id = redis.call('LPOP', p .. 'staged')
  if id then
    entry = redis.call('XRANGE', p .. 'groups', id, id)[1]
  else
    local read = redis.call('XREADGROUP', 'GROUP', 'trainer', consumer, 'COUNT', 1, 'STREAMS', p .. 'groups', '>')
    if not read then break end
    entry = read[1][2][1]
  end
  if entry then
    if version - tonumber(field(entry, 'v')) > eta then
      redis.call('XACK', p .. 'groups', 'trainer', entry[1])
      redis.call('XDEL', p .. 'groups', entry[1])
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
if redis.call('EXISTS', p .. 'acked:' .. id) == 1 then return {2} end
local ids = redis.call('LRANGE', p .. 'batch:' .. id, 0, -1)
if #ids == 0 then return {0} end
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
