"""The composition's autograd node in C++ (``csrc/compose_node.cpp``): less host time per layer call.

A DoRA training step on the H200 is host-bound: the GPU waits for the Python of the composition's autograd node --
its ``ctx``, the launch preparation, the backward's interpreter frames on the autograd thread. The C++ node runs the
same kernels with the same arguments: the Python launchers (``fastdora.kernels.compose.compose_fwd`` /
``compose_bwd``) register, per problem key (shape, dtypes, flags, device), a *launch template* -- Triton's compiled
launcher and its argument tuple with this key's constants, and which argument is which tensor role, the stream or a
scalar -- and the node fills a template with a call's data pointers, stream and scalars and calls the compiled
launcher, from C++. Whatever no template covers (a key's first call, unaligned pointers, a CUDA graph capture in the
backward, Triton launch hooks) runs through the Python fallbacks the ops layer registers
(:func:`set_fallbacks`), called from the node. Outputs and gradients are bitwise those of the Python node (same
kernels, same configs; tests/kernels/test_native_node.py). ``dora_linear`` is a whole DoRA Linear layer (base
product, ``lora_A``, ``lora_B``, composition) as one node, called from ``fastdora.layers.lean_linear_forward``:
bitwise the separate nodes' results, three saved activations under gradient checkpointing instead of six.

**Direct launch and the Triton boundary.** Where the layout of a template's kernel parameters is known
(``fastdora._native.native_layout``: Triton's ``CompiledKernel`` signature minus its constexprs, then the global and
profile scratch pointers), the template also carries it and the node launches the kernel itself with the CUDA driver's
``cuLaunchKernel`` (same function, grid, block, shared memory and parameter bytes as Triton's launcher), without
calling into Python per launch. That layout is Triton's launcher ABI, which is not a public interface, so the direct
launch is taken only

- on the Triton versions it was verified on (:data:`VERIFIED_TRITON`; any other version runs Triton's own launcher:
  same kernels and results, more host time per launch, and ``launch_status()`` / the enable report say why),
- after a one-time self-check at first use (:func:`_self_check`): a tiny composition forward and backward launched
  directly must equal, bitwise, the same launches through Triton's launcher; otherwise a warning and Triton's
  launcher from then on,
- unless ``FASTDORA_NATIVE_LAUNCH=0``.

The extension (built and loaded by :mod:`fastdora._native`, which also holds the launch-layout derivation and the
version allow-list) is compiled on first use; ``FASTDORA_NATIVE`` (``auto`` | ``1`` | ``0``) decides whether the node
is used. ``status()`` says whether it is active and, if not, why.
"""

from __future__ import annotations

import functools
import operator
import sys
import threading
import warnings
from typing import Callable, Optional

import torch

from .. import _native
from .. import config as _config
from .._native import COPY, EPS, SCALE, STREAM, VERIFIED_TRITON, direct_launch_refusal  # noqa: F401 (re-exported)
from .._native import native_layout as _native_layout
from .._native import triton_version as _triton_version

__all__ = ["node", "first_node", "status", "launch_status", "clear_templates", "register_fwd", "register_bwd",
           "set_fallbacks", "direct_launch_refusal", "VERIFIED_TRITON", "ROLES_FWD", "ROLES_BWD"]

# template argument roles (the enum of compose_node.cpp)
ROLES_FWD = ("result", "lora", "bias", "magnitude", "norm", "y", "inner")  # codes 0..6
ROLES_BWD = ("dy", "inner", "magnitude", "norm", "d_result", "d_lora", "part_dm", "dm", "counts")  # codes 10..18

_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "reason": "not requested yet (first CUDA training composition)",
                "launch": "no node"}
# the active C++ module once loaded and configured (module global: one lookup on the hot path); None otherwise
NODE = None
# (slow_fwd, slow_bwd): the Python compositions the node falls back to (set by fastdora.ops.compose)
_FALLBACKS: Optional[tuple] = None


