"""Launch programs of the C++ extension (``fastdora._native``, ``fastdora._launch.Replay(..., direct=True)``): a
recorded launch sequence launched from C++ passes, per launch, exactly the parameters Triton's CUDA launcher would get
from the Python replay of the same sequence; a program whose results differ from the launchers' on the recording's
own tensors is dropped, the tensors keep the launchers' results and programs turn off with a warning.

On CPU the extension records its direct launches instead of making them (``testing_record_native``); the expected
parameters are written out here from the signature, independently of ``fastdora._native.native_layout``. The GPU
tests of POET-X's replay (tests/poetx/test_kernels_gpu.py) compare real launches bitwise."""

from __future__ import annotations

import struct
import types

import pytest
import torch

from fastdora import _launch
from fastdora import _native

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """The extension (built once for this module where no other test built it)."""
    import os

    pytest.importorskip("triton")
    old = os.environ.get("FASTDORA_CACHE_DIR")
    os.environ["FASTDORA_CACHE_DIR"] = str(tmp_path_factory.mktemp("fastdora-cache"))
    try:
        try:
            return _native.load()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"the C++ extension cannot be built here: {e}")
    finally:
        if old is None:
            os.environ.pop("FASTDORA_CACHE_DIR", None)
        else:
            os.environ["FASTDORA_CACHE_DIR"] = old


class _Compiled:
    """A fake ``CompiledKernel``: the source's signature as Triton writes it (constexprs, and ints equal to 1, as
    ``"constexpr"``), the launch metadata, the function handle, and a ``run`` that logs its arguments."""

    def __init__(self, kinds, handle, warps=4, shared=2048, scratch=True):
        names = [f"a{i}" for i in range(len(kinds))]
        self.src = types.SimpleNamespace(fn=types.SimpleNamespace(arg_names=names), signature=dict(zip(names, kinds)),
                                         constants={(i,): 0 for i, k in enumerate(kinds) if k == "constexpr"})
        meta = dict(num_warps=warps, num_ctas=1, shared=shared, launch_cooperative_grid=False, launch_pdl=False)
        if scratch:
            meta.update(global_scratch_size=0, profile_scratch_size=0)
        self.metadata = types.SimpleNamespace(**meta)
        self.function = handle
        self.calls: list = []

    def run(self, *args):
        self.calls.append(args)


def _expected(kinds, run_args) -> bytes:
    """Triton's CUDA launcher's parameter bytes for one ``CompiledKernel.run`` call: each non-constexpr signature
    entry in order (a pointer's address, an int by its type, a float as fp32), 8 bytes per parameter, then the global
    and profile scratch pointers (null)."""
    fmt = {"i32": "<i", "i64": "<q", "fp32": "<f"}
    out = b""
    for kind, v in zip(kinds, run_args[9:]):
        if kind == "constexpr":
            continue
        out += struct.pack("<Q", v) if kind.startswith("*") else struct.pack(fmt[kind], v).ljust(8, b"\0")
    return out + b"\0" * 16


def _sequence():
    """Two launches over three named tensors (pointers at offsets inside them, an int equal to 1 among the ints)."""
    a = torch.empty(64, dtype=torch.float32)
    b = torch.empty(8, 16, dtype=torch.bfloat16)
    c = torch.empty(4, 4, dtype=torch.int64)
    k1 = ["*fp32", "*bf16", "*fp32", "i32", "constexpr", "i64", "fp32", "constexpr", "constexpr"]
    k2 = ["*bf16", "*i64", "i32", "constexpr"]
    c1, c2 = _Compiled(k1, 0xA1, warps=8, shared=4096), _Compiled(k2, 0xB2, warps=4, shared=0)
    recorded = [((c1, c1.function, "packed1"), (3, 2, 1), (a.data_ptr(), b[4:].data_ptr(), a.data_ptr()),
                 (64, 1, -(2**40)), (0.1,), (True, 32)),
                ((c2, c2.function, "packed2"), (5, 1, 1), (b.data_ptr(), c[1:].data_ptr()), (7,), (), (16,))]
    return (a, b, c), recorded, (c1, k1), (c2, k2)


def _records(ext, replay, named, stream):
    records: list = []
    ext.testing_record_native(records)
    try:
        replay(named, stream)
    finally:
        ext.testing_record_native(None)
    return records


