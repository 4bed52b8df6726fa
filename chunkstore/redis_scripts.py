"""Lua scripts of the Redis chunk directory (one script = one atomic round trip).

Key layout under a prefix ``P`` (every key holds hashes, ids or counts only):

- ``P:live``            sorted set: worker id -> lease expiry (server ms)
- ``P:w:<worker>``      msgpack ``[epoch, last_seq]`` (``last_seq`` -1: fresh, -2: broken)
- ``P:s:<worker>``      set of the worker's 32-byte page keys (current epoch only)
- ``P:h:<worker>``      of those, the keys only in the worker's host-memory tier
- ``P:stage:<worker>:<id>``  set being filled by a snapshot, renamed onto ``P:s:<worker>``
  (and ``...:<id>:h``, its host-only keys, onto ``P:h:<worker>``)

Invariants:
- ``P:s:<worker>`` always belongs to the epoch in ``P:w:<worker>``: an epoch change
  unlinks it in the same script that records the new epoch. ``P:h:<worker>`` is a
  subset of it, changed in the same scripts (a snapshot replaces it).
- A lease in ``P:live`` is always for the epoch in ``P:w:<worker>`` (a stale epoch
  never renews it), so a lookup needs only the lease and the set.
- Every worker key expires one lease TTL after the worker's lease (PXAT / PEXPIREAT
  set in the same script that renews the lease), and ``P:live`` drops members
  whose lease ended more than one TTL ago: entries never outlive a lease by more
  than one TTL.
- Times come from the server's clock (``TIME``), so clients' clocks never matter.

Arguments are passed in ARGV (prefix and worker first) and keys are built in Lua:
fine on a standalone Redis or a primary with replicas, not on Redis Cluster.
"""

from __future__ import annotations

STATUS_APPLIED = 0
STATUS_NEEDS_SNAPSHOT = 1
STATUS_STALE_EPOCH = 2

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# ARGV: prefix, worker, epoch, ttl_ms, ...
_WORKER = (
    _NOW
    + """
local prefix, worker = ARGV[1], ARGV[2]
local epoch, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local live_key = prefix .. 'live'
local state_key = prefix .. 'w:' .. worker
local set_key = prefix .. 's:' .. worker
local host_key = prefix .. 'h:' .. worker
local FRESH, BROKEN = -1, -2

-- The worker's last seq under `epoch`, voiding an older epoch; nil if `epoch` is stale.
local function open_stream()
  local raw = redis.call('GET', state_key)
  if raw then
    local state = cmsgpack.unpack(raw)
    if state[1] > epoch then return nil end
    if state[1] == epoch then return state[2] end
  end
  redis.call('UNLINK', set_key, host_key)
  return FRESH
end

-- Record the stream position and renew the lease; all worker keys expire one TTL later.
local function commit(last_seq)
  local lease = now + ttl
  redis.call('SET', state_key, cmsgpack.pack({epoch, last_seq}), 'PXAT', lease + ttl)
  redis.call('PEXPIREAT', set_key, lease + ttl)
  redis.call('PEXPIREAT', host_key, lease + ttl)
  redis.call('ZADD', live_key, lease, worker)
  redis.call('ZREMRANGEBYSCORE', live_key, '-inf', now - ttl)
  redis.call('PEXPIREAT', live_key, lease + ttl)
end
"""
)

# ARGV: prefix, worker, epoch, ttl_ms, seq, msgpack [[kind, [key, ...]], ...]
# kind: 0 stored (or reloaded: back in device memory), 1 removed, 2 cleared,
# 3 offloaded (still held, only in host memory).
PUBLISH = (
    _WORKER
    + """
local seq = tonumber(ARGV[5])
local last = open_stream()
if last == nil then return 2 end
if seq ~= last + 1 then
  -- a gap (BROKEN + 1 never matches): the recorded keys are no longer known to be right
  redis.call('UNLINK', set_key, host_key)
  commit(BROKEN)
  return 1
end
for _, event in ipairs(cmsgpack.unpack(ARGV[6])) do
  local kind, keys = event[1], event[2]
  if kind == 2 then
    redis.call('UNLINK', set_key, host_key)
  else
    local command = (kind == 1) and 'SREM' or 'SADD'
    local host_command = (kind == 3) and 'SADD' or 'SREM'
    for i = 1, #keys, 1000 do
      local last = math.min(i + 999, #keys)
      redis.call(command, set_key, unpack(keys, i, last))
      redis.call(host_command, host_key, unpack(keys, i, last))
    end
  end
end
commit(seq)
return 0
"""
)

