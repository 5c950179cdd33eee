"""Server differential test on the Mooncake backend (issue 26): a server spilling to a real
Mooncake Store (master on loopback) gives exactly the never-evicting server's greedy outputs.

The workload is test_exactness_server.py's, served once per session by the reference (branching
conversations: forks inside earlier turns, revisits of conversations pushed out long ago), shorter:
its first `REQUESTS` requests, page size 1, our server with a 1,024-token pool and `--hicache-spill-backend mooncake`. The tier must really
be used (tokens spilled and restored through the store) and nothing refused as corrupt. After
`RESTART_AT` requests the master is killed and restarted (everything in the store is lost): the
server goes on serving the rest.

After the restart the reference is no oracle for every turn. A turn whose spilled history was lost
is recomputed, and a recompute is one prefill of tokens the reference computed piece by piece (its
earlier prompts, then its outputs one decode step at a time): sglang's own arithmetic then differs
in the last bits and may flip a greedy token (plain sglang given this workload's #32 with only its
system prefix cached answers as ours does, not as the reference). So a reply after the restart
either equals the reference's, or took nothing from the tier and equals what a plain server
computes for the same prompt over the same device prefix (a recompute, checked, never restored KV).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench.server_process import ServerProcess
from tests.mooncake_master import MooncakeMaster
from tests.server.conftest import SPILL_FLAGS
from tests.server.test_exactness_server import (
    POOL,
    Sent,
    counter,
    differences,
    generate,
    plain_reference,
    replay,
    restored,
    restored_range,
)

pytestmark = pytest.mark.server

REQUESTS = 40
RESTART_AT = 30  # the master is restarted (killed) after this many requests


@pytest.fixture
def transcript(exactness_transcript: list[Sent]) -> list[Sent]:
    return exactness_transcript[:REQUESTS]


def mooncake_server(model: Path, tmp: Path, master: MooncakeMaster) -> ServerProcess:
    cfg = master.config(segment_bytes=64 << 20)
    settings = {"master": cfg.master, "metadata_server": cfg.metadata_server, "protocol": "tcp",
                "local_hostname": "127.0.0.1", "global_segment_size": "64M", "local_buffer_size": "16M"}  # fmt: skip
    args = (*SPILL_FLAGS, "--page-size", "1", "--enable-hicache-spill", "--hicache-spill-dir", str(tmp / "tier"),
            "--hicache-spill-backend", "mooncake", "--hicache-spill-mooncake-config", json.dumps(settings))  # fmt: skip
    return ServerProcess(model, POOL, args, log_path=tmp / "server.log")


def recomputed_elsewhere(model: Path, tmp: Path, changed: list[tuple[Sent, dict[str, Any]]]) -> list[str]:
    """The replies among `changed` that a plain server, given the same prompt over the same device
    prefix (cached first, as ours had it), does not reproduce."""
    tmp.mkdir()
    wrong = []
    with plain_reference(model, tmp, 1) as plain:
        for s, reply in changed:
            flush = urllib.request.Request(plain.base_url + "/flush_cache", method="POST")
            with urllib.request.urlopen(flush, timeout=60):
                pass
            device = restored_range(reply)[0]
            if device:  # one new token: sglang caches the prompt, no token made by a decode step
                generate(plain.base_url, s.input_ids[:device], max_new=1)
            again = generate(plain.base_url, s.input_ids)
            assert again["meta_info"]["cached_tokens"] == device, (again["meta_info"], device)
            if again["output_ids"] != reply["output_ids"]:
                wrong.append(f"{len(s.input_ids)} tokens over {device} cached: "
                             f"plain {again['output_ids']}, ours {reply['output_ids']}")  # fmt: skip
    return wrong


def test_a_server_on_mooncake_matches_the_never_evicting_reference(
    transcript: list[Sent], tiny_model: Path, tmp_path: Path, mooncake_master: MooncakeMaster
) -> None:
    with mooncake_server(tiny_model, tmp_path, mooncake_master) as ours:
        replies = replay(ours.base_url, transcript[:RESTART_AT])
        counters = {n: counter(ours.base_url, n) for n in ("spilled_tokens", "restored_tokens",
                                                          "mismatch_extents", "corrupt_extents")}  # fmt: skip
        mooncake_master.restart()  # the store's contents are gone; the server goes on (recomputing)
        later = replay(ours.base_url, transcript[RESTART_AT:])
        after = {n: counter(ours.base_url, n)
                 for n in ("restore_failures", "spill_failures", "spilled_tokens", "mismatch_extents",
                           "corrupt_extents")}  # fmt: skip
    before = transcript[:RESTART_AT]
    assert not differences(before, replies), "\n".join(differences(before, replies))
    assert counters["spilled_tokens"] > 0 and counters["restored_tokens"] > 0, counters
    assert counters["mismatch_extents"] == 0 and counters["corrupt_extents"] == 0, counters
    assert any(restored(r) for s, r in zip(before, replies, strict=True) if s.kind in ("fork", "revisit"))
    assert not list((tmp_path / "tier").rglob("*.ext")), "extents went to files, not to the store"
    # after the restart: a reply unlike the reference's restored nothing and is sglang's recompute
    changed = [
        (s, r) for s, r in zip(transcript[RESTART_AT:], later, strict=True) if r["output_ids"] != s.output_ids
    ]
    assert not [r for _, r in changed if restored(r)], [restored_range(r) for _, r in changed]
    if changed:
        wrong = recomputed_elsewhere(tiny_model, tmp_path / "plain", changed)
        assert not wrong, "\n".join(wrong)
    assert after["mismatch_extents"] == 0 and after["corrupt_extents"] == 0, after  # lost ones are misses
    # the restart was felt (restores of lost extents recomputed, or spills refused while it was away)
    # and the tier worked again after it (spills went on)
    assert after["restore_failures"] + after["spill_failures"] > 0, after
    assert after["spilled_tokens"] > counters["spilled_tokens"], after
