"""The [flexmig] group of nova.conf: bad values at start (samples: test_config_samples)."""

from __future__ import annotations

import pathlib

import pytest
from oslo_config import cfg

from nova_driver import conf as flexmig_conf

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _conf_from(tmp_path: pathlib.Path, text: str) -> cfg.ConfigOpts:
    path = tmp_path / "nova.conf"
    path.write_text("[flexmig]\n" + text)
    conf = cfg.ConfigOpts()
    flexmig_conf.register_opts(conf)
    conf(["--config-file", str(path)], project="nova-test", default_config_files=[])
    return conf


def test_defaults_are_valid(tmp_path: pathlib.Path) -> None:
    conf = _conf_from(tmp_path, "")
    flexmig_conf.validate(conf)
    assert conf.flexmig.agent_port == 9797
    assert conf.migration.allowed_modes == ["precopy", "postcopy", "split"]


@pytest.mark.parametrize(
    ("line", "option"),
    [
        ("max_downtime_ms = 0", "max_downtime_ms"),
        ("agent_port = 70000", "agent_port"),
        ("agent_timeout = abc", "agent_timeout"),
        ("allowed_modes = precopy,warp", "allowed_modes"),
        ("allowed_modes =", "allowed_modes"),
        ("dirty_sample_seconds = 2,2", "dirty_sample_seconds"),
        ("dirty_sample_seconds = 1,99", "dirty_sample_seconds"),
        ("credential_ttl = 5", "credential_ttl"),
    ],
)
def test_a_bad_value_fails_naming_the_option(
    tmp_path: pathlib.Path, line: str, option: str
) -> None:
    conf = _conf_from(tmp_path, line + "\n")
    with pytest.raises(flexmig_conf.InvalidConfig) as err:
        flexmig_conf.validate(conf)
    # The engine's options, set under their old [flexmig] names, name their new group.
    nova_own = ("agent_port", "agent_timeout", "credential_ttl")
    group = "flexmig" if option in nova_own else "migration"
    assert f"[{group}] {option}" in str(err.value)
