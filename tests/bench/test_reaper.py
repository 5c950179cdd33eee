"""The signal-time reaper of started servers (`server_process._Reaper`): its SIGTERM/SIGINT
handlers can only be set from the main thread, so a first server started from another thread
(`--servers 2` boots its servers side by side) must not leave them unset for good."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.bench import server_process


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_a_first_server_from_another_thread_then_install_from_the_main_thread(
    handlers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    reaper = server_process._Reaper()
    monkeypatch.setattr(server_process.atexit, "register", lambda f: None)
    proc: Any = type("P", (), {"pid": 12345})()
    worker = threading.Thread(target=reaper.add, args=(proc,))
    worker.start()
    worker.join()
    assert reaper.live == {12345: proc}
    assert signal.getsignal(signal.SIGTERM) != reaper._on_signal  # none could be set there
    reaper.install()  # the main thread, as cluster._start does before its threads
    assert signal.getsignal(signal.SIGTERM) == reaper._on_signal
    assert signal.getsignal(signal.SIGINT) == reaper._on_signal
    reaper.install()  # once: the handler it replaced stays the first one
    assert reaper.previous[signal.SIGTERM] != reaper._on_signal
