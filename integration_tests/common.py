"""Helpers shared by the end-to-end tests (run inside each framework's virtual environment)."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLES = os.path.join(REPO, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from _tiny import PROBE_TEXT, build_all  # noqa: E402

#: |loss(fastdora) - loss(stock PEFT)| per logged step; both runs are fp32 on CPU with the same seed, and fastdora's
#: eager path is exact math with a different operation order (measured differences are ~1e-7..1e-6).
LOSS_ATOL = 1e-4
#: logits of the trained model (in the training process, with fastdora) vs the saved adapter loaded in stock PEFT
LOGITS_ATOL = 1e-4

REPORT_FILE = "fastdora_report.json"  # rank 0's; rank N writes fastdora_report.rank<N>.json (rank_report_file)
PROBE_FILE = "probe_logits.pt"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a torchrun rendezvous port: a fixed one collides with any other job on the
    machine that holds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd, env=None, cwd=None, log_path=None, timeout=900) -> float:
    """Run a command (in its own process group); on failure or past ``timeout`` seconds (the whole group is killed
    then) write its output to ``log_path``, print the tail and raise. Returns the wall time."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    t0 = time.time()
    log("$ " + " ".join(cmd) + (f"   (env {env})" if env else ""))
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too
        out, _ = proc.communicate()
        rc = f"killed after the {timeout} s timeout"
    dt = time.time() - t0
    if log_path:
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(out)
    if rc != 0:
        print(out[-12000:])
        raise SystemExit(f"command failed (rc={rc}) after {dt:.1f}s: {' '.join(cmd)}")
    log(f"  ok in {dt:.1f}s" + (f" (log: {log_path})" if log_path else ""))
    return dt


def tiny(work: str) -> dict:
    return build_all(os.path.join(work, "tiny"))


def losses_from_state(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def find_trainer_state(output_dir: str) -> str:
    cands = []
    for root, _dirs, files in os.walk(output_dir):
        if "trainer_state.json" in files:
            cands.append(os.path.join(root, "trainer_state.json"))
    if not cands:
        raise AssertionError(f"no trainer_state.json under {output_dir}")

    def step_of(p):
        with open(p, encoding="utf-8") as f:
            return json.load(f).get("global_step", 0)

    return max(cands, key=step_of)


def check_losses(fast: list, stock: list, what: str, atol: float = LOSS_ATOL, must_decrease: bool = True,
                 names: tuple = ("fastdora", "stock")) -> float:
    assert len(fast) == len(stock) and len(fast) >= 3, f"{what}: loss logs differ in length: {fast} vs {stock}"
    assert [s for s, _ in fast] == [s for s, _ in stock], f"{what}: logged steps differ"
    diff = max(abs(a - b) for (_, a), (_, b) in zip(fast, stock))
    log(f"{what}: {len(fast)} losses, first {fast[0][1]:.5f} last {fast[-1][1]:.5f}; "
        f"max |loss({names[0]}) - loss({names[1]})| = {diff:.2e} (tolerance {atol:g})")
    assert diff <= atol, f"{what}: loss curves differ by {diff} > {atol}"
    if must_decrease:
        assert fast[-1][1] < fast[0][1], f"{what}: loss did not go down: {fast}"
    return diff


def rank_report_file(rank: int) -> str:
    """The plugins' report of one rank: ``fastdora_report.json`` (rank 0), ``fastdora_report.rank<N>.json``."""
    return REPORT_FILE if rank == 0 else f"fastdora_report.rank{rank}.json"


def check_report(output_dir: str, what: str, expect_keys=("linear:",), rank: int = 0) -> dict:
    path = os.path.join(output_dir, rank_report_file(rank))
    assert os.path.exists(path), f"{what}: {path} missing: the plugin did not write rank {rank}'s report"
    with open(path, encoding="utf-8") as f:
        rep = json.load(f)
    counter = rep.get("active_path_counter", {})
    assert rep.get("enabled") and rep.get("fastdora_layers", 0) > 0, f"{what}: no layer runs fastdora: {rep}"
    assert sum(counter.values()) > 0, f"{what}: fastdora's path never ran in the training process: {rep}"
    assert rep.get("rank", 0) == rank, f"{what}: {path} was written by rank {rep.get('rank')}"
    for prefix in expect_keys:
        assert any(k.startswith(prefix) for k in counter), f"{what}: no {prefix}* path in {counter}"
    log(f"{what}: rank {rank}: {rep.get('report')}; path counter in the training process {counter} "
        f"(pid {rep.get('pid')})")
    return rep


def check_rank_reports(output_dir: str, what: str, world_size: int, expect_keys=("linear:",)) -> list:
    """Every rank of a multi-process run wrote its own report, each with converted layers that ran fastdora, from
    distinct processes; returns them in rank order."""
    reps = [check_report(output_dir, what, expect_keys, rank=r) for r in range(world_size)]
    pids = [rep.get("pid") for rep in reps]
    assert len(set(pids)) == world_size, f"{what}: the reports come from processes {pids}, not {world_size} ranks"
    assert all(rep.get("world_size") == world_size for rep in reps), [rep.get("world_size") for rep in reps]
    return reps


def check_no_report(output_dir: str, what: str) -> None:
    found = sorted(glob.glob(os.path.join(output_dir, "fastdora_report*.json")))
    assert not found, f"{what}: {found} exist although fastdora was not switched on"
    log(f"{what}: no fastdora_report*.json (fastdora not used)")


def stock_logits(python: str, base: str, adapter: str, out: str, env=None) -> None:
    """Load the adapter with stock PEFT in a fresh process (fastdora must not get imported) and save logits."""
    run([python, os.path.join(HERE, "peft_load_check.py"), base, adapter, out], env=env)


def compare_logits(trained: str, stock: str, what: str, atol: float = LOGITS_ATOL,
                   stock_name: str = "adapter loaded in stock PEFT") -> float:
    import torch

    a = torch.load(trained)
    b = torch.load(stock)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a.float() - b.float()).abs().max().item()
    log(f"{what}: max |logits(trained model) - logits({stock_name})| = {diff:.2e} "
        f"(tolerance {atol:g}, logits scale {b.abs().max().item():.2f})")
    assert diff <= atol, f"{what}: logits differ by {diff}"
    return diff