def set_fallbacks(slow_fwd: Callable, slow_bwd: Callable) -> None:
    """Register the Python forward / backward the node calls where no template covers a call:
    ``slow_fwd(result, lora, magnitude, norm, bias, scale, eps, out_dtype, save_inner) -> (y, inner)`` and
    ``slow_bwd(dy, magnitude, norm, scale, eps, inner, rd, ld, need_dm, need_dres, need_dlora, dm_from_y) ->
    (d_result, d_lora, dm)`` (the ops layer's Triton path with its exact eager fallback)."""
    global _FALLBACKS
    _FALLBACKS = (slow_fwd, slow_bwd)


def status() -> str:
    """``"active"`` or why the C++ node is not used."""
    return "active" if NODE is not None else str(_state["reason"])


def launch_status() -> str:
    """How the active node launches its templates: ``"direct"`` (cuLaunchKernel from C++) or why through Triton's
    launcher."""
    return str(_state["launch"])


def _configure(mod) -> None:
    from .. import _launch
    from . import compose as kc

    if _FALLBACKS is None:
        raise RuntimeError("no Python fallbacks registered (fastdora.ops.compose sets them on import)")
    mod.configure(*_FALLBACKS, _launch.capturing, _launch.hooks_active, kc._counters)
    mod.set_native_launch(False)  # on only after the allow-list, the driver and the self-check (_decide_launch)


def _decide_launch(mod) -> None:
    """Turn the direct launch on where it may run (:func:`direct_launch_refusal`, the CUDA driver, the self-check);
    record why not otherwise. Runs once, right after the node is loaded."""
    why = direct_launch_refusal(_triton_version(), _config.SETTINGS.native_launch, torch.cuda.is_available())
    if why is None:
        why = mod.load_driver()
    if why is None:
        why = _self_check(mod)
        if why is not None:
            warnings.warn(f"fastdora: the C++ node's direct kernel launch failed its self-check ({why}); Triton's "
                          "launcher runs instead (same results, more host time per launch)", RuntimeWarning,
                          stacklevel=3)
    _state["launch"] = "direct" if why is None else f"Triton's launcher ({why})"


def _compare(direct: tuple, reference: tuple) -> Optional[str]:
    """None where every direct-launch result equals the Triton-launcher result bitwise; else what differed."""
    for name, a, b in zip(("y", "d_result", "d_lora", "dm"), direct, reference):
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            return f"{name} differs between the direct launch and Triton's launcher"
    return None


def _self_check(mod) -> Optional[str]:
    """Launch a tiny composition forward and backward (bf16, 64 x 256) through Triton's launcher, then the same
    through the node's direct launch, and compare bitwise; None if equal, else why not. Not during a CUDA graph
    capture (no synchronisation possible there: the direct launch then stays off)."""
    from .. import _launch
    from . import compose as kc

    if _launch.capturing():
        return "the self-check cannot run during a CUDA graph capture"
    if torch.compiler.is_compiling():
        return "the self-check cannot run while torch.compile traces"
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)  # a generator of its own: the process's random streams stay untouched
    M, N, bf16 = 64, 256, torch.bfloat16
    scale, eps = 0.5, 1e-6
    mod.set_native_launch(True)
    try:
        # real autograd even under inference mode / no_grad, and saved tensors that stay ours even if the first use
        # happens inside a checkpointed forward (its saved-tensor hooks are below ours)
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            result, lora, dy = (torch.randn(M, N, generator=gen).to(dev, bf16) for _ in range(3))
            magnitude = (torch.rand(N, generator=gen) + 0.5).to(dev)
            norm = (torch.rand(N, generator=gen) + 0.5).to(dev)
            y_ref, inner = kc.compose_fwd(result, lora, magnitude, norm, scale, eps, None, None, bf16, True)
            d_res_ref, d_lora_ref, _, dm_ref, _ = kc.compose_bwd(dy, magnitude, norm, scale, eps, inner, False, bf16,
                                                                bf16, None, True, False)
            r, lo, m = (t.clone().requires_grad_() for t in (result, lora, magnitude))
            before = mod.stats()["native"]
            y = mod.compose(r, lo, m, norm, None, scale, eps, bf16, False)
            y.backward(dy)
            torch.cuda.synchronize(dev)
            launched = mod.stats()["native"] - before
    except Exception as e:  # noqa: BLE001 - any failure: Triton's launcher, with the reason
        mod.set_native_launch(False)
        return f"{type(e).__name__}: {e}"
    why = None
    if launched < 2:
        why = f"{launched} of 2 launches went direct"
    else:
        why = _compare((y.detach(), r.grad, lo.grad, m.grad), (y_ref, d_res_ref, d_lora_ref, dm_ref))
    if why is not None:
        mod.set_native_launch(False)
    return why


