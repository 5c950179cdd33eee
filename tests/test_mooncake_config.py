"""`--hicache-spill-backend mooncake` and its settings (issue 26): one JSON object, Mooncake's own
variables for what it leaves unset, one-line errors before sglang starts, and the trip to the
scheduler intact."""

from __future__ import annotations

import argparse

import pytest

from sgl_hicache.config import ConfigError, MiB, MooncakeConfig, SpillBackend, SpillConfig
from sgl_hicache.server import flags


def config(argv: list[str], env: dict[str, str] | None = None) -> SpillConfig:
    parser = argparse.ArgumentParser()
    flags.add_flags(parser)
    return flags.config_from(parser.parse_args(argv), env or {})


MOONCAKE = ["--hicache-spill-backend", "mooncake"]


def test_file_is_the_default_and_carries_no_mooncake_settings() -> None:
    c = config([], {"MOONCAKE_MASTER": "10.0.0.1:50051"})
    assert c.tier.backend is SpillBackend.FILE and c.tier.mooncake == MooncakeConfig()


def test_the_flag_beats_mooncakes_variables_which_beat_the_defaults() -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.1:50051",
        "MOONCAKE_PROTOCOL": "rdma",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb",
    }
    c = config(
        [*MOONCAKE, "--hicache-spill-mooncake-config", '{"protocol": "tcp", "local_buffer_size": "32M"}'], env
    )
    assert c.tier.mooncake == MooncakeConfig(
        master="10.0.0.1:50051", metadata_server="P2PHANDSHAKE", protocol="tcp", device_name="",
        local_hostname="localhost", global_segment_size=1024 * MiB, local_buffer_size=32 * MiB,
    )  # fmt: skip
    assert SpillConfig.from_json(c.to_json()) == c  # the scheduler gets the same settings
    assert config([], {"SGL_HICACHE_SPILL_BACKEND": "mooncake", **env}).tier.mooncake.protocol == "rdma"


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (MOONCAKE, {}, "needs the master's address"),
        ([*MOONCAKE, "--hicache-spill-mooncake-config", '{"mastr": "h:1"}'], {}, "unknown key mastr"),
        ([*MOONCAKE, "--hicache-spill-mooncake-config", '{"master": "h:1",'], {}, "not a JSON object"),
        ([*MOONCAKE, "--hicache-spill-mooncake-config", '{"master": "h"}'], {}, "host:port"),
        ([*MOONCAKE, "--hicache-spill-mooncake-config", '{"master": 5}'], {}, "expected a string"),
        ([*MOONCAKE], {"MOONCAKE_MASTER": "h:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "4M"}, "at least 16M"),
        (
            [*MOONCAKE],
            {"MOONCAKE_MASTER": "h:1", "MOONCAKE_LOCAL_BUFFER_SIZE": "lots"},
            "MOONCAKE_LOCAL_BUFFER_SIZE",
        ),
        (["--hicache-spill-backend", "redis"], {}, "invalid choice"),
        (
            [*MOONCAKE, "--hicache-spill-mooncake-config", '{"master": "h:1", "load_calls": "both"}'],
            {},
            "load_calls must be merged or by_group, got 'both'",
        ),
        (
            [*MOONCAKE, "--hicache-spill-mooncake-config", '{"master": "h:1", "placement": "near"}'],
            {},
            "placement must be any or local, got 'near'",
        ),
    ],
)
def test_bad_settings_are_one_line_naming_the_culprit(
    argv: list[str], env: dict[str, str], says: str
) -> None:
    with pytest.raises(ConfigError) as e:
        config(argv, env)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_load_calls_are_merged_unless_asked_by_group_and_reach_the_scheduler() -> None:
    """`load_calls` (tier/mooncake/load.py): a restore that is not layer-wise reads its chunks in
    one call, or a call a layer group as a layer-wise one does (to compare them side by side)."""
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051"}
    assert config(MOONCAKE, env).tier.mooncake.load_calls == "merged"
    c = config([*MOONCAKE, "--hicache-spill-mooncake-config", '{"load_calls": "by_group"}'], env)
    assert (c.tier.mooncake.load_calls, c.tier.mooncake.master) == ("by_group", "10.0.0.1:50051")
    assert SpillConfig.from_json(c.to_json()) == c


