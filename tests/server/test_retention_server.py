"""The retention routes on the real server (issue 27), one server for all: hostile bodies get 4xx and
change nothing; a pin over the pin budget is refused with its reason (409); a purge leaves nothing
of its salt on the tier (`sgl-hicache fsck --cache-salt`) while another salt's stays; and the
server's greedy output is the same before and after all of it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sgl_hicache.cli import main as cli_main
from tests.server.conftest import eventually, post_json

pytestmark = pytest.mark.server

POOL = 1024
PROMPT = [(i * 7) % 900 + 20 for i in range(300)]


def post(base: str, route: str, data: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(base + route, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def generate(base: str, ids: list[int], salt: str | None = None) -> list[int]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    if salt:
        body["cache_salt"] = salt
    out: list[int] = post_json(base + "/generate", body)["output_ids"]
    return out


def salt_on_tier(tier: Path, salt: str) -> bool:
    return cli_main(["fsck", str(tier), "--cache-salt", salt]) == 1


def test_retention_routes_refuse_hostile_bodies_and_purge_completely(
    tiny_model: Path, start_server: Any, tmp_path: Path
) -> None:
    tier = tmp_path / "tier"
    server = start_server(tiny_model, "--enable-hicache-spill", "--hicache-spill-dir", str(tier),
                          "--hicache-spill-min-free", "0", "--hicache-spill-capacity", "64M",
                          "--hicache-spill-extra-config", '{"pin_share": 0.01}', max_total_tokens=POOL)  # fmt: skip
    base = server.base_url
    reference = {salt: generate(base, PROMPT, salt) for salt in ("tenant-a", "tenant-b")}
    for route, body in [
        ("/hicache/pin", b'{"input_ids": [1, 2]}'), ("/hicache/pin", b'{"input_ids": [1], "ttl_s": -1}'),
        ("/hicache/pin", b'{"input_ids": [1], "ttl_s": true}'), ("/hicache/drop", b'{"input_ids": [99999999]}'),
        ("/hicache/drop", b'{"input_ids": [1], "ttl_s": 5}'), ("/hicache/purge", b"{}"),
        ("/hicache/purge", b'{"cache_salt": "tenant-a", "input_ids": [1]}'), ("/hicache/purge", b"[1]"),
        ("/hicache/purge", b"\\xff"), ("/hicache/pin", b"{" * 10_000),
    ]:  # fmt: skip
        status, reply = post(base, route, body)
        assert status == 400 and "\n" not in reply["error"], (route, body, reply)
    status, reply = post(base, "/hicache/pin", json.dumps({"input_ids": [5] * 30000, "ttl_s": 60}).encode())
    assert status == 409 and "pin budget" in reply["error"], reply
    assert post(base, "/hicache/pin", json.dumps({"input_ids": PROMPT[:32], "ttl_s": 60}).encode()) == (
        200, {"accepted": True, "prompt_tokens": 32},
    )  # fmt: skip
    for k in range(POOL // len(PROMPT) + 2):  # push both tenants out of the pool: spilled
        generate(base, [(i * 11 + k * 97) % 900 + 20 for i in range(300)])
    assert eventually(lambda: salt_on_tier(tier, "tenant-a") and salt_on_tier(tier, "tenant-b"), 60)
    assert post(base, "/hicache/purge", b'{"cache_salt": "tenant-a"}') == (200, {"accepted": True})
    assert eventually(lambda: not salt_on_tier(tier, "tenant-a"), 30)
    assert salt_on_tier(tier, "tenant-b")
    assert {salt: generate(base, PROMPT, salt) for salt in reference} == reference
