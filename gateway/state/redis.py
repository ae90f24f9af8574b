"""The Redis backends: the quota windows (`RedisState`'s `State` calls, the same sliding-window
logs as `MemoryState`, kept for every gateway) and the slot ledger (its `SlotLedger` calls).
They let a failing Redis raise (`failures`); what the gateway does then is `FailoverState`'s
(failover.py), so these stay a plain mapping of calls to scripts. The key layout is theirs alone:
callers name a tenant's window or a pool's replica, and the hash tags below keep what one script
touches in one Redis Cluster slot.

Each call is one Lua script, so each is atomic across gateways without locks or WATCH retries.
Per window `K` (`quota:{tenant}:<window>`, so a tenant's windows share one Redis Cluster slot and
one script may charge them together) the script keeps:

- `K:z`, a ZSET of charge ids scored by the time they were made;
- `K:a`, a hash of their amounts;
- `K:u`, the running total, so a call costs the charges that expired, not the whole log. It is
  written with `KEEPTTL` (Redis 6.0 or later): a plain `SET` drops a key's expiry, and a total
  rewritten by a call that then charged nothing (a refusal) would outlive the log it sums,
  counting charges long gone against the tenant for good.

The clock is Redis' own `TIME`, read inside the script: one clock for all gateways, whose own
clocks may disagree. Tests may inject a clock (as with `MemoryState`) to move time instead of
sleeping a minute; production never does. Keys expire a window after their last write, so a
tenant gone idle leaves nothing behind.

The holder record (its `HolderRecord` calls) is one plain key per stored response,
`holder:<id>`, holding the holder as a JSON array (the stored conversation's messages in it, so
one read gives another gateway the whole conversation it counts) and expiring `holder_ttl_s`
after it was last written or read.

Every call is bounded by `socket_timeout` / `socket_connect_timeout` and by an overall
deadline (`gateway.deadline`): a slow or dead Redis turns into an error within `timeout_s`, which
`FailoverState` turns into local limits or a refusal. redis-py retries a call once, at once, inside
that bound: after Redis restarts, every pooled connection is stale and fails its first use.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.deadline import Deadline
from gateway.state.base import (
    WINDOW_S,
    Correction,
    Holder,
    Limit,
    PoolReplica,
    Reservation,
    SliceAsk,
    SliceGrant,
    SlotClaim,
    TenantWindow,
    Window,
    WindowFull,
)

T = TypeVar("T")

# Every script's clock: the caller's (tests move time) or, given '', Redis' own TIME.
_CLOCK = """
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.17g', x) end
"""

_PRELUDE = (
    _CLOCK
    + """