# ARGV: prefix, worker, epoch, ttl_ms, seq, stage key, host stage key
COMMIT_SNAPSHOT = (
    _WORKER
    + """
local seq, stage, host_stage = tonumber(ARGV[5]), ARGV[6], ARGV[7]
if open_stream() == nil then
  redis.call('UNLINK', stage, host_stage)
  return 2
end
redis.call('UNLINK', set_key, host_key)
if redis.call('EXISTS', stage) == 1 then redis.call('RENAME', stage, set_key) end
if redis.call('EXISTS', host_stage) == 1 then redis.call('RENAME', host_stage, host_key) end
commit(seq)
return 0
"""
)

# ARGV: prefix, worker, epoch, ttl_ms
HEARTBEAT = (
    _WORKER
    + """
local last = open_stream()
if last == nil then return 2 end
commit(last)
if last < 0 then return 1 end
return 0
"""
)

# KEYS: stage key. ARGV: ttl_ms, key, ... (the stage expires unless committed)
STAGE_ADD = """
redis.call('SADD', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 0
"""

# ARGV: prefix, n, n chain keys, entry keys -> msgpack [worker, leading run of the chain
# keys, [held entry indices (0-based)], [host-only chain key indices], [host-only entry
# indices], ...] over live workers holding the first chain key or some entry (one bulk
# string: far cheaper for the client to parse than an array). Host-only keys are looked
# for among the run and the held entries; a worker with none costs one EXISTS for them. Most workers hold a short run (a shared system prompt, then nothing), so
# the first two chain keys are probed one by one; a worker holding both gets the rest
# in one call. Entries are any subset (no prefix): one SMISMEMBER per worker.
LOOKUP = (
    _NOW
    + """
local prefix, nkeys = ARGV[1], tonumber(ARGV[2])
local nentries = #ARGV - 2 - nkeys
local workers = redis.call('ZRANGEBYSCORE', prefix .. 'live', string.format('(%d', now), '+inf')
local out = {}
for _, worker in ipairs(workers) do
  local set_key = prefix .. 's:' .. worker
  local n = 0
  while n < math.min(2, nkeys) and redis.call('SISMEMBER', set_key, ARGV[n + 3]) == 1 do
    n = n + 1
  end
  if n == 2 and nkeys > 2 then
    local held = redis.call('SMISMEMBER', set_key, unpack(ARGV, 5, nkeys + 2))
    while n < nkeys and held[n - 1] == 1 do n = n + 1 end
  end
  local entries = {}
  if nentries > 0 then
    local held = redis.call('SMISMEMBER', set_key, unpack(ARGV, nkeys + 3))
    for i = 1, nentries do
      if held[i] == 1 then entries[#entries + 1] = i - 1 end
    end
  end
  if n > 0 or #entries > 0 then
    local host_chain, host_entries = {}, {}
    local host_key = prefix .. 'h:' .. worker
    if redis.call('EXISTS', host_key) == 1 then
      local probe = {}
      for i = 1, n do probe[#probe + 1] = ARGV[i + 2] end
      for _, e in ipairs(entries) do probe[#probe + 1] = ARGV[nkeys + 3 + e] end
      local flags = redis.call('SMISMEMBER', host_key, unpack(probe))
      for i = 1, #probe do
        if flags[i] == 1 then
          if i <= n then
            host_chain[#host_chain + 1] = i - 1
          else
            host_entries[#host_entries + 1] = entries[i - n]
          end
        end
      end
    end
    out[#out + 1] = worker
    out[#out + 1] = n
    out[#out + 1] = entries
    out[#out + 1] = host_chain
    out[#out + 1] = host_entries
  end
end
return cmsgpack.pack(out)
"""
)

# ARGV: prefix -> {live workers, entries of live workers}
STATS = (
    _NOW
    + """
local prefix = ARGV[1]
local workers = redis.call('ZRANGEBYSCORE', prefix .. 'live', string.format('(%d', now), '+inf')
local entries = 0
for _, worker in ipairs(workers) do
  entries = entries + redis.call('SCARD', prefix .. 's:' .. worker)
end
return {#workers, entries}
"""
)

# ARGV: prefix, worker
REMOVE_WORKER = """
local prefix, worker = ARGV[1], ARGV[2]
redis.call('UNLINK', prefix .. 'w:' .. worker, prefix .. 's:' .. worker, prefix .. 'h:' .. worker)
redis.call('ZREM', prefix .. 'live', worker)
return 0
"""
