"""The lean module forward (``fastdora.layers.lean_linear_forward``): bitwise the same outputs, gradients and
recorded paths as PEFT's ``lora.Linear.forward`` -> fastdora variant chain, and PEFT's own forward everywhere the
lean path does not apply."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastdora
from fastdora import layers as L
from fastdora.stats import active_path_counter

from ..helpers import MLP, assert_close, assert_same_grads, forward_backward, make_pair, model_input


@pytest.fixture
def peft_forward_calls(monkeypatch):
    """Counts calls of PEFT's ``lora.Linear.forward`` (the class method: the lean path skips it)."""
    calls = []
    orig = LoraLinear.forward

    def counting(self, x, *args, **kwargs):
        calls.append(self)
        return orig(self, x, *args, **kwargs)

    monkeypatch.setattr(LoraLinear, "forward", counting)
    return calls


def _lora_linears(model):
    return [m for m in model.modules() if type(m) is LoraLinear]


def _lean_installed(model):
    return [L._is_lean(m.__dict__.get("forward")) for m in _lora_linears(model)]


def _chain():
    """The block every call of a chain model runs in: the internal setting ``lean_forward`` off, so the model takes
    PEFT's ``lora.Linear.forward`` -> fastdora variant -> magnitude layer chain (the setting is read at every call,
    and the variant would install the lean forward at the first call with it on)."""
    return fastdora.config.override(lean_forward=False)


def _triple(dtype=torch.float32, adapter_dtype=None, **kw):
    """(stock PEFT, fastdora lean, fastdora chain) with identical parameters; call the chain model inside
    :func:`_chain`."""
    bias = kw.pop("bias", True)
    ref, lean = make_pair(lambda: MLP(bias=bias), dtype=dtype, enable=False,
                          adapter_dtype=adapter_dtype, **kw)
    chain = copy.deepcopy(lean)
    fastdora.enable(lean, kernels="eager")
    with _chain():
        fastdora.enable(chain, kernels="eager")
    return ref, lean, chain


