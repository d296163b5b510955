"""DISTCKPT_DRAIN_TIMEOUT_S: the bound on the collectives of a tiered manager's drain channel
(distckpt._dist.control_group(timeout_s=...)), read and validated like DISTCKPT_TIMEOUT_S."""

from __future__ import annotations

import pytest

from distckpt.config import KNOWN_VARIABLES, load_config, warn_unknown_variables
from distckpt.errors import ConfigError


def test_drain_timeout_default_and_value():
    assert load_config({}).drain_timeout_s == 3600.0
    assert load_config({"DISTCKPT_DRAIN_TIMEOUT_S": ""}).drain_timeout_s == 3600.0
    assert load_config({"DISTCKPT_DRAIN_TIMEOUT_S": "7200"}).drain_timeout_s == 7200.0
    assert load_config({"DISTCKPT_DRAIN_TIMEOUT_S": "1.5"}).drain_timeout_s == 1.5
    # Independent of the control plane's bound.
    cfg = load_config({"DISTCKPT_TIMEOUT_S": "10", "DISTCKPT_DRAIN_TIMEOUT_S": "900"})
    assert (cfg.timeout_s, cfg.drain_timeout_s) == (10.0, 900.0)


@pytest.mark.parametrize("raw", ["soon", "0", "0.5", "-3", "86401", "nan", "inf"])
def test_drain_timeout_bad_values_are_config_errors(raw):
    with pytest.raises(ConfigError) as info:
        load_config({"DISTCKPT_DRAIN_TIMEOUT_S": raw})
    assert info.value.details.get("variable") == "DISTCKPT_DRAIN_TIMEOUT_S" or "DISTCKPT_DRAIN_TIMEOUT_S" in str(info.value)
    assert "DISTCKPT_DRAIN_TIMEOUT_S" in str(info.value)


def test_drain_timeout_is_a_known_variable():
    assert "DISTCKPT_DRAIN_TIMEOUT_S" in KNOWN_VARIABLES
    assert warn_unknown_variables({"DISTCKPT_DRAIN_TIMEOUT_S": "60"}) == []
