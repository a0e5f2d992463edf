"""The C++ extension (``kernels/csrc/compose_node.cpp``): its build, its import, and the Triton launcher ABI its
direct launches rely on.

The extension holds two things: DoRA's composition autograd node (:mod:`fastdora.kernels.native` configures and
uses it) and *launch programs*, recorded sequences of Triton launches that it launches from C++ with the CUDA
driver's ``cuLaunchKernel`` (:class:`fastdora._launch.Replay`, used by POET-X's layer, :mod:`fastdora.poetx.replay`).
It is compiled on first use with the C++ compiler against the installed torch's headers (no CUDA toolkit needed: the
CUDA driver is opened at run time) and cached in ``FASTDORA_CACHE_DIR`` per source / torch / Triton / Python.

**The Triton boundary.** A direct launch passes the parameters Triton's CUDA launcher would pass
(:func:`native_layout`: the compiled kernel's signature minus its constexprs, then the global and profile scratch
pointers). That layout is not a public interface of Triton, so direct launches are used only on the Triton versions
they were verified on (:data:`VERIFIED_TRITON`, :func:`direct_launch_refusal`), after a self-check by each user at
first use (bitwise the same results as Triton's launcher), and unless ``FASTDORA_NATIVE_LAUNCH=0``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import hashlib
import os
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from typing import Optional

import torch

from . import config as _config

__all__ = ["VERIFIED_TRITON", "COPY", "SCALE", "EPS", "STREAM", "triton_version", "load", "load_status",
           "direct_launch_refusal", "native_layout", "programs", "programs_status", "disable_programs", "program"]

_MODULE = "fastdora_compose_node"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "csrc", "compose_node.cpp")

#: Triton releases (major.minor) whose launcher ABI the direct launch was verified on (the GPU tests and the
#: model-level benchmarks on the H100 / H200). Add a version only after those pass on it.
VERIFIED_TRITON = ("3.6",)

# parameter roles of a direct launch's layout (the enum of compose_node.cpp): a constant, or one the caller fills
STREAM, SCALE, EPS, COPY = 30, 31, 32, -1

_lock = threading.Lock()
_loaded: dict = {"module": None, "error": None}
# launch programs: None = not decided yet; else (module or None, why not)
_programs: Optional[tuple] = None


def triton_version() -> Optional[str]:
    try:
        import triton

        return str(triton.__version__)
    except Exception:  # pragma: no cover - no Triton: nothing here is used
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


def _cxx_standard(torch_version: str) -> str:
    """The C++ standard to build against ``torch_version``'s headers: C++20 from torch 2.12 on (the standard its own
    ``torch.utils.cpp_extension`` builds with; torch 2.14's ATen headers refuse anything older), C++17 before."""
    try:
        major, minor = (int(p) for p in torch_version.split("+")[0].split(".")[:2])
    except ValueError:  # an unparseable version: a build from source, newer than any release this was written for
        return "c++20"
    return "c++20" if (major, minor) >= (2, 12) else "c++17"


