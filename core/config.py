"""Options and environment. The ONLY module of fastdora that reads environment variables.

Environment variables (all optional):

- ``FASTDORA=0``                 kill switch: ``enable()`` converts nothing and reports why; converted layers fall back
                                  to stock PEFT at their next forward.
- ``FASTDORA_KERNELS``           default for the ``kernels`` option: ``auto`` (default), ``triton`` or ``eager``.
- ``FASTDORA_LEGACY_EMBEDDING=1``  default for ``legacy_embedding_compose``.
- ``FASTDORA_NORM_BUDGET_MB``    default for ``norm_budget_mb`` (working-set budget of the eager factored norm).
- ``FASTDORA_NATIVE``            the composition's C++ autograd node (``fastdora.kernels.native``): ``auto`` (default:
                                  built and used on CUDA where a C++ compiler is found, the Python node otherwise),
                                  ``1`` (required: an error if it cannot be built), ``0`` (never).
- ``FASTDORA_NATIVE_LAUNCH``     ``1`` (default): the C++ node launches its kernels directly (cuLaunchKernel); ``0``:
                                  through Triton's own launcher (same kernels and arguments, more host time).
- ``FASTDORA_CACHE_DIR``         where the C++ node is built and cached (default ``$XDG_CACHE_HOME/fastdora`` or
                                  ``~/.cache/fastdora``); ``CXX``: the C++ compiler (default ``c++``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["Options", "make_options", "killed", "env_default", "native_mode", "native_launch",
           "native_build_env"]

_KERNELS = ("auto", "triton", "eager")


def killed() -> bool:
    """True when the kill switch ``FASTDORA=0`` (or ``false``/``off``/``no``) is set."""
    return os.environ.get("FASTDORA", "1").strip().lower() in ("0", "false", "off", "no")


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    val = raw.strip().lower()
    if val in ("1", "true", "on", "yes"):
        return True
    if val in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"fastdora: environment variable {name}={raw!r} is not a boolean (use 0 or 1)")


def native_mode() -> str:
    """``FASTDORA_NATIVE``: ``"auto"``, ``"1"`` or ``"0"`` (see the module docstring)."""
    raw = os.environ.get("FASTDORA_NATIVE", "auto").strip().lower() or "auto"
    if raw in ("1", "true", "on", "yes"):
        return "1"
    if raw in ("0", "false", "off", "no"):
        return "0"
    if raw != "auto":
        raise ValueError(f"fastdora: environment variable FASTDORA_NATIVE={raw!r} is invalid; use auto, 1 or 0")
    return raw


def native_launch() -> bool:
    """``FASTDORA_NATIVE_LAUNCH`` (default on): the C++ node's direct kernel launches."""
    return _env_bool("FASTDORA_NATIVE_LAUNCH", True)


def native_build_env() -> tuple[str, str]:
    """``(cache directory, C++ compiler)`` for building the C++ composition node."""
    cache = os.environ.get("FASTDORA_CACHE_DIR", "").strip()
    if not cache:
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(base, "fastdora")
    return cache, os.environ.get("CXX", "").strip() or "c++"


