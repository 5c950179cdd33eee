"""The user-facing examples against a stand-in OpenAI-compatible server (issue 28): every request
carries the `--api-key` given, resume hints go out when asked for, and the summary line reports
what the server said was cached. Issue 38: every example takes the server's root as `--base-url`
(a trailing `/v1` is dropped), and a refused key (401) or a conversation longer than the model's
context (sglang's 400) ends it with one line on stderr and exit code 1, not a traceback."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class StandIn:
    """GET /v1/models, streamed POST /v1/chat/completions (usage: half the prompt cached after the
    first request), POST /hicache/prefetch; records each request's path and Authorization header.
    With `key`, every request without it gets sglang's 401; with `context_words`, a chat whose
    messages hold more words gets sglang's 400 for a prompt longer than the context."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.bodies: list[tuple[str, Any]] = []  # (path, JSON body) of the hints and chats
        self.chats = 0
        self.refuse_pins = False
        self.key: str | None = None
        self.context_words: int | None = None

    @web.middleware
    async def check_key(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            self.seen.append((request.path, request.headers.get("Authorization", "")))
            return web.json_response({"error": "Unauthorized"}, status=401)  # sglang's middleware's answer
        return await handler(request)  # type: ignore[no-any-return]

    async def models(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization", "")))
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]}
        )

    async def prefetch(self, request: web.Request) -> web.Response:
        self.seen.append((request.path, request.headers.get("Authorization", "")))
        body = await request.json()
        return web.json_response({"accepted": True, "prompt_tokens": len(json.dumps(body["messages"]))})

    async def retention(self, request: web.Request) -> web.Response:
        """POST /hicache/pin, /drop, /purge: accepted (a pin refused with 409 if `refuse_pins`)."""
        self.seen.append((request.path, request.headers.get("Authorization", "")))
        body = await request.json()
        self.bodies.append((request.path, body))
        if request.path.endswith("/pin") and self.refuse_pins:
            return web.json_response({"error": "over the pin budget"}, status=409)
        if request.path.endswith("/purge"):
            return web.json_response({"accepted": True})
        return web.json_response({"accepted": True, "prompt_tokens": len(json.dumps(body["messages"]))})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, request.headers.get("Authorization", "")))
        body = await request.json()
        self.bodies.append((request.path, body))
        words = sum(len(m["content"].split()) for m in body["messages"])
        if self.context_words is not None and words > self.context_words:  # sglang's answer, word for word
            message = f"The input ({words} tokens) is longer than the model's context length ({self.context_words} tokens)."
            error = {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
            return web.json_response(error, status=400)
        if not body.get("stream"):  # a whole answer at once
            usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                     "prompt_tokens_details": {"cached_tokens": 4 if self.chats else 0}}  # fmt: skip
            self.chats += 1
            message = {"role": "assistant", "content": "seven"}
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": usage,
                                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})  # fmt: skip
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        cached = prompt // 2 if self.chats else 0
        self.chats += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        delta = {**base, "choices": [{"index": 0, "delta": {"content": "next: read"}, "finish_reason": None}]}
        usage = {**base, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                 "total_tokens": prompt + 2, "prompt_tokens_details": {"cached_tokens": cached}}}  # fmt: skip
        for chunk in (delta, usage):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def standin() -> Iterator[tuple[str, StandIn]]:
    state, ready, loop = StandIn(), threading.Event(), asyncio.new_event_loop()
    holder: dict[str, Any] = {}

    async def start() -> None:
        app = web.Application(middlewares=[state.check_key])
        app.router.add_get("/v1/models", state.models)
        app.router.add_post("/v1/chat/completions", state.chat)
        app.router.add_post("/hicache/prefetch", state.prefetch)
        for route in ("pin", "drop", "purge"):
            app.router.add_post(f"/hicache/{route}", state.retention)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        holder["runner"], holder["port"] = runner, runner.addresses[0][1]
        ready.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True
    )
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{holder['port']}", state
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:  # as when run as a script: the examples import each other
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_multi_user_chat_sends_the_key_and_hints(standin: tuple[str, StandIn], capsys: Any) -> None:
    url, state = standin
    args = ["--base-url", url, "--api-key", "s3cret", "--users", "3", "--turns", "3", "--think-s", "0",
            "--question-words", "10", "--hint"]  # fmt: skip
    assert example("multi_user_chat").main(args) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["resumed_turns"] == 3 * 2 and 0 < figures["resumed_cached_share"] <= 0.5
    assert {auth for _, auth in state.seen} == {"Bearer s3cret"}
    assert sum(path == "/hicache/prefetch" for path, _ in state.seen) == 3 * 2  # one before each resumed turn


def test_agent_loop_grows_its_context_and_sends_the_key(standin: tuple[str, StandIn], capsys: Any) -> None:
    url, state = standin
    args = ["--base-url", url, "--api-key", "k", "--steps", "4", "--tool-s", "0", "--tool-chars", "300"]
    assert example("agent_loop").main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    prompts = [int(line.split()[1]) for line in lines[1:5]]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1], "every step's context holds the last"
    assert 0 < json.loads(lines[-1])["cached_share_after_first"] <= 0.5
    assert {auth for _, auth in state.seen} == {"Bearer k"}


