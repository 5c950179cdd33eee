"""A tier directory or secret another user could have written (or read) is refused at open."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from sgl_hicache.tier import UntrustedDirectory
from sgl_hicache.tier.file.budget.ledger import LEDGER_NAME
from sgl_hicache.tier.file.budget.mark import PRESENCE_NAME
from sgl_hicache.tier.trust import SECRET_BYTES, SECRET_NAME
from tests.tier.common import NS

Breaker = Callable[[Path], None]


def other_uid() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return os.geteuid() + 4242  # any uid not ours will do for chown as root


def prepared(make_tier, tmp_path: Path) -> Path:
    """A tier directory made by a first open (root, namespace dir, secret), closed again."""
    make_tier().close()
    return tmp_path / "tier"


def test_a_missing_directory_is_created_private_with_a_secret(make_tier, tmp_path):
    root = tmp_path / "a" / "b" / "tier"
    make_tier(directory=root).close()
    secret = root / SECRET_NAME
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / NS.id.hex()).stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == SECRET_BYTES
    before = secret.read_bytes()
    make_tier(directory=root).close()
    assert secret.read_bytes() == before, "a second open keeps the secret"
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [SECRET_NAME, LEDGER_NAME, PRESENCE_NAME, NS.id.hex()]
    )  # no temp left; the presence file stays (a lock, never content)


def test_a_world_writable_sticky_parent_is_fine(make_tier, tmp_path):
    public = tmp_path / "public"
    public.mkdir()
    public.chmod(0o1777)  # like /tmp and /var/tmp
    make_tier(directory=public / "tier").close()
    assert stat.S_IMODE((public / "tier").stat().st_mode) == 0o700


def _chown_root(root: Path) -> None:
    os.chown(root, other_uid(), -1)


def _chmod_root(root: Path) -> None:
    root.chmod(0o770)


def _chmod_ns(root: Path) -> None:
    (root / NS.id.hex()).chmod(0o757)


def _loose_secret(root: Path) -> None:
    (root / SECRET_NAME).chmod(0o644)


def _foreign_secret(root: Path) -> None:
    os.chown(root / SECRET_NAME, other_uid(), -1)


def _linked_secret(root: Path) -> None:
    (root / SECRET_NAME).rename(root.parent / "elsewhere")
    (root / SECRET_NAME).symlink_to(root.parent / "elsewhere")


def _short_secret(root: Path) -> None:
    (root / SECRET_NAME).write_bytes(b"guessable")


@pytest.mark.parametrize(
    ("breaker", "message"),
    [
        (_chown_root, r"tier directory \S+/tier is owned by uid \d+, not uid \d+ .*`chown \d+ \S+/tier`"),
        (
            _chmod_root,
            r"tier directory \S+/tier is writable by group or others \(mode 0770\).*`chmod 700 \S+/tier`",
        ),
        (_chmod_ns, r"tier directory \S+/tier/[0-9a-f]{32} is writable by group or others \(mode 0757\)"),
        (_loose_secret, r"\S+/tier/\.secret has mode 0644: .*`chmod 600 \S+/tier/\.secret`"),
        (_foreign_secret, r"\S+/tier/\.secret is owned by uid \d+, not uid \d+ .*remove it"),
        (_linked_secret, r"\S+/tier/\.secret is a symbolic link: remove it"),
        (_short_secret, r"\S+/tier/\.secret holds 9 bytes, not a 32-byte secret: remove it"),
    ],
    ids=[
        "root-owner",
        "root-mode",
        "namespace-mode",
        "secret-mode",
        "secret-owner",
        "secret-link",
        "secret-size",
    ],
)
def test_untrusted_directories_are_refused(make_tier, tmp_path, breaker: Breaker, message: str):
    root = prepared(make_tier, tmp_path)
    breaker(root)
    with pytest.raises(UntrustedDirectory, match=message) as refused:
        make_tier()
    assert isinstance(refused.value, OSError) and "\n" not in str(refused.value)


def test_a_symlinked_root_is_refused(make_tier, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UntrustedDirectory, match=r"\S+/link is a symbolic link: configure the directory"):
        make_tier(directory=tmp_path / "link")
    assert list(real.iterdir()) == [], "nothing is created through the link"


def test_a_foreign_root_is_refused_before_anything_is_written(make_tier, tmp_path):
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    os.chown(root, other_uid(), -1)
    with pytest.raises(UntrustedDirectory, match="owned by uid"):
        make_tier()
    assert list(root.iterdir()) == []


def test_concurrent_first_opens_agree_on_one_secret(tmp_path):
    """Tensor-parallel ranks open a fresh directory at once: all must end up with the same secret."""
    from concurrent.futures import ThreadPoolExecutor

    from sgl_hicache.tier.trust import open_trusted

    root = tmp_path / "tier"
    with ThreadPoolExecutor(8) as pool:
        secrets = list(pool.map(lambda i: open_trusted(root, NS.id.hex()), range(32)))
    assert len(set(secrets)) == 1 and (root / SECRET_NAME).read_bytes() == secrets[0]
    assert sorted(p.name for p in root.iterdir()) == sorted([SECRET_NAME, NS.id.hex()])