def env_default(name: str) -> Any:
    if name == "kernels":
        return os.environ.get("FASTDORA_KERNELS", "auto").strip().lower() or "auto"
    if name == "legacy_embedding_compose":
        return _env_bool("FASTDORA_LEGACY_EMBEDDING", False)
    if name == "norm_budget_mb":
        raw = os.environ.get("FASTDORA_NORM_BUDGET_MB", "16")
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"fastdora: FASTDORA_NORM_BUDGET_MB={raw!r} is not a number") from None
    raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``fastdora.enable(**options)`` accepts (keyword-only).

    kernels: ``"auto"`` (Triton on CUDA when it pays, exact PyTorch otherwise), ``"triton"`` (require Triton on
        CUDA tensors; CPU tensors still use PyTorch), ``"eager"`` (always the exact PyTorch path).
    legacy_embedding_compose: compose DoRA embeddings as PEFT 0.13-0.17 did (no ``embed_scale`` on the DoRA part),
        for embedding adapters trained with those releases on scaled embeddings (e.g. Gemma). Default: as the
        installed PEFT does.
    cache_norm: reuse the weight norm while ``W, A, B, s`` are unchanged (exact; turn off only to debug).
    norm_budget_mb: working-set budget of the eager factored norm's column chunks (MB).
    fuse_lora_b: opt-in. Linear layers whose ``lora_B`` is a plain ``nn.Linear`` (no bias, no hooks) compute its
        product inside the composition's autograd node, which never materialises ``d_lora`` (one activation-sized
        pass less per layer backward). Session 11 measured no model-level gain on the H200 with the Python node
        (its backward ran lora_B's two matmuls from Python on the host-bound step); since session 23 the C++ node
        runs it (``compose_b``: the matmuls from C++, bitwise the Python node's results, also on the H200); session
        24 measured no gain there either (pure bf16 1.104 vs 1.105 s per iteration: below the process-to-process
        spread). Off by default; ``lora_B`` is then called as a module, as PEFT does. On the exact PyTorch path on a
        CUDA device with half activations the fused node forms ``inner = result + s * h @ B^T`` as one ``addmm``
        (session 30); there too no model-level gain was measured (pure bf16, r=384: 1.214 / 1.219 s vs 1.219 s off,
        one run) and its Python backward costs host time (CPU, AMP: +7% per layer call), so it stays opt-in.
    lean_forward: PEFT LoRA ``Linear`` layers with a fastdora adapter run their common forward call (one active
        adapter, no extra arguments, no hooks, not merged / disabled, no training-mode dropout) through one flattened
        function instead of PEFT's ``forward`` -> variant -> magnitude module chain: the same operations in the same
        order (bitwise the same outputs and gradients), less host time per layer. Off: PEFT's ``forward`` always.
    layer_node: with ``lean_forward``, on the Triton path with the C++ node active (``fastdora.kernels.native``), a
        Linear layer whose base layer, ``lora_A`` and ``lora_B`` are bare ``nn.Linear`` modules (the adapters
        bias-free, the base layer's weight and bias frozen), run in the adapters' dtype or under autocast, runs as
        ONE autograd node (its three products and the composition,
        forward and backward, from C++): the same operations, bitwise the same outputs and gradients as the
        separate nodes, and under gradient checkpointing three saved activations (x, lora_A's output, the
        composition's) instead of six saved tensors, each of which costs checkpointing's Python hooks. Off: the
        separate nodes.
    dm_from_output: with ``layer_node``, a bias-free layer computing in bf16 / fp32 saves its output ``y`` for the
        magnitude's gradient, ``dm = sum(dy * y) / m``, instead of the composition's ``inner``
        (``dm = sum(dy * inner) / max(norm, eps)``: the same value, since ``y = g * inner``, rounded once per
        element either way). The model's next ops keep most layers' outputs anyway (SiLU and the gate product keep
        gate's and up's, attention keeps v), so the saved tensor costs no memory of its own there, and the forward
        writes no ``inner``. Taken only while the magnitude has no element below 1e-20 in magnitude (checked once
        per magnitude update: a host sync per layer and optimizer step); a model that changes a layer's output in
        place before the backward gets autograd's error naming this option. Off: ``inner`` is saved, as before.
    graph_norm: on CUDA, a layer's once-per-step norm recomputation (Triton path, cached base) is captured into a CUDA
        graph after its first recomputations and replayed from then on: the same kernels on the same inputs (bitwise
        the same norm), one graph launch instead of ~12 kernel launches and their Python per layer and step. Inputs
        that moved (storage swaps, another stream) are recaptured; off: eager launches always.
    """

    kernels: str = "auto"
    legacy_embedding_compose: bool = False
    cache_norm: bool = True
    norm_budget_mb: float = 16.0
    fuse_lora_b: bool = False
    lean_forward: bool = True
    layer_node: bool = True
    dm_from_output: bool = True
    graph_norm: bool = True

    @property
    def norm_budget_bytes(self) -> int:
        return int(self.norm_budget_mb * (1 << 20))


_FIELDS = {f.name for f in dataclasses.fields(Options)}


def make_options(**kwargs: Any) -> Options:
    """Validate options: an unknown name raises ``TypeError``, a bad value ``ValueError``, each naming it."""
    unknown = sorted(set(kwargs) - _FIELDS)
    if unknown:
        raise TypeError(
            f"fastdora.enable() got unknown option(s) {unknown}; valid options: {sorted(_FIELDS)}"
        )
    values = {name: env_default(name) for name in ("kernels", "legacy_embedding_compose", "norm_budget_mb")}
    values.update(kwargs)
    kernels = values["kernels"]
    if not isinstance(kernels, str) or kernels not in _KERNELS:
        raise ValueError(f"fastdora: option kernels={kernels!r} is invalid; use one of {list(_KERNELS)}")
    for name in ("legacy_embedding_compose", "cache_norm", "fuse_lora_b", "lean_forward", "layer_node",
                 "dm_from_output", "graph_norm"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"fastdora: option {name}={values[name]!r} must be a bool")
    budget = values["norm_budget_mb"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(f"fastdora: option norm_budget_mb={budget!r} must be a positive number")
    values["norm_budget_mb"] = float(budget)
    return Options(**values)
