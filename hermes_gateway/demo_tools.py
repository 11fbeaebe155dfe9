"""Tools the demo registers (run by the python executor in the worker processes)."""

from __future__ import annotations

import time
import zlib
from typing import Any

CITIES = ("北京", "上海", "广州", "深圳", "杭州", "成都", "Berlin", "Paris", "Lisbon", "Nairobi")


def weather(city: str, unit: str = "celsius", ctx: Any = None) -> dict[str, Any]:
    """A made-up but deterministic weather report, with progress messages and a little latency."""
    if ctx is not None:
        ctx.progress(f"querying weather service for {city}")
    time.sleep(0.02)
    if city not in CITIES:
        raise LookupError(f"no weather station for {city!r}")
    temp = zlib.crc32(city.encode()) % 35
    if unit == "fahrenheit":
        temp = round(temp * 9 / 5 + 32)
    if ctx is not None:
        ctx.progress("1 station found, formatting")
    return {"city": city, "temperature": temp, "unit": unit}
