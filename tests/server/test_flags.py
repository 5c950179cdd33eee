"""Our flags: derived from the config, in sglang's conventions, validated before sglang starts (exit
2, one line, no writes). Refusals by sglang's own parser and of models: test_sglang_args.py."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_hicache.config import ConfigError, Fsync, GiB, KvEventsMedium, MiB, PrefetchPolicy, SpillAdmission
from sgl_hicache.launch_server import parse
from sgl_hicache.server.flags import EXTRA_CONFIG, config_from, flag_names, settings
from sgl_hicache.server.handoff import ENV_CONFIG, export_config, import_config
from tests.server.launcher import refusal, run_main

LAUNCH = [sys.executable, "-m", "sgl_hicache.launch_server", "--model-path", "sgl-hicache-test/no-such-model"]
KNOBS = {"io_threads", "chunk_size", "direct_io", "fsync", "compression", "zstd_level", "min_spill_tokens",
         "prefetch_ttl_s", "pin_share", "clean_ahead", "layer_groups", "admission_hold",
         "restore_reserve", "take_back_reads", "restores_in_order", "restores_take_back"}  # fmt: skip


def launch(
    *args: str, user: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = None if env is None else {**os.environ, **env}
    return subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=60, user=user, env=environ
    )


def test_every_setting_has_one_flag_or_key_and_an_env() -> None:
    assert set(flag_names()) == {
        "--enable-hicache-spill", "--hicache-spill-dir", "--hicache-spill-capacity", "--hicache-spill-min-free",
        "--hicache-spill-staging", "--hicache-spill-prefetch-policy", "--hicache-spill-prefetch-timeout",
        "--hicache-spill-write-policy", "--hicache-spill-backend", "--hicache-spill-mooncake-config",
        "--hicache-spill-kv-events-medium", "--hicache-spill-admission", "--hicache-spill-admission-min-tokens",
        "--hicache-spill-layerwise", EXTRA_CONFIG,
    }  # fmt: skip
    assert {s.key for s in settings() if s.key} == KNOBS
    assert all((s.flag is None) != (s.key is None) for s in settings())
    envs = [s.env for s in settings()]
    assert len(set(envs)) == len(envs)
    assert {"SGL_HICACHE_SPILL_CAPACITY", "SGL_HICACHE_SPILL_IO_THREADS", "SGL_HICACHE_SPILL_CHUNK_SIZE",
            "SGL_HICACHE_SPILL_PREFETCH_TTL_S", "SGL_HICACHE_ENABLE_HICACHE_SPILL"} <= set(envs)  # fmt: skip


def test_parse_splits_our_flags_from_sglangs(tmp_path: Path) -> None:
    config, rest = parse(["--model-path", "m", "--enable-hicache-spill", "--hicache-spill-dir", str(tmp_path / "t"),
                          "--hicache-spill-capacity", "200G", EXTRA_CONFIG, '{"fsync": "full"}', "--page-size", "16"])  # fmt: skip
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


@pytest.mark.parametrize(
    ("flag", "value", "field", "expected"),
    [
        ("--hicache-spill-capacity", "200", "capacity_bytes", 200 * GiB),
        ("--hicache-spill-capacity", "1.5T", "capacity_bytes", 1536 * GiB),
        ("--hicache-spill-staging", "1", "staging_bytes", 1 * GiB),
        ("--hicache-spill-staging", "512M", "staging_bytes", 512 * MiB),
        ("--hicache-spill-min-free", "0", "min_free_bytes", 0),
        ("--hicache-spill-min-free", "2", "min_free_bytes", 2 * GiB),
    ],
)
def test_a_bare_size_is_in_gb_as_sglangs_hicache_size(
    flag: str, value: str, field: str, expected: int
) -> None:
    config, _ = parse([flag, value])
    assert getattr(config.tier if field != "staging_bytes" else config, field) == expected


@pytest.mark.parametrize(("name", "member"), [("wait_complete", PrefetchPolicy.WAIT_COMPLETE),
                         ("wait", PrefetchPolicy.WAIT_COMPLETE), ("timeout", PrefetchPolicy.TIMEOUT),
                         ("best_effort", PrefetchPolicy.BEST_EFFORT)])  # fmt: skip
def test_sglangs_prefetch_policy_names_and_our_old_alias(name: str, member: PrefetchPolicy) -> None:
    assert parse(["--hicache-spill-prefetch-policy", name])[0].prefetch_policy is member
    assert config_from(None, {"SGL_HICACHE_SPILL_PREFETCH_POLICY": name}).prefetch_policy is member


def test_the_write_admission_rule_by_flag_or_environment() -> None:
    """Issue 37: the default stays `all` (today's behaviour) until measured otherwise."""
    assert parse(["--enable-hicache-spill"])[0].admission is SpillAdmission.ALL
    config, _ = parse(["--enable-hicache-spill", "--hicache-spill-admission", "reused",
                       "--hicache-spill-admission-min-tokens", "4096"])  # fmt: skip
    assert (config.admission, config.admission_min_tokens) == (SpillAdmission.REUSED, 4096)
    env = {"SGL_HICACHE_SPILL_ADMISSION": "reused", "SGL_HICACHE_SPILL_ADMISSION_MIN_TOKENS": "64"}
    assert (config_from(None, env).admission, config_from(None, env).admission_min_tokens) == (
        SpillAdmission.REUSED, 64,
    )  # fmt: skip


ADMISSION_BAD = [
    (["--hicache-spill-admission", "often"],
     "--hicache-spill-admission: invalid choice 'often' (choose from all, reused)"),
    (["--hicache-spill-admission-min-tokens", "-1"],
     "--hicache-spill-admission-min-tokens: admission min tokens must be >= 0, got -1"),
    (["--hicache-spill-admission-min-tokens", "4k"],
     "--hicache-spill-admission-min-tokens: expected an integer, got '4k'"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), ADMISSION_BAD, ids=[a[-1] for a, _ in ADMISSION_BAD])
def test_a_bad_admission_rule_exits_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = launch("--enable-hicache-spill", *args, env={"TMPDIR": str(tmp_path)})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


def test_kv_events_medium_by_flag_or_environment() -> None:
    flag, env = "--hicache-spill-kv-events-medium", "SGL_HICACHE_SPILL_KV_EVENTS_MEDIUM"
    assert parse([])[0].kv_events_medium is KvEventsMedium.DISK
    assert parse([flag, "cpu_pinned"])[0].kv_events_medium is KvEventsMedium.CPU_PINNED
    assert config_from(None, {env: "cpu_pinned"}).kv_events_medium is KvEventsMedium.CPU_PINNED
    with pytest.raises(ConfigError) as refused:
        parse([flag, "gpu"])
    assert str(refused.value) == f"{flag}: invalid choice 'gpu' (choose from disk, cpu_pinned)"


def test_tuning_knobs_come_in_one_json_flag() -> None:
    config, _ = parse([EXTRA_CONFIG, '{"io_threads": 3, "chunk_size": "8M", "direct_io": false, "fsync": "none", '
                       '"compression": "zstd", "zstd_level": 5, "min_spill_tokens": 1, "prefetch_ttl_s": 2.5}'])  # fmt: skip
    tier = config.tier
    assert (tier.io_threads, tier.chunk_bytes, tier.direct_io, tier.fsync) == (3, 8 * MiB, False, Fsync.NONE)
    assert (tier.compression.value, tier.zstd_level, config.min_spill_tokens) == ("zstd", 5, 1)
    assert config.prefetch_ttl_s == 2.5


def test_env_overrides_and_flag_precedence() -> None:
    env = {"SGL_HICACHE_SPILL_CAPACITY": "3G", "SGL_HICACHE_SPILL_IO_THREADS": "5",
           "SGL_HICACHE_SPILL_CHUNK_SIZE": "8M", "SGL_HICACHE_SPILL_DIRECT_IO": "off"}  # fmt: skip
    config = config_from(None, env)
    assert config.tier.capacity_bytes == 3 * GiB and config.tier.io_threads == 5
    assert config.tier.chunk_bytes == 8 * MiB and config.tier.direct_io is False
    assert config_from(None, {"SGL_HICACHE_SPILL_CAPACITY": "3"}).tier.capacity_bytes == 3 * GiB
    config, _ = parse([EXTRA_CONFIG, '{"io_threads": 7}'])
    assert config.tier.io_threads == 7
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGL_HICACHE_SPILL_IO_THREADS", "5")
        mp.setenv("SGL_HICACHE_SPILL_ZSTD_LEVEL", "4")
        config, _ = parse([EXTRA_CONFIG, '{"io_threads": 7}'])
    assert config.tier.io_threads == 7 and config.tier.zstd_level == 4, "a key beats its env, others stay"
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


BAD = [
    (["--hicache-spill-capacity", "12x"], "--hicache-spill-capacity: cannot parse size '12x'"),
    (["--hicache-spill-capacity", "0"], "--hicache-spill-capacity: capacity must be positive"),
    (["--hicache-spill-dir", "relative/dir"], "--hicache-spill-dir: relative/dir is not an absolute path"),
    (["--hicache-spill-dir", "/etc/hostname/tier"], "/etc/hostname is not a directory"),
    (["--hicache-spill-dir", "/proc/x"], "--hicache-spill-dir: /proc/x would be on a pseudo filesystem (proc)"),
    (["--hicache-spill-dir", "/sys/kernel/x"], "--hicache-spill-dir: /sys/kernel/x would be on a pseudo filesystem (sysfs)"),
    (["--hicache-spill-dir", "/dev/x"], "--hicache-spill-dir: /dev/x would be on a pseudo filesystem"),
    (["--hicache-spill-dir", "/tmp/" + "n" * 300], "cannot be created: file name too long"),
    (["--hicache-spill-staging", "999T"], "--hicache-spill-staging: 999T is more than this machine's memory ("),
    (["--hicache-spill-prefetch-policy", "sometimes"],
     "--hicache-spill-prefetch-policy: invalid choice 'sometimes' (choose from wait_complete, timeout, best_effort)"),
    (["--hicache-spill-prefetch-timeout", "inf"], "--hicache-spill-prefetch-timeout: expected a finite number, got 'inf'"),
    ([EXTRA_CONFIG, '{"chunk_size": 4}'], f"{EXTRA_CONFIG} chunk_size: 4 has no unit (give a unit, e.g. 4M)"),
    ([EXTRA_CONFIG, '{"io_threads": 1.9}'], f"{EXTRA_CONFIG} io_threads: expected an integer, got 1.9"),
    ([EXTRA_CONFIG, '{"min_spill_tokens": "16"}'], f'{EXTRA_CONFIG} min_spill_tokens: expected an integer, got "16"'),
    ([EXTRA_CONFIG, '{"direct_io": "yes"}'], f'{EXTRA_CONFIG} direct_io: expected true or false, got "yes"'),
    ([EXTRA_CONFIG, '{"io_thread": 8}'],
     f"{EXTRA_CONFIG}: unknown key 'io_thread' (did you mean io_threads? known: admission_hold, chunk_size, clean_ahead, compression, direct_io, "
     "fsync, io_threads, layer_groups, min_spill_tokens, pin_share, prefetch_ttl_s, restore_reserve, restores_in_order, "
     "restores_take_back, take_back_reads, zstd_level)"),
    ([EXTRA_CONFIG, "{io_threads: 8}"], f"{EXTRA_CONFIG}: not a JSON object: Expecting property name"),
    ([EXTRA_CONFIG, "[8]"], f"{EXTRA_CONFIG}: not a JSON object: [8]"),
    ([EXTRA_CONFIG, '{"io_threads": 0}'], f"{EXTRA_CONFIG} io_threads: io threads must be in 1..256, got 0"),
    ([EXTRA_CONFIG, '{"zstd_level": null}'], f"{EXTRA_CONFIG} zstd_level: expected an integer, got null"),
    (["--hicache-spill-io-threads", "8"],
     f"--hicache-spill-io-threads moved into {EXTRA_CONFIG}: pass {EXTRA_CONFIG} '{{\"io_threads\": 8}}'"),
    (["--no-hicache-spill-direct-io"],
     f"--no-hicache-spill-direct-io moved into {EXTRA_CONFIG}: pass {EXTRA_CONFIG} '{{\"direct_io\": false}}'"),
    (["--hicache-spill-chunk-size=8M"],
     f"--hicache-spill-chunk-size moved into {EXTRA_CONFIG}: pass {EXTRA_CONFIG} '{{\"chunk_size\": \"8M\"}}'"),
    (["--hicache-spill-capcity", "200G"], "unknown flag --hicache-spill-capcity (did you mean --hicache-spill-capacity?)"),
    ([EXTRA_CONFIG, '{"pin_share": 1}'], f"{EXTRA_CONFIG} pin_share: pin share must be in [0, 1), got 1"),
    ([EXTRA_CONFIG, '{"pin_share": 1.5}'], f"{EXTRA_CONFIG} pin_share: pin share must be in [0, 1), got 1.5"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_bad_flags_are_refused_before_sglang_is_imported(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse(["--enable-hicache-spill", *args])
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("args", "message"), BAD[::4], ids=[" ".join(a)[:40] for a, _ in BAD[::4]])
def test_bad_flags_exit_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = launch("--enable-hicache-spill", *args, env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert lines[0].startswith("python -m sgl_hicache.launch_server: error:")
    assert list(tmp_path.iterdir()) == [], "a refused launch wrote something"


def test_a_refusal_quoting_a_line_break_is_still_one_line() -> None:
    line = refusal(run_main(["--enable-hicache-spill", "--hicache-spill-dir", "a\x1eb\nc"]))
    assert line == "--hicache-spill-dir: a\\x1eb\\nc is not an absolute path"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SGL_HICACHE_SPILL_IO_THREADS": "1.9"}, "SGL_HICACHE_SPILL_IO_THREADS: expected an integer, got '1.9'"),
        ({"SGL_HICACHE_SPILL_CHUNK_SIZE": "4096"}, "SGL_HICACHE_SPILL_CHUNK_SIZE: 4096 has no unit (give a unit, e.g. 4M)"),
        ({"SGL_HICACHE_SPILL_PREFETCH_TTL_S": "nan"}, "SGL_HICACHE_SPILL_PREFETCH_TTL_S: expected a finite number, got 'nan'"),
    ],
)  # fmt: skip
def test_bad_environment_values_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from(None, env)
    assert str(refused.value) == message


def test_help_is_ours_only_short_and_does_not_import_sglang() -> None:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "sgl_hicache.launch_server", "--help"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    imported = {
        line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert not {m for m in imported if m.split(".")[0] in ("sglang", "torch")}, (
        "--help imported sglang or torch"
    )
    out = result.stdout
    assert all(flag in out for flag in flag_names()) and "--help-sglang" in out
    assert all(f"{key} " in out for key in KNOBS) and "SGL_HICACHE_SPILL_IO_THREADS" in out
    assert "{wait_complete,timeout,best_effort}" in out and "--hicache-spill-capacity SIZE" in out
    assert "--hicache-spill-kv-events-medium {disk,cpu_pinned}" in out
    assert "--hicache-spill-dir DIR" in out and "--hicache-spill-prefetch-timeout SECONDS" in out
    assert "HICACHE_SPILL__" not in out and "--tp-size" not in out, "sglang's flags are not ours"
    assert len(out.splitlines()) < 134  # 3 or 4 lines a setting (30): short enough to read at once


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


def test_read_only_filesystem_is_rejected(tmp_path: Path) -> None:
    """A read-only bind mount (skipped where mounting is not permitted)."""
    target = tmp_path / "ro"
    target.mkdir()
    r = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(tmp_path), str(target)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"cannot bind-mount read-only here: {r.stderr.strip()}")
    try:
        with pytest.raises(ConfigError, match="read-only filesystem"):
            parse(["--enable-hicache-spill", "--hicache-spill-dir", str(target / "tier")])
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


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


def test_a_server_started_without_our_launcher_warns_once_when_its_tier_opens(
    small_volume: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`sglang.launch_server` with our backend is not refused before it starts: the cache factory
    warns once, in the launcher's words, when it opens the tier on a volume that cannot hold the
    format's least extent above --hicache-spill-min-free (1G here; 64M of volume)."""
    from tests.cache.conftest import build_stack, close_stack

    tier = small_volume / "tier"
    with caplog.at_level(logging.WARNING):
        stack = build_stack(tier, min_free_bytes=1 << 30)
    close_stack(stack)
    warned = [r.getMessage() for r in caplog.records if "--hicache-spill-min-free" in r.getMessage()]
    assert warned == [
        f"spill tier: --hicache-spill-min-free: the volume of {tier} holds 64M in all, not above the 1G to keep "
        "free plus one extent (at least 8K), so every store would be refused (counted as no_space); lower "
        "--hicache-spill-min-free or use a larger volume"
    ], caplog.text


@pytest.mark.parametrize(("min_free", "fits"), [("65528K", True), ("65529K", False), ("60M", True)])
def test_a_volume_is_refused_only_below_the_watermark_plus_one_extent(
    small_volume: Path, min_free: str, fits: bool
) -> None:
    """64 MiB holds the watermark plus one extent of the least size, 8K, or it does not; a volume a
    few MiB above the watermark was refused before (it wanted 256 MiB of room for extents)."""
    args = ["--enable-hicache-spill", "--hicache-spill-dir", str(small_volume / "tier"),
            "--hicache-spill-min-free", min_free]  # fmt: skip
    if fits:
        assert parse(args)[0].tier.min_free_bytes == int(min_free[:-1]) << (10 if min_free[-1] == "K" else 20)
        return
    with pytest.raises(ConfigError) as refused:
        parse(args)
    assert str(refused.value) == (
        f"--hicache-spill-min-free: the volume of {small_volume} holds 64M in all, not above the 65529K to keep "
        "free plus one extent (at least 8K), so every store would be refused (counted as no_space); lower "
        "--hicache-spill-min-free or use a larger volume"
    )


@pytest.mark.parametrize(("capacity", "fits"), [("8191B", False), ("8K", True), ("2M", True)])
def test_a_capacity_below_the_least_extent_file_is_refused(tmp_path: Path, capacity: str, fits: bool) -> None:
    """No extent file is smaller than a 4K header block and one 4K block of KV, whatever the model."""
    args = [
        "--enable-hicache-spill",
        "--hicache-spill-dir",
        str(tmp_path / "tier"),
        "--hicache-spill-capacity",
        capacity,
    ]
    if fits:
        assert parse(args)[0].enabled
        return
    with pytest.raises(
        ConfigError, match=r"^--hicache-spill-capacity: 8191 cannot hold one extent \(at least 8K"
    ):
        parse(args)
