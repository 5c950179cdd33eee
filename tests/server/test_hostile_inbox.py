"""The hint path's defences without a server (issue 12): checks on both sides, the inbox that never
raises for a hint and takes a bounded number per call, the private runtime directory, contained
hooks, and the opt-in integrity verdict."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from sgl_hicache.cache.reporting import INTEGRITY_ENV, integrity_verdict
from sgl_hicache.server import hooks
from sgl_hicache.server.hints import (
    DRAIN_PER_ITERATION,
    OWNER_ENV,
    RUNTIME_DIR_ENV,
    Hint,
    HintError,
    HintInbox,
    HintLimits,
    HintSocketError,
    check_hint,
    check_private_dir,
    private_runtime_dir,
    remove_runtime_dir,
    send_hint,
    unpack_hint,
)
from sgl_hicache.server.http_routes import BodyTooLarge, parse_hint, read_body

LIMITS = HintLimits(vocab_size=100, max_tokens=50)


@pytest.fixture
def private(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def inbox(private: Path) -> Iterator[HintInbox]:
    box = HintInbox(str(private), LIMITS)
    yield box
    box.close()


def ask(inbox: HintInbox, runtime_dir: Path, payload: Any, handle: Any) -> dict[str, Any]:
    """Send one message (a Hint through `send_hint`, or raw bytes) while draining the inbox."""
    replies: list[dict[str, Any]] = []

    def client() -> None:
        if isinstance(payload, Hint):
            replies.append(send_hint(str(runtime_dir), payload))
            return
        with zmq.Context.instance().socket(zmq.REQ) as s:
            s.connect(f"ipc://{runtime_dir}/hints.sock")
            s.send(payload)
            assert s.poll(5000)
            replies.append(msgpack.unpackb(s.recv()))

    t = threading.Thread(target=client)
    t.start()
    while t.is_alive():
        inbox.drain(handle)
        time.sleep(0.005)
    t.join()
    return replies[0]


@pytest.mark.parametrize(
    "ids, extra_key, cache_salt",
    [
        ([2**63], None, None), ([-1], None, None), ([100], None, None), ([True], None, None),
        ([1.0], None, None), ([], None, None), ([1] * 51, None, None), ("12", None, None),
        (None, None, None), ([1], 7, None), ([1], None, "s" * 257), ([1], None, ["a"]),
    ],
)  # fmt: skip
def test_bad_hints_are_refused(ids: Any, extra_key: Any, cache_salt: Any) -> None:
    with pytest.raises(HintError):
        check_hint(ids, extra_key, cache_salt, LIMITS)


def test_a_good_hint_passes() -> None:
    assert check_hint([0, 99] * 25, "k", "s" * 256, LIMITS) == Hint([0, 99] * 25, "k", "s" * 256)


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb({"ids": [2**63]}), msgpack.packb({"ids": [1] * 51}),
     msgpack.packb({"ids": [1], "a": 1, "b": 2, "c": 3}), msgpack.packb({"ids": b"\x01"})],
)  # fmt: skip
def test_the_scheduler_checks_again(payload: bytes) -> None:
    with pytest.raises(Exception):  # noqa: B017 (msgpack raises several kinds; all are answered)
        unpack_hint(payload, LIMITS)


def test_a_hint_round_trip_says_only_accepted(inbox: HintInbox, private: Path) -> None:
    seen = []
    reply = ask(inbox, private, Hint([1, 2, 3], "k", "s"), lambda *a: seen.append(a) or 123)
    assert reply == {"accepted": True} and seen == [([1, 2, 3], "k", "s", "prefetch", None)]


def test_a_bad_message_gets_an_error_reply(inbox: HintInbox, private: Path) -> None:
    def handle(*a: Any) -> None:
        raise AssertionError("never called for a bad hint")

    reply = ask(inbox, private, msgpack.packb({"ids": [2**63]}), handle)
    assert reply["status"] == 400 and "bad hint" in reply["error"]


def test_a_failing_handler_is_answered_counted_and_logged_once(
    inbox: HintInbox, private: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def handle(*a: Any) -> None:
        raise OverflowError("int too big to convert")

    with caplog.at_level(logging.ERROR, logger="sgl_hicache.server.hints"):
        replies = [ask(inbox, private, Hint([1], None, None), handle) for _ in range(2)]
    assert all(r["status"] == 500 and "OverflowError" in r["error"] for r in replies)
    assert inbox.failures == 2 and len(caplog.records) == 1


def test_drain_takes_a_bounded_number_per_call(inbox: HintInbox, private: Path) -> None:
    n = DRAIN_PER_ITERATION + 4
    sockets = [zmq.Context.instance().socket(zmq.REQ) for _ in range(n)]
    try:
        for s in sockets:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{private}/hints.sock")
            s.send(msgpack.packb({"ids": [1]}))
        time.sleep(0.5)  # all of them reach the ROUTER
        assert inbox.drain(lambda *a: 0) == DRAIN_PER_ITERATION
        assert inbox.drain(lambda *a: 0) == 4
        assert all(s.poll(2000) and msgpack.unpackb(s.recv()) == {"accepted": True} for s in sockets)
    finally:
        for s in sockets:
            s.close()


def test_close_removes_the_socket_file(private: Path) -> None:
    box = HintInbox(str(private), LIMITS)
    assert (private / "hints.sock").exists()
    box.close()
    assert not (private / "hints.sock").exists()


def test_a_directory_others_can_enter_or_not_ours_is_refused(tmp_path: Path, private: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)
    link = tmp_path / "link"
    link.symlink_to(private)
    (tmp_path / "file").write_text("")
    for path in (shared, link, tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(HintSocketError):
            check_private_dir(str(path))
        with pytest.raises(HintSocketError):
            HintInbox(str(path), LIMITS)
    assert send_hint(str(shared), Hint([1], None, None))["status"] == 503
    if os.getuid() == 0:
        os.chown(private, 12345, -1)
        with pytest.raises(HintSocketError, match="belongs to uid 12345"):
            check_private_dir(str(private))


def test_a_socket_path_too_long_is_an_error_not_a_log_line(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    deep.mkdir(mode=0o700)
    with pytest.raises(HintSocketError, match="too long"):
        HintInbox(str(deep), LIMITS)


def test_the_launcher_makes_a_private_directory_and_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    with private_runtime_dir() as path:
        st = os.lstat(path)
        assert os.environ[RUNTIME_DIR_ENV] == path and st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o700
        Path(path, "hints.sock").write_text("")
    assert not os.path.exists(path) and RUNTIME_DIR_ENV not in os.environ


def test_temp_files_the_launcher_makes_meanwhile_go_with_its_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What sglang makes in the launcher's process and never removes (IPC socket names by
    `NamedTemporaryFile(delete=False)`, the Prometheus directory) leaves nothing in the temp directory."""
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with private_runtime_dir() as path, tempfile.NamedTemporaryFile(delete=False) as ipc:
        metrics = tempfile.mkdtemp()
        assert os.path.dirname(ipc.name) == os.path.dirname(metrics) == path
    assert list(tmp_path.iterdir()) == [] and tempfile.gettempdir() == str(tmp_path)


