"""`check_integrity`'s file half: the index must match the extent files on disk, byte for byte."""

from __future__ import annotations

from sgl_hicache.tier.file.paths import ExtentPaths
from sgl_hicache.tier.format import EXTENT_SUFFIX, TEMP_SUFFIX
from sgl_hicache.tier.keys import ExtentKey


def check_files(paths: ExtentPaths, indexed: dict[ExtentKey, int]) -> None:
    """Raise AssertionError (with the numbers) unless every indexed extent has a file of its size,
    no extent file is unindexed and no temp file is left (call when no store is in flight)."""
    on_disk: dict[str, int] = {}
    temps = 0
    for de in paths.walk():
        if de.name.endswith(EXTENT_SUFFIX):
            on_disk[de.name] = de.stat().st_size
        temps += de.name.endswith(TEMP_SUFFIX)
    want = {key.hex() + EXTENT_SUFFIX: size for key, size in indexed.items()}
    missing = sorted(set(want) - set(on_disk))
    extra = sorted(set(on_disk) - set(want))
    wrong = sorted(n for n in set(want) & set(on_disk) if want[n] != on_disk[n])
    disk_bytes, index_bytes = sum(on_disk.values()), sum(want.values())
    if missing or extra or wrong or temps or disk_bytes != index_bytes:
        raise AssertionError(
            f"tier integrity: {len(want)} indexed ({index_bytes} B), {len(on_disk)} files ({disk_bytes} B); "
            f"{len(missing)} missing {missing[:3]}, {len(extra)} unindexed {extra[:3]}, "
            f"{len(wrong)} wrong size {wrong[:3]}, {temps} temp files"
        )
