"""Options, internal settings and environment. The ONLY module of fastdora that reads environment variables.

Public options (``fastdora.enable(model, **options)``, and every plugin's): :class:`Options`.

Environment variables (all optional):

- ``FASTDORA=0``                 kill switch: ``enable()`` converts nothing and reports why; converted layers fall back
                                  to stock PEFT at their next forward.
- ``FASTDORA_KERNELS``           default for the ``kernels`` option: ``auto`` (default), ``triton`` or ``eager``.
- ``FASTDORA_LEGACY_EMBEDDING=1``  default for ``legacy_embedding_compose``.
- ``FASTDORA_NATIVE``            the composition's C++ autograd node (``fastdora.kernels.native``): ``auto`` (default:
                                  built and used on CUDA where a C++ compiler is found, the Python node otherwise),
                                  ``1`` (required: an error if it cannot be built), ``0`` (never).
- ``FASTDORA_NATIVE_LAUNCH``     ``1`` (default): the C++ node launches its kernels directly (``cuLaunchKernel``) on the
                                  Triton versions it was verified on; ``0``: always through Triton's own launcher.
- ``FASTDORA_CACHE_DIR``         where the C++ node is built and cached (default ``$XDG_CACHE_HOME/fastdora`` or
                                  ``~/.cache/fastdora``); ``CXX``: the C++ compiler (default ``c++``).

Internal settings (:class:`Settings`, the instance :data:`SETTINGS`; :func:`override` for tests and benchmarks) are
not options: each holds a design decision measured on the H200 (docs/ARCHITECTURE.md lists them and why), and every
one of them keeps the results exact; they exist so that tests can reach every code path and benchmarks can measure
the alternatives side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Optional

__all__ = ["Options", "Settings", "SETTINGS", "make_options", "override", "killed", "native_build_env"]

_KERNELS = ("auto", "triton", "eager")
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def killed() -> bool:
    """True when the kill switch ``FASTDORA=0`` (or ``false``/``off``/``no``) is set."""
    return os.environ.get("FASTDORA", "1").strip().lower() in _FALSE


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return False
    raise ValueError(f"fastdora: environment variable {name}={raw!r} is not a boolean (use 0 or 1)")


def _env_native() -> str:
    """``FASTDORA_NATIVE``: ``"auto"``, ``"1"`` or ``"0"``."""
    raw = os.environ.get("FASTDORA_NATIVE", "auto").strip().lower() or "auto"
    if raw in _TRUE:
        return "1"
    if raw in _FALSE:
        return "0"
    if raw != "auto":
        raise ValueError(f"fastdora: environment variable FASTDORA_NATIVE={raw!r} is invalid; use auto, 1 or 0")
    return raw


def native_build_env() -> tuple[str, str]:
    """``(cache directory, C++ compiler)`` for building the C++ composition node."""
    cache = os.environ.get("FASTDORA_CACHE_DIR", "").strip()
    if not cache:
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(base, "fastdora")
    return cache, os.environ.get("CXX", "").strip() or "c++"


# ------------------------------------------------------------------------------------------------ public options


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``fastdora.enable(**options)`` accepts (keyword-only); every plugin exposes exactly these.

    kernels: ``"auto"`` (Triton on CUDA, the exact PyTorch path elsewhere), ``"triton"`` (require Triton for CUDA
        tensors: an error instead of a silent fallback), ``"eager"`` (always the exact PyTorch path, e.g. to compare
        against the kernels or to run where Triton misbehaves).
    legacy_embedding_compose: compose DoRA embeddings as PEFT 0.13-0.17 did (no ``embed_scale`` on the DoRA part),
        for embedding adapters trained with those releases on scaled embeddings (e.g. Gemma's). Default: as the
        installed PEFT does.
    dm_from_output: the whole-layer node takes the magnitude's gradient from the layer's output, which the model's
        next ops keep anyway, instead of saving an extra activation per layer. Turn it off if the model changes a DoRA
        layer's output in place before the backward (autograd then raises an error naming this option).
    """

    kernels: str = "auto"
    legacy_embedding_compose: bool = False
    dm_from_output: bool = True


_FIELDS = tuple(f.name for f in dataclasses.fields(Options))


def make_options(**kwargs: Any) -> Options:
    """Validate options: an unknown name raises ``TypeError``, a bad value ``ValueError``, each naming it."""
    unknown = sorted(set(kwargs) - set(_FIELDS))
    if unknown:
        raise TypeError(f"fastdora.enable() got unknown option(s) {unknown}; valid options: {list(_FIELDS)}")
    values = {
        "kernels": os.environ.get("FASTDORA_KERNELS", "auto").strip().lower() or "auto",
        "legacy_embedding_compose": _env_bool("FASTDORA_LEGACY_EMBEDDING", False),
    }
    values.update(kwargs)
    kernels = values["kernels"]
    if not isinstance(kernels, str) or kernels not in _KERNELS:
        raise ValueError(f"fastdora: option kernels={kernels!r} is invalid; use one of {list(_KERNELS)}")
    for name in ("legacy_embedding_compose", "dm_from_output"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"fastdora: option {name}={values[name]!r} must be a bool")
    return Options(**values)


