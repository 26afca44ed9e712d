"""Every config key says what it does here (acts / no effect here / refused), the loader keeps
its word (one warning per no-effect key a config sets, a refusal naming the key), and
docs/configuration.md is the generator's output, so the reference cannot drift from the code."""

from __future__ import annotations

import logging
import pathlib
from typing import get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from serve_app.config import AppConfig, ConfigError, load_config
from serve_app.config.effects import ACTS, NO_EFFECT, REFUSED, effect_of
from serve_app.config.loading import API_KEYS_ENV
from serve_app.config.reference import SECTIONS, render
from serve_app.pydantic_errors import dotted
from tests.test_config import merge

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "configuration.md"


def _section(annotation):
    """The config model a field holds, and whether it holds a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = get_args(annotation) if get_origin(annotation) is tuple else ()
    if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], True
    return None, False


def every_key(model=AppConfig, loc=()):
    """(loc, model, name, field) of every key reachable from AppConfig; a list's item is [0]."""
    for name, field in model.model_fields.items():
        here = (*loc, name)
        yield here, model, name, field
        nested, is_list = _section(field.annotation)
        if nested is not None:
            yield from every_key(nested, (*here, 0) if is_list else here)


KEYS = list(every_key())


def args_at(loc: tuple, value) -> dict:
    """('A', 'B', 0, 'c'), 1 -> {'A': {'B': [{'c': 1}]}}."""
    out = value
    for part in reversed(loc):
        out = [out] if isinstance(part, int) else {part: out}
    return out


def value_with_no_effect(effect, field):
    """A value the status is about: the one its condition names, else the default, set."""
    if effect.when is None:
        return field.get_default(call_default_factory=True)
    op, bound = effect.when
    return bound if op == "==" else bound + 1


def keys_of(kind: str) -> list[tuple]:
    return [
        (loc, field, effect_of(field))
        for loc, _, _, field in KEYS
        if effect_of(field) and effect_of(field).kind == kind
    ]


def params_of(kind: str) -> list:
    return [pytest.param(*key, id=dotted(key[0])) for key in keys_of(kind)]


# ---- the reference ------------------------------------------------------------------------------


def test_docs_are_the_generated_reference():
    assert DOCS.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md differs from the config models: run "
        "`python -m serve_app.config.reference > docs/configuration.md`"
    )


def test_the_reference_has_a_table_for_every_section():
    reached = {model for _, model, _, _ in KEYS}
    assert reached == {model for _, model in SECTIONS}
    text = render()
    for loc, _, name, _ in KEYS:
        assert f"| `{name}` |" in text or f"| [`{name}`](#" in text, dotted(loc)


def test_every_key_has_a_description_and_a_status():
    for loc, _, _, field in KEYS:
        assert field.description, f"{dotted(loc)} has no description"
        effect = effect_of(field)
        assert effect is not None, f"{dotted(loc)} declares no status (effects.acts/...)"
        assert effect.kind in (ACTS, NO_EFFECT, REFUSED)
        if effect.kind != ACTS:  # the user is told why, and what to do instead
            assert len(effect.note) > 20, dotted(loc)


# The classification itself, so that a key changing status is a decision someone wrote down.
NO_EFFECT_KEYS = {
    "ServerConfig.ipAddress", "ServerConfig.port", "ServerConfig.managementPort",
    "ServerConfig.metricsPort", "ServerConfig.interCommPort", "ServerConfig.openAiSupport",
    "BackendConfig.npuDeviceIds",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].cpuMemSize",
    "BackendConfig.ModelDeployConfig.ModelConfig[0].trustRemoteCode",
    *(f"BackendConfig.ScheduleConfig.{k}" for k in (
        "templateType", "prefillTimeMsPerReq", "decodeTimeMsPerReq", "prefillPolicyType",
        "decodePolicyType", "maxPreemptCount", "supportSelectBatch",
        "maxQueueDelayMicroseconds", "maxFirstTokenWaitTime",
    )),
}  # fmt: skip
REFUSED_KEYS = {"ServerConfig.httpsEnabled", "BackendConfig.multiNodesInferEnabled"}


def test_the_statuses_are_the_ones_written_down():
    assert {dotted(loc) for loc, _, _ in keys_of(NO_EFFECT)} == NO_EFFECT_KEYS
    assert {dotted(loc) for loc, _, _ in keys_of(REFUSED)} == REFUSED_KEYS