#: POET-X runs through the frameworks' CLIs: merges every POET_MERGE_INTERVAL optimizer steps, POETX_STEPS optimizer
#: steps of POETX_GRAD_ACCUM micro-batches each, a checkpoint every POETX_RESUME_STEP steps (checkpoint-4: one step
#: into the second merge interval, the run resumed from it must continue the uninterrupted run's loss curve)
POETX_MERGE_INTERVAL, POETX_STEPS, POETX_GRAD_ACCUM, POETX_RESUME_STEP = 3, 8, 2, 4


def check_poetx_training(full: str, resumed: str, what: str) -> dict:
    """The checks of a POET-X run through a framework's CLI and of the same run resumed from ``checkpoint-4`` of it:
    ``poetx_report.json`` written by the training process (its pid is the probe's, which runs there) with converted
    layers and merges after optimizer steps 3 and 6 (6 in the resumed run), the trained model's POET-X layers merged
    twice (the probe), POETX_STEPS optimizer steps logged (gradient accumulation: the merges count optimizer steps, not
    micro-batches), the loss going down, and the resumed run's losses after step 4 equal to the uninterrupted run's
    within LOSS_ATOL."""
    assert POETX_RESUME_STEP % POETX_MERGE_INTERVAL, "the checkpoint must lie inside a merge interval"
    expected = [s for s in range(1, POETX_STEPS + 1) if s % POETX_MERGE_INTERVAL == 0]
    out: dict = {}
    for name, d, merges in (("uninterrupted", full, expected),
                            ("resumed", resumed, [s for s in expected if s > POETX_RESUME_STEP])):
        path = os.path.join(d, "poetx_report.json")
        assert os.path.exists(path), f"{what} ({name}): {path} missing: the plugin did not write its report"
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        with open(os.path.join(d, "probe_meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        assert rep["method"] == "poetx" and rep["pid"] == meta["pid"] != os.getpid(), \
            f"{what} ({name}): the report (pid {rep['pid']}) is not the training process's (pid {meta['pid']})"
        assert rep["converted"] and len(rep["converted"]) == meta["poetx_layers"], (rep["converted"], meta)
        assert rep["merges_at_steps"] == merges, \
            f"{what} ({name}): merges after steps {rep['merges_at_steps']}, expected {merges}"
        assert meta["poetx_merge_counts"] == [len(expected)], f"{what} ({name}): merge counts {meta}"
        with open(find_trainer_state(d), encoding="utf-8") as f:
            assert json.load(f)["global_step"] == POETX_STEPS
        out[name] = rep
    rep = out["uninterrupted"]
    log(f"{what}: {len(rep['converted'])} layers converted in the training process (pid {rep['pid']}), "
        f"{len(rep['skipped'])} skipped ({sorted(set(rep['skipped'].values()))}); merges after optimizer steps "
        f"{rep['merges_at_steps']} (gradient accumulation {POETX_GRAD_ACCUM}), resumed run: "
        f"{out['resumed']['merges_at_steps']}")
    curve = losses_from_state(find_trainer_state(full))
    assert [s for s, _ in curve] == list(range(1, POETX_STEPS + 1)), curve
    assert curve[-1][1] < curve[0][1], f"{what}: loss did not go down: {curve}"
    tail = [(s, loss) for s, loss in losses_from_state(find_trainer_state(resumed)) if s > POETX_RESUME_STEP]
    diff = check_losses(tail, curve[POETX_RESUME_STEP:], what, must_decrease=False,
                        names=(f"resumed at step {POETX_RESUME_STEP}", "uninterrupted"))
    return {"converted_layers": len(rep["converted"]), "merges": rep["merges_at_steps"],
            "first_last_loss": [curve[0][1], curve[-1][1]], "resume_loss_max_abs_diff": diff}


def check_poetx_export(python: str, trained: str, tokenizer_dir: str, what: str, env=None) -> dict:
    """Export the framework's saved POET-X model (``poetx_export.py``: reloaded with fastdora, its logits equal to the
    training process's within 1e-6, then ``fastdora.poetx.export``), then load the export in stock transformers in a
    fresh process (``stock_model_check.py``: fastdora not imported, no missing or unexpected weight, plain
    ``nn.Linear`` layers): its logits equal the trained POET-X model's within LOGITS_ATOL."""
    export_dir = os.path.join(trained, "exported")
    reloaded = os.path.join(trained, "reloaded_logits.pt")
    run([python, os.path.join(HERE, "poetx_export.py"), trained, tokenizer_dir, export_dir, reloaded], env=env)
    reload_diff = compare_logits(os.path.join(trained, PROBE_FILE), reloaded, what, atol=1e-6,
                                 stock_name="the saved POET-X model reloaded with fastdora")
    stock_out = os.path.join(trained, "stock_logits.pt")
    run([python, os.path.join(HERE, "stock_model_check.py"), export_dir, stock_out], env=env)
    diff = compare_logits(os.path.join(trained, PROBE_FILE), stock_out, what,
                          stock_name="exported model loaded in stock transformers")
    return {"reload_logits_max_abs_diff": reload_diff, "logits_max_abs_diff": diff}


def make_init_adapter(model_dir: str, out_dir: str, targets: list, seed: int = 0) -> str:
    """A seeded DoRA adapter (r=8, alpha=16) with non-zero lora_B, saved with PEFT: lets two runs of a framework
    that does not seed its adapter initialisation (Axolotl) start from identical weights, and exercises the full
    DoRA composition from the first step."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(out_dir, "adapter_config.json")):
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets,
                                             use_dora=True, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    return out_dir


def write_config(out: str, lines: list) -> str:
    """Write a generated training config (one YAML line per item) to ``out + ".yaml"``; returns its path."""
    path = out + ".yaml"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def write_summary(work: str, name: str, summary: dict) -> None:
    path = os.path.join(work, f"summary_{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    log(f"summary -> {path}: {json.dumps(summary)}")


__all__ = [
    "HERE", "REPO", "PROBE_TEXT", "LOSS_ATOL", "LOGITS_ATOL", "REPORT_FILE", "PROBE_FILE", "log", "run", "tiny",
    "losses_from_state", "find_trainer_state", "check_losses", "check_report", "check_rank_reports",
    "check_no_report", "rank_report_file", "stock_logits", "compare_logits", "write_config", "write_summary",
    "make_init_adapter", "POETX_MERGE_INTERVAL", "POETX_STEPS", "POETX_GRAD_ACCUM", "POETX_RESUME_STEP",
    "check_poetx_training", "check_poetx_export",
]
