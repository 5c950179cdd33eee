"""Format v6: layer-grouped payloads. Round trips and page prefixes are bit-exact on both backends,
each group's chunks are verified on their own (a corrupt chunk in group 2 leaves groups 0 and 1
verified), and page-major extents of format v5 still load, also rearranged into groups."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from sgl_hicache.config import Compression, SpillBackend, TierConfig
from sgl_hicache.tier import (
    ROOT_KEY,
    ExtentKey,
    IndexedTier,
    KVDtype,
    KVLayout,
    Namespace,
    Status,
    chain_key,
    open_tier,
)
from sgl_hicache.tier.format import FIXED_SIZE, MAC_BYTES, DirectoryMac, decode_fixed, file_bound
from sgl_hicache.tier.groups import section_lengths
from tests.tier.common import CHUNK

LAYERS, PAGE = 5, 4
LAYOUT = KVLayout(num_layers=LAYERS, num_heads=2, head_dim=64, dtype=KVDtype.BF16, page_size=PAGE)
LAYER_PAGE = 9000  # bytes of one page of one layer: sections are not chunk- nor 4096-aligned
TOKENS = 10 * PAGE - 3  # ten pages, the last partial
PAGES = -(-TOKENS // PAGE)


def canonical(seed: int = 1) -> np.ndarray:
    """[page, layer, bytes]: what any layout of the payload rearranges."""
    return np.random.default_rng(seed).integers(0, 256, (PAGES, LAYERS, LAYER_PAGE), dtype=np.uint8)


def laid_out(canon: np.ndarray, group_layers: int, pages: int | None = None) -> bytes:
    """The first `pages` pages in groups of `group_layers` layers (0: page-major)."""
    part = canon[: PAGES if pages is None else pages]
    if not group_layers:
        return part.tobytes()
    return b"".join(part[:, lo : lo + group_layers].tobytes() for lo in range(0, LAYERS, group_layers))


def tokens() -> list[int]:
    return list(range(TOKENS))


@pytest.fixture(params=[SpillBackend.FILE, SpillBackend.MOONCAKE])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., IndexedTier]]:
    backend: SpillBackend = request.param
    extra = {}
    if backend is SpillBackend.MOONCAKE:
        extra["mooncake"] = request.getfixturevalue("mooncake_master").config()
    ns = Namespace(f"groups-{time.monotonic_ns()}", LAYOUT)
    opened: list[IndexedTier] = []

    def make(**kw: object) -> IndexedTier:
        cfg = TierConfig(backend=backend, directory=tmp_path / "tier", capacity_bytes=64 << 20, min_free_bytes=0,
                         chunk_bytes=CHUNK, io_threads=4, **extra, **kw)  # type: ignore[arg-type]  # fmt: skip
        opened.append(open_tier(cfg, ns))
        return opened[-1]

    yield make
    threads = [threading.Thread(target=tier.close, args=(5,)) for tier in opened]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def key_of(tier: IndexedTier) -> ExtentKey:
    return chain_key(tier.namespace.id, ROOT_KEY, tokens())


@pytest.mark.parametrize("compression", [Compression.NONE, Compression.ZSTD])
@pytest.mark.parametrize("group_layers", [2, 1])
def test_grouped_round_trip_and_page_prefixes(make_tier, compression, group_layers):
    tier, canon = make_tier(compression=compression), canonical()
    payload = np.frombuffer(laid_out(canon, group_layers), dtype=np.uint8)
    assert tier.wait(
        tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY, group_layers=group_layers)
    ).ok
    for pages in (PAGES, 1, 3, PAGES - 1):
        nbytes = pages * LAYERS * LAYER_PAGE
        dest = np.zeros(nbytes + 7, dtype=np.uint8)
        done = tier.wait(tier.submit_load(key_of(tier), dest, nbytes))
        assert (done.status, done.nbytes) == (Status.OK, nbytes)
        assert dest[:nbytes].tobytes() == laid_out(canon, group_layers, pages), f"{pages} pages"
        assert not dest[nbytes:].any()
    # another grouping, and page-major, delivered rearranged after verification
    for other in (0, 3):
        dest = np.zeros(payload.nbytes, dtype=np.uint8)
        assert tier.wait(tier.submit_load(key_of(tier), dest, None, group_layers=other)).ok
        assert dest.tobytes() == laid_out(canon, other)


def test_a_load_of_part_of_a_page_or_of_unequal_layers_is_refused(make_tier):
    tier, canon = make_tier(), canonical()
    payload = np.frombuffer(laid_out(canon, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match="equal layers"):
        tier.submit_store(key_of(tier), payload[:-1], tokens(), ROOT_KEY, group_layers=2)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY, group_layers=2)).ok
    done = tier.wait(
        tier.submit_load(key_of(tier), np.zeros(payload.nbytes, np.uint8), LAYER_PAGE * LAYERS + 1)
    )
    assert done.status is Status.REJECTED and tier.contains(key_of(tier))


def ext_path(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "tier").rglob("*.ext")
    return path


@pytest.mark.parametrize("make_tier", [SpillBackend.FILE], indirect=True)
def test_a_corrupt_chunk_in_group_2_fails_only_group_2(make_tier, tmp_path):
    """Groups 0 and 1 of a load are verified and land (`landed` covers exactly them), group 2's
    chunk fails its checksum: the load is CORRUPT, and no byte of group 2 counts."""
    tier, canon = make_tier(), canonical()
    payload = np.frombuffer(laid_out(canon, 2), dtype=np.uint8)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY, group_layers=2)).ok
    sections = section_lengths(payload.nbytes, TOKENS, PAGE, LAYERS, 2)
    assert len(sections) == 3
    path = ext_path(tmp_path)
    header = decode_fixed(path.read_bytes()[:FIXED_SIZE], None)
    starts = [sum(-(-n // CHUNK) for n in sections[:g]) for g in range(3)]  # first chunk of each group
    stored_at = 0
    for length in sections[:2]:  # uncompressed chunks: each at the 4096-aligned end of the one before
        stored_at += sum(-(-min(CHUNK, length - o) // 4096) * 4096 for o in range(0, length, CHUNK))
    assert starts[2] == 2 * (-(-sections[0] // CHUNK))
    raw = bytearray(path.read_bytes())
    raw[header.header_len + stored_at + 11] ^= 0xFF  # group 2's first chunk
    path.write_bytes(bytes(raw))
    dest = np.zeros(payload.nbytes, dtype=np.uint8)
    ticket = tier.submit_load(key_of(tier), dest)
    deadline = time.monotonic() + 30
    while tier.stats().checksum_failures == 0:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    group_1_end = sections[0] + sections[1]
    assert tier.landed(ticket) == group_1_end, "groups 0 and 1 verified; group 2 not"
    assert dest[:group_1_end].tobytes() == payload[:group_1_end].tobytes()
    assert tier.wait(ticket).status is Status.CORRUPT


def reseal_as(path: Path, root: Path, version: int) -> None:
    """Rewrite a file's fixed header as format `version` (an older writer's), sealed again."""
    raw = bytearray(path.read_bytes())
    raw[8:10] = version.to_bytes(2, "little")
    seal = DirectoryMac((root / ".secret").read_bytes())
    mac_at = FIXED_SIZE - MAC_BYTES
    raw[mac_at:FIXED_SIZE] = seal.header(bytes(raw[:mac_at]))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("make_tier", [SpillBackend.FILE], indirect=True)
def test_page_major_extents_of_format_v5_still_load_also_in_groups(make_tier, tmp_path):
    tier, canon = make_tier(), canonical(7)
    payload = np.frombuffer(laid_out(canon, 0), dtype=np.uint8)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY)).ok
    path = ext_path(tmp_path)
    reseal_as(path, tmp_path / "tier", 5)
    assert struct.unpack_from("<H", path.read_bytes(), 8)[0] == 5
    again = make_tier()  # a restarted server: its scan indexes the v5 file
    assert again.contains(key_of(again))
    for group_layers, pages in ((None, PAGES), (0, 3), (2, PAGES), (2, 4), (1, 1)):
        nbytes = pages * LAYERS * LAYER_PAGE
        dest = np.zeros(nbytes, dtype=np.uint8)
        done = again.wait(again.submit_load(key_of(again), dest, nbytes, group_layers=group_layers))
        assert (done.status, done.nbytes) == (Status.OK, nbytes)
        assert dest.tobytes() == laid_out(canon, group_layers or 0, pages), (group_layers, pages)


@pytest.mark.parametrize("make_tier", [SpillBackend.FILE], indirect=True)
def test_file_bound_holds_a_grouped_extent(make_tier, tmp_path):
    tier, canon = make_tier(), canonical()
    payload = np.frombuffer(laid_out(canon, 2), dtype=np.uint8)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY, group_layers=2)).ok
    sections = section_lengths(payload.nbytes, TOKENS, PAGE, LAYERS, 2)
    size = ext_path(tmp_path).stat().st_size
    assert size <= file_bound(payload.nbytes, TOKENS, CHUNK, 0, sections)
    assert size > file_bound(payload.nbytes, TOKENS, CHUNK, 0) - 4096 * len(sections), "per-section chunks"


@pytest.mark.parametrize("make_tier", [SpillBackend.FILE], indirect=True)
def test_review_a_load_rearranged_into_groups_lands_nothing_before_it_completes(make_tier, tmp_path):
    """Review of issue 37 (closes a test gap; passes on main): a page-major extent (format v5)
    loaded in layer groups is rearranged only once every chunk is verified, so `landed` must report
    nothing before then: its verified prefix is page-major bytes, which a caller reading them as
    group 0 (early unpack, a layer-wise restore) would unpack as wrong KV. No other test fails when
    `LoadProgress.landed` ignores `plan.convert`. Here the last chunk is corrupt: every other chunk is
    verified, and still nothing may count as landed."""
    tier, canon = make_tier(), canonical(3)
    payload = np.frombuffer(laid_out(canon, 0), dtype=np.uint8)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY)).ok
    path = ext_path(tmp_path)
    reseal_as(path, tmp_path / "tier", 5)
    again = make_tier()
    header = decode_fixed(path.read_bytes()[:FIXED_SIZE], None)
    last = -(-payload.nbytes // CHUNK) - 1  # page-major: chunk i stored at i * CHUNK
    raw = bytearray(path.read_bytes())
    raw[header.header_len + last * CHUNK + 5] ^= 0xFF  # the last chunk
    path.write_bytes(bytes(raw))
    dest = np.zeros(payload.nbytes, dtype=np.uint8)
    ticket = again.submit_load(key_of(again), dest, None, group_layers=2)
    deadline = time.monotonic() + 30
    while again.stats().checksum_failures == 0:  # counted once every chunk of the load is done
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert again.landed(ticket) == 0, "page-major bytes reported as landed in a grouped load"
    assert again.wait(ticket).status is Status.CORRUPT


def test_a_load_rearranged_into_another_grouping_lands_whole_once_rearranged(make_tier):
    """Issue 37 (the load's verified prefix shared by both backends, `progress.LoadProgress`): a
    load delivered in another grouping than the extent's lands nothing before it is rearranged,
    then, as any finished load, all of it until its completion is returned (`Tier.landed`), in
    the grouping asked for."""
    tier, canon = make_tier(), canonical(5)
    payload = np.frombuffer(laid_out(canon, 2), dtype=np.uint8)
    assert tier.wait(tier.submit_store(key_of(tier), payload, tokens(), ROOT_KEY, group_layers=2)).ok
    dest = np.zeros(payload.nbytes, dtype=np.uint8)
    ticket = tier.submit_load(key_of(tier), dest, None, group_layers=0)
    deadline = time.monotonic() + 30
    while tier.stats().loads == 0:  # counted once rearranged, before the completion is posted
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert tier.landed(ticket) == payload.nbytes
    assert dest.tobytes() == laid_out(canon, 0)
    assert tier.wait(ticket).ok and tier.landed(ticket) == 0
