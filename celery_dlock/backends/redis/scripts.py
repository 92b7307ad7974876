"""The Lua scripts behind every lock operation, one constant each.

Each runs atomically on one Redis node; Redlock runs the same script on every node at once.
Ownership is checked by *prefix*: a value is ``head .. fence .. "}"`` where ``head`` holds the
acquisition's random nonce (see :mod:`celery_dlock.core.holder`), so ``head`` alone identifies the
owner, and on Redlock each node may append its own fence counter without making values differ
where it matters.

Replies are small integer codes; :mod:`.redlock` maps them to outcomes in one place.
Requires Redis 6.2+ (or Valkey): scripts call ``TIME`` before writing (effects replication).
"""

from __future__ import annotations

#: The most bytes of a lock value a script sends back. This library's values are about 200
#: bytes; a bigger one was written by something else, and reading it whole would let whoever
#: can write the store exhaust the workers' memory (benchmarks/README.md, "Figures behind the
#: code's constants"). Scripts send the first MAX_VALUE bytes and the value's length.
MAX_VALUE = 4096
#: How many blocks of a waiter (each up to the holder's time left, or the waiter's ttl if
#: longer) one refusal's waiter marker covers: the waiter looks again between them with a bare
#: ``PTTL`` and sets the marker again (a full attempt) only when it would end before the next
#: block. More blocks, fewer full attempts; but a marker outlives the last waiter by that
#: much, and a release meanwhile writes a wake-up for nobody.
MARKER_BLOCKS = 10
#: The highest fencing token issued, plus one: 2**53 - 1, the largest integer a Lua double
#: (and a JSON number read by most languages) holds exactly. The server clock floor starts
#: tokens near 1.8e15 (microseconds since 1970), so one acquisition per microsecond on average
#: reaches it in about 230 years.
MAX_TOKEN = 2**53 - 1

#: A Lua function both reading scripts open with: ``bounded(key)`` is the value's first
#: MAX_VALUE bytes (or false when missing) and its length, at a cost that does not grow with
#: the value (STRLEN, GETRANGE). A user granted the ACL line of an older version (no
#: ``+strlen``) gets the value by GET, cut here: its transfer is bounded, not the server's copy.
BOUNDED = """
local function bounded(key)
  local n = redis.pcall('STRLEN', key)
  if type(n) == 'number' and n > MAX_VALUE then
    return redis.call('GETRANGE', key, 0, MAX_VALUE - 1), n
  end
  local v = redis.call('GET', key)
  if v then
    return string.sub(v, 1, MAX_VALUE), #v
  end
  return false, 0
end
"""