def test_placement_is_the_masters_unless_asked_local_and_reaches_the_scheduler() -> None:
    """`placement` (tier/mooncake/client.py): the master's choice, or the writer's own segment first."""
    env = {"MOONCAKE_MASTER": "10.0.0.1:50051"}
    assert config(MOONCAKE, env).tier.mooncake.placement == "any"
    c = config([*MOONCAKE, "--hicache-spill-mooncake-config", '{"placement": "local"}'], env)
    assert c.tier.mooncake.placement == "local"
    assert SpillConfig.from_json(c.to_json()) == c


def test_a_real_client_stands_for_the_master_and_reaches_the_scheduler() -> None:
    """`real_client` (tier/mooncake/client.py): the server joins through a `mooncake_client` on its
    host (Mooncake's standalone mode), which holds the segment and talks to the master."""
    c = config([*MOONCAKE, "--hicache-spill-mooncake-config", '{"real_client": "127.0.0.1:50052"}'])
    assert (c.tier.mooncake.real_client, c.tier.mooncake.master) == ("127.0.0.1:50052", "")
    assert SpillConfig.from_json(c.to_json()) == c
    env = {"MOONCAKE_CLIENT": "10.0.0.2:7", "MOONCAKE_MASTER": "10.0.0.1:50051"}
    standalone = config(MOONCAKE, {**env, "MOONCAKE_STANDALONE_STORAGE": "1"}).tier.mooncake
    assert (standalone.real_client, standalone.master) == ("10.0.0.2:7", "")  # as sglang reads them
    plain = config(MOONCAKE, env).tier.mooncake  # MOONCAKE_CLIENT alone is not standalone mode
    assert (plain.real_client, plain.master) == ("", "10.0.0.1:50051")
    offload = {**env, "MOONCAKE_STANDALONE_STORAGE": "y", "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/x"}
    assert config(MOONCAKE, offload).tier.mooncake.ssd_offload_path == ""  # the real client's, not read
    with pytest.raises(ConfigError, match="MOONCAKE_STANDALONE_STORAGE: expected a boolean"):
        config(MOONCAKE, {**env, "MOONCAKE_STANDALONE_STORAGE": "maybe"})
    given = '{"master": "10.0.0.3:1"}'  # a master given beats the variables' standalone mode
    assert config([*MOONCAKE, "--hicache-spill-mooncake-config", given], {**env, "MOONCAKE_STANDALONE_STORAGE": "1"}
                  ).tier.mooncake.real_client == ""  # fmt: skip


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ('{"real_client": "h"}', "real_client must be host:port"),
        ('{"real_client": "h:1", "placement": "local"}', "placement local needs a segment of this server"),
        ('{"real_client": "h:1", "ssd_offload_path": "/x"}', "ssd_offload_path is the real client's"),
        ('{"real_client": "h:1", "master": "h:2"}', "give master or real_client, not both"),
        ("{}", "needs the master's address (\"master\" or MOONCAKE_MASTER) or a real client's"),
    ],
)
def test_real_client_settings_that_cannot_work_are_one_line(given: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        config([*MOONCAKE, "--hicache-spill-mooncake-config", given])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_real_client_takes_at_most_128_io_threads() -> None:
    """Past 160 calls in parallel Mooncake's client pool shares a connection between calls, and one
    timing out then fails the others at once while their copies may still run (client.py
    `LOST_AFTER_S`): a tier joined through a real client keeps under it."""
    extra = ["--hicache-spill-extra-config", '{"io_threads": 129}']
    with pytest.raises(ConfigError, match="with a real client io_threads must be at most 128"):
        config([*MOONCAKE, "--hicache-spill-mooncake-config", '{"real_client": "h:1"}', *extra])
    assert config([*MOONCAKE, *extra], {"MOONCAKE_MASTER": "h:1"}).tier.io_threads == 129
