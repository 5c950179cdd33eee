"""`RestorePolicy`: the one place the prefetch policy (`--hicache-spill-prefetch-policy`) becomes
time limits. Everything that waits for I/O before admitting a request asks it; nothing else reads
`SpillConfig.prefetch_policy`.

Two waits follow from the policy. Neither blocks: the scheduler asks again each round, and each
wait counts from when it began.
- **A lookup's** (`lookup_wait_s`): how long a request's admission is skipped while its cross-server
  lookup runs (lookups.py; the admission hook asks `SpillRadixCache.lookup_waiting`). Past it the
  request is admitted without what the lookup may still find.
- **A restore's** (`restore_wait_s`): how long admission is deferred while the reads of the
  request's spilled prefix land (`SpillRadixCache.init_load_back`). Past it the request recomputes
  that prefix (`restores_too_late`).

A restore's first attempt may also **hold** admission, blocking a bounded moment for reads in
flight (`hold_share` of what a deferral costs, within `restore_wait_s`; cache/admission_hold.py).

One rule per policy:
- WAIT_COMPLETE: a lookup waits up to `prefetch_timeout_s`; a restore waits until its reads land or
  fail, bounded by the tier's I/O timeout (`io_timeout_s`: max(`prefetch_timeout_s`, 10 s)); holds
  at `admission_hold`.
- TIMEOUT: both wait up to `prefetch_timeout_s`; holds at `admission_hold`.
- BEST_EFFORT: neither waits (a lookup's admission is never skipped; a restore whose reads have
  not landed recomputes at once), nor holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_hicache.config import PrefetchPolicy, SpillConfig


@dataclass(frozen=True)
class RestorePolicy:
    lookup_wait_s: float  # 0: admission never waits for a running lookup
    restore_wait_s: float  # 0: admission is never deferred for reads in flight
    hold_share: float = 0.0  # 0: a first attempt never holds admission for its reads

    @staticmethod
    def of(config: SpillConfig) -> RestorePolicy:
        """The limits of `config`'s prefetch policy (see the module doc)."""
        timeout_s = config.prefetch_timeout_s
        match config.prefetch_policy:
            case PrefetchPolicy.WAIT_COMPLETE:
                return RestorePolicy(timeout_s, config.io_timeout_s, config.admission_hold)
            case PrefetchPolicy.TIMEOUT:
                return RestorePolicy(timeout_s, timeout_s, config.admission_hold)
            case PrefetchPolicy.BEST_EFFORT:
                return RestorePolicy(lookup_wait_s=0.0, restore_wait_s=0.0)
