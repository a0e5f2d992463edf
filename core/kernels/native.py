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
(``_native_layout``: Triton's ``CompiledKernel`` signature minus its constexprs, then the global and profile scratch
pointers), the template also carries it and the node launches the kernel itself with the CUDA driver's
``cuLaunchKernel`` (same function, grid, block, shared memory and parameter bytes as Triton's launcher), without
calling into Python per launch. That layout is Triton's launcher ABI, which is not a public interface, so the direct
launch is taken only

- on the Triton versions it was verified on (:data:`VERIFIED_TRITON`; any other version runs Triton's own launcher:
  same kernels and results, more host time per launch, and ``launch_status()`` / the enable report say why),
- after a one-time self-check at first use (:func:`_self_check`): a tiny composition forward and backward launched
  directly must equal, bitwise, the same launches through Triton's launcher; otherwise a warning and Triton's
  launcher from then on,
- unless ``FASTDORA_NATIVE_LAUNCH=0``.

The extension is compiled on first use with the C++ compiler against the installed torch's headers (no CUDA
toolkit needed: the CUDA driver is opened at run time) and cached in ``FASTDORA_CACHE_DIR`` per source / torch /
Triton / Python; ``FASTDORA_NATIVE`` (``auto`` | ``1`` | ``0``) decides whether it is used. ``status()`` says whether
it is active and, if not, why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import operator
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from typing import Callable, Optional

import torch

from .. import config as _config

__all__ = ["node", "first_node", "status", "launch_status", "clear_templates", "register_fwd", "register_bwd",
           "set_fallbacks", "direct_launch_refusal", "VERIFIED_TRITON", "ROLES_FWD", "ROLES_BWD"]

_MODULE = "fastdora_compose_node"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "compose_node.cpp")

#: Triton releases (major.minor) whose launcher ABI the direct launch was verified on (the GPU tests and the
#: model-level benchmark on the H200). Add a version only after those pass on it.
VERIFIED_TRITON = ("3.6",)

# template argument roles (the enum of compose_node.cpp)
ROLES_FWD = ("result", "lora", "bias", "magnitude", "norm", "y", "inner")  # codes 0..6
ROLES_BWD = ("dy", "inner", "magnitude", "norm", "d_result", "d_lora", "part_dm", "dm", "counts")  # codes 10..18
STREAM, SCALE, EPS, COPY = 30, 31, 32, -1

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


def _triton_version() -> Optional[str]:
    try:
        import triton

        return str(triton.__version__)
    except Exception:  # pragma: no cover - no Triton: the node is not built (kernels/compose needs it)
        return None


def direct_launch_refusal(triton_version: Optional[str], setting: bool, cuda: bool) -> Optional[str]:
    """Why the direct launch must not be used (None: it may, subject to the self-check)."""
    if not setting:
        return "FASTDORA_NATIVE_LAUNCH=0"
    if not cuda:
        return "no CUDA device"
    if triton_version is None:
        return "Triton's version is unknown"
    major_minor = ".".join(triton_version.split("+")[0].split(".")[:2])
    if major_minor not in VERIFIED_TRITON:
        return (f"Triton {triton_version} is not among the versions the direct launch was verified on "
                f"({', '.join(v + '.x' for v in VERIFIED_TRITON)})")
    return None