-- KEYS holds each window's three keys (K:z, K:a, K:u), so a script touches only declared keys
-- (Redis Cluster routes by them); BASE is the windows' own names, K.
local BASE = {}
for i = 1, #KEYS, 3 do BASE[#BASE + 1] = string.sub(KEYS[i], 1, -3) end
local function expire(k, horizon)
  local z, a, u = k .. ':z', k .. ':a', k .. ':u'
  local used = tonumber(redis.call('GET', u) or '0')
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', fmt(horizon))
  if #gone > 0 then
    for i = 1, #gone, 1000 do
      local chunk = {}
      for j = i, math.min(i + 999, #gone) do chunk[#chunk + 1] = gone[j] end
      local amounts = redis.call('HMGET', a, unpack(chunk))
      for _, amount in ipairs(amounts) do used = used - tonumber(amount or '0') end
      redis.call('HDEL', a, unpack(chunk))
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', fmt(horizon))
    redis.call('SET', u, used, 'KEEPTTL')
  end
  return used
end
local function window(k, limit, used, now, span)
  local newest = redis.call('ZRANGE', k .. ':z', -1, -1, 'WITHSCORES')
  local reset = 0
  if #newest > 0 then reset = tonumber(newest[2]) + span - now end
  return {tostring(limit), tostring(math.max(0, limit - used)), fmt(reset)}
end
-- Keys live until their newest charge leaves the window (a slice's is stamped ahead), + 1 s.
local function touch(k, now, span)
  local newest = redis.call('ZRANGE', k .. ':z', -1, -1, 'WITHSCORES')
  local last = #newest > 0 and math.max(now, tonumber(newest[2])) or now
  local ms = math.ceil((last - now + span + 1) * 1000)
  for _, s in ipairs({':z', ':a', ':u'}) do redis.call('PEXPIRE', k .. s, ms) end
end
local function charge(k, id, at, amount, used, now, span)
  redis.call('ZADD', k .. ':z', fmt(at), id)
  redis.call('HSET', k .. ':a', id, amount)
  redis.call('SET', k .. ':u', used + amount, 'KEEPTTL')
  touch(k, now, span)
end
-- When the refused windows (indexes into BASE) would all fit: nil when one asks more than its
-- whole limit; else the time until enough of each window's oldest charges have left it.
local function retry_after(refused, amounts, limits, used, now, span)
  local retry = 0
  for _, i in ipairs(refused) do
    if amounts[i] > limits[i] then return nil end
    local excess = used[i] + amounts[i] - limits[i]
    local log = redis.call('ZRANGE', BASE[i] .. ':z', 0, -1, 'WITHSCORES')
    for j = 1, #log, 2 do
      excess = excess - tonumber(redis.call('HGET', BASE[i] .. ':a', log[j]) or '0')
      if excess <= 0 then
        retry = math.max(retry, math.max(0, tonumber(log[j + 1]) + span - now))
        break
      end
    end
  end
  return retry
end
local function refusal(refused, amounts, limits, used, now, span)
  local retry = retry_after(refused, amounts, limits, used, now, span)
  return {0, refused[1], retry == nil and '' or fmt(retry)}
end
"""
)

# KEYS: the three keys of each limit's window. ARGV: now ('' = TIME), window, id, then amount,
# limit per window.
# Returns, comma-joined (`_fields`): granted (1/0), refused index (1-based, 0), retry ('' = none),
# then limit, remaining, reset per key.
_RESERVE = (
    _PRELUDE
    + """
local now, span, id = clock(), tonumber(ARGV[2]), ARGV[3]
local used, amounts, limits, refused = {}, {}, {}, {}
for i, k in ipairs(BASE) do
  amounts[i], limits[i] = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  used[i] = expire(k, now - span)
  if used[i] + amounts[i] > limits[i] then refused[#refused + 1] = i end
end
local out = {}
if #refused == 0 then
  out = {1, 0, ''}
  for i, k in ipairs(BASE) do
    charge(k, id, now, amounts[i], used[i], now, span)
    used[i] = used[i] + amounts[i]
  end
else
  out = refusal(refused, amounts, limits, used, now, span)
end
for i, k in ipairs(BASE) do
  for _, v in ipairs(window(k, limits[i], used[i], now, span)) do out[#out + 1] = v end
end
return table.concat(out, ',')
"""
)

# KEYS: the three keys of each limit's window. ARGV: now, window, then one limit per window.
# Returns, comma-joined: limit, remaining, reset per window.
_PEEK = (
    _PRELUDE
    + """
local now, span = clock(), tonumber(ARGV[2])
local out = {}
for i, k in ipairs(BASE) do
  local used = expire(k, now - span)
  for _, v in ipairs(window(k, tonumber(ARGV[2 + i]), used, now, span)) do out[#out + 1] = v end
end
return table.concat(out, ',')
"""
)

# KEYS: the three keys of each correction's window (one window may come twice). ARGV: now,
# window, then id, reserved, actual per correction.
_ADJUST = (
    _PRELUDE
    + """
local now, span = clock(), tonumber(ARGV[2])
for i, k in ipairs(BASE) do
  local id, reserved, actual = ARGV[3 * i], tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
  local used = expire(k, now - span)
  local held = redis.call('HGET', k .. ':a', id)
  if held then
    redis.call('HSET', k .. ':a', id, actual)
    redis.call('SET', k .. ':u', used + actual - tonumber(held), 'KEEPTTL')
    touch(k, now, span)
  elseif actual > reserved then
    -- a slice's charge may be corrected again after it left: its excesses add up, stamped now
    local more = tonumber(redis.call('HGET', k .. ':a', id .. '+') or '0')
    charge(k, id .. '+', now, more + actual - reserved, used - more, now, span)
  end
end
return 1
"""
)


# A slice of each window (gateway/state/slices.py): KEYS as `_RESERVE`'s. ARGV: now, window,
# id, max_age, then per window: need, extra, limit, the id of the slice it replaces ('' none) and
# what that one handed out. Each old slice is rewritten to its amount first; then, all or none,
# each window is charged the most in [need, need + extra] that fits, stamped now + max_age.
# Returns, comma-joined: granted, refused index, retry, then limit, remaining, reset, amount
# per window.
_SLICE = (
    _PRELUDE
    + """
local now, span, id, age = clock(), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local used, needs, extras, limits, refused = {}, {}, {}, {}, {}
for i, k in ipairs(BASE) do
  local j = 5 * i
  needs[i], extras[i], limits[i] = tonumber(ARGV[j]), tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  used[i] = expire(k, now - span)
  local old = ARGV[j + 3]
  local held = old ~= '' and redis.call('HGET', k .. ':a', old)
  if held then
    used[i] = used[i] + tonumber(ARGV[j + 4]) - tonumber(held)
    redis.call('HSET', k .. ':a', old, ARGV[j + 4])
    redis.call('SET', k .. ':u', used[i], 'KEEPTTL')
  end
  if used[i] + needs[i] > limits[i] then refused[#refused + 1] = i end
end
local out, amounts = {1, 0, ''}, {}
if #refused == 0 then
  for i, k in ipairs(BASE) do
    amounts[i] = math.min(needs[i] + extras[i], limits[i] - used[i])
    charge(k, id, now + age, amounts[i], used[i], now, span)
    used[i] = used[i] + amounts[i]
  end
else
  out = refusal(refused, needs, limits, used, now, span)
end
for i, k in ipairs(BASE) do
  for _, v in ipairs(window(k, limits[i], used[i], now, span)) do out[#out + 1] = v end
  out[#out + 1] = tostring(amounts[i] or 0)
end
return table.concat(out, ',')
"""
)


_SLOTS = (
    _CLOCK
    + """
local function live(k, now)
  redis.call('ZREMRANGEBYSCORE', k, '-inf', fmt(now))
  return redis.call('ZCARD', k)
end
local function touch(ttl)
  for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, math.ceil(ttl * 2000)) end
end
"""
)

# A replica's leases (`slots:{pool|url}:...`, one Redis Cluster slot per replica): KEYS[1],
# every lease (id -> expiry), against the cap; KEYS[2..], one per reserved class, its leases
# again, against the reservations. Keys are named by class, and the cap counts every lease
# whatever its class, so a reload that changes reservations (or two gateways mid-rollout with
# different ones) can never hide a lease from the cap.

# ARGV: now, ttl, id, the index of its class among KEYS[2..] (0: unreserved), cap, then the slots
# reserved per class. Returns {granted 1/0, the replica's leases}.
_LEASE = (
    _SLOTS
    + """
local now, ttl, id = clock(), tonumber(ARGV[2]), ARGV[3]
local mine, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
local total = live(KEYS[1], now)
local kept = 0  -- slots the other reserved classes keep and do not use
for i = 2, #KEYS do
  local used = live(KEYS[i], now)
  if i - 1 ~= mine then kept = kept + math.max(0, tonumber(ARGV[4 + i]) - used) end
end
if total + kept >= cap then return {0, total} end
redis.call('ZADD', KEYS[1], fmt(now + ttl), id)
if mine > 0 then redis.call('ZADD', KEYS[1 + mine], fmt(now + ttl), id) end
touch(ttl)
return {1, total + 1}
"""
)

# ARGV: now, ttl, then per lease: 'k' (held: extend it, writing it back if it expired) or 'x'
# (released: drop it, a release that was lost or raced this renewal), the index of its class
# among KEYS[2..] (0: none), its id. Returns the replica's leases.
_RENEW = (
    _SLOTS
    + """
local now, ttl = clock(), tonumber(ARGV[2])
for j = 3, #ARGV, 3 do
  local class, id = tonumber(ARGV[j + 1]), ARGV[j + 2]
  if ARGV[j] == 'k' then
    redis.call('ZADD', KEYS[1], fmt(now + ttl), id)
    if class > 0 then redis.call('ZADD', KEYS[1 + class], fmt(now + ttl), id) end
  else
    redis.call('ZREM', KEYS[1], id)
    if class > 0 then redis.call('ZREM', KEYS[1 + class], id) end
  end
end
local total = live(KEYS[1], now)
touch(ttl)
return total
"""
)

# KEYS: the pool's waiting counts (HASH gateway -> "n,n,n", one per tier) and their expiries
# (ZSET). ARGV: now, ttl, gateway, its counts. Returns the waiting per tier of every gateway that
# reported lately.
_WAITING = (
    _SLOTS
    + """
local now, ttl = clock(), tonumber(ARGV[2])
local w, t = KEYS[1], KEYS[2]
redis.call('HSET', w, ARGV[3], ARGV[4])
redis.call('ZADD', t, fmt(now + ttl), ARGV[3])
local gone = redis.call('ZRANGEBYSCORE', t, '-inf', fmt(now))
if #gone > 0 then
  redis.call('HDEL', w, unpack(gone))
  redis.call('ZREMRANGEBYSCORE', t, '-inf', fmt(now))
end
local totals = {}
for _, v in ipairs(redis.call('HVALS', w)) do
  local tier = 1
  for n in string.gmatch(v, '%d+') do
    totals[tier] = (totals[tier] or 0) + tonumber(n)
    tier = tier + 1
  end
end
touch(ttl)
return totals
"""
)


def _slot_keys(replica: PoolReplica, classes: Iterable[str]) -> list[str]:
    """Every lease of the replica, then the leases of each reserved class named: one hash tag
    per replica of a pool keeps them in one slot."""
    base = f"slots:{{{replica.pool}|{replica.url}}}"
    return [f"{base}:all", *(f"{base}:class:{c}" for c in classes)]


def _keys(windows: Iterable[TenantWindow]) -> list[str]:
    """Each window's ZSET, amounts and total: declared, as Redis Cluster wants every key a
    script touches; one hash tag per tenant keeps them in one slot."""
    return [
        f"quota:{{{tenant}}}:{window}:{part}"
        for tenant, window in windows
        for part in ("z", "a", "u")
    ]


def _holder_key(response_id: str) -> str:
    return f"holder:{response_id}"


def _holder(raw: bytes | str | None) -> Holder | None:
    """A record as stored; anything else (written by another version, or not by a gateway) is
    no record rather than an error."""
    if raw is None:
        return None
    try:
        tenant, pool, replica, turns, unheard = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    if not (isinstance(tenant, str) and isinstance(pool, str) and isinstance(replica, str)):
        return None
    if not isinstance(unheard, int) or isinstance(unheard, bool) or unheard < 0:
        return None
    if not isinstance(turns, list) or not all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) for turn in turns
    ):
        return None
    return Holder(tenant, pool, replica, tuple(turns), unheard)


def _fields(reply: bytes | str) -> list[str]:
    """A script's reply made one comma-joined string: redis-py parses a bulk string in one read,
    an array element by element (most of a call's CPU for a reply of nine fields)."""
    text = reply.decode() if isinstance(reply, bytes) else reply
    return text.split(",") if text else []


def _windows(values: Sequence[Any]) -> tuple[Window, ...]:
    return tuple(
        Window(limit=int(values[i]), remaining=int(values[i + 1]), reset_s=float(values[i + 2]))
        for i in range(0, len(values), 3)
    )


class RedisState:
    """Windows in Redis through a bounded connection pool; see the module docstring.

    Reservation ids are this gateway's random prefix plus a counter, so charges of several
    gateways in one window never collide.
    """

    # What a call raises when Redis fails (down, hung past `timeout_s`, a stale connection
    # twice), as opposed to a bug: the errors `FailoverState` answers with its failure policy.
    failures: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        clock: Callable[[], float] | None = None,
        max_connections: int = 64,
        lease_ttl_s: float = 10.0,
        holder_ttl_s: float = 86400.0,
    ) -> None:
        self.clock = clock  # tests only: None reads Redis' TIME
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self._holder_ttl_ms = max(1, round(holder_ttl_s * 1000))
        # A blocking pool: a burst over `max_connections` waits (within `timeout_s`) for a
        # connection rather than failing over, as redis-py's default pool would.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),  # a stale pooled connection; still within timeout_s
        )
        self.client: aioredis.Redis = aioredis.Redis.from_pool(pool)  # closes the pool with it
        self._reserve = self.client.register_script(_RESERVE)
        self._peek = self.client.register_script(_PEEK)
        self._adjust = self.client.register_script(_ADJUST)
        self._slice = self.client.register_script(_SLICE)
        self._lease = self.client.register_script(_LEASE)
        self._renew = self.client.register_script(_RENEW)
        self._waiting = self.client.register_script(_WAITING)
        self._prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)

    def _now(self) -> str:
        return "" if self.clock is None else repr(float(self.clock()))

    async def _bounded(self, call: Awaitable[T]) -> T:
        """One call, never longer than `timeout_s` however the socket behaves."""
        with Deadline(asyncio.get_running_loop().time() + self.timeout_s):
            return await call

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return await self._bounded(script(keys=keys, args=args))

    async def reserve(self, limits: Sequence[Limit]) -> Reservation | WindowFull:
        charge_id = f"{self._prefix}:{next(self._ids)}"
        args: list[Any] = [self._now(), WINDOW_S, charge_id]
        for limit in limits:
            args += [limit.amount, limit.limit]
        reply = await self._run(self._reserve, _keys(limit.key for limit in limits), args)
        out = _fields(reply)
        windows = _windows(out[3:])
        if int(out[0]) == 1:
            return Reservation(id=charge_id, windows=windows)
        retry = out[2]
        return WindowFull(
            index=int(out[1]) - 1, retry_after_s=float(retry) if retry else None, windows=windows
        )

    async def peek(self, limits: Sequence[Limit]) -> tuple[Window, ...]:
        args: list[Any] = [self._now(), WINDOW_S, *(limit.limit for limit in limits)]
        reply = await self._run(self._peek, _keys(limit.key for limit in limits), args)
        return _windows(_fields(reply))

    async def adjust(self, corrections: Sequence[Correction]) -> None:
        """One script per tenant (a script's keys share one Redis Cluster slot), several in one
        pipeline: the slices' flusher corrects every tenant's at once."""
        by_tenant: dict[str, list[Correction]] = {}
        for fix in corrections:
            by_tenant.setdefault(fix.key.tenant, []).append(fix)
        calls = [self._adjust_call(fixes) for fixes in by_tenant.values()]
        if len(calls) == 1:
            await self._run(self._adjust, *calls[0])
        elif calls:
            # Closed on the way out: a time-out during the scripts' check, which `execute`
            # makes before the part that gives its connection back, would keep that
            # connection from the pool for good, and a pool emptied so fails every call.
            async with self.client.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    await self._adjust(keys=keys, args=args, client=pipe)
                await self._bounded(pipe.execute())

    def _adjust_call(self, corrections: Sequence[Correction]) -> tuple[list[str], list[Any]]:
        args: list[Any] = [self._now(), WINDOW_S]
        for fix in corrections:
            args += [fix.charge_id, fix.reserved, fix.actual]
        return _keys(fix.key for fix in corrections), args

    def slice_id(self) -> str:
        return f"{self._prefix}:q{next(self._ids)}"

    async def grant(
        self, asks: Sequence[SliceAsk], slice_id: str, max_age_s: float
    ) -> SliceGrant | WindowFull:
        args: list[Any] = [self._now(), WINDOW_S, slice_id, max_age_s]
        for ask in asks:
            old_id, old_amount = ask.old if ask.old is not None else ("", 0)
            args += [ask.need, ask.extra, ask.limit, old_id, old_amount]
        out = _fields(await self._run(self._slice, _keys(ask.key for ask in asks), args))
        rows = [out[i : i + 4] for i in range(3, len(out), 4)]
        windows = _windows([v for row in rows for v in row[:3]])
        if int(out[0]) == 1:
            return SliceGrant(slice_id, tuple(int(row[3]) for row in rows), windows)
        retry = out[2]
        return WindowFull(
            index=int(out[1]) - 1, retry_after_s=float(retry) if retry else None, windows=windows
        )

    # --- replica slots as leases (the `SlotLedger` calls, undecorated: `FailoverState` adds
    # the failure policy) ------------------------------------------------------------------

    def lease_id(self) -> str:
        return f"{self._prefix}:s{next(self._ids)}"

    async def lease(self, claim: SlotClaim, lease_id: str) -> tuple[bool, int]:
        classes = [workload for workload, _ in claim.reserved]
        mine = classes.index(claim.workload) + 1 if claim.workload in classes else 0
        args: list[Any] = [self._now(), self.lease_ttl_s, lease_id, mine, claim.cap]
        args += [slots for _, slots in claim.reserved]
        granted, total = await self._run(self._lease, _slot_keys(claim.replica, classes), args)
        return bool(int(granted)), int(total)

    async def renew(
        self,
        replica: PoolReplica,
        held: Sequence[tuple[str, str]],
        released: Sequence[tuple[str, str]] = (),
    ) -> int:
        """`held` and `released` are (class, lease id); the class "" has no reservation."""
        classes = sorted({c for c, _ in (*held, *released) if c})
        index = {c: i + 1 for i, c in enumerate(classes)}
        args: list[Any] = [self._now(), self.lease_ttl_s]
        for op, leases in (("k", held), ("x", released)):
            for workload, lease_id in leases:
                args += [op, index.get(workload, 0), lease_id]
        return int(await self._run(self._renew, _slot_keys(replica, classes), args))

    async def unlease(self, replica: PoolReplica, leases: Sequence[tuple[str, str]]) -> None:
        await self.renew(replica, (), leases)

    async def share_waiting(self, pool: str, waiting: Sequence[int]) -> tuple[int, ...]:
        keys = [f"queue:{{{pool}}}:w", f"queue:{{{pool}}}:t"]
        args = [self._now(), self.lease_ttl_s, self._prefix, ",".join(map(str, waiting))]
        totals = [int(n) for n in await self._run(self._waiting, keys, args)]
        return tuple(totals + [0] * (len(waiting) - len(totals)))

    # --- stored responses' holders (the `HolderRecord` calls) -------------------------------

    async def record(self, response_id: str, holder: Holder) -> None:
        value = orjson.dumps(
            [holder.tenant, holder.pool, holder.replica, holder.turns, holder.unheard]
        )
        key = _holder_key(response_id)
        await self._bounded(self.client.set(key, value, px=self._holder_ttl_ms))

    async def holder(self, response_id: str) -> Holder | None:
        key = _holder_key(response_id)  # read, it lives on: a conversation in use is kept
        return _holder(await self._bounded(self.client.getex(key, px=self._holder_ttl_ms)))

    async def forget(self, response_id: str) -> None:
        await self._bounded(self.client.delete(_holder_key(response_id)))

    async def close(self) -> None:
        await self.client.aclose()
