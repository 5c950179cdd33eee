"""`GET /server_info` with the integrity check on, while another process's hand deletes and corrupts
the tier's extent files (issue 12): every poll is answered, and the conversation spilled before
still gets the greedy answer it got before (its KV restored verified, or recomputed)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import post_json
from tests.server.test_concurrent_clients import spill_state

pytestmark = pytest.mark.server

WORDS = [
    "disk",
    "cache",
    "spill",
    "restore",
    "extent",
    "token",
    "prefix",
    "tier",
    "read",
    "write",
    "page",
    "slot",
]


def text(seed: int, words: int = 160) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(base: str, content: str) -> str:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return str(post_json(base + "/v1/chat/completions", body)["choices"][0]["message"]["content"])


def extent_files(tier: Path) -> list[Path]:
    return sorted(tier.rglob("*.ext"))


class Vandal(threading.Thread):
    """Deletes or corrupts (bytes flipped, or truncated) tier extent files until stopped."""

    def __init__(self, tier: Path) -> None:
        super().__init__(daemon=True)
        self.tier, self.stop, self.rng = tier, threading.Event(), random.Random(0)
        self.deleted = self.corrupted = 0

    def run(self) -> None:
        while not self.stop.wait(0.005):
            for path in extent_files(self.tier):
                with contextlib.suppress(OSError):  # removed by the tier meanwhile (eviction, a bad read)
                    self._spoil(path)

    def _spoil(self, path: Path) -> None:
        action = self.rng.randrange(3)
        if action == 0:
            path.unlink()
            self.deleted += 1
            return
        size = path.stat().st_size
        with open(path, "r+b") as f:
            if action == 1:
                f.seek(self.rng.randrange(size))
                f.write(os.urandom(16))
            else:
                f.truncate(self.rng.randrange(size))
        self.corrupted += 1


def test_server_info_answers_while_extents_vanish(
    tiny_model: Path, tmp_path: Path, start_server: Any
) -> None:
    tier = tmp_path / "tier"
    server = start_server(tiny_model, "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
                          "--hicache-spill-min-free", "0", max_total_tokens=1024,
                          env={"SGL_HICACHE_REPORT_INTEGRITY": "1"})  # fmt: skip
    base = server.base_url
    question = text(0)
    reference = chat(base, question)
    for seed in range(1, 8):  # other conversations push the question's KV out of the pool: spilled
        chat(base, text(seed))
    assert spill_state(base)["counters"]["spilled_tokens"] > 0 and extent_files(tier)
    vandal = Vandal(tier)
    vandal.start()
    try:
        verdicts = []
        for i in range(40):
            verdicts.append(spill_state(base)["integrity"])
            if i % 8 == 0:  # new spills: new files to spoil
                chat(base, text(100 + i))
    finally:
        vandal.stop.set()
        vandal.join()
    assert vandal.deleted and vandal.corrupted
    assert all(v == "ok" or v.startswith(("failed: ", "skipped: ")) for v in verdicts), verdicts
    assert any(v.startswith("failed: ") for v in verdicts), "the check never saw the damage: vacuous"
    assert chat(base, question) == reference
    assert spill_state(base)["counters"]["match_requests"] > 0
