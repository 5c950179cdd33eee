"""Hostile clients of `POST /hicache/prefetch` (issue 12): no body, however wrong, stops the server.

One server serves the whole module, in file order: the out-of-range id that used to kill the
scheduler, raw bodies (not JSON, too large, too deep), random JSON bodies (hypothesis), then a flood
from threads. Every answer is 200, 4xx or 503, and at the end the server still serves the same
greedy output as before any of it.

The server runs with sglang's `--api-key` and `--admin-api-key` (issue 38): the routes that delete
data (`/hicache/drop`, `/hicache/purge`) take the admin key exactly as sglang's own `/flush_cache`
does, the others the user key, as `/generate` does. Every request of the module carries its key.
"""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.bench.server_process import ServerProcess
from tests.server.conftest import SPILL_FLAGS

pytestmark = pytest.mark.server

POOL = 1024
VOCAB = 1024  # the tiny model's
CONTEXT = 32768  # the tiny model's max_position_embeddings
PROMPT = [(i * 7) % 900 + 20 for i in range(120)]
OK = {200, 400, 413, 503}
USER_KEY, ADMIN_KEY = "user-key-1", "admin-key-2"  # the server's --api-key and --admin-api-key


def headers(key: str | None = USER_KEY) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def generate(base: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    status, reply = post_raw(base, json.dumps(body).encode(), "/generate")
    assert status == 200, reply
    ids: list[int] = reply["output_ids"]
    return ids


def post_raw(
    base: str, data: bytes, route: str = "/hicache/prefetch", key: str | None = USER_KEY
) -> tuple[int, Any]:
    """(status, JSON answer, or the text of one that is not JSON) for any status; a dropped
    connection raises."""
    req = urllib.request.Request(base + route, data, headers(key))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read() or b"{}"
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text.decode(errors="replace")


def post_body(base: str, body: Any) -> tuple[int, dict[str, Any]]:
    return post_raw(base, json.dumps(body).encode())  # type: ignore[no-any-return]


def healthy(base: str) -> bool:
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        return r.status == 200


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One spill server; its TMPDIR is ours, so the launcher's runtime directory is found there."""
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "run").mkdir()
    args = (*SPILL_FLAGS, "--enable-hicache-spill", "--hicache-spill-dir", str(tmp / "tier"),
            "--hicache-spill-min-free", "0", "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY)  # fmt: skip
    env = {"TMPDIR": str(tmp / "run")}
    with ServerProcess(tiny_model, POOL, args, log_path=tmp / "server.log", env=env) as s:
        s.reference = generate(s.base_url)  # type: ignore[attr-defined]
        s.run_dir = tmp / "run"  # type: ignore[attr-defined]
        yield s
    # the runtime directory, and what sglang made in the launcher's temp directory (IPC socket names,
    # the Prometheus directory), went with the server
    assert list((tmp / "run").iterdir()) == [], "the server left temp files behind"


def test_out_of_range_token_id_is_refused_and_the_server_lives(server: Any) -> None:
    base = server.base_url
    status, reply = post_body(base, {"input_ids": [9223372036854775808]})  # 2**63: msgpack's uint64
    assert status == 400, reply
    assert set(reply) == {"error"} and "\n" not in reply["error"]
    assert healthy(base) and generate(base) == server.reference


def test_a_valid_hint_is_accepted_without_saying_what_the_cache_holds(server: Any) -> None:
    status, reply = post_body(server.base_url, {"input_ids": PROMPT, "cache_salt": "t"})
    assert status == 200 and reply == {"accepted": True, "prompt_tokens": len(PROMPT)}


def test_the_hint_socket_lives_in_a_private_directory(server: Any) -> None:
    (run_dir,) = server.run_dir.glob("sgl_hicache_*")
    st_ = os.lstat(run_dir)
    assert stat.S_ISDIR(st_.st_mode) and st_.st_uid == os.getuid()
    assert stat.S_IMODE(st_.st_mode) == 0o700
    assert "hints.sock" in [p.name for p in run_dir.iterdir()]  # beside sglang's own IPC sockets


# Each route with a body it accepts, and the key it takes: sglang's `/flush_cache` is the model of
# the admin level (ADMIN_OPTIONAL: with an admin key set, only that key), `/generate` of the user
# level (with an api key set, only that key, even when an admin key is set too).
ROUTES_AND_KEYS = [
    ("/flush_cache", b"", ADMIN_KEY),
    ("/hicache/drop", json.dumps({"input_ids": PROMPT[:16][::-1]}).encode(), ADMIN_KEY),
    ("/hicache/purge", b'{"cache_salt": "nobody-here"}', ADMIN_KEY),
    ("/generate", json.dumps({"input_ids": PROMPT[:8], "sampling_params": {"max_new_tokens": 1}}).encode(), USER_KEY),
    ("/hicache/prefetch", json.dumps({"input_ids": PROMPT}).encode(), USER_KEY),
    ("/hicache/pin", json.dumps({"input_ids": PROMPT[:8], "ttl_s": 5}).encode(), USER_KEY),
]  # fmt: skip


@pytest.mark.parametrize("route, data, key", ROUTES_AND_KEYS, ids=[r for r, _, _ in ROUTES_AND_KEYS])
def test_each_route_takes_the_key_of_its_level_and_no_other(
    server: Any, route: str, data: bytes, key: str
) -> None:
    other = USER_KEY if key == ADMIN_KEY else ADMIN_KEY
    for wrong in (None, other, "not-a-key"):
        status, reply = post_raw(server.base_url, data, route, wrong)
        assert status == 401 and reply == {"error": "Unauthorized"}, (route, wrong, status, reply)
    status, reply = post_raw(server.base_url, data, route, key)
    assert status == 200, (route, status, reply)


def test_bodies_are_taken_as_sglang_takes_chat_messages_and_nothing_else(server: Any) -> None:
    """Issue 38: OpenAI text parts give the plain string's tokens (this server's chat template and
    content format); a key no route takes is a 400, never a drop of the default tenant."""
    text = "Name a prime number."
    plain = post_body(server.base_url, {"messages": [{"role": "user", "content": text}]})
    parts = post_body(
        server.base_url, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    )
    assert plain == parts and plain[0] == 200 and plain[1]["prompt_tokens"] > 5, (plain, parts)
    typo = json.dumps({"input_ids": PROMPT, "cache_slat": "t"}).encode()
    status, reply = post_raw(server.base_url, typo, "/hicache/drop", ADMIN_KEY)
    assert status == 400 and "cache_slat" in reply["error"], reply


def test_an_example_ends_a_refused_key_with_one_line(server: Any) -> None:
    """Issue 38: sglang's own 401, through an example given the OpenAI form of the base URL."""
    example = Path(__file__).resolve().parents[2] / "examples" / "resume_hint.py"
    runs = {
        key: subprocess.run([sys.executable, str(example), "--base-url", server.base_url + "/v1", "--api-key", key],
                            capture_output=True, text=True, timeout=120)
        for key in ("wrong", USER_KEY)
    }  # fmt: skip
    assert runs["wrong"].returncode == 1 and runs["wrong"].stdout == "", runs["wrong"]
    (line,) = runs["wrong"].stderr.strip().splitlines()
    assert line.startswith("resume_hint: error: POST /hicache/prefetch answered 401") and "--api-key" in line
    assert runs[USER_KEY].returncode == 0 and "next turn:" in runs[USER_KEY].stdout, runs[USER_KEY]


@pytest.mark.parametrize(
    "data",
    [b"{not json", b"[" * 200_000, b"9" * 5000, b"\xff\xfe", b"[1, 2]", b'"a string"'],
    ids=["not-json", "deeper-than-the-parser", "beyond-the-digit-limit", "not-utf8", "a-list", "a-string"],
)
def test_raw_bodies_that_are_not_a_json_object(server: Any, data: bytes) -> None:
    status, reply = post_raw(server.base_url, data)
    assert status == 400 and "error" in reply, reply


def test_a_body_declared_too_large_is_refused_before_it_is_sent(server: Any) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/hicache/prefetch")
        for name, value in headers().items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(1 << 30))
        conn.endheaders()  # and not one byte of the body
        answer = conn.getresponse()
        assert answer.status == 413 and "error" in json.loads(answer.read())
    finally:
        conn.close()


