"""The Lua scripts behind the shared rate limits and fair-share clock.

Redis runs a script alone, start to end, so each check-and-charge is atomic across every
gateway, in one round trip (EVALSHA). Time is Redis's own (TIME), never a gateway's: the
gateways' clocks need not agree. Numbers travel as strings (%.17g): Redis would truncate a
Lua number in a reply to an integer.

A bucket is a hash {level, updated}; a missing key is a full bucket, so each key expires once
it would have refilled, and idle tenants cost no memory. A bucket is clamped to the tenant's
current capacity (a reloaded key file with lower limits takes effect at once; higher limits
refill at the new rate) rather than restarted full as the embedded limiter does: with several
gateways reading key files at different moments, restarting would refill on every flip.
"""
from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function num(x) return string.format('%.17g', x) end
"""

# KEYS[1] the bucket; ARGV[1] its capacity per minute (> 0)
_REFILL = _NOW + """
local capacity = tonumber(ARGV[1])
local rate = capacity / 60
local state = redis.call('HMGET', KEYS[1], 'level', 'updated')
local level = tonumber(state[1]) or capacity
local updated = tonumber(state[2]) or now
level = math.min(capacity, level + math.max(0, now - updated) * rate)
local function store()
  redis.call('HSET', KEYS[1], 'level', num(level), 'updated', num(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - level) / rate * 1000) + 1000)
end
"""

# ARGV[2] the amount: "0" when taken, else the seconds until it could be ("inf": never)
TAKE = _REFILL + """
local amount = tonumber(ARGV[2])
local wait = '0'
if amount > capacity then
  wait = 'inf'
elseif amount > level then
  wait = num((amount - level) / rate)
else
  level = level - amount
end
store()
return wait
"""

# ARGV[2] tokens charged but not used
REFUND = _REFILL + """
level = math.min(capacity, level + tonumber(ARGV[2]))
store()
return 1
"""

# KEYS[1] a tenant's virtual clock (Redis seconds); ARGV[1] the seconds this request takes.
# The reply is its virtual start relative to now: each gateway adds its own monotonic now.
_CLOCK = _NOW + """
local function keep(clock)
  redis.call('SET', KEYS[1], num(clock), 'PX', math.ceil(math.max(0, clock - now) * 1000) + 60000)
end
"""

START = _CLOCK + """
local begin = math.max(now, tonumber(redis.call('GET', KEYS[1])) or 0)
keep(begin + tonumber(ARGV[1]))
return num(begin - now)
"""

# ARGV[1] seconds to add (negative: the request used fewer tokens than estimated); a clock
# already gone (expired: the tenant is idle) has nothing to correct
CORRECT = _CLOCK + """
local clock = tonumber(redis.call('GET', KEYS[1]))
if clock == nil then return 0 end
local delta = tonumber(ARGV[1])
clock = clock + delta
if delta < 0 then clock = math.max(now, clock) end
keep(clock)
return 1
"""
