"""Client resume hints: `POST /hicache/prefetch` warms a conversation before its next turn arrives.

The HTTP process tokenizes the hint (chat messages through the model's chat template, or token ids)
and sends it to the scheduler over a local ZeroMQ socket; the scheduler thread takes hints between
its loop iterations (never from another thread: the tree is not thread-safe), starts the reads of
the spilled prefix (`SpillRadixCache.prefetch`), and answers at once with the number of tokens on
their way. The endpoint never waits for the reads themselves.

Socket: `ipc://<tmp>/sgl_hicache_hints_<port>`, bound by the scheduler of TP rank 0 (hints are
not supported with tensor parallelism > 1: every rank would have to take the same hint).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_MS = 2000


def hint_address(port: int) -> str:
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'sgl_hicache_hints_{port}')}"


class HintInbox:
    """Scheduler side: a ROUTER socket drained without blocking."""

    def __init__(self, port: int) -> None:
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(hint_address(port))

    def drain(self, handle: Any) -> int:
        """Answer every waiting hint with `handle(ids, extra_key, cache_salt) -> tokens`; never blocks."""
        served = 0
        while True:
            try:
                ident, empty, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return served
            reply: dict[str, int | str]
            try:
                hint = msgpack.unpackb(payload)
                reply = {
                    "prefetch_tokens": int(handle(hint["ids"], hint.get("extra_key"), hint.get("cache_salt")))
                }
            except (KeyError, TypeError, ValueError) as e:
                reply = {"error": f"bad hint: {e}"}
            self._socket.send_multipart([ident, empty, msgpack.packb(reply)])
            served += 1

    def close(self) -> None:
        self._socket.close()


def send_hint(port: int, ids: list[int], extra_key: str | None, cache_salt: str | None) -> dict[str, Any]:
    """HTTP side (blocking; run it off the event loop): one request, one reply or a timeout error."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(hint_address(port))
        socket.send(msgpack.packb({"ids": ids, "extra_key": extra_key, "cache_salt": cache_salt}))
        if not socket.poll(REPLY_TIMEOUT_MS):
            return {"error": "the scheduler did not answer the hint in time"}
        reply: dict[str, Any] = msgpack.unpackb(socket.recv())
        return reply
    finally:
        socket.close()
