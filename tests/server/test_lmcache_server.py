"""LMCache as the benchmark runs it (`benchmarks/bench/lmcache_process.py`): a real LMCache daemon and
a tiny-model sglang server using it (`--enable-lmcache`). A prompt served once, then sglang's
`/flush_cache` (which empties the server's own cache, not LMCache), is served again from LMCache:
its whole chunks, reported as `storage` with `storage_backend: LMCache`, and the same answer. After
a kill nothing of either process is left; a killed driver takes its daemon with it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks.bench.lmcache_process import L2, DaemonSpec, LMCacheServer
from tests.server.conftest import SPILL_FLAGS, eventually, post_json
from tests.test_process_signals import REPO, group_alive, wait_gone

pytestmark = pytest.mark.server

CHUNK = 256  # LMCache's default, what the benchmark's lmcache-* systems run
PROMPT = [(i * 7919) % 900 + 10 for i in range(2 * CHUNK + 88)]  # two whole chunks and a part


def generate(base: str) -> dict:
    return post_json(
        base + "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    )


def test_a_flushed_prompt_is_served_from_lmcache_and_a_kill_leaves_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = DaemonSpec(l1_mb=64, chunk_size=CHUNK, l2=L2.FS, l2_dir=tmp_path / "l2")
    server = LMCacheServer(tiny_model, 2048, (*SPILL_FLAGS, "--page-size", "16"), module="sglang.launch_server",
                           log_path=tmp_path / "server.log", daemon_spec=spec)  # fmt: skip
    try:
        server.start()
        assert server.proc is not None and server.daemon is not None and server.daemon.proc is not None
        groups = (server.proc.pid, server.daemon.proc.pid)
        first = generate(server.base_url)
        assert first["meta_info"]["cached_tokens"] == 0
        whole = len(PROMPT) // CHUNK
        # the store is asynchronous: the daemon's L1 holds the prompt's whole chunks once it is done
        assert eventually(lambda: server.daemon.l1_objects() == whole, 30), server.daemon.status()
        assert list((tmp_path / "l2").iterdir()), "the fs L2 got a copy"
        flush = urllib.request.Request(server.base_url + "/flush_cache", method="POST")
        with urllib.request.urlopen(flush, timeout=30) as r:
            assert r.status == 200
        second = generate(server.base_url)
        assert second["meta_info"]["cached_tokens"] == whole * CHUNK
        details = second["meta_info"]["cached_tokens_details"]
        assert details == {"device": 0, "host": 0, "storage": whole * CHUNK, "storage_backend": "LMCache"}
        assert second["output_ids"] == first["output_ids"]
        server.kill()
        assert not any(group_alive(g) for g in groups), (
            "a process of the server or its daemon outlived kill()"
        )
    finally:
        server.stop()


DRIVER = """
import sys, time
from pathlib import Path
from benchmarks.bench.lmcache_process import DaemonSpec, LMCacheDaemon

daemon = LMCacheDaemon(DaemonSpec(l1_mb=16), Path(sys.argv[1]))
daemon.start()
print(daemon.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_driver_takes_its_lmcache_daemon_with_it(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "daemon.log")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    pgid = 0
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the driver did not start its daemon within 120 s"
        pgid = int(proc.stdout.readline())
        assert group_alive(pgid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert wait_gone(pgid, 10), "the LMCache daemon outlived its driver"
    finally:
        for group in (pgid, proc.pid):
            if group and group_alive(group):
                os.killpg(group, signal.SIGKILL)
        proc.wait(10)
