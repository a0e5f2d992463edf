"""POET-X under FSDP2 (``fully_shard`` on every decoder layer and the root; torchrun, CPU, gloo, 2 processes) against
one process (a plain model) on the same global batch, through the public ``fastdora.poetx.merge`` in a plain AdamW
loop (poetx_fsdp2_job.py). Every rank draws the same permutations from the shared seed; a merge all-gathers each
layer's ``W``, ``q_in`` and ``q_out`` (DTensor all-gathers, three per layer) and writes back its own rows: no
broadcast, no other collective. Training and merges equal the one-process run to float reassociation (fp32, measured
max differences about 5e-7 for parameters and 2.4e-7 for losses; tolerance 1e-5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ._support import REPO, free_port, job_env  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "poetx_fsdp2_job.py")
N_LAYERS = 14  # q k v o gate up down, 2 decoder layers
TOL = 1e-5


def _start(cmd, out):
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd + [str(out)], cwd=REPO, env=job_env(PYTHONWARNINGS="ignore"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(proc):
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    base = tmp_path_factory.mktemp("poetx_fsdp2")
    one = _start([sys.executable, JOB], base / "one")
    two = _start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                  "127.0.0.1", "--master_port", str(free_port()), JOB], base / "two")
    _wait(one)
    _wait(two)
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    return load(base / "one" / "rank0.pt"), [load(base / "two" / f"rank{r}.pt") for r in range(2)]


def test_ranks_merge_alike_with_only_the_layers_all_gathers(runs):
    _, ranks = runs
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["merges"] == ranks[1]["merges"] == [2, 4]
    assert ranks[0]["merged_layers"] == ranks[0]["converted"] == N_LAYERS
    for r in ranks:
        assert r["dist_calls_in_merges"] == 0  # no torch.distributed call: no broadcast, no all-reduce
        # per merge, DTensor's all-gather of W, q_in and q_out of every layer, and nothing else
        assert r["comm_counts"] == [{"c10d_functional.all_gather_into_tensor": 3 * N_LAYERS}] * 2
    assert len(ranks[0]["drawn"]) == 2 and ranks[0]["drawn"][0]
    for d0, d1 in zip(ranks[0]["drawn"], ranks[1]["drawn"]):  # drawn by each rank itself, from the shared seed
        assert set(d0) == set(d1) and all(torch.equal(d0[k], d1[k]) for k in d0)
    a, b = ranks[0]["state"], ranks[1]["state"]
    assert set(a) == set(b) and any(k.endswith("perm_in") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # gathered weights, Q, permutations, merge counts


def test_two_sharded_processes_train_as_one(runs):
    one, ranks = runs
    assert one["merges"] == [2, 4] and one["world"] == 1
    mean = [(x + y) / 2 for x, y in zip(ranks[0]["losses"], ranks[1]["losses"])]  # each rank: half of the batch
    assert mean == pytest.approx(one["losses"], rel=0, abs=TOL)
    assert set(ranks[0]["state"]) == set(one["state"])
    assert one["state"]["model.layers.0.self_attn.q_proj.merge_count"] == 2
    for k, v in one["state"].items():
        torch.testing.assert_close(ranks[0]["state"][k], v, rtol=0, atol=TOL, msg=k)


def test_root_layer_merges_after_a_forward_with_uneven_shards(runs):
    _, ranks = runs
    for r in ranks:
        lone = r["lone"]
        assert lone["merged_equal"], lone  # bitwise the unsharded layer's merge
        assert lone["forward_diff"] < 1e-6 and lone["after_merge_diff"] < 1e-6, lone
