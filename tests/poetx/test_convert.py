"""convert / merge / export on a tiny Llama-like stack and on transformers' LlamaForCausalLM."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastdora import poetx
from fastdora.poetx import ConvertReport, PoetXLinear
from fastdora.poetx.convert import PEFT_REASON

from . import oracle

D, H, V, B = 32, 64, 50, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, D, bias=False), nn.Linear(D, 16), nn.Linear(D, 16)
        self.o_proj = nn.Linear(16, D, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=True)

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q_proj(h)[..., :16], self.k_proj(h), self.v_proj(h)
        attn = torch.softmax(q @ k.mT / 4.0, dim=-1) @ v
        x = x + self.o_proj(attn)
        h = self.norm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Tiny(nn.Module):
    """Two blocks plus layers convert must skip: a width not divisible by B, one smaller than B, an nn.Linear
    subclass, two tied layers, and lm_head."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.odd = nn.Linear(D, 24)
        self.small = nn.Linear(24, 8)
        self.special = nn.modules.linear.NonDynamicallyQuantizableLinear(8, D)
        self.tied_a, self.tied_b = nn.Linear(D, D), nn.Linear(D, D)
        self.tied_b.weight = self.tied_a.weight
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        x = x + self.special(self.small(self.odd(x)))
        return self.lm_head(self.tied_b(self.tied_a(x)))


BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONVERTED = [f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS]
SKIPPED = {
    "odd": "out_features 24 is not divisible by block_size 16",
    "small": "in_features 24 is not divisible by block_size 16",
    "special": "is a NonDynamicallyQuantizableLinear (a subclass of nn.Linear): only plain nn.Linear layers are "
               "converted",
    "tied_a": "its weight is shared with another module (tied weights)",
    "tied_b": "its weight is shared with another module (tied weights)",
    "lm_head": "excluded by 'lm_head'",
}



def _assert_same_function(after, before):
    """Conversion keeps the function: a converted layer stores its weight in its permutations' frame, so its GEMM adds
    nn.Linear's products in another order; float32 outputs agree to float32 rounding."""
    assert oracle.rel_err(after, before) < 1e-6

def _tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def _ids(batch=2, seq=7, seed=1):
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _sgd_steps(model, ids, steps=3, lr=4.0):
    """A few steps on the POET-X parameters only (large enough to move the output well above rounding)."""
    params = [p for n, p in model.named_parameters() if n.endswith(("q_in", "q_out"))]
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
    assert all(p.abs().max() > 1e-3 for p in params)


def test_convert_is_exact_and_reports_every_layer():
    model, ids = _tiny(), _ids()
    before = model(ids)
    report = poetx.convert(model, block_size=B)
    assert isinstance(report, ConvertReport)
    assert report.converted == CONVERTED
    assert report.skipped == SKIPPED
    n_skew = B * (B - 1) // 2
    blocks_per_block = (2 + 2) + (2 + 1) + (2 + 1) + (1 + 2) + (2 + 4) + (2 + 4) + (4 + 2)
    assert report.trainable_parameters == 2 * blocks_per_block * n_skew
    assert [n for n, m in model.named_modules() if isinstance(m, PoetXLinear)] == CONVERTED
    assert [model.get_submodule(n).layer_index for n in CONVERTED] == list(range(len(CONVERTED)))
    _assert_same_function(model(ids), before)
    text = str(report)
    assert "converted 14 linear layers" in text and "skipped lm_head: excluded by 'lm_head'" in text


def test_block_size_larger_than_a_layer_is_a_skip_reason():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    report = poetx.convert(model, block_size=64)
    assert report.converted == ["0"]
    assert report.skipped == {"1": "block_size 64 exceeds out_features 32"}


