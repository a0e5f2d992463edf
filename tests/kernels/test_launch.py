"""The low-overhead Triton launcher (``fastdora._launch``): the first launch of every specialisation goes
through the JIT, later ones through the compiled kernel, and anything Triton specialises on starts a new entry.

The fast path itself needs a GPU (``tests/kernels/test_kernels_gpu.py`` runs every kernel through it); here a
stand-in JIT function records which way each launch went.
"""

from __future__ import annotations

import pytest
import torch

launch = pytest.importorskip("fastdora._launch")


class _Compiled:
    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert (function, packed, stream) == ("fn-handle", "packed", 7)
        self.log.append(("fast", (g0, g1, g2), args))


class _Jit:
    def __init__(self, compiled_cls=_Compiled):
        self.log = []
        self.compiled_cls = compiled_cls

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.log.append(("jit", grid, args, num_warps))
            return self.compiled_cls(self.log)

        return run


def _fast_launcher(monkeypatch, knobs, compiled_cls):
    """A Launcher on the fast path over a stand-in JIT whose compiled kernels are ``compiled_cls``."""
    monkeypatch.setattr(launch, "_raw_stream", lambda dev: 7)
    monkeypatch.setattr(launch, "_knobs", knobs)
    fn = _Jit(compiled_cls)
    launcher = launch.Launcher(fn)
    launcher.fast = True  # the stand-in is no JITFunction
    return fn, launcher


class _Knobs:
    class runtime:
        launch_enter_hook = None
        launch_exit_hook = None


def test_first_launch_per_specialisation_compiles_then_reuses(monkeypatch):
    fn, launcher = _fast_launcher(monkeypatch, _Knobs, _Compiled)
    a = torch.zeros(64)
    b = torch.zeros(64, dtype=torch.bfloat16)
    calls = [
        ((2,), (a, b), (64,), (0.5,), (True, 16), 4, "jit"),
        ((3, 2), (a, b), (64,), (0.7,), (True, 16), 4, "fast"),  # same specialisation (floats are not specialised)
        ((3,), (a, b), (48,), (0.7,), (True, 16), 4, "fast"),  # 48: still a multiple of 16 in int32
        ((3,), (a, b), (1,), (0.7,), (True, 16), 4, "jit"),  # == 1
        ((3,), (a, b), (40,), (0.7,), (True, 16), 4, "jit"),  # not a multiple of 16
        ((3,), (a, b), (2**31,), (0.7,), (True, 16), 4, "jit"),  # int64
        ((3,), (a[1:], b), (64,), (0.7,), (True, 16), 4, "jit"),  # pointer not 16-byte aligned
        ((3,), (a, a), (64,), (0.7,), (True, 16), 4, "jit"),  # dtype
        ((3,), (a, b), (64,), (0.7,), (False, 16), 4, "jit"),  # constexpr value
        ((3,), (a, b), (64,), (0.7,), (True, 16), 8, "jit"),  # num_warps
        ((3,), (a, b), (40,), (0.7,), (True, 16), 4, "fast"),  # cached above
    ]
    for grid, tensors, ints, floats, consts, warps, _ in calls:
        launcher(grid, tensors, ints, floats, consts, warps)
    assert [e[0] for e in fn.log] == [c[-1] for c in calls]
    # JIT launches get every argument positionally (pointers, ints, floats, constexprs); fast ones a 3-D grid too
    kind, grid, args, warps = fn.log[0]
    assert grid == (2, 1, 1) and warps == 4 and len(args) == 6 and args[0] is a and args[2:] == (64, 0.5, True, 16)
    # fast launches: the pointers as integers (Triton's launcher takes them as they are), then the rest
    kind, grid, args = fn.log[1]
    assert grid == (3, 2, 1) and args == (a.data_ptr(), b.data_ptr(), 64, 0.7, True, 16)