#: Take the lock if free and issue its fencing token.
#:
#: KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] this attempt's void marker (see VOID),
#: KEYS[4] (with ARGV[6] only) the key's waiter marker (see RELEASE).
#: ARGV[1] value head, ARGV[2] ttl in ms, ARGV[3] fence counter retention in ms,
#: ARGV[4] a task id whose *queued* lock (enqueue-time mode) we may take over, or "".
#: ARGV[5] "1" to floor every token at the server clock (single Redis), "0" to do so only
#: when the counter is missing (Redlock, where nodes' clocks differ and would force a
#: write-back round on every acquisition).
#: ARGV[6] (optional, only when the caller waits if refused) the most ms the marker should
#: last beyond one block: the refusal then makes the marker last longer than the caller will
#: block on the signal list (the holder's time left, or this attempt's ttl if longer, plus a
#: second), and up to MARKER_BLOCKS - 1 more such blocks but at most ARGV[6] ms more, so a
#: waiter that looks again with a bare ``PTTL`` need not set it on every look. Never shorter
#: than it was: an earlier waiter may still block longer (a caller with a shorter ttl, refused
#: by a later holder, would otherwise cut its marker, and a release would then wake nobody
#: while it blocks).
#: The void marker is read only when the key is free: a refused attempt writes nothing anyway.
#: Returns ``{1, fence}`` when acquired, ``{0, current_value, pttl_ms, length}`` when held by
#: another (the value's first MAX_VALUE bytes, and its length), ``{2}`` when the attempt was
#: voided before it arrived, ``{3, counter}`` when the fence counter is not a count below
#: MAX_TOKEN (its next token would not rise, or not be exact).
#:
#: Taking over is allowed only from a value marked ``"queued":true`` for that task id: the
#: lock a message holds while it waits passes to its execution without a gap, while a running
#: execution's lock is never taken over, not even by a redelivered copy with the same id.
#:
#: The counter is floored at the server's clock in microseconds, so tokens keep rising across a
#: loss of the counter (expired, restart without data, restore of an older snapshot) as long
#: as the key issued fewer than about one token per microsecond on average and the server
#: clock did not step back. Tokens stay below MAX_TOKEN (2**53 - 1), so Lua's doubles hold
#: them exactly: a counter at or past it (or not a number: something else wrote it) refuses
#: the acquisition (code 3) rather than issue a token that is negative or does not rise.
#: GET + SET PX is one command fewer than EXISTS + INCR + PEXPIRE.
ACQUIRE = """
local cur, size = bounded(KEYS[1])
if cur then
  local mine = false
  if ARGV[4] ~= '' and size <= MAX_VALUE then
    local ok, v = pcall(cjson.decode, cur)
    mine = ok and type(v) == 'table' and v['queued'] == true and v['holder'] == ARGV[4]
  end
  if not mine then
    local left = redis.call('PTTL', KEYS[1])
    if ARGV[6] then
      local block = math.max(left, tonumber(ARGV[2]))
      local want = block + math.min(block * (MARKER_BLOCKS - 1), tonumber(ARGV[6])) + 1000
      if redis.call('PTTL', KEYS[4]) < want then
        redis.call('SET', KEYS[4], '1', 'PX', want)
      end
    end
    return {0, cur, left, size}
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {2}
end
local last = redis.call('GET', KEYS[2])
local fence = 0
if last then
  local n = tonumber(last)
  if not (n and n >= 0 and n < MAX_TOKEN) then
    return {3, string.sub(last, 1, 40)}
  end
  fence = n + 1
end
if not last or ARGV[5] == '1' then
  local t = redis.call('TIME')
  fence = math.max(fence, tonumber(t[1]) * 1000000 + tonumber(t[2]))
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
#: KEYS[1] lock key, KEYS[2] waiter signal list, KEYS[3] (optional) the waiter marker: when
#: given, a waiter is woken only while the marker exists, i.e. while someone refused by
#: ACQUIRE may still be blocked on the list (nobody waiting: no signal written at all).
#: ARGV[1] value head (or any prefix of it that holds the nonce), ARGV[2] signal ttl in ms,
#: ARGV[3] "1" to wake a waiter, "0" not to,
#: "2" only if this call deleted the key (a release sent again: the first one may have woken a
#: waiter already), ARGV[4] our random nonce, the signal's content.
#: Returns 1 when deleted, 0 when the key was already gone, 2 when someone else holds it.
#:
#: The signal list holds at most one element and each BLPOP-ing waiter takes one, so a release
#: wakes exactly one waiter (no herd). The element names the releasing nonce: on Redlock the
#: woken waiter may still find that nonce on nodes the release has not reached yet, and then
#: retries at once instead of sleeping again (which would lose the wake-up). A key already
#: gone signals too: on Redlock the waiters block on one node, which may be the one that lost
#: the key. The signal expires, so an
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
if ARGV[3] == '0' or (ARGV[3] == '2' and not cur)
    or (KEYS[3] and redis.call('EXISTS', KEYS[3]) == 0) then
  if cur then
    return 1
  end
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
if cur then
  return 1
end
return 0
"""

