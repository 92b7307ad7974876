"""The Lua scripts behind every lock operation, one constant each.

Each runs atomically on one Redis node; Redlock runs the same script on every node at once.
Ownership is checked by *prefix*: a value is ``head .. fence .. "}"`` where ``head`` holds the
acquisition's random token (see :mod:`celery_dlock.holder`), so ``head`` alone identifies the
owner, and on Redlock each node may append its own fence counter without making values differ
where it matters.

Replies are small integer codes; :mod:`celery_dlock.redlock` maps them to outcomes in one place.
Requires Redis 6.2+ (or Valkey): scripts call ``TIME`` before writing (effects replication).
"""

from __future__ import annotations

#: Take the lock if free and issue its fencing token.
#:
#: KEYS[1] lock key, KEYS[2] fence counter key.
#: ARGV[1] value head, ARGV[2] ttl in ms, ARGV[3] fence counter retention in ms.
#: Returns ``{1, fence}`` when acquired, ``{0, current_value, pttl_ms}`` when held by another.
#:
#: The counter starts at the server's clock in ms when absent (new key, expired counter, or a
#: node that restarted empty), so tokens keep rising across such a loss as long as the key
#: issued fewer than about one token per millisecond on average and the server clock did not
#: step back. GET + SET PX is one command fewer than EXISTS + INCR + PEXPIRE.
ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
local last = redis.call('GET', KEYS[2])
local fence
if last then
  fence = tonumber(last) + 1
else
  local t = redis.call('TIME')
  fence = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local f = string.format('%d', fence)
redis.call('SET', KEYS[2], f, 'PX', ARGV[3])
redis.call('SET', KEYS[1], ARGV[1] .. f .. '}', 'PX', ARGV[2])
return {1, fence}
"""

#: Raise a node's fence counter to at least the token a Redlock acquisition settled on.
#:
#: KEYS[1] fence counter key. ARGV[1] token, ARGV[2] retention in ms. Returns 1.
#: Needed only when the quorum's counters disagreed (a node was wiped or missed acquisitions):
#: afterwards a majority holds >= token, so every later quorum reads at least one such node.
RAISE_FENCE = """
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if last < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1
"""

#: Delete the lock if we own it, and wake one waiter.
#:
#: KEYS[1] lock key, KEYS[2] waiter signal list.
#: ARGV[1] value head, ARGV[2] signal ttl in ms, ARGV[3] "1" to wake a waiter, "0" not to.
#: Returns 1 when deleted, 0 when the key was already gone, 2 when someone else holds it.
#:
#: The signal list holds at most one element and each BLPOP-ing waiter takes one, so a release
#: wakes exactly one waiter (no herd). A key already gone signals too: on Redlock the waiters
#: block on one node, which may be the one that lost the key. The signal expires, so an
#: unclaimed one does not linger. Undoing a failed attempt does not signal: the lock was never
#: ours, and a wake-up then would only start another waiter on a futile attempt.
RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) ~= ARGV[1] then
  return 2
end
if cur then
  redis.call('DEL', KEYS[1])
end
if ARGV[3] == '0' then
  if cur then
    return 1
  end
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], '1')
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if cur then
  return 1
end
return 0
"""

#: Delete the lock if its holder id matches: for the parent worker of a killed task, and operators.
#:
#: KEYS[1] lock key, KEYS[2] waiter signal list. ARGV[1] holder id, ARGV[2] signal ttl in ms.
#: Returns 1 when deleted, 0 otherwise.
RELEASE_HOLDER = """
local cur = redis.call('GET', KEYS[1])
if not cur then
  return 0
end
local ok, v = pcall(cjson.decode, cur)
if ok and type(v) == 'table' and v['holder'] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[2])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

#: Extend every listed lock we still own: the watchdog's batched renewal, one call per node.
#:
#: KEYS[2i-1] lock key i, KEYS[2i] its fence counter key.
#: ARGV[1] "1" to re-take a key that vanished from this node (Redlock), "0" not to.
#: ARGV[2] fence counter retention in ms.
#: ARGV[3i], ARGV[3i+1], ARGV[3i+2]: value head, ttl in ms, fencing token of lock i.
#: Returns one code per lock: 1 extended, 2 absent and re-taken, 0 absent, 3 held by another.
#:
#: Re-taking a vanished key keeps a Redlock lease alive across successive single-node wipes;
#: the caller counts only code 1 toward the quorum, so a re-take never manufactures a majority.
EXTEND = """
local retake = ARGV[1] == '1'
local out = {}
for i = 1, #KEYS / 2 do
  local key = KEYS[2 * i - 1]
  local head = ARGV[3 * i]
  local ttl = ARGV[3 * i + 1]
  local cur = redis.call('GET', key)
  if cur then
    if string.sub(cur, 1, #head) == head then
      redis.call('PEXPIRE', key, ttl)
      out[i] = 1
    else
      out[i] = 3
    end
  elseif retake then
    local token = ARGV[3 * i + 2]
    redis.call('SET', key, head .. token .. '}', 'PX', ttl)
    local fkey = KEYS[2 * i]
    if tonumber(redis.call('GET', fkey) or '0') < tonumber(token) then
      redis.call('SET', fkey, token, 'PX', ARGV[2])
    end
    out[i] = 2
  else
    out[i] = 0
  end
end
return out
"""

#: Read a lock for inspection. KEYS[1] lock key, KEYS[2] fence counter key.
#: Returns ``{value or false, pttl_ms, fence counter or false}``.
INSPECT = """
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2])}
"""

ALL = {
    "acquire": ACQUIRE,
    "raise_fence": RAISE_FENCE,
    "release": RELEASE,
    "release_holder": RELEASE_HOLDER,
    "extend": EXTEND,
    "inspect": INSPECT,
}
