"""The Axolotl plugin's pure logic, without Axolotl (a stand-in ``BasePlugin``): unknown ``fast_dora_*`` keys fail at
``register``, and the foreign-forward check recognises fastdora's own instance-level forward."""

from __future__ import annotations

import logging

import pytest

import fastdora
from fastdora.plugins import axolotl as ax_plugin

from ._support import collect, fresh_announce, stub_axolotl, tiny_dora_model

DORA_CFG = {"adapter": "lora", "peft_use_dora": True, "plugins": ["fastdora.plugins.axolotl.FastDoraPlugin"]}


@pytest.fixture
def plugin_cls(monkeypatch):
    stub_axolotl(monkeypatch)
    return ax_plugin._build_plugin()


# ------------------------------------------------------------------------------------------------- config keys
def test_valid_keys_pass():
    ax_plugin.check_cfg_keys({**DORA_CFG, "fast_dora_kernels": "eager", "fast_dora_legacy_embedding_compose": False,
                              "fast_dora_dm_from_output": True, "lora_r": 8})


@pytest.mark.parametrize(
    "key, hint",
    [
        ("fast_dora_kernal", "did you mean fast_dora_kernels"),
        ("fastdora_kernels", "did you mean fast_dora_kernels"),
        ("fast_dora_dm_from_outputs", "did you mean fast_dora_dm_from_output"),
        ("fast_dora_cache_norm", "no longer an option"),
        ("fast_dora_norm_budget_mb", "no longer an option"),
        ("use_fast_dora", "plugins:"),
        ("fast_dora_whatever", ""),
    ],
)
def test_unknown_key_names_it_and_the_valid_ones(key, hint):
    with pytest.raises(ValueError) as err:
        ax_plugin.check_cfg_keys({**DORA_CFG, key: True})
    msg = str(err.value)
    assert key in msg and hint in msg
    for valid in ("fast_dora_kernels", "fast_dora_legacy_embedding_compose", "fast_dora_dm_from_output"):
        assert valid in msg


def test_register_rejects_a_misspelled_key_before_anything_runs(plugin_cls):
    cfg = {**DORA_CFG, "fast_dora_kernal": "eager"}
    with pytest.raises(ValueError, match="fast_dora_kernal"):
        plugin_cls().register(cfg)
    assert "lora_qkv_kernel" not in cfg  # failed before touching the config


def test_register_switches_off_the_fused_lora_kernels(plugin_cls):
    cfg = {**DORA_CFG, "fast_dora_kernels": "eager"}
    plugin_cls().register(cfg)
    assert all(cfg[k] is False for k in ax_plugin.AXOLOTL_LORA_KERNEL_KEYS)


def test_register_ignores_other_plugins_keys(plugin_cls):
    plugin_cls().register({"adapter": "lora", "liger_rope": True, "fast_attention": True})


# ------------------------------------------------------------------------------------------ foreign forwards
def test_clean_fastdora_run_does_not_warn(monkeypatch):
    model = tiny_dora_model()
    fastdora.enable(model)
    # fastdora put its own instance-level forward on the LoRA Linear layers: that must not count as foreign
    lean = [n for n, m in model.named_modules() if getattr(m, "lora_magnitude_vector", None) and "forward" in vars(m)]
    assert lean, "fastdora installed no instance-level forward: the test would prove nothing"
    recs = collect(monkeypatch, "test.axolotl")
    assert ax_plugin.check_foreign_forwards(model, logging.getLogger("test.axolotl")) == []
    assert recs.messages(logging.WARNING) == []


def test_foreign_forward_warns_with_the_count(monkeypatch):
    model = tiny_dora_model()
    fastdora.enable(model)
    layer = model.base_model.model.q
    layer.forward = lambda x: x  # e.g. a fused-kernel patch replacing PEFT's DoRA path
    recs = collect(monkeypatch, "test.axolotl")
    found = ax_plugin.check_foreign_forwards(model, logging.getLogger("test.axolotl"))
    assert found == ["base_model.model.q"]
    warnings = recs.messages(logging.WARNING)
    assert len(warnings) == 1 and "1 DoRA module(s)" in warnings[0] and "base_model.model.q" in warnings[0]


def test_foreign_forward_without_fastdora_is_reported_too():
    model = tiny_dora_model()  # stock PEFT: no instance-level forward at all
    assert ax_plugin.check_foreign_forwards(model) == []
    model.base_model.model.v.forward = lambda x: x
    assert ax_plugin.check_foreign_forwards(model) == ["base_model.model.v"]


def test_post_model_load_is_silent_on_a_clean_run(plugin_cls, monkeypatch):
    fresh_announce(monkeypatch)
    recs = collect(monkeypatch, "axolotl.integrations.fastdora")
    model = tiny_dora_model()
    plugin = plugin_cls()
    cfg = {**DORA_CFG, "fast_dora_kernels": "eager"}
    plugin.post_lora_load(cfg, model)
    plugin.post_model_load(cfg, model)
    assert plugin.report is not None and plugin.report.total_converted == 2
    assert recs.messages(logging.WARNING) == []
    on = [m for m in recs.messages(logging.INFO) if m.startswith("fastdora: on")]
    assert on == ["fastdora: on, converted 2 DoRA layer(s) (2 linear); eager PyTorch path (kernels='eager')"]

    model.base_model.model.v.forward = lambda x: x
    plugin.post_model_load(cfg, model)
    assert any("1 DoRA module(s)" in m for m in recs.messages(logging.WARNING))


def test_callback_from_the_plugin_carries_the_options(plugin_cls):
    pytest.importorskip("transformers")
    cfg = {**DORA_CFG, "fast_dora_kernels": "eager", "fast_dora_dm_from_output": False}
    (cb,) = plugin_cls().add_callbacks_pre_trainer(cfg, None)
    assert cb.options == {"kernels": "eager", "dm_from_output": False} and cb.framework == "axolotl"