#: Call off an acquisition attempt whose reply never came: delete its lock if it was taken,
#: and leave a marker that makes the attempt fail if it only executes now.
#:
#: KEYS[1] lock key, KEYS[2] the attempt's void marker. ARGV[1] value head, ARGV[2] ttl in ms.
#: Returns 1 when a lock was deleted, 0 otherwise.
#:
#: A node that stalls (GC, swapping, SIGSTOP) still runs the acquire it received once it
#: resumes, possibly after our undo reached it on a new connection; without the marker that
#: late acquire would hold the key for the whole ttl with nobody to release it.
VOID = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

#: A release owed to a node that was silent while the lease was held (an acquire or renewal
#: that timed out there may still run), or that a release did not reach: delete the lock if
#: ours, wake a waiter if it was, and leave the attempt's void and revoked markers so that a
#: late acquire (ACQUIRE) or renewal (EXTEND's re-take) of this acquisition cannot bring the
#: key back.
#:
#: KEYS[1] lock key, KEYS[2] void marker, KEYS[3] revoked marker, KEYS[4] waiter signal list.
#: ARGV[1] value head, ARGV[2] marker ttl in ms, ARGV[3] signal ttl in ms, ARGV[4] our random
#: nonce. Returns 1 when deleted, 0 otherwise.
RELEASE_LATE = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('DEL', KEYS[4])
  redis.call('RPUSH', KEYS[4], ARGV[4])
  redis.call('PEXPIRE', KEYS[4], ARGV[3])
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
  redis.call('RPUSH', KEYS[2], tostring(v['token']))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

#: Delete the lock if it holds one acquisition, named by its random nonce: for the parent
#: worker of an execution it knows has ended, and for a queued message that will never run.
#:
#: KEYS[1] lock key, KEYS[2] waiter signal list. ARGV[1] the acquisition's nonce, ARGV[2] signal
#: ttl in ms. Returns 1 when deleted, 0 otherwise.
#:
#: Every value opens with its nonce (see :func:`holder.value_head`), so a prefix compares it.
#: Unlike RELEASE_HOLDER, which any execution of a task id matches, this never frees the lock
#: of another execution of the same task (a redelivered copy, the retried run).
RELEASE_NONCE = """
local cur = redis.call('GET', KEYS[1])
local prefix = '{"token":"' .. ARGV[1] .. '"'
if not cur or string.sub(cur, 1, #prefix) ~= prefix then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""

#: Extend every listed lock we still own: the watchdog's batched renewal, one call per node.
#:
#: KEYS[3i-2] lock key i, KEYS[3i-1] its fence counter key, KEYS[3i] its revoked marker (see
#: FORCE_RELEASE). ARGV[1] "1" to re-take a key that vanished from this node (Redlock), "0" not
#: to. ARGV[2] fence counter retention in ms.
#: ARGV[3i], ARGV[3i+1], ARGV[3i+2]: value head, ttl in ms, fencing token of lock i.
#: Returns one code per lock: 1 extended, 2 absent and re-taken, 0 absent, 3 held by another,
#: 4 released by an operator (never re-taken).
#:
#: Re-taking a vanished key keeps a Redlock lease alive across successive single-node wipes;
#: the caller counts only code 1 toward the quorum, so a re-take never manufactures a majority.
EXTEND = """
local retake = ARGV[1] == '1'
local out = {}
for i = 1, #KEYS / 3 do
  local key = KEYS[3 * i - 2]
  local head = ARGV[3 * i]
  local ttl = ARGV[3 * i + 1]
  local cur = redis.call('GET', key)
  if redis.call('EXISTS', KEYS[3 * i]) == 1 then
    out[i] = 4
  elseif cur then
    if string.sub(cur, 1, #head) == head then
      redis.call('PEXPIRE', key, ttl)
      out[i] = 1
    else
      out[i] = 3
    end
  elseif retake then
    local token = ARGV[3 * i + 2]
    redis.call('SET', key, head .. token .. '}', 'PX', ttl)
    local fkey = KEYS[3 * i - 1]
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

#: An operator's forced release: blacklist the holder's acquisition rather than only delete it,
#: so its next renewal reports the lease lost instead of re-taking the key: a holder must learn
#: it lost the lock rather than silently regain it (Kleppmann, "How to do distributed locking",
#: https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).
#:
#: KEYS[1] lock key, KEYS[2] fence counter key, KEYS[3] waiter signal list, KEYS[4] the
#: revoked marker of the acquisition (named after its nonce). ARGV[1] that nonce, ARGV[2]
#: how long the marker lives in ms (longer than the holder could keep renewing unnoticed),
#: ARGV[3] fence counter retention in ms. Returns 1 when released here, 0 when the key was not
#: held by that acquisition on this node (a marker is left anyway, for a node that missed it).
#:
#: The fencing counter moves on at once, so the revoked holder's token is stale before any
#: new holder writes. A missing counter (expired while the lease was held longer than the
#: retention, or lost) stays missing: the next acquisition floors it at the server clock.
#: Starting it at 1 would make Redlock, which floors only a missing counter, issue token 2,
#: below the revoked holder's.
FORCE_RELEASE = """
redis.call('SET', KEYS[4], '1', 'PX', ARGV[2])
local cur = redis.call('GET', KEYS[1])
if not cur or not string.find(cur, '"token":"' .. ARGV[1] .. '"', 1, true) then
  return 0
end
redis.call('DEL', KEYS[1])
local last = tonumber(redis.call('GET', KEYS[2]) or '')
if last and last >= 0 and last < MAX_TOKEN then
  redis.call('SET', KEYS[2], string.format('%d', last + 1), 'PX', ARGV[3])
end
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], 'forced')
redis.call('PEXPIRE', KEYS[3], ARGV[2])
return 1
"""

#: Turn a running execution's lock into a queued lock for its own retry message, atomically.
#:
#: KEYS[1] lock key. ARGV[1] our value head, ARGV[2] the queued value's head, ARGV[3] the
#: fencing token to keep, ARGV[4] ttl in ms. Returns 1 when handed over, 0 if no longer ours.
HANDOVER = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2] .. ARGV[3] .. '}', 'PX', ARGV[4])
  return 1
