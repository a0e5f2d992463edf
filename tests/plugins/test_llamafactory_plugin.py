"""The LLaMA-Factory plugin's pure logic, without LLaMA-Factory (stand-in argument dataclass and modules; the real
``transformers.HfArgumentParser`` that LLaMA-Factory parses its YAML with)."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
from torch import nn

from fastdora.plugins import llamafactory as lf

from ._support import collect, fresh_announce, tiny_dora_model


@dataclasses.dataclass
class FinetuningArguments:  # stand-in for llamafactory.hparams.FinetuningArguments
    finetuning_type: str = "lora"
    use_dora: bool = False

    def __post_init__(self):
        pass


@pytest.fixture(scope="module")
def args_cls():
    return lf.make_finetuning_arguments(FinetuningArguments)


def _parse(args_cls, cfg):
    """What LLaMA-Factory 0.9.5 does with the YAML dict: ``HfArgumentParser(...).parse_dict(cfg,
    allow_extra_keys=False)`` (``allow_extra_keys`` is only true with ``ALLOW_EXTRA_ARGS=1``)."""
    from transformers import HfArgumentParser

    return HfArgumentParser([args_cls]).parse_dict(cfg, allow_extra_keys=False)[0]


# --------------------------------------------------------------------------------------------- argument fields
def test_declares_exactly_the_fastdora_and_poetx_fields(args_cls):
    added = {f.name for f in dataclasses.fields(args_cls)} - {f.name for f in dataclasses.fields(FinetuningArguments)}
    assert added == {"use_fast_dora", "fast_dora_kernels", "fast_dora_legacy_embedding_compose",
                     "fast_dora_dm_from_output", "use_poetx", "poetx_block_size", "poetx_merge_interval",
                     "poetx_mode", "poetx_lr_scale", "poetx_exclude", "poetx_weight_format"}
    assert issubclass(args_cls, FinetuningArguments) and args_cls.__name__ == "FinetuningArguments"
    assert lf.make_finetuning_arguments(args_cls) is args_cls  # idempotent
    assert lf.make_finetuning_arguments(FinetuningArguments) is args_cls


def test_known_keys_parse(args_cls):
    ft = _parse(args_cls, {"finetuning_type": "lora", "use_dora": True, "use_fast_dora": True,
                           "fast_dora_kernels": "eager", "fast_dora_dm_from_output": False})
    assert ft.use_fast_dora is True
    assert lf.options_from_args(ft) == {"kernels": "eager", "dm_from_output": False}


@pytest.mark.parametrize("key", ["fast_dora_kernal", "use_fastdora", "fastdora_kernels", "fast_dora_cache_norm",
                                 "fast_dora_norm_budget_mb"])
def test_misspelled_or_removed_key_fails_in_the_parser(args_cls, key):
    with pytest.raises(ValueError, match="Some keys are not used by the HfArgumentParser") as err:
        _parse(args_cls, {"use_fast_dora": True, key: "eager"})
    assert key in str(err.value)


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"use_fast_dora": "maybe"}, "use_fast_dora must be true or false"),
        ({"use_fast_dora": True, "fast_dora_kernels": "cuda"}, "fast_dora_kernels must be one of"),
        ({"use_fast_dora": True, "fast_dora_dm_from_output": "no"}, "fast_dora_dm_from_output must be true or false"),
    ],
)
def test_bad_value_fails(args_cls, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        _parse(args_cls, cfg)


def test_patch_parser_swaps_the_argument_lists():
    class Other:
        pass

    mod = types.ModuleType("llamafactory.hparams.parser")
    mod.FinetuningArguments = FinetuningArguments
    mod._TRAIN_ARGS = [Other, FinetuningArguments]
    mod._INFER_ARGS = [FinetuningArguments]
    mod._EVAL_ARGS = [Other]
    lf.patch_parser(mod)
    sub = lf.make_finetuning_arguments(FinetuningArguments)
    assert mod._TRAIN_ARGS == [Other, sub] and mod._INFER_ARGS == [sub] and mod._EVAL_ARGS == [Other]


# ------------------------------------------------------------------------------- init_adapter: train vs export
@pytest.mark.parametrize(
    "use, trainable, dora, action",
    [
        (False, True, True, "off"),
        (True, True, True, "enable"),
        (True, False, True, "enable"),  # e.g. a quantized model keeps its adapter unmerged for inference
        (True, False, False, "merged"),  # llamafactory-cli export / chat: the adapter was merged
        (True, True, False, "no_dora"),
        (True, None, False, "no_dora"),
    ],
)
def test_init_adapter_action(use, trainable, dora, action):
    ft = types.SimpleNamespace(use_fast_dora=use)
    model = tiny_dora_model() if dora else nn.Linear(4, 4)
    assert lf.init_adapter_action(ft, trainable, model) == action


def test_call_args_positional_and_keyword():
    ft = object()
    assert lf._init_adapter_call_args(("cfg", "model", "margs", ft, False), {}) == (ft, False)
    assert lf._init_adapter_call_args(("cfg", "model", "margs"), {"finetuning_args": ft, "is_trainable": 1}) == (
        ft, True)
    assert lf._init_adapter_call_args(("cfg", "model", "margs", ft), {}) == (ft, None)


@pytest.fixture
def state(monkeypatch):
    monkeypatch.setattr(lf.STATE, "options", None)
    monkeypatch.setattr(lf.STATE, "report", None)
    monkeypatch.setattr(lf.STATE, "poetx_options", None)
    return lf.STATE


def _wrapped(model):
    return lf._wrap_init_adapter(lambda *args, **kwargs: model)


def test_export_of_a_merged_model_is_silent(monkeypatch, state):
    recs = collect(monkeypatch, "fastdora.plugins.llamafactory")
    plain = nn.Linear(4, 4)  # what init_adapter returns after merge_and_unload
    ft = types.SimpleNamespace(use_fast_dora=True)
    assert _wrapped(plain)("config", None, "model_args", ft, False) is plain
    assert recs.messages(logging.WARNING) == [] and state.options is None


def test_training_a_model_without_dora_warns(monkeypatch, state):
    recs = collect(monkeypatch, "fastdora.plugins.llamafactory")
    ft = types.SimpleNamespace(use_fast_dora=True)
    _wrapped(nn.Linear(4, 4))("config", None, "model_args", ft, True)
    assert any("no DoRA layer" in m for m in recs.messages(logging.WARNING))


def test_training_a_dora_model_converts_and_announces(monkeypatch, state):
    fresh_announce(monkeypatch)
    recs = collect(monkeypatch, "fastdora.plugins.llamafactory")
    model = tiny_dora_model()
    ft = types.SimpleNamespace(use_fast_dora=True, fast_dora_kernels="eager")
    _wrapped(model)(config="config", model=None, model_args="model_args", finetuning_args=ft, is_trainable=True)
    assert state.options == {"kernels": "eager"} and state.report.total_converted == 2
    assert recs.messages(logging.INFO)[-1].startswith("fastdora: on, converted 2 DoRA layer(s)")


def test_without_the_switch_nothing_happens(monkeypatch, state):
    recs = collect(monkeypatch, "fastdora.plugins.llamafactory")
    model = tiny_dora_model()
    _wrapped(model)("config", None, "model_args", types.SimpleNamespace(use_fast_dora=False), True)
    assert state.options is None and recs.records == []
    assert not any(type(v).__name__.startswith("FastDora") for m in model.modules()
                   for v in (getattr(m, "lora_variant", None) or {}).values())
