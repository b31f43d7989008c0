"""The wire format between a sandboxed program and the trusted side that judges it.

A verdict must never be something the program can state about itself. So the program only ever
sends *values*, as plain data, and the trusted side (the reward worker, or the trusted test runner)
compares them with expected values the program never sees. A value crosses as tagged JSON built with
exact type checks: ``int``, ``float``, ``str``, ``bool``, ``None``, ``bytes``, and lists, tuples,
sets and dicts of those. A subclass (an ``int`` whose ``__eq__`` always returns True), an object, a
generator or anything else is refused, so nothing the program defines can take part in a comparison.

Messages are one JSON object per line, at most ``MAX_MESSAGE_BYTES``, read under a deadline.

This module is standard library only, and must stay so: its source is sent, together with
``_harness.py``, into the sandbox, which has no access to roll's packages.
"""

import base64
import json
import math
import os
import select
import time

MAX_MESSAGE_BYTES = 1 << 20
MAX_DEPTH = 64


class ProtocolError(ValueError):
    """A message or value that is not plain data, too large, too deep or malformed."""


def encode_value(value, depth=0):
    """A plain-data value as JSON-ready data (tagged for tuple, set, dict, bytes and non-finite floats)."""
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return [encode_value(v, depth + 1) for v in value]
    if kind is tuple:
        return {"$tuple": [encode_value(v, depth + 1) for v in value]}
    if kind is set or kind is frozenset:
        return {"$" + kind.__name__: [encode_value(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise ProtocolError(f"a {kind.__name__} is not plain data")


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def decode_value(data, depth=0):
    """The inverse of :func:`encode_value`; anything else raises :class:`ProtocolError`."""
    if depth > MAX_DEPTH:
        raise ProtocolError("value nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, str, int, float):
        return data
    if kind is list:
        return [decode_value(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise ProtocolError("malformed value")
    (tag, body), = data.items()
    try:
        if tag == "$float" and body in _FLOATS:
            return _FLOATS[body]
        if tag == "$bytes" and type(body) is str:
            return base64.b64decode(body.encode("ascii"), validate=True)
        if type(body) is not list:
            raise ProtocolError("malformed value")
        items = [decode_value(v, depth + 1) for v in body]
        if tag == "$tuple":
            return tuple(items)
        if tag == "$set":
            return set(items)
        if tag == "$frozenset":
            return frozenset(items)
        if tag == "$dict" and all(type(p) is list and len(p) == 2 for p in items):
            return {k: v for k, v in items}
    except (TypeError, ValueError) as e:  # unhashable set members or keys, bad base64
        raise ProtocolError(f"malformed value: {e}") from None
    raise ProtocolError(f"unknown value tag {tag!r}")


class Channel:
    """Line-delimited JSON messages over a pair of pipe descriptors, bounded in size and in time."""

    def __init__(self, read_fd, write_fd):
        self.read_fd, self.write_fd = read_fd, write_fd
        self._buffer = b""

    def send(self, message, deadline=None):
        data = json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
        view = memoryview(data)
        while view:
            _wait(self.write_fd, deadline, write=True)
            view = view[os.write(self.write_fd, view):]

    def recv(self, deadline=None):
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"message over the limit of {MAX_MESSAGE_BYTES} bytes")
            _wait(self.read_fd, deadline)
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise EOFError("the other side closed the channel")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"not a JSON message: {e}") from None
        if type(message) is not dict:
            raise ProtocolError("a message must be a JSON object")
        return message


def _wait(fd, deadline, write=False):
    if deadline is None:
        return
    left = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(left, 0))[1] if write else select.select([fd], [], [], max(left, 0))[0]
    if not ready:
        raise TimeoutError("no answer before the deadline")
