"""msgpack on the wire, never pickle; also RQ's serializer for our jobs."""

from __future__ import annotations

import threading
from typing import Any

import msgpack

from .errors import DecodeError


def _default(obj: Any) -> Any:
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


# What msgpack carries as an integer (int64 to uint64), and how deeply a call's arguments may nest (later
# code recurses over them).
WIRE_INTS = range(-(2**63), 2**64)
MAX_DEPTH = 100


def nesting(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply ``value`` nests lists and mappings, counted up to ``limit + 1`` (without recursion); -1
    when a mapping has a key that is not text (JSON's keys are; a later JSON reader would fail on it)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list | tuple) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            if not all(type(k) is str for k in item):
                return -1
            item = item.values()
        for child in item:  # (a loop: no generator per item)
            if isinstance(child, dict | list | tuple):
                stack.append((child, depth + 1))
    return deepest


_packers = threading.local()
_KEEP_BELOW = 64 * 1024  # a packer whose buffer grew past this is let go, not kept for the thread


def pack(value: Any) -> bytes:
    """Encode with msgpack; unknown types are a TypeError, not a silent str()."""
    # A packer per thread, kept between calls (``msgpack.packb`` makes and allocates one each time). It is
    # taken out while in use, so a pack nested in a ``default=`` conversion gets a fresh one, and it is
    # dropped after a failure or a large value (its buffer only grows).
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = msgpack.Packer(use_bin_type=True, default=_default)
    else:
        _packers.packer = None
    out = packer.pack(value)
    if len(out) < _KEEP_BELOW:
        _packers.packer = packer
    return out


def extend_map(packed_map: bytes, key: str) -> bytes:
    """A packed map with room for one more entry and that entry's key, its value's bytes to follow: how
    bytes already packed (a call's arguments) go into a record without packing them again."""
    first = packed_map[0]
    if 0x80 <= first <= 0x8F:  # fixmap, map 16, map 32
        n, rest = first & 0x0F, packed_map[1:]
    elif first in (0xDE, 0xDF):
        width = 2 if first == 0xDE else 4
        n, rest = int.from_bytes(packed_map[1 : 1 + width], "big"), packed_map[1 + width :]
    else:
        raise ValueError("extend_map: not a packed map")
    n += 1
    head = bytes([0x80 | n]) if n <= 15 else b"\xde" + n.to_bytes(2, "big") if n <= 0xFFFF else b"\xdf" + n.to_bytes(4, "big")
    return head + rest + pack(key)


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """Decode msgpack; anything malformed is a DecodeError."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise DecodeError(f"payload is not valid msgpack: {e}") from e


def text(value: Any) -> str:
    """A Redis reply (bytes, str or None) as text."""
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode(errors="replace")
    return "" if value is None else str(value)


def raw(value: Any) -> bytes:
    """A Redis reply as bytes (redis-py types replies as ``bytes | str``)."""
    return value if isinstance(value, bytes) else str(value).encode()


class MsgpackSerializer:
    """RQ serializer (``dumps``/``loads``) so RQ stores our jobs as msgpack."""

    dumps = staticmethod(pack)
    loads = staticmethod(unpack)
