"""Can the tier hold one extent? The least extent a server writes, and the checks that need it.

Eviction writes a leaf of at least `min_spill_tokens` tokens as one extent (shorter leaves are
dropped), and a radix node holds whole pages, so the least extent it writes holds the KV of
`min_spill_tokens` rounded up to whole pages, in a file of a 4096-byte header block and the payload
in whole blocks (`tier.volume.extent_floor`). A tier whose capacity, or whose volume above
`--hicache-spill-min-free`, is below that refuses every store: nothing could ever spill. With
`--tp-size N` the ranks on one machine share the directory's budget and volume, and each writes its
own extent of an evicted node (kept only if every rank's is): below N least extents no node could be
kept spilled on every rank. Anything larger can work, so only that is refused.

The KV bytes per token come from a local model's `config.json` and sglang's flags, as a floor (it
must never refuse what would work): the layers, the KV heads of one TP rank (sglang's
`max(1, heads // tp)`) and the head size, at the smallest element the KV cache may have: 1 byte
for an fp8 cache, 2 for bf16, and half a byte (an fp4 cache) where `--kv-cache-dtype auto` leaves
it to sglang. Without a readable `config.json` (a hub id) only the format's floor applies: one
header block and one payload block.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from sgl_hicache.config import ConfigError, SpillBackend, SpillConfig, TierConfig, flag_named, format_size
from sgl_hicache.tier.file.volume import VolumeShort, extent_floor, human, too_small

ELEMENT_BYTES = {"bf16": Fraction(2), "bfloat16": Fraction(2), "fp8_e5m2": Fraction(1),
                 "fp8_e4m3": Fraction(1), "mxfp8": Fraction(1)}  # fmt: skip
"""The bytes of one KV element for a `--kv-cache-dtype`; any other (auto, fp4 recipes): `LEAST_ELEMENT`."""
LEAST_ELEMENT = Fraction(1, 2)
logger = logging.getLogger(__name__)


def least_tokens(config: SpillConfig, page_size: int | None) -> int:
    """The tokens of the least extent an eviction writes: `min_spill_tokens` in whole pages."""
    page = max(page_size or 1, 1)
    return -(-config.min_spill_tokens // page) * page


def least_extent(
    config: SpillConfig, page_size: int | None = None, token_bytes: Fraction | None = None
) -> int:
    """The least file size of an extent an eviction writes (`token_bytes`: a floor of the KV bytes
    of one token on one TP rank; None: unknown, so the format's floor)."""
    payload = math.ceil(least_tokens(config, page_size) * token_bytes) if token_bytes else 1
    return extent_floor(payload, config.tier.compression)


def kv_token_bytes(model: Mapping[str, Any], args: Any) -> Fraction | None:
    """A floor of the KV bytes of one token on one TP rank of the model whose `config.json` is
    `model`, under sglang's parsed flags `args`; None if the file does not say (then no floor)."""
    text = model["text_config"] if isinstance(model.get("text_config"), dict) else model
    layers = _positive(text.get("num_hidden_layers"))
    element = ELEMENT_BYTES.get(str(args.kv_cache_dtype), LEAST_ELEMENT)
    if layers is None:
        return None
    latent = _positive(text.get("kv_lora_rank"))
    if latent is not None:  # MLA: one latent vector (and its rope part) per layer, not sharded
        return layers * (latent + (_positive(text.get("qk_rope_head_dim")) or 0)) * element
    heads = _positive(text.get("num_attention_heads"))
    kv_heads = _positive(text.get("num_key_value_heads")) or heads
    head_dim = _positive(text.get("head_dim"))
    if head_dim is None and heads is not None and _positive(text.get("hidden_size")) is not None:
        head_dim = text["hidden_size"] // heads
    if kv_heads is None or not head_dim:
        return None
    per_rank = max(1, kv_heads // max(int(args.tp_size or 1), 1))
    return layers * per_rank * head_dim * 2 * element  # K and V


def ranks_here(args: Any) -> int:
    """The TP ranks of sglang's parsed flags `args` that run on this machine (`--tp-size` over
    `--nnodes`): each allocates its own staging and writes its own extents."""
    return max(1, max(int(args.tp_size or 1), 1) // max(int(getattr(args, "nnodes", 1) or 1), 1))


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_room(
    config: SpillConfig, directory: Path, page_size: int | None = None, token_bytes: Fraction | None = None,
    ranks: int = 1,
) -> None:  # fmt: skip
    """ConfigError (naming the flag) if the capacity, or the volume of `directory` (the tier
    directory's nearest existing ancestor) above the free-space watermark, cannot hold the least
    extent (`least_extent` of the same arguments) of each of `ranks` TP ranks: they share the
    directory's budget and volume, and each writes its own extent of an evicted node (kept only if
    every rank's is). The file tier only: a Mooncake Store's capacity is its master's."""
    if config.tier.backend is not SpillBackend.FILE:
        return
    need = least_extent(config, page_size, token_bytes) * ranks
    capacity = config.tier.capacity_bytes
    if capacity < need:
        flag = flag_named(TierConfig, "capacity_bytes")
        raise ConfigError(
            f"{flag}: {format_size(capacity)} cannot hold one extent{_each(ranks)} (at least {format_size(need)}: "
            f"{_least_why(config, page_size, token_bytes, ranks)}), so {_refused(ranks)}; raise {flag}",
            "capacity_bytes",
        )
    short = too_small(config.tier, directory, need)
    if short is not None:
        raise ConfigError(volume_refusal(short, ranks), "min_free_bytes")


def _each(ranks: int) -> str:
    return f" for each of {ranks} TP ranks" if ranks > 1 else ""


def _refused(ranks: int) -> str:
    return "every store would be refused" if ranks == 1 else "no node could be kept spilled on every rank"


def _least_why(config: SpillConfig, page_size: int | None, token_bytes: Fraction | None, ranks: int) -> str:
    """What the least extent of each of `ranks` ranks is made of, in words."""
    times = f"{ranks} × " if ranks > 1 else ""
    if not token_bytes:
        return f"{times}a 4K header and a 4K block of KV"
    kv, tokens = ("the KV" if ranks == 1 else "one rank's KV"), least_tokens(config, page_size)
    return f"{times}a 4K header and {kv} of {tokens} tokens, min_spill_tokens in whole pages, of this model"


def volume_refusal(short: VolumeShort, ranks: int = 1) -> str:
    """Why the volume `short` cannot keep an evicted node of `ranks` TP ranks, in words that name the flag."""
    flag = flag_named(TierConfig, "min_free_bytes")
    counted = " (counted as no_space)" if ranks == 1 else ""
    return (
        f"{flag}: the volume of {short.directory} holds {human(short.total)} in all, not above the "
        f"{format_size(short.min_free)} to keep free plus one extent{_each(ranks)} (at least "
        f"{format_size(short.least)}), so {_refused(ranks)}{counted}; lower {flag} or use a larger volume"
    )


def warn_if_too_small(cfg: TierConfig) -> None:
    """One warning if the volume of the file tier of `cfg` (its directory exists: the tier is open)
    cannot hold the format's least extent above the watermark: a server started without our
    launcher (`sglang.launch_server` with our backend) was not refused before it started."""
    short = too_small(cfg, cfg.directory)
    if short is not None:
        logger.warning("spill tier: %s", volume_refusal(short))


def check_staging_room(config: SpillConfig, page_size: int | None, token_bytes: Fraction | None) -> None:
    """ConfigError (naming the flag) if staging cannot hold the packed KV of the least extent an
    eviction writes (`least_tokens` of the model's KV, a floor): no node could ever spill or be
    restored. Only the least extent is known here: a node may be as long as a whole prompt, so a
    longer one staging cannot hold is dropped at its eviction (counted, logged once), and a history
    of many extents streams through staging whatever its length."""
    if not token_bytes:
        return
    tokens = least_tokens(config, page_size)
    least = math.ceil(tokens * token_bytes)
    if config.staging_bytes < least:
        flag = flag_named(SpillConfig, "staging_bytes")
        raise ConfigError(
            f"{flag}: {format_size(config.staging_bytes)} cannot hold one extent (at least {format_size(least)}: "
            f"the KV of {tokens} tokens, min_spill_tokens in whole pages, of this model), so nothing could "
            f"spill; raise {flag}",
            "staging_bytes",
        )
