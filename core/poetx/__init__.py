"""POET-X: orthogonal-equivalence training. Each converted linear layer keeps its weight ``W`` frozen and learns two
block-orthogonal factors around it, ``y = x·(R W P)ᵀ + bias``; every ``merge_interval`` steps the factors are folded
into ``W`` and restarted from the identity, so ``W`` keeps its singular values (up to the truncated series' small
deviation from orthogonality, :mod:`~fastdora.poetx.cayley`).

    from fastdora import poetx
    report = poetx.convert(model, block_size=256)  # the converted model computes what it computed
    ...                                            # train the q_in / q_out parameters
    poetx.merge(model)                             # every merge_interval optimizer steps (then reset their moments)
    poetx.export(model)                            # back to plain nn.Linear layers, the original state-dict keys

Modules: :mod:`~fastdora.poetx.cayley` (the orthogonal blocks), :mod:`~fastdora.poetx.ops` (the input-centric
forward and backward), :mod:`~fastdora.poetx.layer` (:class:`PoetXLinear`), :mod:`~fastdora.poetx.convert`,
:mod:`~fastdora.poetx.quant` (the group-wise int8 base, ``weight_format="int8"``).
"""

from .convert import ConvertReport, convert, export, merge
from .layer import PoetXLinear

__all__ = ["convert", "merge", "export", "PoetXLinear", "ConvertReport"]