def _bitwise(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: not bitwise equal (max diff {(a.double() - b.double()).abs().max():.3e})"


def _bitwise_grads(ga, gb, what):
    assert ga.keys() == gb.keys(), what
    for n in ga:
        _bitwise(ga[n], gb[n], f"{what} grad {n}")


SETUPS = {
    "fp32": dict(dtype=torch.float32),
    "fp64": dict(dtype=torch.float64),
    "bf16_base_fp32_adapters": dict(dtype=torch.bfloat16),  # PEFT's input cast to the adapters' dtype
    "bf16": dict(dtype=torch.bfloat16, adapter_dtype=torch.bfloat16),
    "no_bias": dict(dtype=torch.float32, bias=False),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("autocast", [False, True])
def test_lean_equals_chain_and_peft(setup, autocast, peft_forward_calls):
    """The lean forward and the chain record the same paths and give bitwise the same outputs and gradients, with the
    same composition node; both match stock PEFT."""
    kw = dict(SETUPS[setup])
    dtype = kw["dtype"]
    if autocast and dtype == torch.float64:
        pytest.skip("CPU autocast does not take fp64 inputs")
    ref, lean, chain = _triple(**kw)
    x = model_input(lean, dtype)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else torch.enable_grad

    def run(model):
        with ctx():
            return forward_backward(model, x)

    def run_chain():
        with _chain():
            return run(chain)

    out_c, g_c = run_chain()
    out_l, g_l = run(lean)  # enable() installed the lean forward: the first call takes it as well
    assert all(_lean_installed(lean)) and not any(_lean_installed(chain))
    peft_forward_calls.clear()
    active_path_counter.clear()
    out_l, g_l = run(lean)
    assert peft_forward_calls == [], "the lean path called PEFT's forward"
    lean_paths = dict(active_path_counter)
    active_path_counter.clear()
    out_c, g_c = run_chain()
    assert len(peft_forward_calls) == len(_lora_linears(chain))
    assert lean_paths == dict(active_path_counter)  # same paths recorded (composition and norm cache)
    _bitwise(out_l, out_c, "output")
    _bitwise_grads(g_l, g_c, "lean vs chain")
    with ctx():  # the node of the last layer's composition (the model's output)
        nodes = {type(lean(x).grad_fn).__name__}
        with _chain():
            nodes.add(type(chain(x).grad_fn).__name__)
    assert nodes == {"_DoraComposeBackward"}, nodes
    out_r, g_r = run(ref)
    tol_dtype = torch.bfloat16 if (autocast or dtype == torch.bfloat16) else dtype
    assert_close(out_l, out_r, tol_dtype, "output vs PEFT")
    assert_same_grads(g_l, g_r, tol_dtype, "lean vs PEFT")


def test_inference_and_checkpointing():
    ref, lean, chain = _triple(dtype=torch.float32)
    x = model_input(lean, torch.float32)
    forward_backward(lean, x)  # a first training call of each
    with _chain():
        forward_backward(chain, x)
    with torch.no_grad():
        out_l = lean(x)
        with _chain():
            _bitwise(out_l, chain(x), "no-grad output")
    lean.eval(), chain.eval()
    with torch.inference_mode():
        out_l = lean(x)
        with _chain():
            _bitwise(out_l, chain(x), "inference-mode output")
    lean.train(), chain.train()

    def ckpt_fb(model):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = checkpoint(model, xx, use_reentrant=False)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out_l, g_l = ckpt_fb(lean)
    with _chain():  # the backward (recomputation) inside the block too
        out_c, g_c = ckpt_fb(chain)
    _bitwise(out_l, out_c, "checkpointed output")
    _bitwise_grads(g_l, g_c, "checkpointed")


def test_training_steps_track_peft():
    """Optimizer steps change W-independent factors: the lean path's norm cache key sees them (fp64: tight)."""
    ref, lean, _ = _triple(dtype=torch.float64)
    x = model_input(lean, torch.float64)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in (ref, lean)]
    for step in range(4):
        for m, opt in zip((ref, lean), opts):
            opt.zero_grad()
            out = m(x)
            (out ** 2).mean().backward()
            opt.step()
    active_path_counter.clear()
    out_r, g_r = forward_backward(ref, x)
    out_l, g_l = forward_backward(lean, x)
    assert active_path_counter["norm:computed_base_cached"] == len(_lora_linears(lean))
    assert_close(out_l, out_r, torch.float64, "output after 4 steps")
    assert_same_grads(g_l, g_r, torch.float64, "after 4 steps")
    active_path_counter.clear()
    forward_backward(lean, x)
    assert active_path_counter["norm:cached"] == len(_lora_linears(lean))


def _fallback_case(name, model, x):
    """Put ``model`` in a state where the lean path must not run; returns an undo callable."""
    if name == "disabled":
        model.base_model.disable_adapter_layers()
        return model.base_model.enable_adapter_layers
    if name == "merged":
        model.base_model.merge_adapter()
        return model.base_model.unmerge_adapter
    if name == "mag_hook":
        hs = [m.lora_magnitude_vector["default"].register_forward_hook(lambda *a: None) for m in _lora_linears(model)]
        return lambda: [h.remove() for h in hs]
    if name == "global_hook":
        h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        return h.remove
    if name == "dropout_train":
        for m in _lora_linears(model):
            m.lora_dropout["default"] = nn.Dropout(0.3)

        def undo():
            for m in _lora_linears(model):
                m.lora_dropout["default"] = nn.Identity()

        return undo
    if name == "lean_off":  # the internal setting, read at every call (the undo callables run in reverse order)
        block = fastdora.config.override(lean_forward=False)
        block.__enter__()
        return lambda: block.__exit__(None, None, None)
    raise AssertionError(name)


@pytest.mark.parametrize("case", ["disabled", "merged", "mag_hook", "global_hook", "dropout_train", "lean_off"])
def test_fallbacks_run_peft_forward(case, peft_forward_calls):
    ref, lean, _ = _triple(dtype=torch.float64)
    x = model_input(lean, torch.float64)
    forward_backward(lean, x)
    assert all(_lean_installed(lean))
    undo_l, undo_r = _fallback_case(case, lean, x), _fallback_case(case, ref, x)
    try:
        peft_forward_calls.clear()
        torch.manual_seed(0)
        out_l = lean(x)
        assert len(peft_forward_calls) == len(_lora_linears(lean)), f"{case}: the lean path ran"
        torch.manual_seed(0)
        out_r = ref(x)
        assert_close(out_l, out_r, torch.float64, case)
    finally:
        undo_r(), undo_l()
    peft_forward_calls.clear()
    lean(x)
    assert peft_forward_calls == [], f"{case}: the lean path did not resume"


def test_dropout_eval_mode_uses_lean_path(peft_forward_calls):
    ref, lean, _ = _triple(dtype=torch.float64, lora_dropout=0.3)
    x = model_input(lean, torch.float64)
    forward_backward(lean, x)  # train mode with dropout: PEFT's forward (no lean install needed to be correct)
    lean.eval(), ref.eval()
    lean(x)  # eval mode: the lean path applies again
    peft_forward_calls.clear()
    out_l = lean(x)
    assert peft_forward_calls == []
    assert_close(out_l, ref(x), torch.float64, "eval with dropout module")


def test_two_active_adapters_and_other_adapter(peft_forward_calls):
    from peft import LoraConfig

    ref, _, _ = _triple(dtype=torch.float64)
    ref.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["lin0", "lin1"], use_dora=True,
                                        init_lora_weights=False))
    lean = copy.deepcopy(ref)
    fastdora.enable(lean, kernels="eager")
    x = model_input(lean, torch.float64)
    lean(x)
    for adapters in (["default", "other"], "other"):
        for m in (ref, lean):
            m.base_model.set_adapter(adapters)
        peft_forward_calls.clear()
        out_l = lean(x)
        if isinstance(adapters, list):
            assert len(peft_forward_calls) == len(_lora_linears(lean))
        else:
            assert peft_forward_calls == []
        assert_close(out_l, ref(x), torch.float64, f"adapters {adapters}")


