-- Library (prepended to the scripts that record events): with_seq(p, seq) appends the key "seq" with
-- the integer value seq to the msgpack fixmap p (at most 14 entries), so a script numbers an event
-- atomically with the state change, with no msgpack library in Lua.
local function with_seq(p, seq)
  local n = string.byte(p, 1) - 128
  local s
  if seq < 128 then
    s = string.char(seq)
  elseif seq < 65536 then
    s = string.char(205, math.floor(seq / 256), seq % 256)
  else
    s = string.char(206, math.floor(seq / 16777216) % 256, math.floor(seq / 65536) % 256,
                    math.floor(seq / 256) % 256, seq % 256)
  end
  return string.char(128 + n + 1) .. string.sub(p, 2) .. '\163seq' .. s
end
