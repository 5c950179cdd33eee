"""Client resume hints: `POST /hicache/prefetch` warms a conversation before its next turn arrives.

The HTTP process checks and tokenizes the hint (chat messages through the model's chat template, or
token ids) and sends it to the scheduler over a local ZeroMQ socket; the scheduler thread of TP rank 0 takes
hints between its loop iterations (never from another thread: the tree is not thread-safe), answers
"accepted" at once, and hands them to sglang's request broadcast; every rank then starts the reads
of the spilled prefix (`SpillRadixCache.prefetch`) in that iteration (hooks.py, 3). The endpoint
never waits for the reads themselves; a hint that fails after its answer is counted and logged by
the hook (`hook_errors`), and a hint sglang drops with its broadcast (a receive skipped by its
disaggregation gate) is simply lost, as a hint may be.

The answer is only "accepted". It used to carry the number of tokens whose reads the hint started:
that number tells any client whether a conversation with a given prefix is spilled, i.e. what
another tenant talked about (with the same salt, or none), so it is no longer given.

Hostile input: every hint is checked twice, in the HTTP process (`http_routes.py`: HTTP 400 before
anything reaches the scheduler) and again on the scheduler thread (`check_hint`), whose loop must
never see an exception of ours: `HintInbox.drain` answers each hint, whatever goes wrong with it,
with an error reply. The scheduler takes at most `DRAIN_PER_ITERATION` hints per loop iteration
(the rest wait), the ROUTER socket has a receive high-water mark and refuses messages larger than
a hint can be, and the HTTP process keeps a bounded number of hints in flight.

Socket: `ipc://$SGL_HICACHE_RUNTIME_DIR/hints.sock`. The launcher (`sgl_hicache.launch_server`) makes
that directory (mode 0700, our uid) before sglang starts and removes it at exit; every process of
the server inherits the variable. Both ends refuse a directory that is not ours or that group or
others can enter: a predictable path in the shared temp directory (as before) let whoever bound it
first receive every hint, i.e. conversation content. Without the variable (a plain
`python -m sglang.launch_server`), hints are off. Bound by the scheduler of TP rank 0, the rank that
receives requests; with tensor parallelism the checked hints reach the other ranks inside sglang's
own request broadcast, so every rank prefetches the same hint in the same iteration (hooks.py, 3).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgpack
import zmq

logger = logging.getLogger(__name__)

RUNTIME_DIR_ENV = "SGL_HICACHE_RUNTIME_DIR"
OWNER_ENV = "SGL_HICACHE_RUNTIME_DIR_OWNER"  # pid of the process that made the directory
SOCKET_NAME = "hints.sock"
REPLY_TIMEOUT_MS = 2000
DRAIN_PER_ITERATION = 16  # hints the scheduler answers per loop iteration; the rest wait
RECEIVE_HWM = 64  # messages queued per peer at the ROUTER before ZeroMQ stops taking more
MAX_KEY_CHARS = 256  # cache_salt, extra_key
_MAX_SUN_PATH = 100  # a unix socket path is at most 107 bytes on Linux; keep a margin


class HintError(ValueError):
    """A hint that breaks the rules (HTTP 400); the message is one line."""


class HintSocketError(RuntimeError):
    """The hint socket cannot be used safely: its directory is not private, or the bind failed."""


class HintLimits(NamedTuple):
    vocab_size: int  # ids are in [0, vocab_size)
    max_tokens: int  # the model's context length


class Hint(NamedTuple):
    ids: list[int]
    extra_key: str | None
    cache_salt: str | None


def check_hint(ids: Any, extra_key: Any, cache_salt: Any, limits: HintLimits) -> Hint:
    """The hint, if every field is well-formed; HintError otherwise."""
    if not isinstance(ids, list) or not 1 <= len(ids) <= limits.max_tokens:
        raise HintError(f"token ids must be a list of 1 to {limits.max_tokens} integers")
    if not all(type(t) is int and 0 <= t < limits.vocab_size for t in ids):  # not bool, not a float
        raise HintError(f"token ids must be integers in [0, {limits.vocab_size})")
    return Hint(ids, _check_key("extra_key", extra_key), _check_key("cache_salt", cache_salt))


def _check_key(name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= MAX_KEY_CHARS):
        return value
    raise HintError(f"'{name}' must be a string of at most {MAX_KEY_CHARS} characters, or absent")


def unpack_hint(payload: bytes, limits: HintLimits) -> Hint:
    """The scheduler's own check of a message from the socket; HintError or msgpack's errors."""
    data = msgpack.unpackb(payload, max_array_len=limits.max_tokens, max_map_len=3,
                           max_str_len=4 * MAX_KEY_CHARS, max_bin_len=0, max_ext_len=0)  # fmt: skip
    if not isinstance(data, dict):
        raise HintError("a hint is a map")
    return check_hint(data.get("ids"), data.get("extra_key"), data.get("cache_salt"), limits)


def max_message_bytes(limits: HintLimits) -> int:
    return 9 * limits.max_tokens + 4 * MAX_KEY_CHARS * 2 + 256  # msgpack: at most 9 bytes per int


# ---- the private runtime directory ----------------------------------------------------------


@contextlib.contextmanager
def private_runtime_dir() -> Iterator[str]:
    """The launcher's, around the whole server: `$SGL_HICACHE_RUNTIME_DIR` if already set (checked,
    left in place), else a new private directory (mkdtemp: mode 0700, our uid) exported in that
    variable for every process sglang starts, and removed with its socket on exit (also when sglang
    ends this process itself: `remove_runtime_dir`, via `hooks.py`).
    Raises HintSocketError for a given directory that is not private."""
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        check_private_dir(given)
        yield given
        return
    path = tempfile.mkdtemp(prefix="sgl_hicache_")
    os.environ[RUNTIME_DIR_ENV], os.environ[OWNER_ENV] = path, str(os.getpid())
    try:
        yield path
    finally:
        remove_runtime_dir()
        os.environ.pop(RUNTIME_DIR_ENV, None)


def remove_runtime_dir() -> None:
    """Remove the runtime directory and its socket if this process made it; nothing otherwise."""
    path = os.environ.get(RUNTIME_DIR_ENV)
    if path and os.environ.get(OWNER_ENV) == str(os.getpid()):
        shutil.rmtree(path, ignore_errors=True)  # a socket file at most; gone already is fine


def check_private_dir(path: str) -> None:
    """HintSocketError unless `path` is a directory (not a link) of ours that only we can enter."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise HintSocketError(f"runtime directory {path}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise HintSocketError(f"runtime directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise HintSocketError(
            f"runtime directory {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})"
        )
    if st.st_mode & 0o077:
        raise HintSocketError(
            f"runtime directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; group and others must have no access"
        )