LEAF = st.one_of(
    st.none(), st.booleans(), st.floats(), st.text(max_size=20),
    st.integers(), st.integers(min_value=2**63 - 2, max_value=2**70), st.integers(-(2**70), -1),
)  # fmt: skip
JUNK = st.recursive(LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)  # fmt: skip
IDS = st.one_of(
    JUNK,
    st.lists(st.one_of(st.integers(0, VOCAB + 5), LEAF), max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.tuples(st.integers(0, CONTEXT + 10), st.integers(0, VOCAB + 1)).map(lambda t: [t[1]] * t[0]),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]) | JUNK, "content": st.text(max_size=60) | JUNK}
)
MESSAGES = JUNK | st.lists(MESSAGE, max_size=4)
KEYS = {"cache_salt": JUNK | st.text(max_size=300), "extra_key": JUNK | st.text(max_size=300)}
BODIES = st.one_of(
    JUNK,
    st.fixed_dictionaries({"input_ids": IDS}, optional=KEYS),  # type: ignore[arg-type]
    st.fixed_dictionaries({"messages": MESSAGES}, optional=KEYS),  # type: ignore[arg-type]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(body=BODIES)
@example(body={"input_ids": [2**63]})
@example(body={"input_ids": [2**64 + 1]})
@example(body={"input_ids": [-1]})
@example(body={"input_ids": [True, False]})
@example(body={"input_ids": [1.0]})
@example(body={"input_ids": []})
@example(body={"input_ids": [VOCAB]})
@example(body={"input_ids": [5] * (CONTEXT + 1)})
@example(body={"input_ids": [5], "cache_salt": 7})
@example(body={"input_ids": [5], "extra_key": "k" * 10_000})
@example(body={"messages": [{"role": "user", "content": {"nested": ["junk"]}}]})
@example(body={"messages": "hello"})
@example(body={"prompt": "neither field"})
@example(body=[1, 2, 3])
def test_random_bodies_are_answered_never_fatal(server: Any, body: Any) -> None:
    status, reply = post_body(server.base_url, body)
    assert status in OK, (status, reply)
    assert ("error" in reply) == (status != 200), reply


def test_a_flood_of_hints_is_answered_or_shed(server: Any) -> None:
    def hint(i: int) -> int:
        return post_body(server.base_url, {"input_ids": [(i * 13 + k) % VOCAB for k in range(64)]})[0]

    with ThreadPoolExecutor(max_workers=24) as pool:
        statuses = list(pool.map(hint, range(500)))
    assert set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) > 0


def test_after_all_of_it_the_server_serves_the_same_output(server: Any) -> None:
    assert healthy(server.base_url)
    assert generate(server.base_url) == server.reference
    req = urllib.request.Request(server.base_url + "/server_info", headers=headers())
    with urllib.request.urlopen(req, timeout=60) as r:
        state = json.loads(r.read())["internal_states"][0]["hicache_spill"]
    assert state["hook_errors"] == {}, "a hook had to contain an exception"
    assert state["integrity"] == "off"  # opt-in: SGL_HICACHE_REPORT_INTEGRITY=1
