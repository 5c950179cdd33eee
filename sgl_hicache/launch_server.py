"""`python -m sgl_hicache.launch_server [sglang flags] --enable-hicache-spill [--hicache-spill-* ...]`

Every sglang 0.5.23 flag plus ours (see `sgl_hicache.server.flags`). Everything that can be refused
is refused before sglang starts, with one line and exit code 2, having written nothing: our flags
first (no sglang import), then sglang's, read by sglang's own parser (`server.sglang_args`: unknown
flags, bad values, a local model path that does not exist, what our backend refuses, the model's
config.json, a tier too small for one of its extents), then an installed sglang
that is not the one we were written against (`sgl_hicache.server.sglang_seam`). `--help` prints
ours only, without importing sglang; `--help-sglang` prints sglang's.
With `--enable-hicache-spill`, `--radix-cache-backend hicache_spill` is added for sglang, and the
config travels to the scheduler processes in `SGL_HICACHE_CONFIG`. `--device cpu` also sets
`SGLANG_USE_CPU_ENGINE=1`, which sglang's CPU engine needs, and with `--tp-size N>1` the defaults of
`sgl_hicache_cpu.cpu_tp_env` (the CPU profile's platform and a thread binding), unless already set:
the one module of the CPU profile (`cpu/`, not in this package) the runtime names; without that
profile, CPU tensor parallelism is refused.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import NoReturn

from sgl_hicache import BACKEND_NAME
from sgl_hicache.cache.identity import UNISOLATED
from sgl_hicache.config import ConfigError, SpillConfig
from sgl_hicache.server.flags import add_flags, config_from, refuse_unknown_ours
from sgl_hicache.server.handoff import export_config
from sgl_hicache.server.sglang_args import check_sglang_args
from sgl_hicache.server.sglang_seam import SeamError, check_seam
from sgl_hicache.server.validate import check_config

PROG = "python -m sgl_hicache.launch_server"
_QUIET_SGL_ENV = "ignore:Environment variable SGL_HICACHE"


class _Parser(argparse.ArgumentParser):
    """argparse's own refusals (a flag missing its value) as ConfigError: one line, not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def parse(argv: list[str]) -> tuple[SpillConfig, list[str]]:
    """Split argv into our config and sglang's own arguments; raises ConfigError."""
    parser = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    add_flags(parser)
    ours, rest = parser.parse_known_args(argv)
    refuse_unknown_ours(rest)
    config = config_from(ours)
    check_config(config)
    backend = _flag_value(rest, "--radix-cache-backend")
    if config.enabled and backend not in (None, BACKEND_NAME):
        raise ConfigError(f"--enable-hicache-spill needs --radix-cache-backend {BACKEND_NAME}, got {backend}")
    if config.enabled and backend is None:
        rest = [*rest, "--radix-cache-backend", BACKEND_NAME]
    if config.enabled or backend == BACKEND_NAME:
        refuse_unisolated(rest)
    return config, rest


def refuse_unisolated(argv: list[str]) -> None:
    """ConfigError naming the first sglang flag in `argv` that turns on a parallelism the spill
    namespace does not isolate yet (`identity.UNISOLATED`). The cache factory checks the resolved
    configuration again (a `--config` file can set these too)."""
    for entry in UNISOLATED:
        if any(_turns_on(argv, flag, entry.boolean) for flag in entry.flags):
            raise ConfigError(entry.message())


def _turns_on(argv: list[str], flag: str, boolean: bool) -> bool:
    if boolean:
        return flag in argv
    value = _flag_value(argv, flag)
    return value is not None and value.isdigit() and int(value) > 1


def _flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last `NAME VALUE` or `NAME=VALUE` in `argv` for any of `names` (argparse
    keeps the last)."""
    value = None
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names and (eq or i + 1 < len(argv)):
            value = inline if eq else argv[i + 1]
    return value


HELP = """sglang's HTTP server with its radix cache spilling to an NVMe tier: takes every sglang flag
(--help-sglang lists them; it imports sglang, seconds) and the flags below. Sizes are GB when given
without a unit, as sglang's --hicache-size; a flag beats its SGL_HICACHE_* variable."""


def print_help() -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} --model-path PATH [sglang flags] --enable-hicache-spill [--hicache-spill-* ...]",
        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--help-sglang", action="store_true", help="show sglang's own flags and exit")
    add_flags(parser)
    parser.print_help()


def print_sglang_help() -> None:
    from sgl_hicache.server.sglang_args import sglang_parser

    sglang_parser(f"{PROG} [flags of ours]").print_help()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    if "--help-sglang" in argv:
        print_sglang_help()
        return 0
    try:
        config, sglang_argv = parse(argv)
    except ConfigError as e:
        return fail(e)
    export_config(config)
    # sglang rewrites every SGL_* variable to SGLANG_* with a "deprecated" warning; ours are not its.
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET_SGL_ENV]))
    warnings.filterwarnings("ignore", message="Environment variable SGL_HICACHE")
    try:
        if _flag_value(sglang_argv, "--device") == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
            os.environ.update(cpu_tp_defaults(sglang_argv))  # only for --tp-size > 1; never overrides
        check_sglang_args(
            sglang_argv, PROG, config
        )  # imports sglang's server_args, which reads the env above
        check_seam()  # imports sglang
    except (ConfigError, SeamError) as e:
        return fail(e)
    from sgl_hicache.server.hints import HintSocketError, private_runtime_dir
    from sgl_hicache.server.terminate import Terminated

    try:
        with private_runtime_dir():  # the hint socket's directory, for every process of the server
            return run_sglang(sglang_argv)
    except HintSocketError as e:
        return fail(e)
    except Terminated as e:  # everything sglang started is stopped, the directory removed
        print(f"{PROG}: stopped by SIGTERM while the server started", file=sys.stderr)
        return int(e.code or 1)


def cpu_tp_defaults(argv: list[str]) -> dict[str, str]:
    """The CPU profile's environment for `--device cpu --tp-size N` (`sgl_hicache_cpu.cpu_tp_env`);
    ConfigError when N > 1 and that profile is not installed."""
    try:
        from sgl_hicache_cpu.cpu_tp_env import cpu_tp_env
    except ModuleNotFoundError as e:
        if e.name not in ("sgl_hicache_cpu", "sgl_hicache_cpu.cpu_tp_env"):
            raise
        width = _flag_value(argv, "--tp-size", "--tensor-parallel-size") or "1"
        if width.isdigit() and int(width) > 1:
            raise ConfigError(
                "--device cpu with --tp-size above 1 needs the CPU profile: pip install ./cpu "
                "from a source checkout (docs/DEVELOPMENT.md)"
            ) from None
        return {}
    return cpu_tp_env(argv)


_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() splits at


def fail(error: Exception) -> int:
    """Print `error` as one line (a line break in a value it quotes is escaped) and return exit code 2."""
    message = "".join(ascii(c)[1:-1] if c in _LINE_BREAKS else c for c in str(error))
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run_sglang(argv: list[str]) -> int:
    """What `python -m sglang.launch_server` does in its `__main__` block (sglang 0.5.23), plus our
    hooks in this process (`hooks.register_exit_hook`: this process made the runtime directory; a
    SIGTERM sglang's watchdog takes at once) and, until sglang's server handles it, SIGTERM as an
    exception (`terminate.exit_on_sigterm`), so that the `finally` below stops what sglang started."""
    from sgl_hicache.server.terminate import exit_on_sigterm

    exit_on_sigterm()
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sgl_hicache.server.hooks import register_exit_hook

    load_plugins()
    register_exit_hook()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