def _built(ext, recorded, named):
    """``(replay, other tensors like named)``: the replay of ``recorded`` built as a launch program (its build's check
    launches nothing on CPU tensors: recorded only)."""
    ext.testing_record_native([])
    try:
        replay = _launch.Replay.build(recorded, named, direct=True)
    finally:
        ext.testing_record_native(None)
    assert replay is not None and replay.program is not None
    return replay, tuple(torch.empty_like(t) for t in named)


def test_program_passes_tritons_launcher_parameters(ext, monkeypatch):
    monkeypatch.setattr(_native, "programs", lambda: ext)
    named, recorded, (c1, k1), (c2, k2) = _sequence()
    replay, named2 = _built(ext, recorded, named)
    records = _records(ext, replay, named2, 77)
    assert not c1.calls and not c2.calls  # nothing went through Triton's launchers
    program, replay.program = replay.program, None  # the Python replay of the same sequence, for its arguments
    replay(named2, 77)
    replay.program = program
    assert len(records) == 2 and len(c1.calls) == 1 and len(c2.calls) == 1
    for rec, (compiled, kinds) in zip(records, ((c1, k1), (c2, k2))):
        function, grid, block, shared, stream, params, pdl = rec
        call = compiled.calls[0]
        assert function == compiled.function and grid == tuple(call[:3]) and stream == 77 == call[3]
        assert pdl is False  # compiled without launch_pdl: a plain launch
        assert block == 32 * compiled.metadata.num_warps and shared == compiled.metadata.shared
        assert params == _expected(kinds, call)
    # the pointers are the second call's tensors at the recorded offsets
    assert struct.unpack("<Q", records[0][5][8:16])[0] == named2[1].data_ptr() + 4 * 16 * 2
    assert struct.unpack("<Q", records[1][5][8:16])[0] == named2[2].data_ptr() + 4 * 8


def test_programmatic_dependent_launch_steps(ext, monkeypatch):
    """A kernel compiled for programmatic dependent launch (Triton's ``launch_pdl``): its program step is made as one
    (recorded with ``pdl`` True), with the same parameter bytes as Triton's launcher; the other step stays plain.
    ``native_layout`` refuses such a launch unless asked (the DoRA node's templates launch plainly)."""
    monkeypatch.setattr(_native, "programs", lambda: ext)
    named, recorded, (c1, k1), (c2, k2) = _sequence()
    c2.metadata.launch_pdl = True
    assert _native.native_layout(c2, (5, 1, 1), (0, 0, 7, 16), (0, 1, _native.COPY, _native.COPY)) is None
    assert _native.native_layout(c2, (5, 1, 1), (0, 0, 7, 16), (0, 1, _native.COPY, _native.COPY),
                                 pdl_ok=True) is not None
    replay, named2 = _built(ext, recorded, named)
    records = _records(ext, replay, named2, 9)
    program, replay.program = replay.program, None
    replay(named2, 9)
    replay.program = program
    assert [r[6] for r in records] == [False, True]
    for rec, (compiled, kinds) in zip(records, ((c1, k1), (c2, k2))):
        assert rec[0] == compiled.function and rec[5] == _expected(kinds, compiled.calls[0])
    # a step tuple without the flag is a plain launch
    prog = ext.program(1, ((1, (1, 1, 1), 32, 0, (0,), (0,)), (2, (1, 1, 1), 32, 0, (0,), (0,), True)))
    records = []
    ext.testing_record_native(records)
    try:
        ext.run_program(prog, (named[0],), 3)
    finally:
        ext.testing_record_native(None)
    assert [(r[0], r[6]) for r in records] == [(1, False), (2, True)]


def test_no_program_where_programs_do_not_run_or_the_layout_is_unknown(ext, monkeypatch):
    named, recorded, _, _ = _sequence()
    monkeypatch.setattr(_native, "programs", lambda: None)
    assert _launch.Replay.build(recorded, named, direct=True).program is None
    monkeypatch.setattr(_native, "programs", lambda: ext)
    assert _launch.Replay.build(recorded, named).program is None  # not asked for
    needs_scratch = _Compiled(["*fp32"], 0xC3)
    needs_scratch.metadata.global_scratch_size = 256  # a kernel that needs scratch memory: Triton's launcher
    rec = [((needs_scratch, 0xC3, "p"), (1, 1, 1), (named[0].data_ptr(),), (), (), ())]
    assert _launch.Replay.build(rec, named, direct=True).program is None


