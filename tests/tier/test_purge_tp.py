"""With TP > 1 each rank purges only its own namespace (issue 38, 10): every rank receives the purge
and removes its own files, through its own index; rank 0 also removes those of namespaces that are
no rank's of its server (other models, older weights, another TP size). A rank that removed a
sibling's files would leave the sibling's index naming files that are gone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sgl_hicache.tier import ROOT_KEY, KVDtype, KVLayout, Namespace, Tier
from sgl_hicache.tier.results import Op
from tests.tier.common import key_for, payload_for, tokens_for

LAYOUT = KVLayout(2, 2, 64, KVDtype.BF16, 4)
RANK0, RANK1 = (Namespace("tp-model", LAYOUT, tp_rank=r, tp_size=2) for r in (0, 1))
OTHER_MODEL = Namespace("another-model", LAYOUT)


def store(tier: Tier, i: int, salt: str | None) -> None:
    ns = tier.namespace
    ticket = tier.submit_store(
        key_for(i, ns), payload_for(i, 20_000), tokens_for(i), ROOT_KEY, cache_salt=salt
    )
    assert tier.wait(ticket, timeout=30).ok


def purge(tier: Tier, salt: str) -> int:
    done = tier.wait(tier.submit_purge(salt), timeout=30)
    assert done.op is Op.PURGE and done.ok, done
    return done.nbytes


def on_disk(root: Path, i: int, ns: Namespace) -> bool:
    return (root / ns.id.hex() / key_for(i, ns).hex()[:2] / f"{key_for(i, ns).hex()}.ext").exists()


def test_each_rank_purges_its_own_namespace_and_rank_0_the_foreign_ones(
    make_tier: Callable[..., Tier], tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    rank0, rank1, other = make_tier(ns=RANK0), make_tier(ns=RANK1), make_tier(ns=OTHER_MODEL)
    for tier in (rank0, rank1, other):
        store(tier, 1, "s")
        store(tier, 2, "kept")
    assert purge(rank1, "s") == 1  # its own file only
    assert not on_disk(root, 1, RANK1) and on_disk(root, 1, RANK0) and on_disk(root, 1, OTHER_MODEL)
    assert purge(rank0, "s") == 2  # its own and the other model's
    assert not on_disk(root, 1, RANK0) and not on_disk(root, 1, OTHER_MODEL)
    assert all(on_disk(root, 2, ns) for ns in (RANK0, RANK1, OTHER_MODEL))
    assert not rank0.contains(key_for(1, RANK0)) and not rank1.contains(key_for(1, RANK1))
    rank0.check_integrity()
    rank1.check_integrity()  # its index names no file that another rank removed


def test_rank_1s_purge_leaves_rank_0s_files_for_rank_0(
    make_tier: Callable[..., Tier], tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    rank0, rank1 = make_tier(ns=RANK0), make_tier(ns=RANK1)
    store(rank0, 1, "s")
    store(rank1, 1, "s")
    assert purge(rank0, "s") == 1
    assert on_disk(root, 1, RANK1) and rank1.contains(key_for(1, RANK1))
    rank1.check_integrity()
    assert purge(rank1, "s") == 1 and not on_disk(root, 1, RANK1)
    assert purge(rank0, "s") == 0 and purge(rank1, "s") == 0  # nothing left: a purge again is a no-op
    rank1.check_integrity()
