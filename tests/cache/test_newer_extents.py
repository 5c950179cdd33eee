"""An extent of a newer format version (a newer sgl_hicache shares the tier: a rolling upgrade) is a
clean miss for the cache (issue 38, 10): counted as lost, never as corrupt (operators alert on
corruption), recomputed, and its file is left to the server that wrote it."""

from __future__ import annotations

from typing import Any

from sgl_hicache.tier import format as fmt
from sgl_hicache.tier.format import FIXED_SIZE, MAC_BYTES, DirectoryMac
from sgl_hicache.tier.trust import SECRET_NAME

A = list(range(100, 164))


def test_a_newer_extent_is_lost_not_corrupt_and_kept(make_stack: Any) -> None:
    s = make_stack()
    s.insert(A)
    s.evict_all()
    (path,) = s.tier_dir.rglob("*" + fmt.EXTENT_SUFFIX)
    data = bytearray(path.read_bytes())
    data[8:10] = (fmt.VERSION + 1).to_bytes(2, "little")
    maced = FIXED_SIZE - MAC_BYTES
    data[maced:FIXED_SIZE] = DirectoryMac((s.tier_dir / SECRET_NAME).read_bytes()).header(bytes(data[:maced]))
    path.write_bytes(bytes(data))
    m = s.match(A)
    assert s.load_back(m) == (0, m.last_device_node)
    totals = s.metrics.totals
    assert (totals["lost_extents"], totals["corrupt_extents"], totals["restore_failures"]) == (1, 0, 1)
    assert path.exists() and s.cache.controller.tier.stats().newer_extents == 1
    assert s.match(A).host_hit_length == 0, "the lost node is pruned"
    s.cache.check_integrity(with_tier=False)  # the tier's check would list the newer file as another writer's