def test_sglangs_socket_names_stay_in_the_temp_directory_when_the_runtime_one_is_too_deep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """sglang's IPC socket names (`NamedTemporaryFile` there: `<dir>/tmpXXXXXXXX`) must fit a unix
    socket path: a temp directory deep enough that they fit in it but not in the runtime directory
    made inside it keeps them where they were (a server that started before still starts)."""
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    monkeypatch.delenv(OWNER_ENV, raising=False)
    deep = tmp_path / ("d" * max(1, 80 - len(str(tmp_path)) - 1))
    deep.mkdir()
    assert len(str(deep)) + len("/tmpXXXXXXXX") <= 100
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_runtime_dir() as path, tempfile.NamedTemporaryFile() as ipc:
        assert len(path) + len("/tmpXXXXXXXX") > 100
        assert os.path.dirname(ipc.name) == str(deep) and len(ipc.name) <= 100


def test_a_given_directory_is_not_the_temp_directory(monkeypatch: pytest.MonkeyPatch, private: Path) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(private))
    with private_runtime_dir():
        assert tempfile.gettempdir() != str(private)
    assert private.exists()


def test_only_the_process_that_made_it_removes_it(monkeypatch: pytest.MonkeyPatch, private: Path) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(private))
    monkeypatch.setenv(OWNER_ENV, str(os.getpid() + 1))
    remove_runtime_dir()
    assert private.exists()
    monkeypatch.setenv(OWNER_ENV, str(os.getpid()))
    hooks.remove_runtime_dir_first(os.getpid(), False)
    assert private.exists()
    hooks.remove_runtime_dir_first(os.getpid())
    assert not private.exists()