def node(required: Optional[bool] = None):
    """The configured C++ module, building / importing it on the first call; None where it is not used (the reason:
    ``status()``). ``required`` (default: ``FASTDORA_NATIVE=1``) raises instead of returning None."""
    global NODE
    if NODE is not None:
        return NODE
    with _lock:
        if _state["tried"]:
            if required and NODE is None:
                raise RuntimeError(f"fastdora: the C++ composition node is unavailable: {_state['reason']}")
            return NODE
        _state["tried"] = True
        mode = _config.SETTINGS.native
        if required is None:
            required = mode == "1"
        if mode == "0" and not required:
            _state["reason"] = "off (FASTDORA_NATIVE=0)"
            return None
        from . import compose as kc

        try:
            if not (kc._FWD.fast or kc._FWD.interpreted):
                raise RuntimeError("this Triton's launcher is not supported by the template path")
            mod = _native.load()
            _configure(mod)
        except Exception as e:  # noqa: BLE001 - any build / import failure: the Python node, with the reason
            _state["reason"] = f"unavailable: {type(e).__name__}: {e}"
            if required:
                raise RuntimeError(f"fastdora: the C++ composition node is unavailable: {e}") from e
            warnings.warn(f"fastdora: the C++ composition node is unavailable, the Python node runs instead (same "
                          f"results, more host time per layer): {_state['reason'][:500]} (FASTDORA_NATIVE=0 "
                          f"silences this)", RuntimeWarning, stacklevel=2)
            return None
        _state["module"] = mod
        _state["reason"] = "active"
        NODE = mod
        kc.set_template_registrar(sys.modules[__name__])
        _decide_launch(mod)
        return NODE


def first_node(t: torch.Tensor):
    """``node()`` for the first CUDA training composition (the build / import happens then, unless ``enable()`` did
    it); None without a decision to make: a CPU tensor, or ``node()`` already ran (the node would be ``NODE``)."""
    if _state["tried"] or not t.is_cuda:
        return None
    return node()


def clear_templates() -> None:
    """Drop every launch template of the loaded node (tests): the next launch of each key registers again."""
    if _state["module"] is not None:
        _state["module"].clear()
    _REGISTERED.clear()


def reset() -> None:
    """Forget the loaded node and its templates (tests; the next ``node()`` call decides again)."""
    global NODE
    with _lock:
        clear_templates()
        NODE = None
        from . import compose as kc

        kc.set_template_registrar(None)
        _state.update(module=None, tried=False, reason="not requested yet (first CUDA training composition)",
                      launch="no node")


# --------------------------------------------------------------------------------------------------------------------
# templates (called by the Python launchers after a launch, only while the node is active)
# --------------------------------------------------------------------------------------------------------------------

_data_ptr = torch.Tensor.data_ptr
_or = operator.or_
# the node's key (direction, M, N, dtypes, device, flags) -> what its template was built from: a launch that would
# build the same template again (every inference composition, which launches from Python) registers nothing
_REGISTERED: dict = {}


def _roles(tensors, named, base) -> Optional[tuple]:
    """Per launch tensor its role code (``base`` + index in ``named``), by identity; None if one has none."""
    out = []
    for t in tensors:
        for i, cand in enumerate(named):
            if cand is not None and t is cand:
                out.append(base + i)
                break
        else:
            return None
    return tuple(out)