# ---- no effect here: one warning per key a config sets ------------------------------------------


def warnings_of(caplog, args) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serve_app.config"):
        load_config(args)
    return [r.getMessage() for r in caplog.records if r.name == "serve_app.config"]


@pytest.mark.parametrize("loc, field, effect", params_of(NO_EFFECT))
def test_a_key_without_effect_warns_once_naming_it(caplog, loc, field, effect):
    path = dotted(loc)
    [line] = warnings_of(caplog, args_at(loc, value_with_no_effect(effect, field)))
    assert line.startswith(path + " ")
    assert "no effect here" in line
    assert effect.note in line or "instead" in line  # why, and what to do instead


def test_world_size_acts_and_what_cannot_split_the_model_is_refused_at_load(caplog):
    loc = ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "worldSize")
    assert warnings_of(caplog, merge(args_at(loc, 4), model_at("demo"))) == []
    with pytest.raises(ConfigError, match=r"worldSize 3 does not divide the model's 8 attention"):
        load_config(merge(args_at(loc, 3), model_at("demo")))


def model_at(path: str) -> dict:
    return args_at(
        ("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "modelWeightPath"), path
    )


def test_every_key_without_effect_warns_in_one_load(caplog):
    args: dict = {}
    for loc, field, effect in keys_of(NO_EFFECT):
        args = merge(args, args_at(loc, value_with_no_effect(effect, field)))
    lines = warnings_of(caplog, args)
    assert sorted(line.split(" ")[0] for line in lines) == sorted(NO_EFFECT_KEYS)
    assert len(warnings_of(caplog, args)) == len(NO_EFFECT_KEYS)  # and again on the next load


SHIPPED = ["deployments.yaml", "deployments-pd.yaml", "bench/demo.yaml", "cluster/serve-pd.yaml"]


@pytest.mark.parametrize(
    "args",
    [
        None,
        {},
        {"ServerConfig": {}, "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{}]}}},
        # values the status is not about act, so they do not warn
        args_at(("BackendConfig", "ModelDeployConfig", "ModelConfig", 0, "trustRemoteCode"), False),
        {
            "ServerConfig": {"httpsEnabled": False},
            "BackendConfig": {"multiNodesInferEnabled": False},
        },
        *(
            pytest.param(app.get("args") or {}, id=name)
            for name in SHIPPED
            for app in yaml.safe_load((ROOT / name).read_text())["applications"]
        ),
    ],
)
def test_defaults_and_acting_values_never_warn(caplog, args):
    assert warnings_of(caplog, args) == []


@pytest.mark.parametrize(
    "args, env",
    [
        ({"ServerConfig": {"managementPort": 1026, "maxLinkNum": 0}}, ""),
        ({"ServerConfig": {"managementPort": 1026}}, "a b"),  # fails after validation
    ],
)
def test_a_config_that_fails_to_load_does_not_warn(caplog, monkeypatch, args, env):
    monkeypatch.setenv(API_KEYS_ENV, env)
    with caplog.at_level(logging.WARNING, logger="serve_app.config"):
        with pytest.raises(ConfigError):
            load_config(args)
    assert caplog.records == []


# ---- refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize("loc, field, effect", params_of(REFUSED))
def test_a_refused_value_fails_the_load_naming_the_key_and_the_alternative(loc, field, effect):
    with pytest.raises(ConfigError) as info:
        load_config(args_at(loc, value_with_no_effect(effect, field)))
    [line] = str(info.value).splitlines()[1:]
    assert line.strip().startswith(f"{dotted(loc)}: ")
    assert effect.note in line


def test_refusals_are_listed_with_the_other_problems():
    with pytest.raises(ConfigError) as info:
        load_config(
            {
                "ServerConfig": {"httpsEnabled": True, "maxLinkNum": 0},
                "BackendConfig": {"multiNodesInferEnabled": True},
            }
        )
    message = str(info.value)
    assert "ServerConfig.httpsEnabled: true is refused: " in message
    assert "terminate TLS in front of it" in message
    assert "BackendConfig.multiNodesInferEnabled: true is refused: " in message
    assert "one model instance across nodes is not supported" in message
    assert "ServerConfig.maxLinkNum: must be >= 1" in message
