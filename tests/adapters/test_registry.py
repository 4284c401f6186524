"""The head registry: unique names, clear errors, configs that round-trip through JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from multitoken.adapters import registry
from multitoken.adapters.registry import config_from_dict, get_head, make_config, register_head, registered_heads
from multitoken.base.errors import CheckpointError, UsageError


def test_builtin_types_are_registered():
    assert registered_heads() == ["conditioned", "cp", "eagle3", "medusa", "replicated", "whs"]


def test_duplicate_names_are_rejected():
    cls = get_head("medusa")
    with pytest.raises(ValueError, match="already registered"):
        register_head("medusa", cls.config_cls, cls.module_cls)
    assert get_head("medusa") is cls  # the original stays


def test_registration_checks_the_config_shape():
    @dataclass
    class NoType:
        n_future: int = 3

    with pytest.raises(TypeError):
        register_head("notype", NoType, object)
    with pytest.raises(TypeError):
        register_head("plain", dict, object)
    assert "notype" not in registered_heads() and "plain" not in registered_heads()


def test_plugins_can_register_a_new_type(monkeypatch):
    @dataclass
    class ToyConfig:
        head_type: str = "toy"
        n_future: int = 2

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # keep the global clean
    register_head("toy", ToyConfig, object)
    assert "toy" in registered_heads()
    assert make_config("toy", n_future=4) == ToyConfig(n_future=4)


def test_unknown_type_lists_the_registered_ones():
    with pytest.raises(UsageError) as err:
        get_head("transformer-xl")
    assert all(name in str(err.value) for name in registered_heads())


@pytest.mark.parametrize("head_type", registered_heads())
def test_configs_round_trip_through_json(head_type):
    config = make_config(head_type, n_future=4)
    record = json.loads(json.dumps(dataclasses.asdict(config)))
    assert config_from_dict(record) == config
    assert all(not isinstance(v, type) for v in record.values())  # names only, never classes


def test_saved_config_errors_are_checkpoint_errors():
    with pytest.raises(CheckpointError, match="head_type"):
        config_from_dict({"n_future": 3})
    with pytest.raises(CheckpointError, match="rank"):
        config_from_dict({"head_type": "medusa", "n_future": 3, "rank": 2})


@pytest.mark.parametrize("head_type", registered_heads())
@pytest.mark.parametrize("n", [0, -2, 1.5])
def test_every_type_rejects_a_bad_n_future(head_type, n):
    with pytest.raises(UsageError, match="n_future must be an integer >= 1"):
        make_config(head_type, n_future=n)