def test_program_with_other_results_is_dropped(ext, monkeypatch):
    """A program that does not reproduce the recorded results: no program, the launchers' results restored in the
    tensors, programs off for the process with the reason, and a warning."""
    named, recorded, _, _ = _sequence()
    named[0].fill_(1.5)

    def wrong_run(program, tensors, stream):
        tensors[0].fill_(2.5)
        return True

    fake = types.SimpleNamespace(run_program=wrong_run, program=lambda n, steps: "capsule")
    monkeypatch.setattr(_native, "programs", lambda: fake)
    monkeypatch.setattr(_native, "program", lambda n, steps: "capsule")
    disabled = []
    monkeypatch.setattr(_native, "disable_programs", disabled.append)
    with pytest.warns(RuntimeWarning, match="launch program"):
        replay = _launch.Replay.build(recorded, named, direct=True)
    assert replay is not None and replay.program is None
    assert torch.equal(named[0], torch.full_like(named[0], 1.5))
    assert disabled and "differed" in disabled[0]


def test_programs_decision_and_refusals(monkeypatch):
    monkeypatch.setattr(_native.torch.cuda, "is_available", lambda: False)
    _native.reset_programs()
    try:
        assert _native.programs() is None and _native.programs_status() == "no CUDA device"
        assert _native.program(1, ((1, (1, 1, 1), 32, 0, (-1,), (0,)),)) is None
    finally:
        _native.reset_programs()


def test_malformed_programs_are_refused(ext):
    with pytest.raises(ValueError, match="names tensor 2 of 2"):
        ext.program(2, ((1, (1, 1, 1), 32, 0, (0, 2), (0, 0)),))
    with pytest.raises(ValueError, match="bad step"):
        ext.program(1, ((1, (1, 1, 1), 0, 0, (0,), (0,)),))  # block 0
    prog = ext.program(2, ((1, (1, 1, 1), 32, 0, (0, 1), (0, 0)),))
    with pytest.raises(ValueError, match="run_program: expected a tuple of 2 tensors"):
        ext.run_program(prog, (torch.empty(1),), 0)


