"""Every command README.md and docs/*.md show exists and takes the flags shown (issue 16).

A command is a line of a fenced block, or an inline code span, that starts with `python -m`,
`python benchmarks/`, `.venv/bin/python`, `sgl-hicache`, `make` or `bash`. None is run as shown
(most need a server, a GPU or minutes): Python commands and the CLI run with `--help` (subcommand
kept) in a subprocess, which must exit 0 without a traceback and list every `--flag` the doc shows;
`make` targets must exist (`make -n TARGET`, nothing run); `bash` scripts must exist and parse
(`bash -n`). Benchmarks run one way only: `python -m benchmarks.<name>` from the repository root.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PREFIXES = ("python -m ", "python benchmarks/", ".venv/bin/python ", "sgl-hicache", "make ", "bash ")
HELP_TIMEOUT_S = 240  # --help-sglang imports sglang's server_args: ~5 s idle, 15 s on a busy 2-core box

# Modules whose own `--help` is not run, and the help options of another module that list their flags
# instead. The module must still exist (`module_exists`).
HELP_FROM = {
    # sglang's own launcher: ours prints sglang's help with --help-sglang (the same parser), which is
    # lighter than sglang's own --help (all of sglang's imports).
    "sglang.launch_server": ("sgl_hicache.launch_server", (("--help-sglang",),)),
}
# Modules whose flags are listed by more than one help option: our launcher's --help lists ours only,
# --help-sglang the sglang flags it takes too.
HELPS = {"sgl_hicache.launch_server": (("--help",), ("--help-sglang",))}


class DocCommand(NamedTuple):
    where: str  # "README.md:94"
    text: str


def _fenced_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, logical line) of fenced blocks: `\\` continuations joined, `# comments` cut."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        start = start or number
        pending += re.sub(r"\s+#.*$", "", line).strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        yield start, pending
        pending, start = "", 0


def _inline_spans(lines: list[str]) -> Iterator[tuple[int, str]]:
    """(line number, text) of inline code spans outside fenced blocks, paragraph by paragraph."""
    inside, para, start = False, [], 0
    for number, line in enumerate([*lines, ""], 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        if inside or line.lstrip().startswith("```") or not line.strip():
            text = "\n".join(para)
            for m in re.finditer(r"`([^`]+)`", text):
                yield start + text.count("\n", 0, m.start()), " ".join(m.group(1).split())
            para, start = [], 0
            continue
        para.append(line)
        start = start or number


def doc_commands() -> list[DocCommand]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for number, text in [*_fenced_lines(lines), *_inline_spans(lines)]:
            if text.startswith(PREFIXES):
                found.append(DocCommand(f"{doc.relative_to(ROOT)}:{number}", " ".join(text.split())))
    return found


COMMANDS = doc_commands()


def shown_flags(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text)


def leading_words(tokens: list[str]) -> list[str]:
    """Subcommands: the bare lowercase words before the first option or argument."""
    words = []
    for token in tokens:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", token):
            break
        words.append(token)
    return words


def help_argvs(tokens: list[str]) -> list[list[str]]:
    """The `--help` command lines for a python / sgl-hicache command as the doc shows it (most have one)."""
    if tokens[0] == "sgl-hicache":
        return [[str(Path(sys.executable).parent / "sgl-hicache"), *leading_words(tokens[1:]), "--help"]]
    assert tokens[0] in ("python", ".venv/bin/python"), tokens
    if tokens[1] == "-m":
        module, helps = HELP_FROM.get(tokens[2], (tokens[2], ()))
        helps = helps or HELPS.get(module, (("--help",),))
        return [[sys.executable, "-m", module, *leading_words(tokens[3:]), *h] for h in helps]
    return [[sys.executable, tokens[1], *leading_words(tokens[2:]), "--help"]]


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    proc = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=HELP_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{out[-3000:]}"
    assert "Traceback" not in out, f"{shlex.join(argv)} printed a traceback:\n{out[-3000:]}"
    return out


def module_exists(name: str) -> bool:
    """Whether module `name` is installed, found without importing its packages (sglang: ~5 s)."""
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return False
        spec = importlib.machinery.PathFinder.find_spec(
            f"{spec.name}.{part}", spec.submodule_search_locations
        )
    return spec is not None


def check_python(tokens: list[str], text: str) -> None:
    if tokens[0] != "sgl-hicache" and tokens[1] == "-m" and tokens[2] in HELP_FROM:
        assert module_exists(tokens[2]), f"no module {tokens[2]}"
    argvs = help_argvs(tokens)
    out = "".join(help_text(tuple(argv)) for argv in argvs)
    missing = [f for f in shown_flags(text) if not re.search(rf"(?<![\w-]){f}(?![\w-])", out)]
    assert not missing, f"flags not in {' / '.join(shlex.join(a) for a in argvs)}: {missing}"


def check_make(tokens: list[str]) -> None:
    targets = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]
    assert targets, "make without a target"
    proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def check_bash(tokens: list[str]) -> None:
    script = ROOT / tokens[1]
    assert script.is_file(), f"no script {tokens[1]}"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text[:50]}" for c in COMMANDS])
def test_doc_command_exists(command: DocCommand) -> None:
    tokens = [t for t in shlex.split(command.text) if t != "..."]
    if tokens[0] == "make":
        check_make(tokens)
    elif tokens[0] == "bash":
        check_bash(tokens)
    else:
        check_python(tokens, command.text)


def test_extraction_finds_every_kind() -> None:
    """Guards the parser: a change that silently found nothing would pass every check above."""
    kinds = {prefix for c in COMMANDS for prefix in PREFIXES if c.text.startswith(prefix)}
    assert kinds >= {"python -m ", ".venv/bin/python ", "sgl-hicache", "make ", "bash "}, kinds
    assert len(COMMANDS) >= 30, COMMANDS


BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_as_module(name: str) -> None:
    """The one way to run a benchmark: `python -m benchmarks.<name>` from the root, no sys.path edits."""
    assert "sys.path" not in (ROOT / "benchmarks" / f"{name}.py").read_text()
    help_text((sys.executable, "-m", f"benchmarks.{name}", "--help"))


def test_docs_run_benchmarks_as_modules() -> None:
    by_path = [c for c in COMMANDS if re.match(r"(\.venv/bin/)?python benchmarks/", c.text)]
    assert not by_path, f"run benchmarks as `python -m benchmarks.<name>`: {by_path}"
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert not re.search(r"\"\$PY\"\s+benchmarks/", script), "gpu_check.sh runs a benchmark by path"


def test_the_readme_lists_every_flag_of_ours() -> None:
    """The README's flag table names every flag our launcher takes and every key of its extra config
    (a user reads no other file)."""
    from sgl_hicache.server.flags import flag_names, settings

    lines = (ROOT / "README.md").read_text().splitlines()
    listed = {m.group(1) for line in lines if (m := re.match(r"\| `([a-z0-9_-]+)`", line))}
    missing = sorted({*flag_names(), *(s.key for s in settings() if s.key)} - listed)
    assert not missing, f"flags or keys missing from the README's table: {missing}"
