"""No module of the runtime package is over 450 lines (issue 39, "Done when"): a module that grows
past it is split by role, one job per module (docs/DEVELOPMENT.md, the module map), as
`cache/spill_radix_cache.py` was into its parts."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 450


def test_no_module_of_the_package_is_over_the_limit() -> None:
    paths = sorted((ROOT / "sgl_hicache").rglob("*.py"))
    assert paths, "the package was not found"
    long = {
        str(path.relative_to(ROOT)): lines
        for path in paths
        if (lines := len(path.read_text().splitlines())) > LIMIT
    }
    assert not long, f"over {LIMIT} lines (split by role): {long}"