def _build_key(src: bytes) -> str:
    h = hashlib.sha256(src)
    for part in (torch.__version__, str(_triton_version()), sys.version,
                 str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")), sysconfig.get_config_var("EXT_SUFFIX") or ""):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(src_path: str, out_path: str, cxx: str) -> None:
    from torch.utils import cpp_extension

    inc = list(cpp_extension.include_paths()) + [sysconfig.get_paths()["include"]]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    tmp_dir = os.path.dirname(out_path)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=tmp_dir)
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={_MODULE}"]
    cmd += [f"-I{p}" for p in inc] + [src_path, "-o", tmp, f"-L{libdir}", "-lc10", "-ltorch", "-ltorch_cpu",
                                      "-ltorch_python", f"-Wl,-rpath,{libdir}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {src_path} failed ({cxx}, exit {res.returncode}): {res.stderr[-1500:]}")
        os.replace(tmp, out_path)  # atomic: concurrent builders (one per rank) never see a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _import(path: str):
    loader = importlib.machinery.ExtensionFileLoader(_MODULE, path)
    spec = importlib.util.spec_from_file_location(_MODULE, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _load():
    """Build (once per source / torch / Triton / Python) and import the extension; returns the module."""
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cache, cxx = _config.native_build_env()
    out_dir = os.path.join(cache, "compose_node", _build_key(src))
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, _MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not os.path.exists(out):
        _compile(_SOURCE, out, cxx)
    return _import(out)


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
            mod = _load()
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


# Triton signature type -> (direct-launch type code, struct format of a constant's bytes); pointers: "p"
_PARAM_TYPES = {"i1": ("i", "<b"), "i8": ("i", "<b"), "i16": ("i", "<h"), "i32": ("i", "<i"), "i64": ("i", "<q"),
                "u1": ("i", "<B"), "u8": ("i", "<B"), "u16": ("i", "<H"), "u32": ("i", "<I"), "u64": ("i", "<Q"),
                "fp32": ("f", "<f"), "f32": ("f", "<f"), "fp64": ("d", "<d")}


def _param_bytes(fmt: str, value) -> int:
    """A constant parameter's bytes as Triton's launcher stores them, zero-padded to 8, as a little-endian int."""
    return int.from_bytes(struct.pack(fmt, value).ljust(8, b"\0"), "little")


def _native_layout(compiled, grid, values, roles) -> Optional[tuple]:
    """The direct launch of ``compiled`` for a launch with the kernel's declared arguments ``values`` (their roles:
    ``roles``): ``(function, grid, block, shared, param roles, param types, param constants)`` with the parameters
    Triton's CUDA launcher passes (its signature's non-constexpr entries in order, then a null global-scratch and a
    null profile-scratch pointer where the metadata has those sizes, as torch's StaticallyLaunchedCudaKernel reads
    them); None where this launch needs more than that launcher's plain path (clusters, cooperative / PDL launches,
    scratch memory, tensor descriptors, tuples, other types) or the layout cannot be derived."""
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    fn = getattr(src, "fn", None)
    if md is None or not isinstance(sig, dict) or len(sig) != len(values) or fn is None:
        return None
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "launch_pdl", False) or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "tensordesc_meta", None)
            or getattr(md, "instrumentation_mode", "")):  # instrumentation (e.g. gsan) adds parameters
        return None
    names = list(getattr(fn, "arg_names", ()))
    const_idx = set()
    for k in getattr(src, "constants", {}) or {}:
        if isinstance(k, str):
            if k not in names:
                return None
            const_idx.add(names.index(k))
        elif isinstance(k, tuple) and len(k) == 1:
            const_idx.add(k[0])
        else:
            return None  # a constant inside a tuple argument
    p_roles, p_types, p_consts = [], [], []
    for i, (ty, value, role) in enumerate(zip(sig.values(), values, roles)):
        if ty == "constexpr":
            continue
        if i in const_idx or not isinstance(ty, str):
            return None  # a specialised non-constexpr entry, or a tuple: not the plain layout
        if ty.startswith("*"):
            if role == COPY:
                return None
            p_roles.append(role), p_types.append("p"), p_consts.append(0)
            continue
        code_fmt = _PARAM_TYPES.get(ty)
        if code_fmt is None:
            return None
        code, fmt = code_fmt
        if role in (SCALE, EPS):
            if code == "i":
                return None
            p_roles.append(role), p_types.append(code), p_consts.append(0)
        elif role == COPY:
            p_roles.append(COPY), p_types.append(code), p_consts.append(_param_bytes(fmt, value))
        else:
            return None
    for size in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(md, size):
            p_roles.append(COPY), p_types.append("p"), p_consts.append(0)
    return (int(compiled.function), tuple(grid), 32 * int(md.num_warps), int(md.shared), tuple(p_roles),
            "".join(p_types).encode(), tuple(p_consts))


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
