"""Every rank writes its report: ``fastdora_report.json`` on rank 0, ``fastdora_report.rank<N>.json`` on rank N."""

from __future__ import annotations

import json
import types

import pytest

from fastdora.plugins import _common

from ._support import tiny_dora_model


@pytest.mark.parametrize(
    "name, rank, expected",
    [
        ("fastdora_report.json", 0, "fastdora_report.json"),
        ("fastdora_report.json", 1, "fastdora_report.rank1.json"),
        ("fastdora_report.json", 12, "fastdora_report.rank12.json"),
        ("custom.json", 3, "custom.rank3.json"),
        ("custom", 2, "custom.rank2.json"),
    ],
)
def test_report_file_for_rank(name, rank, expected):
    assert _common.report_file_for_rank(name, rank) == expected


def _no_dist(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_process_rank_sources(monkeypatch):
    import torch.distributed as dist

    _no_dist(monkeypatch)
    assert _common.process_rank() == (0, 1)
    assert _common.process_rank(types.SimpleNamespace(process_index=2, world_size=4)) == (2, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _common.process_rank() == (1, 2)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 8)
    assert _common.process_rank() == (5, 8)
    assert not _common.is_main_process()
    assert _common.is_main_process(types.SimpleNamespace(process_index=0, world_size=8))


def _train_end(tmp_path, args, monkeypatch):
    from fastdora.plugins import FastDoraCallback

    monkeypatch.setattr(_common, "_ANNOUNCED", True)  # the one line is not what this tests
    model = tiny_dora_model()
    cb = FastDoraCallback(kernels="eager")
    cb.on_init_end(args, None, None, model=model)
    cb.on_train_end(args, None, None, model=model)
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_every_rank_writes_its_report(tmp_path, monkeypatch, rank):
    _no_dist(monkeypatch)
    args = types.SimpleNamespace(output_dir=str(tmp_path), process_index=rank, world_size=4)
    expected = "fastdora_report.json" if rank == 0 else f"fastdora_report.rank{rank}.json"
    assert _train_end(tmp_path, args, monkeypatch) == [expected]
    rep = json.loads((tmp_path / expected).read_text())
    assert rep["rank"] == rank and rep["world_size"] == 4
    assert rep["enabled"] and rep["fastdora_layers"] == 2 and rep["converted"] == {"linear": 2}


def test_rank_from_the_environment_when_args_have_none(tmp_path, monkeypatch):
    _no_dist(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    assert _train_end(tmp_path, args, monkeypatch) == ["fastdora_report.rank1.json"]


def test_two_ranks_in_one_directory(tmp_path, monkeypatch):
    _no_dist(monkeypatch)
    for rank in (0, 1):
        _train_end(tmp_path, types.SimpleNamespace(output_dir=str(tmp_path), process_index=rank, world_size=2),
                   monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fastdora_report.json", "fastdora_report.rank1.json"]
