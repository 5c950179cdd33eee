"""sglang's own flags, read by sglang's own argument parser before sglang starts.

sglang 0.5.23's `prepare_server_args` builds a plain `argparse.ArgumentParser` with
`ServerArgs.add_cli_args` (abbreviations allowed; a `--config FILE` merged in first) and, on a bad
flag, prints a 480-line usage after all of sglang's imports. The launcher runs that same parser on
the arguments ours left over, so that an unknown flag (with the closest of ours or sglang's), a bad
value, a combination the hicache_spill backend refuses, and a model it cannot serve
(`model_check`) are one line and exit code 2. It imports `sglang.srt.server_args` only (seconds,
and quiet); the seam check and sglang's own start follow. With another sglang version installed it
checks nothing: the seam check says why that cannot start.
"""

from __future__ import annotations

import argparse
import os
from importlib import metadata
from typing import Any, NoReturn

from sgl_hicache import BACKEND_NAME
from sgl_hicache.cache.identity import UNISOLATED
from sgl_hicache.config import ConfigError, SpillConfig
from sgl_hicache.server.flags import flag_names, unknown_flag
from sgl_hicache.server.model_check import check_model, read_config
from sgl_hicache.server.room import check_room, check_staging_room, kv_token_bytes, ranks_here
from sgl_hicache.server.sglang_seam import SUPPORTED_VERSION
from sgl_hicache.server.validate import check_staging, nearest_existing

LOCAL_PREFIXES = ("/", "./", "../", "~")  # a --model-path that can only be a local path


class _Parser(argparse.ArgumentParser):
    """argparse's refusals (a bad choice, a missing value) as ConfigError: one line, not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def sglang_parser(prog: str) -> argparse.ArgumentParser:
    """sglang's argument parser, as `prepare_server_args` builds it."""
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog=prog)
    ServerArgs.add_cli_args(parser)
    return parser


def check_sglang_args(argv: list[str], prog: str, config: SpillConfig | None = None) -> None:
    """Parse `argv` (sglang's arguments) as sglang will; raises ConfigError for what it would refuse
    (a local model path that does not exist, too) and, with our backend, for what we refuse
    (`refuse_with_our_backend`, the model, a tier of `config` too small for one of its extents, the
    staging of every TP rank on this machine more than its memory)."""
    if not supported():
        return
    parser = sglang_parser(prog)
    args, unknown = parser.parse_known_args(_with_config_file(parser, argv))
    if unknown:
        raise ConfigError(_unknown(unknown[0], parser))
    check_model_path(args.model_path)
    if args.radix_cache_backend == BACKEND_NAME:
        refuse_with_our_backend(args)
        check_model(args)
        if config is not None and config.enabled:
            ranks = ranks_here(args)
            check_staging(config.staging_bytes, ranks)
            model = read_config(args.model_path)
            token_bytes = kv_token_bytes(model, args) if model is not None else None
            check_room(config, nearest_existing(config.tier.directory), args.page_size, token_bytes, ranks)
            check_staging_room(config, args.page_size, token_bytes)


def check_model_path(model_path: str | None) -> None:
    """ConfigError for a `--model-path` that can only be a local path (absolute, `./`, `../`, `~`)
    and names nothing: sglang would take it for a Hugging Face id and fail after its start. Anything
    else (`org/name`) is left to sglang."""
    if not model_path or not model_path.startswith(LOCAL_PREFIXES) or os.path.exists(model_path):
        return
    hint = ""
    if model_path.startswith("~") and os.path.exists(os.path.expanduser(model_path)):
        hint = f" (sglang does not expand ~: give {os.path.expanduser(model_path)})"
    raise ConfigError(f"--model-path {model_path}: no such file or directory{hint}")


def supported() -> bool:
    """Whether the installed sglang is the version whose parser this reads (`check_seam` says more)."""
    try:
        return metadata.version("sglang") == SUPPORTED_VERSION
    except metadata.PackageNotFoundError:
        return False


def refuse_with_our_backend(args: Any) -> None:
    """ConfigError naming the first of sglang's flags in `args` the hicache_spill backend refuses."""
    if args.enable_hierarchical_cache:
        raise ConfigError("--enable-hierarchical-cache: not supported with the hicache_spill backend (it "
                          "replaces sglang's HiCache: pass --enable-hicache-spill or it, not both)")  # fmt: skip
    if args.speculative_algorithm is not None:
        raise ConfigError(f"--speculative-algorithm {args.speculative_algorithm}: not supported with the "
                          "hicache_spill backend yet (the tier holds the target model's KV only)")  # fmt: skip
    for entry in UNISOLATED:  # as given on the command line ours checked, but also abbreviated
        if entry.active(getattr(args, entry.field)):
            raise ConfigError(entry.message())
    refuse_unserved(args.disable_radix_cache, args.disaggregation_mode)


def refuse_unserved(disable_radix_cache: bool, disaggregation_mode: str) -> None:
    """ConfigError for a server our backend would not serve right: one without a radix cache (it
    would spill nothing, silently), or one side of a prefill/decode disaggregation. Also checked by
    the cache factory, with sglang's resolved values (a server started without our launcher)."""
    if disable_radix_cache:
        raise ConfigError("--disable-radix-cache: not supported with the hicache_spill backend (it spills "
                          "what the radix cache evicts: without one it would spill and restore nothing)")  # fmt: skip
    if disaggregation_mode in ("prefill", "decode"):
        raise ConfigError(
            f"--disaggregation-mode {disaggregation_mode}: not supported with the hicache_spill backend yet "
            "(sglang sends a request's cached prefix to the decode server without waiting for its "
            "restore from the tier to land, so the decode server could receive KV not yet written)"
        )


def _with_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with sglang's `--config FILE` merged in, as `prepare_server_args` does."""
    if "--config" not in argv:
        return argv
    import yaml
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    try:
        return list(ConfigArgumentMerger(parser).merge_config_with_args(argv))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"--config: {' '.join(str(e).split())}") from None


def _unknown(arg: str, parser: argparse.ArgumentParser) -> str:
    if not arg.startswith("-"):
        return f"unexpected argument {arg!r}"
    name = arg.partition("=")[0]
    if name in flag_names():
        return f"{name}: give our flags on the command line (sglang's --config file takes sglang's only)"
    return unknown_flag(name, [*flag_names(), *parser._option_string_actions])