def test_agent_pins_its_fixed_context_at_every_step(
    standin: tuple[str, StandIn], capsys: Any, tmp_path: Path
) -> None:
    url, state = standin
    system = tmp_path / "system.txt"
    system.write_text("a long system prompt " * 50)
    args = ["--base-url", url, "--api-key", "k", "--steps", "3", "--tool-s", "0", "--tool-chars", "100",
            "--pin-ttl", "600", "--system-file", str(system)]  # fmt: skip
    assert example("agent_loop").main(args) == 0
    pins = [body for path, body in state.bodies if path == "/hicache/pin"]
    assert len(pins) == 3 and all(p["ttl_s"] == 600 and len(p["messages"]) == 2 for p in pins)
    assert pins[0]["messages"][0]["content"] == system.read_text()
    chats = [body for path, body in state.bodies if path == "/v1/chat/completions"]
    assert all(c["messages"][:2] == pins[0]["messages"] for c in chats), "the pin is a prefix of every step"
    assert "pinned" in capsys.readouterr().out
    state.refuse_pins = True
    assert example("agent_loop").main(args) == 0  # a refused pin: the agent goes on without it
    assert "not pinned (409): over the pin budget" in capsys.readouterr().out


@pytest.mark.parametrize("forget", ["purge", "drop"])
def test_chat_app_forgets_a_deleted_conversation(
    standin: tuple[str, StandIn], capsys: Any, forget: str
) -> None:
    url, state = standin
    assert (
        example("chat_delete").main(["--base-url", url, "--api-key", "k", "--turns", "2", "--forget", forget])
        == 0
    )
    chats = [body for path, body in state.bodies if path == "/v1/chat/completions"]
    hint_path, hint = state.bodies[-1]
    assert hint_path == f"/hicache/{forget}"
    if forget == "purge":  # the conversation's own salt, on every turn, then purged
        salts = {c["cache_salt"] for c in chats}
        assert len(salts) == 1 and hint == {"cache_salt": salts.pop()}
    else:
        assert hint["messages"][: len(chats[-1]["messages"])] == chats[-1]["messages"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == 200
    assert {auth for _, auth in state.seen} == {"Bearer k"}


@pytest.mark.parametrize("forget", ["purge", "drop"])
def test_chat_app_forgets_with_the_admin_key(standin: tuple[str, StandIn], forget: str) -> None:
    """A server with `--admin-api-key` takes only that key on drop and purge (issue 38)."""
    args = [
        "--base-url",
        standin[0],
        "--api-key",
        "k",
        "--admin-api-key",
        "adm",
        "--turns",
        "1",
        "--forget",
        forget,
    ]
    assert example("chat_delete").main(args) == 0
    seen = standin[1].seen
    assert seen[-1] == (f"/hicache/{forget}", "Bearer adm")
    assert {auth for _, auth in seen[:-1]} == {"Bearer k"}


# Every example that talks to a server given by `--base-url`, with arguments for a short run.
SHORT_RUNS = {
    "resume_hint": [],
    "multi_turn_chat": [],
    "multi_user_chat": ["--users", "2", "--turns", "2", "--think-s", "0", "--question-words", "5", "--hint"],
    "agent_loop": ["--steps", "2", "--tool-s", "0", "--tool-chars", "40", "--pin-ttl", "60"],
    "chat_delete": ["--turns", "2"],
}


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
@pytest.mark.parametrize("name", SHORT_RUNS)
def test_every_example_takes_the_server_root_as_base_url(
    standin: tuple[str, StandIn], capsys: Any, name: str, suffix: str
) -> None:
    url, state = standin
    assert example(name).main(["--base-url", url + suffix, "--api-key", "k", *SHORT_RUNS[name]]) == 0
    paths = {path for path, _ in state.seen}
    assert "/v1/models" in paths and "/v1/chat/completions" in paths, paths
    assert capsys.readouterr().err == ""


def one_error_line(err: str, name: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), err
    return lines[0]


@pytest.mark.parametrize("name", SHORT_RUNS)
def test_a_refused_key_ends_with_one_line_and_exit_1(
    standin: tuple[str, StandIn], capsys: Any, name: str
) -> None:
    url, state = standin
    state.key = "the-right-key"
    assert example(name).main(["--base-url", url, "--api-key", "wrong", *SHORT_RUNS[name]]) == 1
    line = one_error_line(capsys.readouterr().err, name)
    assert "401" in line and "--api-key" in line, line


@pytest.mark.parametrize("name", SHORT_RUNS)
def test_a_context_too_long_ends_with_one_line_and_exit_1(
    standin: tuple[str, StandIn], capsys: Any, name: str
) -> None:
    url, state = standin
    state.context_words = 3
    assert example(name).main(["--base-url", url, "--api-key", "k", *SHORT_RUNS[name]]) == 1
    line = one_error_line(capsys.readouterr().err, name)
    assert "400" in line and "is longer than the model's context length (3 tokens)" in line, line


def test_a_refused_admin_key_names_the_admin_key(standin: tuple[str, StandIn], capsys: Any) -> None:
    url, state = standin
    state.key = "k"  # the stand-in takes one key: the admin key given is refused
    args = ["--base-url", url, "--api-key", "k", "--admin-api-key", "wrong", "--turns", "1"]
    assert example("chat_delete").main(args) == 1
    line = one_error_line(capsys.readouterr().err, "chat_delete")
    assert "401" in line and "/hicache/purge" in line and "--admin-api-key" in line, line


def test_the_script_exits_1_with_one_line(standin: tuple[str, StandIn]) -> None:
    url, state = standin
    state.key = "the-right-key"
    out = subprocess.run([sys.executable, str(EXAMPLES / "resume_hint.py"), "--base-url", url, "--api-key", "x"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1 and out.stdout == "", out
    assert "401" in one_error_line(out.stderr, "resume_hint")


@pytest.mark.parametrize("name", ["resume_hint", "multi_turn_chat"])  # a hint first; the OpenAI client first
def test_a_server_that_cannot_be_reached_ends_with_one_line(capsys: Any, name: str) -> None:
    from benchmarks.bench.server_process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert example(name).main(["--base-url", url + "/v1", "--api-key", "k"]) == 1
    line = one_error_line(capsys.readouterr().err, name)
    assert f"cannot reach the server at {url}" in line, line
