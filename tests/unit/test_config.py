"""Config: environment parsing, precedence and precise errors."""

import logging

import pytest
import torch

import ddpmon
from ddpmon.config import Config, ConfigError


def test_env_values_are_parsed_and_lose_to_arguments():
    env = {
        "DDPMON_PORT": "8123",
        "DDPMON_ON_NONFINITE": "skip",
        "DDPMON_ENABLED": "yes",
        "DDPMON_STALL_SECONDS": "12.5",
    }
    cfg = Config.from_sources({"port": 9001}, environ=env)
    assert cfg.port == 9001
    assert cfg.on_nonfinite == "skip"
    assert cfg.stall_seconds == 12.5
    assert cfg.enabled is True


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({}, {"DDPMON_PORT": "http"}, "DDPMON_PORT='http': expected an integer"),
        ({"port": 70000}, {}, "port=70000: expected an integer from 0 to 65535"),
        (
            {"on_nonfinite": "ignore"},
            {},
            "on_nonfinite='ignore': expected one of record, skip, raise",
        ),
        (
            {"on_loss_scale_floor": "skip"},
            {},
            "on_loss_scale_floor='skip': expected one of record, raise",
        ),
        (
            {},
            {"DDPMON_LOSS_SCALE_FLOOR_STEPS": "0"},
            "loss_scale_floor_steps=0: expected an integer from 1 to 1000000",
        ),
        ({}, {"DDPMON_ENABLED": "maybe"}, "DDPMON_ENABLED='maybe': expected a boolean"),
        ({"stall_seconds": float("nan")}, {}, "stall_seconds=nan: expected a finite number >= 1.0"),
        ({"run_id": "a/b"}, {}, "run_id='a/b': must not contain path separators"),
        ({"max_groups": 0}, {}, "max_groups=0: expected an integer from 1 to 256"),
        ({"prot": 1}, {}, "unknown option(s): prot; known options: enabled, port"),
    ],
)
def test_bad_values_name_the_option_and_the_fix(options, env, message):
    with pytest.raises(ConfigError) as info:
        Config.from_sources(options, environ=env)
    assert message in str(info.value)


def test_attach_with_bad_config_logs_and_training_continues(caplog):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.ERROR, logger="ddpmon"):
        mon = ddpmon.attach(model, opt, port="not-a-port")
    assert mon.enabled is False
    assert "port='not-a-port'" in mon.error
    assert "invalid configuration" in caplog.text
    before = model.weight.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    mon.observe_loss(1.0)
    mon.close()
    assert not torch.equal(before, model.weight)


def test_enabled_false_installs_nothing(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = ddpmon.attach(model, opt, enabled=False, run_dir=str(tmp_path))
    assert mon.enabled is False and mon.error is None
    assert not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not list(tmp_path.iterdir())
    mon.close()


def test_path_options_take_pathlib_paths(tmp_path):
    config = Config(run_dir=tmp_path / "runs", sd_dir=tmp_path / "sd", web_config=tmp_path / "w")
    assert (config.run_dir, config.sd_dir, config.web_config) == (
        str(tmp_path / "runs"),
        str(tmp_path / "sd"),
        str(tmp_path / "w"),
    )
    with pytest.raises(ConfigError, match="run_dir=3"):
        Config(run_dir=3)