def socket_path(runtime_dir: str) -> str:
    path = os.path.join(runtime_dir, SOCKET_NAME)
    if len(os.fsencode(path)) > _MAX_SUN_PATH:
        raise HintSocketError(f"hint socket path {path} is too long for a unix socket: use a shorter TMPDIR")
    return path


# ---- the two ends ---------------------------------------------------------------------------


class HintInbox:
    """Scheduler side: a ROUTER socket in the private runtime directory, drained without blocking.

    Raises HintSocketError if the directory is not private or the socket cannot be bound."""

    def __init__(self, runtime_dir: str, limits: HintLimits) -> None:
        check_private_dir(runtime_dir)
        self.limits = limits
        self.path = socket_path(runtime_dir)
        self.failures = 0  # hints whose handling raised (answered with an error)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes(limits))
        try:
            self._socket.bind(f"ipc://{self.path}")
        except zmq.ZMQError as e:
            self._socket.close()
            raise HintSocketError(f"cannot bind the resume-hint socket {self.path}: {e}") from e

    def drain(self, handle: Callable[[list[int], str | None, str | None], object]) -> int:
        """Answer up to `DRAIN_PER_ITERATION` waiting hints with `handle(ids, extra_key, cache_salt)`
        after checking each; returns how many were taken. Never blocks; raises nothing for a hint:
        whatever goes wrong with one is its error reply."""
        taken = 0
        while taken < DRAIN_PER_ITERATION:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            taken += 1
            if len(frames) == 3:  # [peer, empty, payload] from a REQ socket; nothing else is answerable
                self._reply(frames[0], self._answer(frames[2], handle))
        return taken

    def _answer(self, payload: bytes, handle: Callable[..., object]) -> dict[str, Any]:
        try:
            hint = unpack_hint(payload, self.limits)
        except Exception as e:  # a malformed message of any kind is a bad hint
            return {"error": f"bad hint: {e}", "status": 400}
        try:
            handle(*hint)
        except Exception as e:
            self.failures += 1
            if self.failures == 1:
                logger.exception("sgl_hicache: a resume hint failed (logged once; answered with an error)")
            return {"error": f"the hint failed on the scheduler ({type(e).__name__})", "status": 500}
        return {"accepted": True}

    def _reply(self, peer: bytes, reply: dict[str, Any]) -> None:
        # A ROUTER drops a reply to a peer that is gone or full; it does not block or raise for that.
        self._socket.send_multipart([peer, b"", msgpack.packb(reply)], zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket and remove its file (the launcher removes the directory). Idempotent."""
        self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def send_hint(runtime_dir: str, hint: Hint) -> dict[str, Any]:
    """HTTP side (blocking; run it off the event loop): one request, then the scheduler's reply or an
    error dict (`{"error": ..., "status": code}`)."""
    try:
        check_private_dir(runtime_dir)
        address = f"ipc://{socket_path(runtime_dir)}"
    except HintSocketError as e:
        return {"error": str(e), "status": 503}
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(address)
        socket.send(msgpack.packb(hint._asdict()))
        if not socket.poll(REPLY_TIMEOUT_MS):
            return {"error": "the scheduler did not answer the hint in time", "status": 503}
        reply: dict[str, Any] = msgpack.unpackb(socket.recv())
        return reply
    finally:
        socket.close()