def test_fast_launch_passes_tensors_to_launch_hooks(monkeypatch):
    """With a launch hook installed (a profiler), the fast path hands it the tensors and Triton's launch metadata,
    as a JIT launch would."""
    seen = []

    class _HookKnobs:
        class runtime:
            launch_enter_hook = staticmethod(lambda meta: seen.append(meta))
            launch_exit_hook = None

    class _MetaCompiled(_Compiled):
        def launch_metadata(self, grid, stream, *args):
            return ("meta", grid, args)

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
            enter(meta)
            self.log.append(("fast", (g0, g1, g2), args))

    fn, launcher = _fast_launcher(monkeypatch, _HookKnobs, _MetaCompiled)
    a = torch.zeros(64)
    for _ in range(2):
        launcher((2,), (a,), (64,), (0.5,), (True,), 4)
    assert [e[0] for e in fn.log] == ["jit", "fast"]
    assert fn.log[1][2][0] is a and seen == [("meta", (2, 1, 1), (a, 64, 0.5, True))]


def test_empty_hook_chains_count_as_no_hooks(monkeypatch):
    """Triton >= 3.5 keeps (empty) hook chains in ``knobs.runtime``: those are no hooks (no metadata, none passed),
    a chain with a hook in it is one."""

    class _Chain:
        def __init__(self, calls):
            self.calls = calls

        def __call__(self, meta):
            for c in self.calls:
                c(meta)

    seen = []

    class _ChainKnobs:
        class runtime:
            launch_enter_hook = _Chain([])
            launch_exit_hook = _Chain([])

    class _HookCompiled(_Compiled):
        def launch_metadata(self, grid, stream, *args):
            return "meta"

        def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
            self.log.append(("fast", meta, enter, args[0]))
            if enter is not None:
                enter(meta)

    fn, launcher = _fast_launcher(monkeypatch, _ChainKnobs, _HookCompiled)
    a = torch.zeros(64)
    for _ in range(2):
        launcher((2,), (a,), (64,), (0.5,), (True,), 4)
    assert fn.log[1] == ("fast", None, None, a.data_ptr())
    _ChainKnobs.runtime.launch_enter_hook.calls.append(seen.append)
    launcher((2,), (a,), (64,), (0.5,), (True,), 4)
    assert fn.log[2][1] == "meta" and fn.log[2][3] is a and seen == ["meta"]


def test_not_fast_launches_everything_through_the_jit():
    fn = _Jit()
    launcher = launch.Launcher(fn)
    assert launcher.fast is False  # not a JITFunction
    for _ in range(3):
        launcher((1,), (torch.zeros(4),), (4,), (), (True,), 4)
    assert [e[0] for e in fn.log] == ["jit"] * 3


def test_fast_launch_detected_for_the_installed_triton():
    triton = pytest.importorskip("triton")
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) >= (3, 4):
        # Triton 3.4 ... 3.9 pass every bound argument (constexprs included) to CompiledKernel.run
        assert launch.FAST_LAUNCH


class _Recorded:
    """A compiled kernel whose ``run`` logs its launches (grid, stream, arguments)."""

    def __init__(self, log):
        self.log = log

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, exit_, *args):
        assert (function, packed, meta, enter, exit_) == ("fn", "packed", None, None, None)
        self.log.append(((g0, g1, g2), stream, args))


def _entry(log):
    return (_Recorded(log), "fn", "packed")


def test_replay_maps_pointers_to_named_tensors_and_their_offsets():
    log = []
    a, b = torch.empty(64, dtype=torch.float32), torch.empty(8, 16, dtype=torch.bfloat16)
    view = b[4:]  # a pointer inside b: offset 4 rows of 16 bf16 = 128 bytes
    recorded = [(_entry(log), (3, 1, 1), (a.data_ptr(), view.data_ptr(), a.data_ptr()), (64, 5), (0.5,), (True, 32)),
                (_entry(log), (2, 2, 1), (b.data_ptr(),), (), (), (16,))]
    replay = launch.Replay.build(recorded, (a, b))
    assert replay is not None
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    replay((a2, b2), 11)
    assert log == [((3, 1, 1), 11, (a2.data_ptr(), b2.data_ptr() + 128, a2.data_ptr(), 64, 5, 0.5, True, 32)),
                   ((2, 2, 1), 11, (b2.data_ptr(), 16))]