end
return 0
"""

#: Read a lock for inspection. KEYS[1] lock key, KEYS[2] fence counter key.
#: Returns ``{value or false, pttl_ms, fence counter or false, length}``: the value's first
#: MAX_VALUE bytes and its length (0 when missing); the counter, if longer than 32 bytes
#: (not a number this library wrote), as false.
INSPECT = """
local cur, n = bounded(KEYS[1])
local fence = redis.call('GET', KEYS[2])
if fence and #fence > 32 then
  fence = false
end
return {cur, redis.call('PTTL', KEYS[1]), fence, n}
"""

ACQUIRE = (BOUNDED + ACQUIRE).replace("MAX_VALUE", str(MAX_VALUE))
ACQUIRE = ACQUIRE.replace("MAX_TOKEN", str(MAX_TOKEN))
ACQUIRE = ACQUIRE.replace("MARKER_BLOCKS", str(MARKER_BLOCKS))
FORCE_RELEASE = FORCE_RELEASE.replace("MAX_TOKEN", str(MAX_TOKEN))
INSPECT = (BOUNDED + INSPECT).replace("MAX_VALUE", str(MAX_VALUE))

ALL = {
    "acquire": ACQUIRE,
    "raise_fence": RAISE_FENCE,
    "release": RELEASE,
    "void": VOID,
    "release_late": RELEASE_LATE,
    "release_holder": RELEASE_HOLDER,
    "release_nonce": RELEASE_NONCE,
    "extend": EXTEND,
    "force_release": FORCE_RELEASE,
    "handover": HANDOVER,
    "inspect": INSPECT,
}
