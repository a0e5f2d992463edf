"""The POET-X side of the Axolotl and LLaMA-Factory plugins, without those frameworks (stand-in ``BasePlugin`` and
argument dataclass, the real ``transformers.HfArgumentParser``): config keys and values fail early with the valid
keys named, an adapter with POET-X is refused, and the callback each plugin hands over converts and merges inside a
real Hugging Face ``Trainer``."""

from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from fastdora import poetx  # noqa: E402
from fastdora.plugins import _poetx_common as px  # noqa: E402
from fastdora.plugins import axolotl as ax  # noqa: E402
from fastdora.plugins import llamafactory as lf  # noqa: E402

from ._support import stub_axolotl  # noqa: E402
from .test_poetx_callback import dataset, layers, make_args, tiny_llama  # noqa: E402

VALID = ["poetx_block_size", "poetx_merge_interval", "poetx_mode", "poetx_lr_scale", "poetx_exclude",
         "poetx_weight_format"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(px, "_ANNOUNCED", False)
    yield
    torch.set_num_threads(threads)


def test_both_frameworks_name_the_options_alike():
    assert list(ax.POETX_CFG_KEYS) == VALID and list(lf.POETX_CFG_KEYS) == VALID
    assert tuple(ax.POETX_CFG_KEYS.values()) == px.OPTION_NAMES


# ---------------------------------------------------------------------------------------------------- Axolotl
@pytest.fixture
def plugin_cls(monkeypatch):
    stub_axolotl(monkeypatch)
    return ax._build_poetx_plugin()


def test_axolotl_valid_keys_pass_and_give_the_options():
    cfg = {"base_model": "x", "poetx_block_size": 64, "poetx_mode": "mem", "poetx_exclude": ["lm_head", "layers.0"]}
    ax.check_poetx_cfg(cfg)
    assert ax.poetx_options_from_cfg(cfg) == {"block_size": 64, "merge_interval": 200, "mode": "mem",
                                              "lr_scale": 0.5, "exclude": ("lm_head", "layers.0"),
                                              "weight_format": "dense"}
    assert ax.poetx_options_from_cfg({**cfg, "poetx_weight_format": "int8"})["weight_format"] == "int8"


@pytest.mark.parametrize("key, hint", [
    ("poetx_blocksize", "did you mean poetx_block_size"),
    ("poet_x_mode", "did you mean poetx_mode"),
    ("poetx_merge_intervall", "did you mean poetx_merge_interval"),
    ("use_poetx", "plugins:"),
    ("poetx_terms", ""),
])
def test_axolotl_unknown_key_names_it_and_the_valid_ones(plugin_cls, key, hint):
    with pytest.raises(ValueError) as err:
        plugin_cls().register({"base_model": "x", key: 3})
    msg = str(err.value)
    assert key in msg and hint in msg and all(v in msg for v in VALID)


def test_axolotl_refuses_an_adapter(plugin_cls):
    with pytest.raises(ValueError, match="adapter: lora.*not supported"):
        plugin_cls().register({"adapter": "lora", "peft_use_dora": True})


@pytest.mark.parametrize("cfg, needle", [
    ({"poetx_block_size": 0}, "block_size must be an int >= 2"),
    ({"poetx_merge_interval": 0}, "merge_interval must be an int > 0"),
    ({"poetx_lr_scale": -1.0}, "lr_scale must be a number > 0"),
    ({"poetx_weight_format": "int4"}, r"weight_format must be one of \['dense', 'int8'\], got 'int4'"),
])
def test_axolotl_bad_value_fails_before_the_model_loads(plugin_cls, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        plugin_cls().pre_model_load(cfg)


def test_axolotl_schema_declares_exactly_the_keys():
    pytest.importorskip("pydantic")
    args = ax._build_poetx_args()
    assert list(args.model_fields) == VALID
    assert args(poetx_mode="mem").poetx_mode == "mem"
    with pytest.raises(Exception, match="poetx_mode"):
        args(poetx_mode="slow")
    assert args(poetx_weight_format="int8").poetx_weight_format == "int8"
    with pytest.raises(Exception, match="poetx_weight_format"):
        args(poetx_weight_format="int4")


def test_axolotl_callback_converts_and_merges_in_a_trainer(plugin_cls, tmp_path):
    cfg = {"poetx_block_size": 8, "poetx_merge_interval": 2}
    plugin = plugin_cls()
    plugin.register(cfg)
    plugin.pre_model_load(cfg)
    model = tiny_llama()
    callbacks = plugin.add_callbacks_pre_trainer(cfg, model)
    trainer = Trainer(model=model, args=make_args(tmp_path, max_steps=4), train_dataset=dataset(), callbacks=callbacks)
    assert len(layers(model)) == 14 and trainer.optimizer is None
    trainer.train()
    assert callbacks[0].merges == [2, 4] and all(int(m.merge_count) == 2 for m in layers(model))
    with open(os.path.join(tmp_path, "poetx_report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    assert rep["framework"] == "axolotl" and rep["merges_at_steps"] == [2, 4]


# ------------------------------------------------------------------------------------------------ LLaMA-Factory
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
    from transformers import HfArgumentParser

    return HfArgumentParser([args_cls]).parse_dict(cfg, allow_extra_keys=False)[0]


@pytest.fixture
def state(monkeypatch):
    for name in ("options", "report", "poetx_options"):
        monkeypatch.setattr(lf.STATE, name, None)
    return lf.STATE


def test_llamafactory_keys_parse(args_cls):
    ft = _parse(args_cls, {"finetuning_type": "full", "use_poetx": True, "poetx_block_size": 64,
                           "poetx_exclude": "lm_head, model.layers.0", "poetx_weight_format": "int8"})
    assert lf.poetx_options_from_args(ft) == {"block_size": 64, "merge_interval": 200, "mode": "fast",
                                              "lr_scale": 0.5, "exclude": ("lm_head", "model.layers.0"),
                                              "weight_format": "int8"}


@pytest.mark.parametrize("cfg, needle", [
    ({"finetuning_type": "lora", "use_poetx": True}, "use_poetx needs finetuning_type: full"),
    ({"finetuning_type": "full", "use_poetx": True, "use_fast_dora": True}, "exclusive"),
    ({"finetuning_type": "full", "use_poetx": "yes"}, "use_poetx must be true or false"),
    ({"finetuning_type": "full", "use_poetx": True, "poetx_mode": "slow"}, "mode must be one of"),
    ({"finetuning_type": "full", "use_poetx": True, "poetx_merge_interval": 0}, "merge_interval must be an int > 0"),
    ({"finetuning_type": "full", "use_poetx": True, "poetx_weight_format": "fp8"},
     r"weight_format must be one of \['dense', 'int8'\], got 'fp8'"),
    ({"finetuning_type": "full", "use_poetx": True, "poetx_blocksize": 8}, "Some keys are not used"),
])
def test_llamafactory_bad_config_fails_in_the_parser(args_cls, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        _parse(args_cls, cfg)


def test_llamafactory_records_the_options_for_training_only(state):
    ft = types.SimpleNamespace(use_poetx=True, use_fast_dora=False, poetx_block_size=8, poetx_merge_interval=2)
    model = tiny_llama()
    wrapped = lf._wrap_init_adapter(lambda *args, **kwargs: model)
    assert wrapped("config", model, "model_args", ft, False) is model  # inference / export: nothing
    assert state.poetx_options is None and not layers(model)
    wrapped("config", model, "model_args", ft, True)
    assert state.poetx_options["block_size"] == 8 and not layers(model)  # converted by the trainer's callback


def test_llamafactory_tuner_callback_converts_and_merges_in_a_trainer(state, tmp_path):
    state.poetx_options = px.collect_options(block_size=8, merge_interval=3)
    model = tiny_llama()
    trainer = Trainer(model=model, args=make_args(tmp_path, max_steps=6), train_dataset=dataset(),
                      callbacks=[lf._make_tuner_callback()])
    assert len(layers(model)) == 14 and trainer.optimizer is None
    trainer.train()
    assert all(int(m.merge_count) == 2 for m in layers(model))
    assert len(trainer.optimizer.param_groups) == 3
    with open(os.path.join(tmp_path, "poetx_report.json"), encoding="utf-8") as f:
        rep = json.load(f)
    assert rep["framework"] == "llamafactory" and rep["merges_at_steps"] == [3, 6]
    assert not os.path.exists(os.path.join(tmp_path, "fastdora_report.json"))  # fastdora's DoRA was not asked for
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, poetx.PoetXLinear)
