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


_packers = threading.local()


def pack(value: Any) -> bytes:
    """Encode with msgpack; unknown types are a TypeError, not a silent str()."""
    # One packer per thread, kept: ``msgpack.packb`` makes (and allocates a buffer for) a new one each time.
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, default=_default)
    try:
        return packer.pack(value)
    except BaseException:
        _packers.packer = None  # a failed pack may leave a partial buffer behind: start afresh
        raise


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

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return pack(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return unpack(data)