# ---------------------------------------------------------------------------------------------- internal settings


@dataclasses.dataclass
class Settings:
    """Internal settings: read on every call where they matter (changes apply to the next call); see
    docs/ARCHITECTURE.md ("Internal settings") for what each one selects and what was measured. Defaults are the
    measured choices; every alternative computes the same function (the tests run them)."""

    # layer integration (fastdora.layers)
    cache_norm: bool = True  # reuse the norm while W, A, B, s and the optimizer-step epoch are unchanged
    lean_forward: bool = True  # PEFT LoRA Linear's common call flattened into one function (bitwise PEFT's chain)
    layer_node: bool = True  # with lean_forward on the Triton path: the whole Linear layer as one C++ autograd node
    graph_norm: bool = True  # a layer's once-per-step Triton norm captured into a CUDA graph and replayed
    graph_capture_after: int = 1  # eager recomputations (with a cached base norm) before the capture
    norm_budget_mb: float = 16.0  # working set of the PyTorch factored norm's column chunks
    # under torch.compile: the composition as fastdora's Triton custom ops (one opaque op per direction) instead of
    # traced PyTorch ops that Inductor fuses with their neighbours
    compiled_compose_op: bool = False
    # the C++ composition node (fastdora.kernels.native)
    native: str = dataclasses.field(default_factory=_env_native)  # "auto" | "1" | "0"
    native_launch: bool = dataclasses.field(default_factory=lambda: _env_bool("FASTDORA_NATIVE_LAUNCH", True))
    # composition kernels (fastdora.kernels.compose)
    compose_crossover_numel: int = 1 << 10  # kernels="auto": eager below this many output elements
    compose_config: dict = dataclasses.field(default_factory=dict)  # {"fwd": (BM, BN, warps), "bwd": (...)}
    bwd_fuse_reduce: bool = True  # the magnitude gradient's second stage in the backward kernel's last program
    bwd_maxnreg: Optional[int] = 128  # register cap of the fused backward kernel
    bwd_evict: str = ""  # L2 eviction policy of the backward's loads ("" or "evict_first")
    bwd_stages: Optional[int] = None  # software-pipelining stages of the backward's row loop
    # factored norm kernels (fastdora.kernels.norm)
    norm_presplit: bool = True  # bf16 W, fp32 A: A's bf16 parts split once per norm (else in every U program)
    norm_split_parts: int = 3  # products per K block in the split mode (3: hi + mid + lo, fp32 level)
    norm_one_product_half: bool = True  # W and A in one half dtype: one exact tensor-core product per K block
    norm_g_sym: bool = True  # G = A A^T from the tiles on and above the diagonal
    norm_g_prec: str = "split"  # G's products for an fp32 A: "split" (six bf16 products), "ieee", "tf32x3"
    norm_combine_prec: str = "split"  # B G in the combine kernel for a bf16 B
    norm_combine_prec_wide_b: str = "ieee"  # ... for an fp32 / fp16 B
    norm_quad_in_u: bool = True  # B G computed in the U pass (else in the combine kernel)
    norm_tma: bool = True  # the pre-split U pass on the tensor-memory accelerator (Hopper+)
    norm_tma_interpret: bool = False  # CPU tensors (Triton's interpreter) take the TMA kernel too (tests)
    norm_workset_plan: float = 1.0  # the norm's planned working set, in bytes of fp32 U and G
    norm_config: dict = dataclasses.field(default_factory=dict)  # tile configs per dot mode
    norm_split: dict = dataclasses.field(default_factory=dict)  # {"G": n, "U": n}: K ranges
    norm_acc: dict = dataclasses.field(default_factory=dict)  # (K blocks per iteration, chained) per config key

    @property
    def norm_budget_bytes(self) -> int:
        return int(self.norm_budget_mb * (1 << 20))


#: The settings in force (one instance per process).
SETTINGS = Settings()

_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(Settings))


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Change internal settings inside a ``with`` block (tests, benchmarks); restored on exit. An unknown name
    raises ``TypeError``."""
    unknown = sorted(set(changes) - _SETTING_NAMES)
    if unknown:
        raise TypeError(f"fastdora: unknown internal setting(s) {unknown}; known: {sorted(_SETTING_NAMES)}")
    saved = {name: getattr(SETTINGS, name) for name in changes}
    for name, value in changes.items():
        setattr(SETTINGS, name, value)
    try:
        yield SETTINGS
    finally:
        for name, value in saved.items():
            setattr(SETTINGS, name, value)
