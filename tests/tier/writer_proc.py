"""Child process for the crash and sharing tests: stores (or loads) extents until killed."""

from __future__ import annotations

import sys
from pathlib import Path

from sgl_hicache.config import Fsync, TierConfig
from sgl_hicache.tier import ROOT_KEY, Status, open_tier
from tests.tier.common import CHUNK, NS, key_for, payload_for


def size_of(i: int) -> int:
    return 3000 + (i * 7919) % (3 * CHUNK)


def main(directory: str, mode: str, first: int, count: int, capacity: int) -> None:
    cfg = TierConfig(
        directory=Path(directory),
        capacity_bytes=capacity,
        chunk_bytes=CHUNK,
        min_free_bytes=0,
        fsync=Fsync.DATA,
    )
    tier = open_tier(cfg, NS)
    print("ready", flush=True)
    for i in range(first, first + count):
        if mode == "store":
            tier.submit_store(key_for(i), payload_for(i, size_of(i)), [i, i + 1], ROOT_KEY)
            tier.get_finished()
        else:
            buf = bytearray(size_of(i))
            done = tier.wait(tier.submit_load(key_for(i), buf))
            assert done.status in (Status.OK, Status.MISS), done
            assert not done.ok or bytes(buf) == payload_for(i, size_of(i)).tobytes(), f"torn read of {i}"
    tier.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