def test_a_given_directory_that_is_not_private_stops_the_launcher(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    tmp_path.chmod(0o755)
    with pytest.raises(HintSocketError), private_runtime_dir():
        pass


def test_a_hook_never_raises_counts_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    @hooks.contained
    def broken_hook(result: Any, *args: Any) -> Any:
        raise RuntimeError("boom")

    before = hooks.HOOK_ERRORS["broken_hook"]
    with caplog.at_level(logging.ERROR, logger="sgl_hicache.server.hooks"):
        assert broken_hook("result", 1) is None and broken_hook(parent_pid=1) is None
    assert hooks.HOOK_ERRORS["broken_hook"] == before + 2 and len(caplog.records) == 1


class FakeTokenizer:
    def __init__(self, out: Any = None, error: Exception | None = None) -> None:
        self.out, self.error = out, error

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        if self.error:
            raise self.error
        return self.out


HI = b'{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    "data, tokenizer",
    [
        (b"[" * 100_000, None), (b"9" * 5000, None), (b"\xff", None), (b"[]", None), (b"{}", None),
        (b'{"messages": []}', FakeTokenizer([1])), (b'{"messages": [1]}', FakeTokenizer([1])),
        (b'{"messages": [{}]}', FakeTokenizer([1])), (HI, None), (HI, FakeTokenizer(error=TypeError("x"))),
        (HI, FakeTokenizer([200])), (HI, FakeTokenizer({"no": 1})), (HI, FakeTokenizer("text")),
    ],
)  # fmt: skip
def test_bad_bodies_are_one_line_400s(data: bytes, tokenizer: Any) -> None:
    with pytest.raises(HintError) as e:
        parse_hint(data, tokenizer, LIMITS)
    assert "\n" not in str(e.value)


def test_messages_go_through_the_chat_template() -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t"}'
    assert parse_hint(body, FakeTokenizer({"input_ids": [4, 5]}), LIMITS) == Hint([4, 5], None, "t")


class FakeRequest:
    def __init__(self, chunks: list[bytes], declared: int | None) -> None:
        self.chunks = chunks
        self.headers = {} if declared is None else {"content-length": str(declared)}

    async def stream(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


@pytest.mark.parametrize("chunks, declared", [([b"x"], 11), ([b"x" * 6, b"x" * 6], None)])
def test_a_body_over_the_limit_is_refused(chunks: list[bytes], declared: int | None) -> None:
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(FakeRequest(chunks, declared), 10))  # type: ignore[arg-type]
    assert asyncio.run(read_body(FakeRequest([b"x" * 10], 10), 10)) == b"x" * 10  # type: ignore[arg-type]


class FakeCache:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def check_integrity(self) -> None:
        if self.error:
            raise self.error


def test_the_integrity_verdict_is_opt_in_and_survives_a_vanished_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(INTEGRITY_ENV, raising=False)
    assert integrity_verdict(FakeCache(AssertionError("x")), idle=True) == "off"  # type: ignore[arg-type]
    monkeypatch.setenv(INTEGRITY_ENV, "1")
    assert integrity_verdict(FakeCache(None), idle=True) == "ok"  # type: ignore[arg-type]
    assert integrity_verdict(FakeCache(None), idle=False).startswith("skipped")  # type: ignore[arg-type]
    gone = FileNotFoundError(2, "No such file or directory", "/tier/ab/x.ext")
    assert integrity_verdict(FakeCache(gone), idle=True).startswith("failed: ")  # type: ignore[arg-type]
    verdict = integrity_verdict(FakeCache(AssertionError("3 != 4")), idle=True)  # type: ignore[arg-type]
    assert verdict == "failed: 3 != 4"