def _template(launcher, entry, grid, tensors, ints, floats, consts, num_warps, num_stages, maxnreg, roles):
    """``(run, args, roles, tensor_args, native)`` of one launch: with a compiled kernel, Triton's launcher and its
    argument tuple (``CompiledKernel.run``'s layout, as ``_launch.Launcher`` calls it) and, where derivable, the
    direct launch (``_native_layout``); under the interpreter a closure that launches through the JIT with the
    tensors themselves (tests)."""
    n_t = len(tensors)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    float_roles = (SCALE, EPS)[: len(floats)]
    if entry is not None:
        compiled, function, packed = entry
        head = (grid[0], grid[1], grid[2], None, function, packed, None, None, None)
        args = head + (None,) * n_t + tuple(ints) + (None,) * len(floats) + tuple(consts)
        arg_roles = roles + (COPY,) * len(ints) + float_roles + (COPY,) * len(consts)
        all_roles = (COPY,) * 3 + (STREAM,) + (COPY,) * 5 + arg_roles
        values = (0,) * n_t + tuple(ints) + tuple(floats) + tuple(consts)
        return compiled.run, args, all_roles, False, _native_layout(compiled, grid, values, arg_roles)
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    run = functools.partial(_jit_run, launcher.fn, tuple(grid), opts)
    args = (None,) * n_t + tuple(ints) + (None,) * len(floats) + tuple(consts)
    return run, args, roles + (COPY,) * len(ints) + float_roles + (COPY,) * len(consts), True, None


def _jit_run(fn, grid, opts, *args):
    fn[grid](*args, **opts)


def _aligned(tensors) -> bool:
    return not (functools.reduce(_or, map(_data_ptr, tensors)) & 15)


def _register(direction, launcher, entry, grid, tensors, ints, floats, consts, launch_opts, named, dtypes, flags, M,
              N, n_parts=0, n_counters=0):
    if NODE is None:  # registrations only while a node is active (NODE unset: the Python node runs)
        return
    roles = _roles(tensors, named, 10 * direction)
    if roles is None or not _aligned(tensors) or (entry is None and not launcher.interpreted):
        return
    dev = tensors[0].get_device() if tensors[0].is_cuda else -1
    key = (direction, M, N, dtypes, dev, flags)
    built_from = (launcher, None if entry is None else entry[0], tuple(grid), tuple(ints), tuple(consts), launch_opts,
                  roles, n_parts, n_counters)
    if _REGISTERED.get(key) == built_from:
        return
    run, args, all_roles, tensor_args, direct = _template(launcher, entry, grid, tensors, ints, floats, consts,
                                                          *launch_opts, roles)
    NODE.register(direction, M, N, dtypes, dev, flags, run, args, all_roles, n_parts, n_counters, tensor_args,
                  direct)
    _REGISTERED[key] = built_from


def register_fwd(launcher, entry, grid, tensors, ints, floats, consts, num_warps, named, dtypes, save_inner, M, N):
    """After a forward launch: register its template (``named``: the role tensors in ``ROLES_FWD`` order;
    ``dtypes``: result, lora, out, magnitude, norm, bias-or-None)."""
    _register(0, launcher, entry, grid, tensors, ints, floats, consts, (num_warps, None, None), named, dtypes,
              int(bool(save_inner)), M, N)


def register_bwd(launcher, entry, grid, tensors, ints, floats, consts, num_warps, num_stages, maxnreg, named,
                 dtypes, flags, M, N, n_parts, n_counters):
    """After a backward launch (fused reduction, or none): register its template (``named`` in ``ROLES_BWD``
    order; ``dtypes``: dy, inner-or-None, result, lora, magnitude, norm; ``flags``: d_result | d_lora << 1 |
    dm << 2 | dm_from_y << 3)."""
    _register(1, launcher, entry, grid, tensors, ints, floats, consts, (num_warps, num_stages, maxnreg), named,
              dtypes, flags, M, N, n_parts, n_counters)