def test_input_cast_disabled_is_honoured():
    from peft.helpers import disable_input_dtype_casting

    ref, lean, chain = _triple(dtype=torch.bfloat16)  # bf16 base, fp32 adapters: PEFT casts x to fp32
    x = model_input(lean, torch.bfloat16)
    lean(x)
    with _chain():
        chain(x)
    with disable_input_dtype_casting(lean), disable_input_dtype_casting(chain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_l = lean(x)
            with _chain():
                _bitwise(out_l, chain(x), "casting disabled")


def test_install_remove_copy_pickle():
    ref, lean, _ = _triple(dtype=torch.float32)
    x = model_input(lean, torch.float32)
    lean(x)
    assert all(_lean_installed(lean))
    dup = copy.deepcopy(lean)
    for m in _lora_linears(dup):
        assert m.__dict__["forward"].__self__ is m  # bound to the copy, not to the original
    _bitwise(dup(x), lean(x), "deepcopy output")
    buf = io.BytesIO()
    torch.save(lean, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in _lora_linears(loaded):
        assert m.__dict__["forward"].__self__ is m
    _bitwise(loaded(x), lean(x), "pickled output")
    pickle.dumps(lean)
    assert fastdora.disable(lean) > 0
    assert not any(_lean_installed(lean)) and all("forward" not in m.__dict__ for m in _lora_linears(lean))
    assert_close(lean(x), ref(x), torch.float32, "after disable")


def test_existing_instance_forward_is_kept():
    """Something else (e.g. accelerate's hooks) replaced ``forward`` on the instance: left alone."""
    ref, lean, _ = _triple(dtype=torch.float32)
    mods = _lora_linears(lean)
    calls = []

    def wrapped(x, *args, _m=mods[0], **kwargs):
        calls.append(1)
        return LoraLinear.forward(_m, x, *args, **kwargs)

    mods[0].forward = wrapped
    x = model_input(lean, torch.float32)
    lean(x), lean(x)
    assert mods[0].__dict__["forward"] is wrapped and len(calls) == 2
    assert L._is_lean(mods[1].__dict__.get("forward"))
    assert not L.install_lean_forward(mods[0])


def test_autocast_round_trip_cast_skipped():
    """bf16 activations, fp32 adapters, bf16 autocast (HF Trainer's AMP): the lean path leaves out PEFT's fp32 cast
    of the input and autocast's cast back (two activation-sized copies per layer forward), with bitwise the same
    outputs and gradients; without autocast (or in another autocast dtype) the cast stays."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dim() > 1 and args[0].shape[0] == 3:
                self.sizes.append((args[0].dtype, out.dtype))  # activation-sized (batch 3) casts only
            return out

    _, lean, chain = _triple(dtype=torch.bfloat16)
    x = model_input(lean, torch.bfloat16)
    forward_backward(lean, x)  # a first training call of each
    with _chain():
        forward_backward(chain, x)
    counts = {}
    for name, m, block in (("lean", lean, contextlib.nullcontext), ("chain", chain, _chain)):
        with block(), torch.autocast("cpu", dtype=torch.bfloat16), CountCopies() as mode:
            m(x)
        counts[name] = mode.sizes
    n = len(_lora_linears(lean))
    assert counts["chain"].count((torch.bfloat16, torch.float32)) == n  # PEFT's cast, once per layer
    assert counts["chain"].count((torch.float32, torch.bfloat16)) == n  # autocast's cast back
    assert counts["lean"] == []
    # no autocast: the fp32 adapters need the cast; fp16 autocast: lin0's bf16 input is cast as by PEFT, lin1's input
    # (lin0's fp16 output) is in the autocast dtype, so its round trip is skipped
    outs = {}
    for ctx, skipped in ((torch.enable_grad, []),
                         (lambda: torch.autocast("cpu", dtype=torch.float16),
                          [(torch.float16, torch.float32), (torch.float32, torch.float16)])):
        for name, m, block in (("lean", lean, contextlib.nullcontext), ("chain", chain, _chain)):
            with block(), ctx(), CountCopies() as mode:
                outs[name] = m(x)
            counts[name] = mode.sizes
        _bitwise(outs["lean"], outs["chain"], "output")
        assert counts["lean"].count((torch.bfloat16, torch.float32)) >= 1
        rest = list(counts["chain"])
        for c in skipped:
            rest.remove(c)
        assert counts["lean"] == rest
    assert not L._autocast_round_trip(x.float(), torch.float32)


def _magnitudes(model):
    return [m for m in model.modules() if type(m) is L.FastDoraLinearLayer]


def test_magnitude_check_batched_per_update(monkeypatch):
    """``dm_from_output``'s magnitude check: ``enable(model)`` registers every layer's magnitude, so after an update
    of all of them the first layer's check answers for every stale one in one pass (one call of
    ``_check_magnitudes``, one host sync), each answer equal to that magnitude's own fp64 check and cached under its
    version; a magnitude changed later is checked again, alone; mixed dtypes and a frozen magnitude."""
    torch.manual_seed(0)
    models = [make_pair(lambda: MLP(bias=False, d_hidden=64), enable=False)[1] for _ in range(2)]
    models[1].to(torch.bfloat16)  # a second model, bf16 magnitudes: batched with the first model's fp32 ones
    for model in models:
        fastdora.enable(model, kernels="eager")
    mags = [mag for model in models for mag in _magnitudes(model)]
    assert len(mags) == 4 and all(mag in L.CHECKED_MAGNITUDES for mag in mags)
    calls = []
    orig = L._check_magnitudes
    monkeypatch.setattr(L, "_check_magnitudes", lambda mag, m: calls.append(mag) or orig(mag, m))
    frozen = mags[3].weight.requires_grad_(False)  # not trainable: never checked, never cached
    with torch.no_grad():
        mags[1].weight[5] = 1e-21  # below the floor (1e-20)
        mags[2].weight[7] = -2e-20  # above it in magnitude (bf16 rounds it, still >= 1e-20)
        mags[0].weight[3] = 1e-19
    want = [bool((mag.weight.double().abs() >= L._MAGNITUDE_FLOOR).all()) for mag in mags]
    assert want[:3] == [True, False, True]
    assert L._magnitude_nonzero(mags[0], mags[0].weight) is True
    assert calls == [mags[0]]
    for mag, ok in zip(mags[:3], want):
        assert mag.__dict__["_fastdora_m_nonzero"] == (mag.weight, L._m_key(mag.weight), ok)
        assert L._magnitude_nonzero(mag, mag.weight) is ok
    assert "_fastdora_m_nonzero" not in mags[3].__dict__ and not frozen.requires_grad
    assert len(calls) == 1  # every later lookup a cache hit
    with torch.no_grad():
        mags[1].weight[5] = 0.25  # a new version of one magnitude: checked again, alone
    assert L._magnitude_nonzero(mags[0], mags[0].weight) is True and len(calls) == 1
    assert L._magnitude_nonzero(mags[1], mags[1].weight) is True and calls[1:] == [mags[1]]


@pytest.mark.parametrize("dtype,autocast,want", [
    (torch.float32, None, torch.float32), (torch.float16, None, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16, torch.bfloat16),
    (torch.float64, torch.bfloat16, torch.float64), (torch.bfloat16, torch.float16, torch.float16),
])
def test_linear_out_dtype(dtype, autocast, want):
    """``_linear_out_dtype`` (which decides whether the magnitude check is needed: not for an fp16 output) is the
    dtype ``F.linear`` returns, under CPU autocast or without."""
    x, w = torch.randn(3, 4, dtype=dtype), torch.randn(5, 4, dtype=dtype)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        assert L._linear_out_dtype(x) == torch.nn.functional.linear(x, w).dtype == want
