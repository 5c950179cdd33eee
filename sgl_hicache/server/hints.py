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

The same path carries the retention hints (`POST /hicache/pin`, `/hicache/drop`, `/hicache/purge`,
cache/retention.py): a `kind` and, for a pin, `ttl_s`. The scheduler of TP rank 0 may refuse one
(a pin over the pin budget) with a one-line reason, answered 409; every other answer is "accepted".

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

from sgl_hicache.cache.hint_source import HintRefused

logger = logging.getLogger(__name__)

RUNTIME_DIR_ENV = "SGL_HICACHE_RUNTIME_DIR"
OWNER_ENV = "SGL_HICACHE_RUNTIME_DIR_OWNER"  # pid of the process that made the directory
SOCKET_NAME = "hints.sock"
REPLY_TIMEOUT_MS = 2000
DRAIN_PER_ITERATION = 16  # hints the scheduler answers per loop iteration; the rest wait
RECEIVE_HWM = 64  # messages queued per peer at the ROUTER before ZeroMQ stops taking more
MAX_KEY_CHARS = 256  # cache_salt, extra_key
KINDS = ("prefetch", "pin", "drop", "purge")
MAX_TTL_S = 7 * 24 * 3600.0  # a pin's longest time to live (cache/pins.py)
_MAX_SUN_PATH = 100  # a unix socket path is at most 107 bytes on Linux; keep a margin
_TEMP_NAME = "/tmpXXXXXXXX"  # what `tempfile` adds to its directory: sglang's IPC socket names


class HintError(ValueError):
    """A hint that breaks the rules (HTTP 400); the message is one line."""


class HintSocketError(RuntimeError):
    """The hint socket cannot be used safely: its directory is not private, or the bind failed."""


class HintLimits(NamedTuple):
    vocab_size: int  # ids are in [0, vocab_size)
    max_tokens: int  # the model's context length


class Hint(NamedTuple):
    ids: list[int]  # empty for a purge
    extra_key: str | None
    cache_salt: str | None
    kind: str = "prefetch"  # one of KINDS
    ttl_s: float | None = None  # a pin's only


def check_hint(ids: Any, extra_key: Any, cache_salt: Any, limits: HintLimits, kind: Any = "prefetch",
               ttl_s: Any = None) -> Hint:  # fmt: skip
    """The hint, if every field is well-formed for its kind; HintError otherwise."""
    if kind not in KINDS:
        raise HintError(f"unknown hint kind (one of {', '.join(KINDS)})")
    extra_key, cache_salt = _check_key("extra_key", extra_key), _check_key("cache_salt", cache_salt)
    if kind == "purge":
        if ids is not None or extra_key is not None or ttl_s is not None:
            raise HintError("a purge takes only 'cache_salt' (everything of that salt goes)")
        if not cache_salt:
            raise HintError("a purge needs a non-empty 'cache_salt'")
        return Hint([], None, cache_salt, kind)
    if not isinstance(ids, list) or not 1 <= len(ids) <= limits.max_tokens:
        raise HintError(f"token ids must be a list of 1 to {limits.max_tokens} integers")
    if not all(type(t) is int and 0 <= t < limits.vocab_size for t in ids):  # not bool, not a float
        raise HintError(f"token ids must be integers in [0, {limits.vocab_size})")
    return Hint(ids, extra_key, cache_salt, kind, _check_ttl(kind, ttl_s))


def _check_ttl(kind: str, ttl_s: Any) -> float | None:
    if kind != "pin":
        if ttl_s is not None:
            raise HintError("only a pin takes 'ttl_s'")
        return None
    if type(ttl_s) not in (int, float) or not 0 < ttl_s <= MAX_TTL_S:  # NaN fails too; not bool
        raise HintError(f"a pin needs 'ttl_s': seconds, a number in (0, {MAX_TTL_S:.0f}]")
    return float(ttl_s)


def _check_key(name: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and len(value) <= MAX_KEY_CHARS):
        return value
    raise HintError(f"'{name}' must be a string of at most {MAX_KEY_CHARS} characters, or absent")