def test_layer_plan_runs_its_steps_in_order(ext):
    """A layer plan (``plan`` / ``run_plan``): allocations on the first input's device, ``at::linear`` /
    ``at::matmul`` with autocast off, a launch program over its slots' tensors (recorded here: CPU), the outputs by
    slot; without a CUDA driver and context (and no recorder) it runs nothing and returns None."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 4, generator=gen), torch.randn(3, 4, generator=gen)
    prog = ext.program(3, ((0xD4, (2, 1, 1), 64, 128, (0, 1, 2, -1), (0, 16, 8, 7)),))
    plan = ext.plan(2, 5, ((0, 2, (3, 4), torch.float32),  # slot 2: empty [3, 4]
                           (2, 3, 0, 1),  # slot 3: linear(x, w)
                           (3, 4, 3, 1),  # slot 4: matmul(slot 3, w)
                           (1, prog, (0, 2, 4))),
                    (2, 3, 4, -1))
    records: list = []
    ext.testing_record_native(records)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # excluded inside the plan
            out = ext.run_plan(plan, (x, w), 5)
    finally:
        ext.testing_record_native(None)
    empty, lin, mm, none = out
    assert none is None and empty.shape == (3, 4) and empty.dtype == torch.float32
    assert lin.dtype == torch.float32 and torch.equal(lin, torch.nn.functional.linear(x, w))
    assert torch.equal(mm, torch.matmul(lin, w))
    assert len(records) == 1
    function, grid, block, shared, stream, params, pdl = records[0]
    assert (function, grid, block, shared, stream, pdl) == (0xD4, (2, 1, 1), 64, 128, 5, False)
    assert struct.unpack("<4Q", params) == (x.data_ptr(), empty.data_ptr() + 16, mm.data_ptr() + 8, 7)
    if not torch.cuda.is_available():
        assert ext.run_plan(plan, (x, w), 0) is None  # no driver / context here: nothing ran


def test_malformed_layer_plans_are_refused(ext):
    prog = ext.program(1, ((1, (1, 1, 1), 32, 0, (0,), (0,)),))
    with pytest.raises(ValueError, match="bad step 0"):
        ext.plan(2, 3, ((0, 1, (4,), torch.float32),), ())  # an allocation into an input slot
    with pytest.raises(ValueError, match="bad step 0"):
        ext.plan(2, 3, ((1, prog, (0, 1)),), ())  # a program over two slots for its one named tensor
    with pytest.raises(ValueError, match="bad step 0"):
        ext.plan(2, 3, ((2, 2, 0, 3),), ())  # a GEMM reading slot 3 of 3
    with pytest.raises(ValueError, match="names slot 3"):
        ext.plan(2, 3, (), (3,))
    plan = ext.plan(2, 3, ((2, 2, 0, 1),), (2,))
    with pytest.raises(ValueError, match="run_plan: expected a tuple of 2 tensors"):
        ext.run_plan(plan, (torch.empty(1),), 0)


def _node_plans(ext):
    """A forward plan of the POET-X node's layout whose only work is a GEMM (``y = x2·Wᵀ``; outputs xp = x2, up = y,
    y, g = an empty [4, 4]), and a backward plan (grad x2 = gy·W, grad q_in = q_in·rows, grad q_out = q_out·cols)."""
    fwd = ext.plan(6, 8, ((2, 6, 0, 1), (0, 7, (4, 4), torch.float32)), (0, 6, 6, 7))
    bwd = ext.plan(13, 16, ((3, 13, 0, 5), (3, 14, 6, 11), (3, 15, 7, 12)), (13, 14, 15))
    return fwd, bwd


@pytest.mark.parametrize("save", [True, False], ids=["fast", "mem"])
def test_poetx_layer_node_forward_backward_and_fallback(ext, save):
    """The C++ layer node (``poetx_layer``): its forward runs the forward plan and reshapes ``y`` like the input;
    without a backward plan its backward calls the Python backward with the saved tensors (fast: xp, up, g; mem: the
    input) and the needs of each input; with one registered (``poetx_set_plan``) it runs that plan; the gradients
    reach x, q_in and q_out; the registry is cleared by ``poetx_clear``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    w = torch.randn(5, 4, generator=gen)
    q_in, q_out = (torch.randn(4, 4, generator=gen, requires_grad=True) for _ in range(2))
    rows, cols = torch.eye(4) * 2, torch.eye(4) * 3
    perm = torch.arange(4)
    gy = torch.randn(2, 3, 5, generator=gen)
    fwd, bwd = _node_plans(ext)
    calls = []

    def backward(gy2, x2, xp, up, g, weight, qi, qo, perm_in, perm_out, inv_in, b, k, need_x, need_qi, need_qo):
        calls.append((x2 is not None, xp is not None, up is not None, g is not None, b, k, need_x, need_qi, need_qo))
        return gy2 @ weight, qi * 5, qo * 7

    ext.poetx_configure(backward, lambda: False)
    ext.poetx_clear()
    ext.testing_record_native([])  # CPU tensors: the recorder stands in for a CUDA context
    try:
        def run(node_id):
            for t in (x, q_in, q_out):
                t.grad = None
            y = ext.poetx_layer(x, q_in, q_out, w, perm, perm, perm, perm, rows, cols, fwd, node_id, 4, 3, save)
            assert y.shape == (2, 3, 5) and torch.equal(y, torch.nn.functional.linear(x, w))
            y.backward(gy)
            assert torch.equal(x.grad, gy @ w)
            return q_in.grad, q_out.grad

        before = ext.poetx_stats()
        gq_in, gq_out = run(7)  # no backward plan: the Python backward
        assert calls == [(not save, save, save, save, 4, 3, True, True, True)]
        assert torch.equal(gq_in, q_in.detach() * 5) and torch.equal(gq_out, q_out.detach() * 7)
        ext.poetx_set_plan(7, True, bwd)
        ext.poetx_set_plan(7, False, bwd)  # (another input-gradient need: not this call's)
        gq_in, gq_out = run(7)
        assert len(calls) == 1
        assert torch.equal(gq_in, q_in.detach() @ rows) and torch.equal(gq_out, q_out.detach() @ cols)
        after = ext.poetx_stats()
        assert after["calls"] == before["calls"] + 2 and after["planned_backward"] == before["planned_backward"] + 1
        assert after["backward_plans"] == 2
        run(8)  # another id: the Python backward again
        assert len(calls) == 2
        ext.poetx_clear()
        assert ext.poetx_stats()["backward_plans"] == 0
        with pytest.raises(ValueError, match="not a forward plan"):
            ext.poetx_layer(x, q_in, q_out, w, perm, perm, perm, perm, rows, cols, bwd, 1, 4, 3, save)
    finally:
        ext.testing_record_native(None)
        ext.poetx_clear()
        from fastdora.poetx import replay

        replay._CONFIGURED.clear()  # the next layer node configures the extension with its own backward again