def _build_key(src: bytes) -> str:
    h = hashlib.sha256(src)
    for part in (torch.__version__, _cxx_standard(torch.__version__), str(triton_version()), sys.version,
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
    cmd = [cxx, "-O2", f"-std={_cxx_standard(torch.__version__)}", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={_MODULE}"]
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


def _load_module():
    """Build (once per source / torch / Triton / Python) and import the extension; returns the module."""
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cache, cxx = _config.native_build_env()
    out_dir = os.path.join(cache, "compose_node", _build_key(src))  # (the directory name of earlier releases)
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, _MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not os.path.exists(out):
        _compile(_SOURCE, out, cxx)
    return _import(out)




def load():
    """The extension module, built and imported on the first call (once per process); raises why it cannot be (the
    same error on every later call)."""
    with _lock:
        if _loaded["module"] is None and _loaded["error"] is None:
            try:
                _loaded["module"] = _load_module()
            except Exception as e:  # noqa: BLE001 - kept and raised again: the callers say why they run without it
                _loaded["error"] = e
        if _loaded["error"] is not None:
            raise _loaded["error"]
        return _loaded["module"]


def load_status() -> Optional[str]:
    """None if the extension is loaded, else why not (``"not loaded yet"`` before the first :func:`load`)."""
    if _loaded["module"] is not None:
        return None
    err = _loaded["error"]
    return "not loaded yet" if err is None else f"{type(err).__name__}: {err}"


def programs():
    """The extension where launch programs run directly (:func:`program`), else None: decided once per process from
    :func:`direct_launch_refusal`, the build and the CUDA driver; :func:`programs_status` says why not."""
    global _programs
    if _programs is None:
        why = direct_launch_refusal(triton_version(), _config.SETTINGS.native_launch, torch.cuda.is_available())
        mod = None
        if why is None and _config.SETTINGS.native == "0":
            why = "off (FASTDORA_NATIVE=0)"
        if why is None:
            try:
                mod = load()
                why = mod.load_driver()
            except Exception as e:  # noqa: BLE001 - no extension: the launches go through Triton's launcher
                why = f"the C++ extension is unavailable: {type(e).__name__}: {e}"
        _programs = (mod if why is None else None, why)
    return _programs[0]


def programs_status() -> str:
    """``"direct"`` where launch programs run from C++, else why not (``"not decided yet"`` before the first use)."""
    if _programs is None:
        return "not decided yet"
    return "direct" if _programs[0] is not None else str(_programs[1])


def disable_programs(why: str) -> None:
    """Launch programs off for the rest of the process (a failed self-check), with the reason."""
    global _programs
    _programs = (None, why)


def reset_programs() -> None:
    """Decide again at the next :func:`programs` (tests)."""
    global _programs
    _programs = None


def program(n_named: int, steps: tuple):
    """A launch program for the extension's ``run_program(program, named, stream)``: ``steps``, each ``(function,
    (gx, gy, gz), block, shared, slots, values[, pdl])`` with per kernel parameter the index of a named tensor whose
    data pointer plus ``value`` bytes it takes, or -1 and its constant bytes (``value``); ``pdl``: the step is a
    programmatic dependent launch (the kernel was compiled with ``launch_pdl``, as Triton's launcher would launch it).
    None where launch programs do not run directly (:func:`programs`)."""
    mod = programs()
    return None if mod is None else mod.program(n_named, steps)


# Triton signature type -> (direct-launch type code, struct format of a constant's bytes); pointers: "p"
_PARAM_TYPES = {"i1": ("i", "<b"), "i8": ("i", "<b"), "i16": ("i", "<h"), "i32": ("i", "<i"), "i64": ("i", "<q"),
                "u1": ("i", "<B"), "u8": ("i", "<B"), "u16": ("i", "<H"), "u32": ("i", "<I"), "u64": ("i", "<Q"),
                "fp32": ("f", "<f"), "f32": ("f", "<f"), "fp64": ("d", "<d")}


def _param_bytes(fmt: str, value) -> int:
    """A constant parameter's bytes as Triton's launcher stores them, zero-padded to 8, as a little-endian int."""
    return int.from_bytes(struct.pack(fmt, value).ljust(8, b"\0"), "little")


def native_layout(compiled, grid, values, roles, pdl_ok: bool = False) -> Optional[tuple]:
    """The direct launch of ``compiled`` for a launch with the kernel's declared arguments ``values`` (their roles:
    ``roles``): ``(function, grid, block, shared, param roles, param types, param constants)`` with the parameters
    Triton's CUDA launcher passes (its signature's non-constexpr entries in order, then a null global-scratch and a
    null profile-scratch pointer where the metadata has those sizes, as torch's StaticallyLaunchedCudaKernel reads
    them); None where this launch needs more than that launcher's plain path (clusters, cooperative / PDL launches,
    scratch memory, tensor descriptors, tuples, other types) or the layout cannot be derived. ``pdl_ok``: a
    programmatic dependent launch is accepted (its parameters are the plain path's; a launch program makes it with
    ``cuLaunchKernelEx``, see :func:`program`)."""
    md = getattr(compiled, "metadata", None)
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    fn = getattr(src, "fn", None)
    if md is None or not isinstance(sig, dict) or len(sig) != len(values) or fn is None:
        return None
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False)
            or (getattr(md, "launch_pdl", False) and not pdl_ok) or getattr(md, "global_scratch_size", 0)
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


