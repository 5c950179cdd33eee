"""Our flags: derived from the config, validated before sglang starts (exit 2, one line, no writes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_hicache.config import ConfigError, Fsync, GiB
from sgl_hicache.launch_server import parse
from sgl_hicache.server.flags import config_from, spill_flags
from sgl_hicache.server.handoff import ENV_CONFIG, export_config, import_config

LAUNCH = [sys.executable, "-m", "sgl_hicache.launch_server", "--model-path", "/nonexistent-model"]


def launch(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=60, user=user)


def test_every_config_option_has_a_flag_and_env() -> None:
    names = {f.name for f in spill_flags()}
    assert {
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        "--hicache-spill-capacity",
        "--hicache-spill-staging",
    } <= names
    envs = [f.env for f in spill_flags()]
    assert "SGL_HICACHE_SPILL_CAPACITY" in envs and len(set(envs)) == len(envs)


def test_parse_splits_our_flags_from_sglangs(tmp_path: Path) -> None:
    config, rest = parse(["--model-path", "m", "--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path / "t"),
                          "--hicache-spill-capacity", "200G", "--hicache-spill-fsync", "full", "--page-size", "16"])  # fmt: skip
    assert config.enabled and config.tier.capacity_bytes == 200 * GiB and config.tier.fsync is Fsync.FULL
    assert rest == ["--model-path", "m", "--page-size", "16", "--radix-cache-backend", "hicache_spill"]
    assert not (tmp_path / "t").exists(), "validation must not create the tier directory"


def test_spill_with_another_backend_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --radix-cache-backend hicache_spill"):
        parse(
            [
                "--enable-hicache-spill",
                "--hicache-spill-dir",
                str(tmp_path),
                "--radix-cache-backend",
                "flexkv",
            ]
        )


def test_env_overrides_and_flag_precedence() -> None:
    env = {"SGL_HICACHE_SPILL_CAPACITY": "3G", "SGL_HICACHE_SPILL_IO_THREADS": "5"}
    assert config_from(None, env).tier.capacity_bytes == 3 * GiB
    config, _ = parse(["--hicache-spill-io-threads", "7"])
    assert config.tier.io_threads == 7
    with pytest.raises(ConfigError, match="SGL_HICACHE_SPILL_CAPACITY"):
        config_from(None, {"SGL_HICACHE_SPILL_CAPACITY": "lots"})


def test_handoff_round_trip_through_environment(tmp_path: Path) -> None:
    config, _ = parse(
        ["--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path), "--hicache-spill-capacity", "5G"]
    )
    env: dict[str, str] = {}
    export_config(config, env)
    assert import_config(env) == config
    assert import_config({}).enabled, "the backend selected without our launcher means spill is on"
    assert ENV_CONFIG in env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hicache-spill-capacity", "12x"], "--hicache-spill-capacity: cannot parse size '12x'"),
        (["--hicache-spill-capacity", "0"], "--hicache-spill-capacity: capacity must be positive"),
        (
            ["--hicache-spill-dir", "relative/dir"],
            "--hicache-spill-dir: relative/dir is not an absolute path",
        ),
        (["--hicache-spill-dir", "/etc/hostname/tier"], "/etc/hostname is not a directory"),
        (
            ["--hicache-spill-prefetch-policy", "sometimes"],
            "--hicache-spill-prefetch-policy: invalid value 'sometimes'",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = launch("--enable-hicache-spill", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert lines[0].startswith("python -m sgl_hicache.launch_server: error:")


def parse_as(user: str, argv: list[str]) -> str:
    """Run `parse(argv)` in a forked child with `user`'s uid/gid; return its error or "ok"."""
    import pwd

    pw = pwd.getpwnam(user)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, parse, report, exit without running pytest's teardown
        os.close(read_fd)
        try:
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            parse(argv)
            message = "ok"
        except ConfigError as e:
            message = str(e)
        except BaseException as e:  # report anything else to the parent, which fails the test
            message = f"unexpected {type(e).__name__}: {e}"
        os.write(write_fd, message.encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        message = f.read()
    os.waitpid(pid, 0)
    return message


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A temp dir that other users can traverse (pytest's own tmp_path lives under a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="sgl_hicache_perm_", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_unwritable_directory_is_rejected_and_nothing_written(public_tmp: Path) -> None:
    tmp_path = public_tmp
    # We run as root, which bypasses permission bits: check as an unprivileged user instead.
    try:
        import pwd

        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user on this machine to check permissions as")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    message = parse_as("nobody", ["--enable-hicache-spill", "--hicache-spill-dir", str(locked / "tier")])
    assert message == f"--hicache-spill-dir: no write permission on {locked} (to create {locked / 'tier'})"
    assert list(locked.iterdir()) == []
    writable = tmp_path / "open"
    writable.mkdir(mode=0o777)
    writable.chmod(0o777)
    assert (
        parse_as("nobody", ["--enable-hicache-spill", "--hicache-spill-dir", str(writable / "tier")]) == "ok"
    )


def test_read_only_filesystem_is_rejected() -> None:
    result = launch("--enable-hicache-spill", "--hicache-spill-dir", "/proc/sys/tier")
    assert result.returncode == 2
    assert "read-only filesystem" in result.stderr or "no write permission" in result.stderr, result.stderr


def _untrusted_dirs(tmp_path: Path) -> dict[str, Path]:
    """Existing tier directories that another user could have written (see tier/trust.py)."""
    made = {name: tmp_path / name for name in ("group", "foreign", "secret", "link")}
    for path in made.values():
        path.mkdir(mode=0o700)
    made["group"].chmod(0o770)
    os.chown(made["foreign"], 65534, -1)
    (made["secret"] / ".secret").write_bytes(bytes(32))
    (made["secret"] / ".secret").chmod(0o644)
    made["link"].rmdir()
    made["link"].symlink_to(made["group"])
    return made


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("group", "is writable by group or others (mode 0770): another user could plant extents"),
        ("foreign", "is owned by uid 65534, not uid 0 (this server)"),
        ("secret", "/secret/.secret has mode 0644: it keys the MAC of every extent"),
        ("link", "/link is a symbolic link: configure the directory it points to instead"),
    ],
)
def test_untrusted_tier_directory_is_refused_before_start(tmp_path: Path, name: str, message: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a directory of another uid needs root")
    path = _untrusted_dirs(tmp_path)[name]
    with pytest.raises(ConfigError, match=r"^--hicache-spill-dir: ") as refused:
        parse(["--enable-hicache-spill", "--hicache-spill-dir", str(path)])
    assert message in str(refused.value)


def test_untrusted_tier_directory_exits_2_with_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o775)
    result = launch("--enable-hicache-spill", "--hicache-spill-dir", str(shared))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"--hicache-spill-dir: tier directory {shared} is writable by group or others" in lines[0]
    assert f"`chmod 700 {shared}`" in lines[0] and list(shared.iterdir()) == []


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (skipped where mounting is not permitted)."""
    target = tmp_path / "small"
    target.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(target)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_volume_too_small_for_the_free_space_watermark_is_refused(small_volume: Path) -> None:
    """The default --hicache-spill-min-free (1G) on a 64 MiB volume: every store would be refused."""
    tier = str(small_volume / "tier")
    with pytest.raises(ConfigError, match=r"^--hicache-spill-min-free: ") as refused:
        parse(["--enable-hicache-spill", "--hicache-spill-dir", tier])
    assert "64M" in str(refused.value) and "1G" in str(refused.value)
    result = launch("--enable-hicache-spill", "--hicache-spill-dir", tier)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--hicache-spill-min-free" in lines[0] and not (small_volume / "tier").exists()
    config, _ = parse(["--enable-hicache-spill", "--hicache-spill-dir", tier,
                       "--hicache-spill-min-free", "8M", "--hicache-spill-capacity", "32M"])  # fmt: skip
    assert config.tier.min_free_bytes == 8 << 20