def unpack_hint(payload: bytes, limits: HintLimits) -> Hint:
    """The scheduler's own check of a message from the socket; HintError or msgpack's errors."""
    data = msgpack.unpackb(payload, max_array_len=limits.max_tokens, max_map_len=5,
                           max_str_len=4 * MAX_KEY_CHARS, max_bin_len=0, max_ext_len=0)  # fmt: skip
    if not isinstance(data, dict) or not set(data) <= set(Hint._fields):
        raise HintError("a hint is a map of Hint's fields")
    get = data.get
    return check_hint(
        get("ids"), get("extra_key"), get("cache_salt"), limits, get("kind", "prefetch"), get("ttl_s")
    )


def max_message_bytes(limits: HintLimits) -> int:
    return 9 * limits.max_tokens + 4 * MAX_KEY_CHARS * 2 + 256  # msgpack: at most 9 bytes per int


def pack_hint(hint: Hint) -> bytes:
    """A hint as it travels to the scheduler (a prefetch as before retention hints existed)."""
    fields = hint._asdict()
    if hint.kind == "prefetch":
        del fields["kind"], fields["ttl_s"]
    elif hint.ttl_s is None:
        del fields["ttl_s"]
    if hint.kind == "purge":
        del fields["ids"], fields["extra_key"]
    return msgpack.packb(fields)


# ---- the private runtime directory ----------------------------------------------------------


@contextlib.contextmanager
def private_runtime_dir() -> Iterator[str]:
    """The launcher's, around the whole server: `$SGL_HICACHE_RUNTIME_DIR` if already set (checked,
    left in place), else a new private directory (mkdtemp: mode 0700, our uid) exported in that
    variable for every process sglang starts, and removed with its socket on exit (also when sglang
    ends this process itself: `remove_runtime_dir`, via `hooks.py`).
    A directory it made is also this process's `tempfile.tempdir` meanwhile: sglang names its IPC
    sockets with `NamedTemporaryFile(delete=False)` and makes its Prometheus multiprocess directory
    here (`--enable-metrics`), never removing either (it ends by SIGKILL to itself), so every start
    left six or so `tmp*` entries in the temp directory; now they go with this directory. Only this
    process: sglang's children keep `TMPDIR` (their caches there, e.g. torch inductor's, persist).
    Not when the names would then be too long for a socket path (a deep TMPDIR): they stay there.
    Raises HintSocketError for a given directory that is not private."""
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        check_private_dir(given)
        yield given
        return
    path = tempfile.mkdtemp(prefix="sgl_hicache_")
    os.environ[RUNTIME_DIR_ENV], os.environ[OWNER_ENV] = path, str(os.getpid())
    previous = tempfile.tempdir
    if len(path) + len(_TEMP_NAME) <= _MAX_SUN_PATH:  # else sglang's socket names would not bind
        tempfile.tempdir = path
    try:
        yield path
    finally:
        tempfile.tempdir = previous
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

    def drain(self, handle: Callable[..., object]) -> int:
        """Answer up to `DRAIN_PER_ITERATION` waiting hints with `handle(ids, extra_key, cache_salt,
        kind, ttl_s)` after checking each (a `HintRefused` it returns is answered 409 with its reason);
        returns how many were taken. Never blocks; raises nothing for a hint: whatever goes wrong
        with one is its error reply."""
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
            answer = handle(*hint)
        except Exception as e:
            self.failures += 1
            if self.failures == 1:
                logger.exception("sgl_hicache: a resume hint failed (logged once; answered with an error)")
            return {"error": f"the hint failed on the scheduler ({type(e).__name__})", "status": 500}
        if isinstance(answer, HintRefused):
            return {"error": answer.reason, "status": 409}
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
        socket.send(pack_hint(hint))
        if not socket.poll(REPLY_TIMEOUT_MS):
            return {"error": "the scheduler did not answer the hint in time", "status": 503}
        reply: dict[str, Any] = msgpack.unpackb(socket.recv())
        return reply
    finally:
        socket.close()
