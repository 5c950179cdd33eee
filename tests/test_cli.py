"""`sgl-hicache inspect` / `fsck` on tiers written through the real tier API, run as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sgl_hicache.cli.summary import human_bytes
from sgl_hicache.config import Compression, Fsync, TierConfig
from sgl_hicache.tier import ROOT_KEY, ExtentKey, KVDtype, KVLayout, Namespace, Tier, chain_key, open_tier
from sgl_hicache.tier.file.owner import Writer, host_tag, me
from sgl_hicache.tier.format import decode_fixed

CHUNK = 64 * 1024
NS_A = Namespace("cli-model-a", KVLayout(2, 2, 64, KVDtype.BF16, 4))
NS_B = Namespace("cli-model-b", KVLayout(4, 8, 128, KVDtype.FP16, 16))
SIZES_A = [3 * CHUNK + 100, CHUNK, 5000, 2 * CHUNK]  # payload bytes of NS_A's extents
SIZES_B = [CHUNK + 1]

OpenTier = Callable[[Namespace], Tier]


@dataclass(frozen=True)
class Stored:
    key: ExtentKey
    tokens: list[int]
    payload: np.ndarray
    path: Path


@dataclass(frozen=True)
class TierDir:
    root: Path
    a: list[Stored]
    b: list[Stored]
    file_bytes_a: int  # as the tier's index accounts them


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sgl_hicache.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(params=[Compression.NONE, Compression.ZSTD], ids=str)
def open_tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenTier]:
    """Opens tiers on tmp_path/tier (uncompressed, then zstd); all are closed at teardown."""
    opened: list[Tier] = []

    def make(ns: Namespace) -> Tier:
        cfg = TierConfig(
            directory=tmp_path / "tier", capacity_bytes=64 << 20, min_free_bytes=0, chunk_bytes=CHUNK,
            compression=request.param, io_threads=2, fsync=Fsync.NONE,
        )  # fmt: skip
        opened.append(open_tier(cfg, ns))
        return opened[-1]

    yield make
    for tier in opened:
        tier.close()


def store_all(tier: Tier, root: Path, sizes: list[int], seed: int) -> list[Stored]:
    out = []
    for i, size in enumerate(sizes):
        tokens = list(range(seed + 10 * i, seed + 10 * i + 3 + i))
        key = chain_key(tier.namespace.id, ROOT_KEY, tokens)
        payload = np.random.default_rng(seed + i).integers(0, 256, size, dtype=np.uint8)
        assert tier.wait(tier.submit_store(key, payload, tokens, ROOT_KEY), timeout=30).ok
        path = root / tier.namespace.id.hex() / key.hex()[:2] / f"{key.hex()}.ext"
        out.append(Stored(key, tokens, payload, path))
    return out


@pytest.fixture
def tier_dir(open_tiers: OpenTier, tmp_path: Path) -> TierDir:
    """Two namespaces written through the tier API (4 extents and 1); the tiers are closed."""
    root = tmp_path / "tier"
    tier_a, tier_b = open_tiers(NS_A), open_tiers(NS_B)
    a, b = store_all(tier_a, root, SIZES_A, 100), store_all(tier_b, root, SIZES_B, 900)
    file_bytes_a = sum(info.file_bytes for info in tier_a.extents())
    tier_a.close()
    tier_b.close()
    return TierDir(root, a, b, file_bytes_a)


def all_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def plant_problems(td: TierDir) -> tuple[Path, Path, Path, Path]:
    """Flip a payload byte of extent a[0], truncate a[1], add a stale and a live temp file."""
    corrupt, truncated = td.a[0].path, td.a[1].path
    header_len = decode_fixed(corrupt.read_bytes()[:4096], None).header_len
    with open(corrupt, "r+b") as f:
        f.seek(header_len + 7)
        byte = f.read(1)
        f.seek(header_len + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(truncated, decode_fixed(truncated.read_bytes()[:4096], None).header_len + 4096)
    key_hex = td.a[2].key.hex()
    dead = Writer(dead_pid(), 1, host_tag())  # a writer of this host whose pid is gone
    stale = td.a[2].path.parent / f".{key_hex}.{dead.token}.0badf00d.tmp"
    live = td.a[2].path.parent / f".{key_hex}.{me().token}.600df00d.tmp"  # this test process: alive
    stale.write_bytes(b"half an extent")
    live.write_bytes(b"being written")
    return corrupt, truncated, stale, live


def test_inspect_json(tier_dir: TierDir) -> None:
    r = cli("inspect", tier_dir.root, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    by_ns = {ns["namespace"]: ns for ns in report["namespaces"]}
    assert set(by_ns) == {NS_A.id.hex(), NS_B.id.hex()}
    a, b = by_ns[NS_A.id.hex()], by_ns[NS_B.id.hex()]
    assert (a["extents"], a["payload_bytes"], a["file_bytes"]) == (4, sum(SIZES_A), tier_dir.file_bytes_a)
    assert a["file_bytes"] == sum(s.path.stat().st_size for s in tier_dir.a)
    assert a["tokens"] == sum(len(s.tokens) for s in tier_dir.a)
    assert (a["layout"], b["layout"]) == ("L2 H2 D64 bf16 p4", "L4 H8 D128 fp16 p16")
    assert (b["extents"], b["payload_bytes"], b["tokens"]) == (1, sum(SIZES_B), len(tier_dir.b[0].tokens))
    assert 0 <= a["newest_age_s"] <= a["oldest_age_s"] < 60
    assert (a["bad_headers"], a["stale_temp_files"], a["live_temp_files"]) == (0, 0, 0)
    assert report["macs_verified"] is True
    assert "hit" not in r.stdout


def test_inspect_table(tier_dir: TierDir) -> None:
    r = cli("inspect", tier_dir.root)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split()[:3] == ["NAMESPACE", "LAYOUT", "EXTENTS"] and len(rows) == 2
    row_a = next(row for row in rows if row.startswith(NS_A.id.hex()))
    assert " 4 " in row_a and human_bytes(sum(SIZES_A)) in row_a
    assert human_bytes(tier_dir.file_bytes_a) in row_a
    assert f" {sum(len(s.tokens) for s in tier_dir.a)} " in row_a
    assert row_a.split()[-2:] == ["0", "0/0"]  # bad headers, stale/live temp files


def test_fsck_clean(tier_dir: TierDir) -> None:
    r = cli("fsck", tier_dir.root)
    assert r.returncode == 0, r.stdout + r.stderr
    macs = f"MACs verified with {tier_dir.root / '.secret'}"
    assert r.stdout.strip() == f"fsck: 5 extents in 2 namespaces, 0 problems; {macs}"


def test_fsck_finds_and_repairs_exactly_the_broken(tier_dir: TierDir, open_tiers: OpenTier) -> None:
    corrupt, truncated, stale, live = plant_problems(tier_dir)
    before = all_files(tier_dir.root)
    inspected = json.loads(cli("inspect", tier_dir.root, "--json").stdout)["namespaces"]
    a = next(ns for ns in inspected if ns["namespace"] == NS_A.id.hex())
    assert (a["bad_headers"], a["stale_temp_files"], a["live_temp_files"]) == (1, 1, 1)  # truncated

    r = cli("fsck", tier_dir.root)
    assert r.returncode == 1
    named = {line.split()[1]: line.split()[0] for line in r.stdout.splitlines()[:-1]}
    assert named == {str(corrupt): "corrupt", str(truncated): "corrupt", str(stale): "stale-temp"}
    assert "checksum mismatch in chunk 0" in r.stdout and "truncated" in r.stdout
    assert all_files(tier_dir.root) == before  # no --repair: nothing touched

    r = cli("fsck", "--repair", tier_dir.root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("fsck: 5 extents in 2 namespaces, 3 problems, 3 removed; ")
    assert all_files(tier_dir.root) == before - {corrupt, truncated, stale}
    assert cli("fsck", tier_dir.root).returncode == 0

    live.unlink()  # the "writer" (this test) is done with it, so the reopened tier starts clean
    tier = open_tiers(NS_A)
    assert sorted(i.key for i in tier.extents()) == sorted(s.key for s in tier_dir.a[2:])
    for s in tier_dir.a[2:]:
        dest = np.empty_like(s.payload)
        assert tier.wait(tier.submit_load(s.key, dest), timeout=30).ok
        assert np.array_equal(dest, s.payload)
    tier.check_integrity()


def test_fsck_verifies_macs_with_the_directory_secret(tier_dir: TierDir) -> None:
    secret = tier_dir.root / ".secret"
    secret.write_bytes(os.urandom(32))  # as if every extent had been planted by someone else
    r = cli("fsck", tier_dir.root)
    assert r.returncode == 1 and r.stdout.count("header MAC mismatch") == 5, r.stdout
    assert json.loads(cli("inspect", tier_dir.root, "--json").stdout)["namespaces"][0]["bad_headers"] > 0
    secret.unlink()
    r = cli("fsck", tier_dir.root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith(
        f"0 problems; MACs NOT verified: no {secret} (a server would drop every extent)"
    )
    r = cli("inspect", tier_dir.root, "--json")
    assert json.loads(r.stdout)["macs_verified"] is False and "MACs NOT verified" in r.stderr


def test_fsck_names_a_misplaced_extent(tier_dir: TierDir) -> None:
    moved = tier_dir.b[0].path.parent.parent / ("00" if tier_dir.b[0].key.hex()[:2] != "00" else "01")
    moved = moved / tier_dir.b[0].path.name
    tier_dir.b[0].path.rename(moved)
    r = cli("fsck", tier_dir.root)
    assert r.returncode == 1 and f"corrupt  {moved}  (misnamed or misplaced" in r.stdout


@pytest.mark.parametrize("command", ["inspect", "fsck"])
def test_bad_directory_is_a_one_line_usage_error(command: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "not_a_tier").mkdir()
    (tmp_path / "not_a_tier" / "notes.txt").write_text("x")
    ns_dir = tmp_path / "tier" / NS_A.id.hex()
    ns_dir.mkdir(parents=True)
    for bad in ("missing", "file", "not_a_tier", f"tier/{NS_A.id.hex()}"):
        r = cli(command, tmp_path / bad)
        assert (r.returncode, r.stdout) == (2, ""), (bad, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"sgl-hicache {command}: {tmp_path / bad}")


def test_cli_imports_neither_torch_nor_sglang() -> None:
    code = "import sys, sgl_hicache.cli; print([m for m in ('torch', 'sglang') if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stderr
