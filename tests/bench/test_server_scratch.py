"""A server's temp files (`ServerProcess`): sglang names its IPC sockets with
`NamedTemporaryFile(delete=False)` and never removes them, and a killed server leaves its
directories; each test server left about six entries in the temp directory, a few hundred per run
of the suite. Each server now has its own TMPDIR, removed when it is stopped or killed."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.standin_server import standin_source

# What sglang does in the processes of a server: temp files and directories that outlive them.
WORKER = """import os, tempfile
tempfile.NamedTemporaryFile(delete=False)
tempfile.mkdtemp()
print(os.environ.get("TORCHINDUCTOR_CACHE_DIR"), flush=True)"""


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_stopped_or_killed_server_leaves_nothing_in_the_temp_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    (tmp_path / "standin_server.py").write_text(standin_source(WORKER))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    log = tmp_path / "server.log"
    server = ServerProcess(
        Path("unused"), 1, module="standin_server", log_path=log, env={"PYTHONPATH": str(tmp_path)}
    )
    with server:
        assert len(list(temp.rglob("tmp*"))) == 2  # the worker ran
        getattr(server, end)()
    assert list(temp.iterdir()) == []
    assert log.read_text().strip() == str(temp / f"torchinductor_{getpass.getuser()}")  # kept, shared


def test_a_tmpdir_the_caller_gives_wins(tmp_path: Path) -> None:
    (tmp_path / "standin_server.py").write_text(standin_source(WORKER))
    given = tmp_path / "given"
    given.mkdir()
    env = {"PYTHONPATH": str(tmp_path), "TMPDIR": str(given)}
    with ServerProcess(Path("unused"), 1, module="standin_server", env=env):
        assert len(os.listdir(given)) == 2


def test_a_server_whose_port_was_taken_since_it_was_picked_starts_on_another(tmp_path: Path) -> None:
    """The bench picks a server's port before starting it; a process started beside it may bind it
    first (a Mooncake client's transfer port did, and a `--servers 2` run ended): the server is
    started again on a fresh port."""
    import socket
    import urllib.request

    (tmp_path / "standin_server.py").write_text(standin_source(""))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "server.log"
        server = ServerProcess(
            Path("unused"),
            1,
            module="standin_server",
            log_path=log,
            env={"PYTHONPATH": str(tmp_path)},
            port=port,
        )
        with server:
            assert server.port != port
            with urllib.request.urlopen(server.base_url + "/health", timeout=5) as r:
                assert r.status == 200
