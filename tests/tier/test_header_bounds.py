"""A header read without its MAC (`decode_fixed(..., None)`: fsck, the alias reader a removal runs)
is someone else's bytes: its sizes must be checked without allocating what they claim.

Found by CI: test_integrity's bit flips drew one in the payload length of an extent that the tier
then removed as corrupt; the removal's alias reader decoded the flipped header without its MAC and
built a chunk list of ~10^9 entries (24 GB, the OOM killer ended the run). Runs in a child process
whose address space is capped, so a regression fails as MemoryError instead of taking the machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import resource
    from sgl_hicache.tier.format import _FIXED, FormatError, decode_fixed
    from tests.tier.common import CHUNK, NS, payload_for
    {build}
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), vm + (512 << 20)))
    try:
        decode_fixed(bad, None)
    except FormatError as e:
        print("FormatError", e)
    """
)


def _child(directory: Path, field: int, value: int) -> subprocess.CompletedProcess[str]:
    build = textwrap.dedent(
        f"""
        from pathlib import Path
        from sgl_hicache.config import TierConfig
        from sgl_hicache.tier import ROOT_KEY, chain_key, open_tier
        d = Path({str(directory)!r})
        tier = open_tier(TierConfig(directory=d / "t", capacity_bytes=64 << 20, chunk_bytes=CHUNK,
                                    min_free_bytes=0), NS)
        tokens = list(range(700))
        assert tier.wait(tier.submit_store(chain_key(NS.id, ROOT_KEY, tokens), payload_for(7, 2 * CHUNK + 3000),
                                           tokens, ROOT_KEY)).ok
        tier.close()
        raw = next((d / "t").rglob("*.ext")).read_bytes()[: _FIXED.size]
        fields = list(_FIXED.unpack(raw))
        fields[{field}] = {value}
        bad = _FIXED.pack(*fields)
        """
    )
    code = CHILD.replace("{build}", build)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "field, value",
    [
        (17, 1 << 62),
        (17, 40 << 30),
        (15, 4096),
    ],  # payload_len huge; chunk_bytes one page under a large payload
    ids=["payload_len_2^62", "payload_len_40G", "chunk_bytes_4K"],
)
def test_a_header_read_without_its_mac_claiming_huge_sizes_is_refused_without_allocating_them(
    field: int, value: int, tmp_path: Path
) -> None:
    done = _child(tmp_path, field, value)
    assert done.returncode == 0 and done.stdout.startswith("FormatError"), done.stderr[-2000:] or done.stdout
