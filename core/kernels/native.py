"""The composition's autograd node in C++ (``csrc/compose_node.cpp``): less host time per layer call.

On the H200 the DoRA training step is host-bound (benchmarks/README.md, sessions 13-20): the GPU waits for the
Python of the composition's autograd node -- its ``ctx``, the launch preparation, the backward's interpreter frames
on the autograd thread. The C++ node runs the same kernels with the same arguments: the Python launchers
(``fastdora.kernels.compose.compose_fwd`` / ``compose_bwd``) register, per problem key (shape, dtypes, flags,
device), a *launch template* -- Triton's compiled launcher and its argument tuple with this key's constants, and
which argument is which tensor role, the stream or a scalar -- and the node fills a template with a call's data
pointers, stream and scalars and calls the compiled launcher, from C++. Whatever no template covers (a key's first
call, unaligned pointers, a CUDA graph capture in the backward, Triton launch hooks) runs through those Python
launchers, called from the node. Outputs and gradients are bitwise those of the Python node (same kernels, same
configs; tests/test_native_node.py, tests/test_gpu_layers.py). ``compose_b`` is the same node with ``lora_B``'s
product inside (``fuse_lora_b``): it replaces ``fastdora.ops.compose._DoraComposeLoraB``, bitwise. ``dora_linear``
is a whole DoRA Linear layer (base product, ``lora_A``, ``lora_B``, composition) as one node (option ``layer_node``,
called from ``fastdora.layers.lean_linear_forward`` through ``fastdora.dispatch.layer_node``): bitwise the separate
nodes' results, three saved activations under gradient checkpointing instead of six saved tensors.

Where the layout of a template's kernel parameters is known (``_native_layout``: Triton's ``CompiledKernel`` signature
minus its constexprs, then the global and profile scratch pointers), the template also carries it and the node
launches the kernel itself with the CUDA driver's ``cuLaunchKernel`` (same function, grid, block, shared memory and
parameter bytes as Triton's launcher), without calling into Python per launch; ``FASTDORA_NATIVE_LAUNCH=0`` keeps
the Triton launcher. ``launch_status()`` says which one runs.

The extension is compiled on first use with the C++ compiler against the installed torch's headers (no CUDA
toolkit needed: the CUDA driver is opened at run time, or Triton's launcher runs) and cached in
``FASTDORA_CACHE_DIR`` per source / torch / Python; ``FASTDORA_NATIVE`` (``auto`` | ``1`` | ``0``, read in
``fastdora.config``) decides whether it is used. ``status()`` says whether it is active and, if not, why.
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
from typing import Optional

import torch

from .. import config as _config

__all__ = ["node", "first_node", "status", "launch_status", "clear_templates", "register_fwd", "register_bwd",
           "ROLES_FWD", "ROLES_BWD"]

_MODULE = "fastdora_compose_node"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "compose_node.cpp")

# template argument roles (the enum of compose_node.cpp)
ROLES_FWD = ("result", "lora", "bias", "magnitude", "norm", "y", "inner")  # codes 0..6
ROLES_BWD = ("dy", "inner", "magnitude", "norm", "d_result", "d_lora", "part_dm", "dm", "counts")  # codes 10..18
STREAM, SCALE, EPS, COPY = 30, 31, 32, -1

_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "reason": "not requested yet (first CUDA training composition)",
                "launch": "no node"}
# the active C++ module once loaded and configured (module global: one lookup on the hot path); None otherwise
NODE = None


def status() -> str:
    """``"active"`` or why the C++ node is not used."""
    return "active" if NODE is not None else str(_state["reason"])


def launch_status() -> str:
    """How the active node launches its templates: ``"direct"`` (cuLaunchKernel from C++) or why through Triton's
    launcher."""
    return str(_state["launch"])


def _build_key(src: bytes) -> str:
    h = hashlib.sha256(src)
    for part in (torch.__version__, sys.version, str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
                 sysconfig.get_config_var("EXT_SUFFIX") or ""):
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
    """Build (once per source / torch / Python) and import the extension; returns the module."""
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
    from ..ops import compose as _ops
    from . import _launch
    from . import compose as kc

    def slow_fwd(result, lora, magnitude, norm, bias, scale, eps, out_dtype, save_inner):
        return kc.compose_fwd(result, lora, magnitude, norm, scale, eps, bias, None, out_dtype, save_inner)

    def slow_bwd(dy, magnitude, norm, scale, eps, inner, rd, ld, need_dm, need_dres, need_dlora, dm_from_y):
        d_result, d_lora, _, dm, _ = kc.compose_bwd(dy, magnitude, norm, scale, eps, inner, False, rd, ld, None,
                                                    need_dm, False, -1, need_dresult=need_dres,
                                                    need_dlora=need_dlora, dm_from_y=dm_from_y)
        return d_result, d_lora, dm

    def lora_b_coefs(magnitude, norm, eps, scale, acc64, lora_b, lora_dtype, need_dh, need_db):
        return _ops.lora_b_row_scales(magnitude, norm, eps, scale, torch.float64 if acc64 else torch.float32,
                                      lora_b, lora_dtype, need_dh, need_db)

    mod.configure(slow_fwd, slow_bwd, _launch.capturing, _launch.hooks_active, kc._counters, lora_b_coefs)
    direct = _config.native_launch()
    mod.set_native_launch(direct)
    if not direct:
        _state["launch"] = "Triton's launcher (FASTDORA_NATIVE_LAUNCH=0)"
    elif not torch.cuda.is_available():
        _state["launch"] = "Triton's launcher (no CUDA device)"
    else:
        why = mod.load_driver()
        _state["launch"] = "direct" if why is None else f"Triton's launcher ({why})"


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
        mode = _config.native_mode()
        if required is None:
            required = mode == "1"
        if mode == "0" and not required:
            _state["reason"] = "off (FASTDORA_NATIVE=0)"
            return None
        from . import compose as kc

        try:
            if not (kc._FWD.fast or kc._FWD.interpreted):
                raise RuntimeError("this Triton's launcher is not supported by the direct launch path")
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