def test_exclude_matches_whole_dotted_components():
    model = _tiny()
    report = poetx.convert(model, block_size=B, exclude=("lm_head", "layers.1", "q_proj"))
    assert report.converted == [f"layers.0.{n}" for n in BLOCK_LINEARS if n != "q_proj"]
    assert report.skipped["layers.0.q_proj"] == "excluded by 'q_proj'"
    assert report.skipped["layers.1.k_proj"] == "excluded by 'layers.1'"
    report = poetx.convert(_tiny(), block_size=B, exclude="proj")  # a string is one entry; "proj" is no component
    assert len(report.converted) == 14


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=1), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=16.0), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(block_size="16"), "block_size"),
    (dict(merge_interval=0), "merge_interval"),
    (dict(merge_interval=-5), "merge_interval"),
    (dict(merge_interval=2.5), "merge_interval"),
    (dict(mode="turbo"), "mode"),
    (dict(terms=0), "terms"),
    (dict(exclude=("",)), "exclude"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_settings_raise_before_touching_the_model(kwargs, match):
    model = _tiny()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        poetx.convert(model, **{"block_size": B, **kwargs})
    assert not any(isinstance(m, PoetXLinear) for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_converting_twice_or_a_lone_linear_is_an_error():
    model = _tiny()
    poetx.convert(model, block_size=B)
    with pytest.raises(ValueError, match="already converted"):
        poetx.convert(model, block_size=B)
    with pytest.raises(ValueError, match="PoetXLinear"):
        poetx.convert(nn.Linear(32, 32), block_size=16)


@pytest.mark.parametrize("use_dora", [False, True])
def test_peft_adapter_layers_are_skipped(use_dora):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         use_dora=use_dora, init_lora_weights=False))
    ids = _ids()
    before = model(ids)
    report = poetx.convert(model, block_size=B)
    prefix = "base_model.model.layers"
    for i in range(2):
        for name in ("q_proj", "v_proj"):
            assert report.skipped[f"{prefix}.{i}.{name}"] == PEFT_REASON
    assert not any("lora" in n for n in report.converted + list(report.skipped))
    assert len(report.converted) == 10
    _assert_same_function(model(ids), before)


def test_seed_decides_the_permutations():
    a, b, c = _tiny(), _tiny(), _tiny()
    poetx.convert(a, block_size=B, seed=3)
    poetx.convert(b, block_size=B, seed=3)
    poetx.convert(c, block_size=B, seed=4)
    name = "layers.1.gate_proj.perm_in"
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items() if "perm" in k)
    assert not torch.equal(a.state_dict()[name], c.state_dict()[name])


def test_train_merge_export_keeps_the_function_and_the_state_dict_keys():
    model, ids = _tiny(), _ids()
    keys = list(model.state_dict())
    poetx.convert(model, block_size=B, mode="mem")
    with torch.no_grad():
        before = model(ids)
    _sgd_steps(model, ids)
    with torch.no_grad():
        trained = model(ids)
        assert oracle.rel_err(trained, before) > 1e-3  # training changed the function
        assert poetx.merge(model) == 14
        merged = model(ids)
    assert oracle.rel_err(merged, trained) < 2e-6
    assert all(not m.q_in.any() for m in model.modules() if isinstance(m, PoetXLinear))
    _sgd_steps(model, ids)
    with torch.no_grad():
        trained = model(ids)
        exported = poetx.export(model)
        assert exported is model
        assert oracle.rel_err(model(ids), trained) < 2e-6
    for name in CONVERTED:
        assert type(model.get_submodule(name)) is nn.Linear
    assert list(model.state_dict()) == keys
    assert model.tied_b.weight is model.tied_a.weight


def test_export_of_a_lone_layer_returns_a_linear():
    layer = PoetXLinear(nn.Linear(32, 32), 16)
    assert type(poetx.export(layer)) is nn.Linear
    assert poetx.merge(nn.Sequential(nn.Linear(4, 4))) == 0


def test_from_scratch_normalize_scales_the_converted_rows_only():
    model = _tiny()
    lm_head = model.lm_head.weight.detach().clone()
    report = poetx.convert(model, block_size=B, from_scratch_normalize=True)
    assert report.from_scratch_normalize and "normalised" in str(report)
    for name in CONVERTED:
        rows = model.get_submodule(name).weight.norm(dim=1)
        torch.testing.assert_close(rows, torch.ones_like(rows))
    assert torch.equal(model.lm_head.weight, lm_head)


def _llama(seed=0):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval(), config


def test_llama_convert_train_merge_export_and_reload():
    transformers = pytest.importorskip("transformers")
    model, config = _llama()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(ids).logits
    report = poetx.convert(model, block_size=B)
    assert len(report.converted) == 14 and report.skipped == {"lm_head": "excluded by 'lm_head'"}
    with torch.no_grad():
        _assert_same_function(model(ids).logits, before)

    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"{n}.weight" for n in report.converted}
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n.endswith(("q_in", "q_out"))], lr=1.0)
    for _ in range(3):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    with torch.no_grad():
        trained = model(ids).logits
        assert oracle.rel_err(trained, before) > 1e-3  # training changed the function
        poetx.merge(model)
        assert oracle.rel_err(model(ids).logits, trained) < 2e-6
        poetx.export(model)
        exported = model(ids).logits
    assert oracle.rel_err(exported, trained) < 2e-6
    assert list(model.state_dict()) == keys
    fresh = transformers.LlamaForCausalLM(config).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, exported)
