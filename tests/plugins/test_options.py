"""Every plugin exposes exactly the core's public options: ``kernels``, ``legacy_embedding_compose``,
``dm_from_output`` (``cache_norm`` / ``norm_budget_mb`` are internal settings, not options)."""

from __future__ import annotations

import dataclasses
import glob
import inspect
import os

import pytest

import fastdora
from fastdora.plugins import _common
from fastdora.plugins import axolotl as ax_plugin
from fastdora.plugins import llamafactory as lf_plugin

from ._support import REPO

PUBLIC = ("kernels", "legacy_embedding_compose", "dm_from_output")
FORMER = ("cache_norm", "norm_budget_mb")


def test_option_names_are_the_core_public_options():
    assert _common.OPTION_NAMES == PUBLIC
    assert set(_common.OPTION_NAMES) == {f.name for f in dataclasses.fields(fastdora.Options)}


@pytest.mark.parametrize("name", FORMER)
def test_former_options_are_rejected(name):
    with pytest.raises(TypeError, match=name):
        _common.collect_options(**{name: 1})


def test_collect_options_keeps_the_set_ones_and_validates():
    assert _common.collect_options(kernels="eager", legacy_embedding_compose=None, dm_from_output=False) == {
        "kernels": "eager",
        "dm_from_output": False,
    }
    with pytest.raises(ValueError, match="dm_from_output"):
        _common.collect_options(dm_from_output="no")


def test_hf_callback_keywords_are_the_options():
    from fastdora.plugins import FastDoraCallback

    params = inspect.signature(FastDoraCallback.__init__).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - {"write_report", "report_file", "framework"} == set(PUBLIC)
    assert FastDoraCallback(dm_from_output=False, kernels="eager").options == {"dm_from_output": False,
                                                                               "kernels": "eager"}
    for name in FORMER:
        with pytest.raises(TypeError):
            FastDoraCallback(**{name: 1})


#: POET-X's options, shared by PoetXCallback, the Axolotl ``poetx_*`` keys and LLaMA-Factory's ``poetx_*`` fields
POETX = ("block_size", "merge_interval", "mode", "lr_scale", "exclude", "weight_format")


def test_poetx_options_are_the_same_in_every_plugin():
    from fastdora.plugins import PoetXCallback
    from fastdora.plugins import _poetx_common as px

    assert px.OPTION_NAMES == POETX and set(px.DEFAULTS) == set(POETX)
    params = inspect.signature(PoetXCallback.__init__).parameters
    keywords = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - {"write_report", "report_file", "framework"} == set(POETX)
    assert ax_plugin.POETX_CFG_KEYS == lf_plugin.POETX_CFG_KEYS == {f"poetx_{name}": name for name in POETX}


@pytest.mark.parametrize("value", ["int4", "INT8", "", 8, None])
def test_poetx_weight_format_is_validated_when_the_options_are_collected(value):
    from fastdora.plugins import _poetx_common as px

    if value is None:  # the default
        assert px.collect_options(weight_format=None)["weight_format"] == "dense"
        return
    with pytest.raises(ValueError, match=rf"weight_format must be one of \['dense', 'int8'\], got {value!r}"):
        px.collect_options(weight_format=value)


def test_trl_exports_the_same_callback():
    from fastdora.plugins import hf, trl

    assert trl.FastDoraCallback is hf.FastDoraCallback


def test_axolotl_keys_follow_the_fast_dora_prefix():
    assert ax_plugin.CFG_KEYS == {f"fast_dora_{name}": name for name in PUBLIC}


def test_axolotl_schema_declares_exactly_the_keys():
    pytest.importorskip("pydantic")
    args = ax_plugin._build_args()
    assert set(args.model_fields) == set(ax_plugin.CFG_KEYS)
    assert args(fast_dora_dm_from_output=False).fast_dora_dm_from_output is False


def test_llamafactory_keys_follow_the_fast_dora_prefix():
    assert lf_plugin.CFG_KEYS == {f"fast_dora_{name}": name for name in PUBLIC}
    assert lf_plugin.FIELD_NAMES == ("use_fast_dora",) + tuple(lf_plugin.CFG_KEYS) + ("use_poetx",) + tuple(
        lf_plugin.POETX_CFG_KEYS)


def _code_files():
    pats = ["examples/**/*.py", "examples/**/*.yaml", "integration_tests/**/*.py", "integration_tests/*.sh",
            "plugins/*.py"]
    for pat in pats:
        yield from glob.glob(os.path.join(REPO, pat), recursive=True)


def test_examples_and_integration_tests_pass_no_former_option():
    offenders = []
    for path in _code_files():
        with open(path, encoding="utf-8") as f:
            for no, line in enumerate(f, 1):
                if "_FORMER_KEYS = " in line:  # the Axolotl plugin names them to say they are gone
                    continue
                offenders += [(os.path.relpath(path, REPO), no, name) for name in FORMER if name in line]
    assert not offenders