def test_replay_refuses_what_it_cannot_replay():
    log = []
    a, other = torch.empty(64), torch.empty(64)
    ok = (_entry(log), (1, 1, 1), (a.data_ptr(),), (), (), ())
    assert launch.Replay.build([ok], (a,)) is not None
    assert launch.Replay.build([ok, None], (a,)) is None  # a launch through the JIT
    assert launch.Replay.build([(_entry(log), (1, 1, 1), (other.data_ptr(),), (), (), ())], (a,)) is None  # unnamed
    assert launch.Replay.build([(_entry(log), (1, 1, 1), (a.data_ptr() + 4,), (), (), ())], (a,)) is None  # unaligned
    assert launch.Replay.build([], (a,)) is None


def test_replay_applies_only_to_aligned_tensors_without_hooks(monkeypatch):
    a = torch.empty(64)
    assert launch.Replay.applies((a,)) == (not launch.hooks_active())
    assert not launch.Replay.applies((a, a[1:]))  # a base pointer 4 bytes past an aligned one


def test_recording_collects_the_launches_of_its_block(monkeypatch):
    fn, launcher = _fast_launcher(monkeypatch, _Knobs, _Compiled)
    t = torch.empty(16)
    launcher((1,), (t,), (16,), (), (8,), 4)  # outside any recording
    with launch.recording() as rec:
        launcher((1,), (t,), (16,), (), (8,), 4)  # a cache hit
        launcher((2,), (t,), (16,), (), (4,), 4)  # a new specialisation: compiled, then recorded too
        with launch.recording() as inner:
            launcher((1,), (t,), (16,), (), (8,), 4)
    assert len(rec) == 2 and len(inner) == 1
    assert [r[1] for r in rec] == [(1, 1, 1), (2, 1, 1)] and rec[0][2] == [t.data_ptr()] and rec[1][5] == (4,)
    slow = launch.Launcher(_Jit())  # not on the fast path: nothing to replay
    slow.fast = False
    with launch.recording() as rec:
        slow((1,), (t,), (), (), (), 4)
    assert rec == [None]


def test_pdl_kernels_get_the_flag_and_the_launch_option(monkeypatch):
    """A ``Launcher(fn, pdl=True)`` passes :func:`pdl_applies` of its first tensor as the kernel's last constexpr and,
    where it is True, compiles the kernel with ``launch_pdl``; the two are separate specialisations. Off a CUDA
    device (or with ``PDL`` off) it is False."""

    class _PdlJit(_Jit):
        def __getitem__(self, grid):
            def run(*args, num_warps, **opts):
                self.log.append(("jit", grid, args, num_warps, opts))
                return self.compiled_cls(self.log)

            return run

    monkeypatch.setattr(launch, "_raw_stream", lambda dev: 7)
    monkeypatch.setattr(launch, "_knobs", _Knobs)
    fn = _PdlJit()
    launcher = launch.Launcher(fn, pdl=True)
    launcher.fast = True
    t = torch.empty(16)
    assert not launch.pdl_applies(t)  # a CPU tensor
    launcher((1,), (t,), (16,), (), (8,), 4)
    monkeypatch.setattr(launch, "pdl_applies", lambda x: True)
    launcher((1,), (t,), (16,), (), (8,), 4)  # a new specialisation: compiled with the launch option
    launcher((1,), (t,), (16,), (), (8,), 4)  # a cache hit
    jit = [e for e in fn.log if e[0] == "jit"]
    assert [e[2] for e in jit] == [(t, 16, 8, False), (t, 16, 8, True)]
    assert jit[0][4] == {} and jit[1][4] == {"launch_pdl": True}
    assert fn.log[-1][0] == "fast" and fn.log[-1][2][-1] is True
    monkeypatch.undo()  # the real pdl_applies
    monkeypatch.setattr(launch, "PDL", False)
    if torch.cuda.is_available():
        assert not launch.pdl_applies(torch.empty(1, device="cuda"))
