"""PoetXCallback under DDP: the HF Trainer in two processes (torchrun, CPU, gloo) against one process on the same
global batch. Every rank merges its own replica at the same steps with the same permutations (seeded by args.seed),
so the ranks' weights stay bitwise equal without any collective call during a merge, and training equals the
one-process run (fp32: float reassociation of the gradient average only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ._support import REPO, free_port, job_env  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "poetx_ddp_job.py")


def _run(cmd, out):
    proc = subprocess.run(cmd + [str(out)], cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    base = tmp_path_factory.mktemp("poetx_ddp")
    _run([sys.executable, JOB], base / "one")
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
          str(free_port()), JOB], base / "two")
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    return load(base / "one" / "rank0.pt"), [load(base / "two" / f"rank{r}.pt") for r in range(2)]


def test_ranks_merge_alike_without_communicating(runs):
    _, ranks = runs
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["merges"] == ranks[1]["merges"] == [2, 4]
    assert ranks[0]["calls_in_merges"] == ranks[1]["calls_in_merges"] == 0
    assert len(ranks[0]["drawn"]) == 2 and ranks[0]["drawn"][0]
    for d0, d1 in zip(ranks[0]["drawn"], ranks[1]["drawn"]):  # drawn by each rank itself, from the shared seed
        assert all(torch.equal(d0[k], d1[k]) for k in d0)
    a, b = ranks[0]["state"], ranks[1]["state"]
    assert set(a) == set(b) and any(k.endswith("perm_in") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # weights, Q, permutations, merge counts


def test_two_processes_train_as_one(runs):
    one, ranks = runs
    assert one["merges"] == [2, 4] and one["world"] == 1
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=0, abs=1e-5)
    for k, v in one["state"].items():
        torch.testing.assert_close(ranks[0]["state"][k], v, rtol=0, atol=1e-5, msg=k)
