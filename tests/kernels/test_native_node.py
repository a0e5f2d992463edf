"""The composition's C++ autograd node (``fastdora.kernels.native``) against the Python node it replaces.

The node launches the same Triton kernels with the same arguments as the Python ``autograd.Function``; every output
and gradient must be bitwise equal to the Python node's (which tests/kernels/test_kernels_interpret.py and
tests/kernels/test_kernels_gpu.py compare with the eager and fp64 references), on the template path (a key's later
calls) and on the Python fallback (first calls, unaligned or strided inputs). CPU: the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, this module re-runs itself in a subprocess with it set), where templates pass
tensors instead of pointers to the same launch code. GPU tests (``-m gpu``): the compiled launcher, PEFT models under
AMP and pure bf16, gradient checkpointing.

The extension is built into a temporary ``FASTDORA_CACHE_DIR`` with the C++ compiler (``c++``): a missing compiler
fails these tests (``FASTDORA_NATIVE=1``), as it would leave the node untested.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from fastdora import config as _config

from ..interpreter import INNER as _INNER
from ..interpreter import run_suite


def _node_env(tmp: str) -> dict:
    return dict(os.environ, FASTDORA_CACHE_DIR=tmp, FASTDORA_NATIVE="1", PYTHONUNBUFFERED="1")


def _triton():
    """The Triton implementation (``fastdora.ops.compose.triton_impl()``); building it registers the Python fallbacks
    the C++ node needs before ``native.node()``."""
    from fastdora.ops import compose as oc

    return oc.triton_impl()


# ---------------------------------------------------------------------------------------------- parent-level tests

if not _INNER:

    @pytest.fixture(scope="module")
    def cache_dir(tmp_path_factory):
        """One build for this module: the interpreter suite's subprocess builds, the layout test imports it."""
        return str(tmp_path_factory.mktemp("fastdora_cache"))

    def test_interpreter_suite(cache_dir):
        pytest.importorskip("triton")
        run_suite(__file__, env=_node_env(cache_dir), timeout=1200)

    def test_native_mode_parsing(monkeypatch):
        # FASTDORA_NATIVE is read when the settings are made (once per process, at import): a fresh Settings reads it
        for raw, want in (("", "auto"), ("auto", "auto"), ("1", "1"), ("on", "1"), ("0", "0"), ("off", "0")):
            monkeypatch.setenv("FASTDORA_NATIVE", raw)
            assert _config.Settings().native == want
        monkeypatch.setenv("FASTDORA_NATIVE", "sometimes")
        with pytest.raises(ValueError, match="FASTDORA_NATIVE"):
            _config.Settings()

    def test_build_env(monkeypatch, tmp_path):
        monkeypatch.setenv("FASTDORA_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CXX", "my-c++")
        assert _config.native_build_env() == (str(tmp_path), "my-c++")
        monkeypatch.delenv("FASTDORA_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
        assert _config.native_build_env()[0] == str(tmp_path / "x" / "fastdora")

    class _FakeCompiled:
        """Stands in for Triton's ``CompiledKernel``: records the arguments of every ``run`` call."""

        function, packed_metadata = 0xF00D, ("packed",)

        def __init__(self):
            self.calls = []

        def run(self, *args):
            self.calls.append(args)

        def launch_metadata(self, *args):
            return None

    def test_compiled_template_argument_layout(cache_dir, monkeypatch):
        """The C++ node's launches through a compiled-launcher template pass Triton's launcher exactly the arguments
        the Python launcher (``_launch.Launcher``'s direct path) passes for the same call: grid, function, metadata,
        the same tensor in every pointer slot, ints, scalars, constexprs (CPU: a fake compiled kernel records both;
        the stream slot is the current CUDA stream on a GPU, None here)."""
        pytest.importorskip("triton")
        monkeypatch.setenv("FASTDORA_CACHE_DIR", cache_dir)
        from fastdora import _launch
        from fastdora.kernels import compose as kc
        from fastdora.kernels import native

        if not (kc._FWD.fast and kc._BWD.fast):
            pytest.skip("this Triton has no direct launch path")
        _triton()
        fakes = {}

        def fake_jit(self, grid, tensors, *rest, **kw):  # the first launch of a key "compiles"
            return fakes.setdefault(id(self), _FakeCompiled())

        monkeypatch.setattr(_launch.Launcher, "_jit", fake_jit)
        monkeypatch.setattr(_launch, "_raw_stream", lambda idx: 1234)
        for launcher in (kc._FWD, kc._BWD):
            monkeypatch.setattr(launcher, "cache", {})
        saved_node = native.NODE
        with _config.override(native="1"):
            mod = native.node(required=True)
        mod.testing_host_templates(True)
        try:
            for dname in ("fp32", "mixed", "bf16"):
                for bias in (False, True):
                    rdt, ldt = DTYPES[dname]
                    prob = _problem((24, 48), rdt, ldt, bias, "cpu", seed=4)
                    known = {t.data_ptr(): name for name, t in zip(("result", "lora", "mag", "norm", "bias", "dy"),
                                                                    prob) if t is not None}
                    _run(native, True, prob, rdt)  # registers this key's templates (through the fake compile)
                    recs = {}
                    for use_node in (False, True):
                        for f in fakes.values():
                            f.calls.clear()
                        fast = mod.stats()["fast"]
                        _run(native, use_node, prob, rdt)
                        if use_node:
                            assert mod.stats()["fast"] == fast + 2, "templates not used"
                        for c in kc._COUNTERS.values():
                            known[c.data_ptr()] = "counters"
                        recs[use_node] = [call for f in (fakes[id(kc._FWD)], fakes[id(kc._BWD)]) for call in f.calls]
                    py, cpp = recs[False], recs[True]
                    assert len(py) == len(cpp) == 2, (len(py), len(cpp))
                    for (a, b), what in zip(zip(py, cpp), ("forward", "backward")):
                        assert len(a) == len(b), what
                        n_ptr = 8 if what == "forward" else 12
                        for i, (x, y) in enumerate(zip(a, b)):
                            if i == 3:
                                assert x == 1234 and y is None, (what, i, x, y)  # the stream slot
                            elif 9 <= i < 9 + n_ptr:  # pointer slots: the same input, or both a fresh output
                                lx, ly = known.get(x, "fresh"), known.get(y, "fresh")
                                assert lx == ly, f"{dname} bias={bias} {what} slot {i}: {lx} vs {ly}"
                            else:
                                assert type(x) is type(y) and x == y, f"{dname} bias={bias} {what} arg {i}: {x} vs {y}"
        finally:
            mod.testing_host_templates(False)
            native.clear_templates()
            native.NODE = saved_node

    def test_native_launch_env(monkeypatch):
        # read when the settings are made (once per process, at import): a fresh Settings reads it
        for raw, want in (("", True), ("1", True), ("0", False), ("off", False)):
            monkeypatch.setenv("FASTDORA_NATIVE_LAUNCH", raw)
            assert _config.Settings().native_launch is want
        monkeypatch.setenv("FASTDORA_NATIVE_LAUNCH", "maybe")
        with pytest.raises(ValueError, match="FASTDORA_NATIVE_LAUNCH"):
            _config.Settings()

    _TRITON_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32"}

    class _Meta:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _FakeSignedCompiled(_FakeCompiled):
        """A fake ``CompiledKernel`` with what the direct launch reads: the source's signature as Triton 3.3+ writes
        it (constexprs, and ints equal to 1, as ``"constexpr"`` with their value in ``constants``), the function
        handle and the launch metadata."""

        def __init__(self, fn, tensors, ints, floats, consts, num_warps, handle):
            super().__init__()
            names = list(fn.arg_names)
            kinds = ([_TRITON_PTR[t.dtype] for t in tensors] + ["constexpr" if i == 1 else "i32" for i in ints]
                     + ["fp32"] * len(floats) + ["constexpr"] * len(consts))
            assert len(kinds) == len(names), (len(kinds), names)
            values = list(tensors) + list(ints) + list(floats) + list(consts)
            sig = dict(zip(names, kinds))
            self.src = _Meta(fn=fn, signature=sig,
                             constants={(i,): v for i, (k, v) in enumerate(zip(kinds, values)) if k == "constexpr"})
            self.metadata = _Meta(num_warps=num_warps, num_ctas=1, shared=1000 + num_warps, global_scratch_size=0,
                                  profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False)
            self.function = handle

    def _expected_params(sig_types, call_args, label):
        """Triton's CUDA launcher's parameter array for one ``CompiledKernel.run`` call, written out here from its
        generated C (backends/nvidia/driver.py): each non-constexpr signature entry in order -- a pointer's device
        address, an int as int32, a float rounded to fp32 -- then the global and profile scratch pointers (null)."""
        import struct
        out = []
        for ty, v in zip(sig_types, call_args[9:]):
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                out.append(("ptr", label(v)))
            elif ty == "i32":
                out.append(("bytes", struct.pack("<i", v) + b"\0" * 4))
            else:
                out.append(("bytes", struct.pack("<f", v) + b"\0" * 4))
        return out + [("bytes", b"\0" * 8)] * 2

    def test_direct_launch_parameter_layout(cache_dir, monkeypatch):
        """The C++ node's direct launches (cuLaunchKernel; recorded here instead of made) pass exactly the
        parameters Triton's launcher would get from the Python launcher for the same call (``_expected_params``,
        from the recorded ``run`` arguments), with its function, grid, block (32 * warps) and shared memory; an int
        argument equal to 1 (a constexpr to Triton) is left out; ``set_native_launch(False)`` goes through Triton's
        launcher again. (Without a CUDA device the node leaves the direct launch off; the test turns it on.)"""
        import struct
        pytest.importorskip("triton")
        monkeypatch.setenv("FASTDORA_CACHE_DIR", cache_dir)
        from fastdora import _launch
        from fastdora.kernels import compose as kc
        from fastdora.kernels import native

        if not (kc._FWD.fast and kc._BWD.fast):
            pytest.skip("this Triton has no direct launch path")
        _triton()
        compiled = []

        def fake_jit(self, grid, tensors, ints, floats, consts, num_warps, *rest, **kw):
            c = _FakeSignedCompiled(self.fn, tensors, ints, floats, consts, num_warps, 0xF000 + len(compiled))
            compiled.append(c)
            return c

        monkeypatch.setattr(_launch.Launcher, "_jit", fake_jit)
        monkeypatch.setattr(_launch, "_raw_stream", lambda idx: 1234)
        for launcher in (kc._FWD, kc._BWD):
            monkeypatch.setattr(launcher, "cache", {})
        saved_node = native.NODE
        with _config.override(native="1"):
            mod = native._state["module"] or native.node(required=True)  # (another test may have unset NODE)
        native.NODE = mod
        mod.testing_host_templates(True)
        mod.set_native_launch(True)
        records: list = []
        try:
            for dname, shape in (("fp32", (24, 48)), ("mixed", (1, 32)), ("bf16", (24, 48))):
                for bias in (False, True):
                    rdt, ldt = DTYPES[dname]
                    prob = _problem(shape, rdt, ldt, bias, "cpu", seed=5)
                    known = {t.data_ptr(): name for name, t in zip(("result", "lora", "mag", "norm", "bias", "dy"),
                                                                    prob) if t is not None}
                    _run(native, True, prob, rdt)  # the first call registers this key's templates
                    for c in compiled:
                        c.calls.clear()
                    _run(native, False, prob, rdt)  # the Python node: Triton launcher calls to compare with
                    for c in kc._COUNTERS.values():
                        known[c.data_ptr()] = "counters"
                    label = lambda v: known.get(v, "fresh")  # noqa: E731
                    py = [(c, call) for c in compiled for call in c.calls]
                    assert len(py) == 2
                    mod.testing_record_native(records)
                    records.clear()
                    before = mod.stats()
                    _run(native, True, prob, rdt)
                    mod.testing_record_native(None)
                    after = mod.stats()
                    assert after["native"] == before["native"] + 2 and after["fast"] == before["fast"] + 2
                    assert len(records) == 2
                    for (c, call), rec in zip(sorted(py, key=lambda x: x[0].function), sorted(records)):
                        function, grid, block, shared, stream, params, pdl = rec
                        what = f"{dname} bias={bias} fn={hex(function)}"
                        assert function == c.function and grid == tuple(call[:3]), what
                        assert block == 32 * c.metadata.num_warps and shared == c.metadata.shared, what
                        assert stream == 0, what  # CPU tensors: no stream
                        assert pdl is False, what  # the DoRA kernels launch plainly
                        want = _expected_params(list(c.src.signature.values()), call, label)
                        got = [params[i:i + 8] for i in range(0, len(params), 8)]
                        assert len(got) == len(want), (what, len(got), len(want))
                        for k, ((kind, w), g) in enumerate(zip(want, got)):
                            if kind == "ptr":
                                assert label(struct.unpack("<Q", g)[0]) == w, f"{what} param {k}"
                            else:
                                assert g == w, f"{what} param {k}: {g.hex()} vs {w.hex()}"
                    if shape[0] == 1:  # M == 1: a constexpr to Triton, left out of the parameters
                        assert any("constexpr" == t for c, _ in py for t in list(c.src.signature.values())[8:9])
            # switched off: the same templates go through Triton's launcher (the fake's run) again
            mod.set_native_launch(False)
            for c in compiled:
                c.calls.clear()
            before = mod.stats()
            _run(native, True, prob, rdt)
            assert mod.stats()["native"] == before["native"] and mod.stats()["fast"] == before["fast"] + 2
            assert sum(len(c.calls) for c in compiled) == 2
        finally:
            # back to what the node decided when it was loaded (on a GPU: the direct launch on, for the tests after)
            mod.set_native_launch(native.launch_status() == "direct")
            mod.testing_record_native(None)
            mod.testing_host_templates(False)
            native.clear_templates()
            native.NODE = saved_node

    def test_native_layout_refusals():
        """``_native_layout`` derives a layout only for Triton's launcher's plain path; anything else (clusters,
        cooperative / PDL launches, scratch memory, tensor descriptors, instrumentation, tuple or unknown argument
        types, a specialised non-constexpr entry, a signature of another length) keeps Triton's launcher."""
        from types import SimpleNamespace as NS

        from fastdora.kernels import native

        fn = NS(arg_names=["p", "n", "s", "B"])

        def make(sig=None, constants=None, **md):
            meta = dict(num_warps=4, num_ctas=1, shared=0, global_scratch_size=0, profile_scratch_size=0)
            meta.update(md)
            return NS(function=7, metadata=NS(**meta),
                      src=NS(fn=fn, signature=sig or {"p": "*bf16", "n": "i32", "s": "fp32", "B": "constexpr"},
                             constants={(3,): 64} if constants is None else constants))

        roles, values = (native.ROLES_FWD.index("result"), native.COPY, native.SCALE, native.COPY), (0, 7, 0.5, 64)
        ok = native._native_layout(make(), (3, 2, 1), values, roles)
        assert ok == (7, (3, 2, 1), 128, 0, (0, native.COPY, native.SCALE, native.COPY, native.COPY), b"pifpp",
                      (0, 7, 0, 0, 0))
        assert native._native_layout(make(sig={"p": "*bf16", "n": "i64", "s": "fp64", "B": "constexpr"}), (1, 1, 1),
                                     (0, -2, 0.5, 64), roles)[5:] == (b"pidpp", (0, 2**64 - 2, 0, 0, 0))
        no_profile = make()
        del no_profile.metadata.profile_scratch_size  # an older Triton: one scratch pointer
        assert native._native_layout(no_profile, (1, 1, 1), values, roles)[5] == b"pifp"
        for bad in (make(num_ctas=2), make(launch_pdl=True), make(launch_cooperative_grid=True),
                    make(global_scratch_size=16), make(profile_scratch_size=8), make(tensordesc_meta=[{}]),
                    make(instrumentation_mode="gsan"),
                    make(sig={"p": "*bf16", "n": ("i32", "i32"), "s": "fp32", "B": "constexpr"}),
                    make(sig={"p": "*bf16", "n": "bf16x", "s": "fp32", "B": "constexpr"}),
                    make(constants={(3,): 64, (1,): 7}), make(sig={"p": "*bf16", "n": "i32", "s": "fp32"})):
            assert native._native_layout(bad, (1, 1, 1), values, roles) is None
        assert native._native_layout(make(), (1, 1, 1), values, (native.COPY,) + roles[1:]) is None  # a bare pointer
        assert native._native_layout(make(), (1, 1, 1), values, roles[:2] + (native.COPY,) * 0 + (0,) + roles[3:]) \
            is None  # a tensor role on a float

    @pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only report")
    def test_enable_report_names_the_node_cpu():
        import fastdora
        from torch import nn
        from peft import LoraConfig, get_peft_model

        pm = get_peft_model(nn.Sequential(nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"], use_dora=True))
        rep = fastdora.enable(pm)
        assert rep.native_node == "not used (no CUDA device)" and "C++ composition node: not used" in str(rep)
        assert fastdora.enable(pm, kernels="eager").native_node == "not used (kernels='eager')"

    def _child(code: str, env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)

    def test_unbuildable_node_reports_why(tmp_path):
        """No compiler: ``auto`` keeps the Python node and says why; ``FASTDORA_NATIVE=1`` raises, naming it."""
        pytest.importorskip("triton")
        env = dict(_node_env(str(tmp_path)), CXX=str(tmp_path / "no-such-compiler"), FASTDORA_NATIVE="auto")
        setup = "import fastdora.kernels.native as n, fastdora.ops.compose as oc; oc.triton_impl()\n"
        code = setup + ("assert n.node() is None and n.NODE is None\n"
                        "print('STATUS', n.status())\n")
        proc = _child(code, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "STATUS unavailable" in proc.stdout and "no-such-compiler" in proc.stdout
        proc = _child(setup + "n.node()", dict(env, FASTDORA_NATIVE="1"))
        assert proc.returncode != 0 and "C++ composition node is unavailable" in proc.stderr
        proc = _child(setup + "assert n.node() is None; print(n.status())", dict(env, FASTDORA_NATIVE="0"))
        assert proc.returncode == 0 and "FASTDORA_NATIVE=0" in proc.stdout


# ------------------------------------------------------------------------------ shared: the bitwise A/B machinery

if _INNER or torch.cuda.is_available():
    pytest.importorskip("triton")


def _problem(shape, rdt, ldt, bias, device, seed=1, offset=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]

    def mk(s, dt):
        t = torch.randn(s, generator=g).to(dt)
        if offset:  # a view whose data pointer is `offset` elements past an allocation: unaligned
            t = torch.cat([torch.zeros(offset, dtype=dt), t.reshape(-1)])[offset:].view(s)
        return t.to(device)

    result = mk(shape, rdt).requires_grad_()
    lora = mk(shape, ldt).requires_grad_()
    mag = (torch.rand(n, generator=g) + 0.5).to(device).requires_grad_()
    norm = (torch.rand(n, generator=g) + 0.5).to(device)
    b = mk((n,), rdt) if bias else None
    dy = mk(shape, rdt)
    return result, lora, mag, norm, b, dy


def _run(native, use_node, prob, out_dtype, scale=0.73, eps=1e-6, need=(True, True, True)):
    """One composition forward + backward through the C++ node (``use_node``) or the Python node."""
    # detach, no clone: the same data pointers and strides (the unaligned / strided cases)
    result, lora, mag, norm, bias, dy = [t.detach() if t is not None else None for t in prob]
    for t, want in zip((result, lora, mag), need):
        t.requires_grad_(want)
    saved = native.NODE
    native.NODE = saved if use_node else None
    try:
        y = _triton().apply(result, lora, mag, norm, bias, None, scale, eps, out_dtype)
        assert (type(y.grad_fn).__name__ == "CppFunction") == use_node, type(y.grad_fn).__name__
        y.backward(dy)
    finally:
        native.NODE = saved
    return [y.detach()] + [t.grad for t in (result, lora, mag)]


def _assert_bitwise(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what}: output {i} presence differs"
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, (
                f"{what}: output {i} {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
            assert torch.equal(x, y), f"{what}: output {i} differs (max {(x.double() - y.double()).abs().max()})"


DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "mixed": (torch.bfloat16, torch.float32),  # AMP: bf16 result, fp32 lora
}


def _assert_template_launches(native, before, device, what, n=2):
    """The last call's ``n`` launches went through templates; on a GPU, directly (cuLaunchKernel)."""
    after = native.NODE.stats()
    assert after["fast"] == before["fast"] + n, what + ": the templates were not used"
    if device == "cuda":
        assert after["direct"], "the direct launch is not active: " + native.launch_status()
        assert after["native"] == before["native"] + n, what + ": the templates were not launched directly"


def _ab_cases(native, device, shapes):
    """Every dtype x bias x shape: the first call (Python fallback, registers templates) and the second (templates)
    through the C++ node, both bitwise equal to the Python node; the second call must have used the templates."""
    for dname, (rdt, ldt) in DTYPES.items():
        for bias in (False, True):
            for shape in shapes:
                prob = _problem(shape, rdt, ldt, bias, device)
                ref = _run(native, False, prob, rdt)
                first = _run(native, True, prob, rdt)
                before = native.NODE.stats()
                second = _run(native, True, prob, rdt)
                what = f"{dname} bias={bias} shape={shape}"
                _assert_bitwise(first, ref, what + " (first call)")
                _assert_bitwise(second, ref, what + " (templates)")
                _assert_template_launches(native, before, device, what)


# ----------------------------------------------------------------------------------- interpreter (CPU) node tests

if _INNER:
    from fastdora.kernels import compose as kc
    from fastdora.kernels import native

    TRITON = _triton()  # registers the node's Python fallbacks

    @pytest.fixture(scope="module", autouse=True)
    def _node():
        mod = native.node(required=True)
        assert native.status() == "active"
        yield mod
        native.reset()  # later test modules in this process (CPU tensors) get the Python node again

    def test_bitwise_vs_python_node():
        _ab_cases(native, "cpu", [(1, 16), (7, 17), (33, 48), (2, 3, 40)])

    @pytest.mark.parametrize("need", [(False, True, True), (True, False, True), (True, True, False),
                                      (False, False, True), (True, False, False)])
    def test_partial_input_grads(need):
        """Only the gradients autograd asks for; those bitwise the Python node's (which computes all)."""
        for dname in ("fp32", "mixed"):
            rdt, ldt = DTYPES[dname]
            prob = _problem((9, 24), rdt, ldt, True, "cpu", seed=3)
            ref = _run(native, False, prob, rdt, need=need)
            for _ in range(2):
                got = _run(native, True, prob, rdt, need=need)
                _assert_bitwise(got, ref, f"{dname} need={need}")

    def test_unaligned_and_strided_inputs_fall_back():
        """An unaligned data pointer or a non-contiguous input takes the Python launchers (same values)."""
        for dname in ("fp32", "bf16"):
            rdt, ldt = DTYPES[dname]
            prob = _problem((10, 32), rdt, ldt, False, "cpu", offset=1)
            assert prob[0].data_ptr() % 16 != 0
            ref = _run(native, False, prob, rdt)
            slow = native.NODE.stats()["slow"]
            _assert_bitwise(_run(native, True, prob, rdt), ref, dname + " unaligned")
            assert native.NODE.stats()["slow"] >= slow + 1
            base = _problem((10, 64), rdt, ldt, False, "cpu", seed=5)
            strided = [None if t is None else (t[:, ::2] if t.dim() == 2 else t[:32]) for t in base]
            _assert_bitwise(_run(native, True, strided, rdt), _run(native, False, strided, rdt),
                            dname + " strided")

    def test_template_registered_once_per_launch_configuration(monkeypatch):
        """A launch that would build the same template again registers nothing (every inference composition launches
        from Python); a launch of the same key with another configuration replaces it, dropped templates come back.
        The node then launches through each template (its results bitwise the Python node's)."""
        mod = native.NODE
        calls = []

        class Recording:
            def __getattr__(self, name):
                return getattr(mod, name)

            def register(self, *args):
                calls.append(args[:6])
                return mod.register(*args)

        monkeypatch.setattr(native, "NODE", Recording())
        native.clear_templates()
        prob = _problem((12, 40), torch.bfloat16, torch.bfloat16, False, "cpu", seed=11)
        result, lora, mag, norm = (t.detach() for t in prob[:4])

        def infer():  # what dora_compose's inference path runs on the kernel path
            with torch.no_grad():
                return TRITON.compose_fwd(result, lora, mag, norm, 0.5, 1e-6, None, None, torch.bfloat16, False)

        infer()
        assert [c[0] for c in calls] == [0], calls  # the forward's template
        for _ in range(3):
            infer()
        assert len(calls) == 1, "re-registered an identical template"
        ref = _run(native, False, prob, torch.bfloat16)  # training: its own keys (saving inner; the backward)
        _run(native, True, prob, torch.bfloat16)  # first calls of those keys: the Python launchers register
        n, fast = len(calls), mod.stats()["fast"]
        assert n == 3, calls
        _assert_bitwise(_run(native, True, prob, torch.bfloat16), ref, "through the registered templates")
        assert mod.stats()["fast"] == fast + 2 and len(calls) == n
        cfg = kc._fwd_config(12, 40, result.device)
        monkeypatch.setattr(kc, "_fwd_config", lambda M, N, dev: (cfg[0] * 2, cfg[1], cfg[2]))
        infer()
        assert len(calls) == n + 1 and calls[-1][0] == 0, "another launch configuration must replace the template"
        native.clear_templates()
        infer()
        assert len(calls) == n + 2, "dropped templates must be registered again"

    def test_eps_scale_and_out_dtype_are_per_call():
        """Scalars fill the template per call (a key's template is shared by layers with other scales)."""
        prob = _problem((8, 32), torch.float32, torch.float32, False, "cpu", seed=7)
        for scale, eps in ((0.5, 1e-6), (2.0, 1e-12), (0.125, 1e-3)):
            _assert_bitwise(_run(native, True, prob, torch.float32, scale, eps),
                            _run(native, False, prob, torch.float32, scale, eps), f"scale={scale} eps={eps}")
        prob = _problem((8, 32), torch.bfloat16, torch.float32, False, "cpu", seed=8)
        _assert_bitwise(_run(native, True, prob, torch.float32), _run(native, False, prob, torch.float32),
                        "fp32 output of bf16 inputs")

    @pytest.mark.parametrize("dname", ["fp32", "bf16", "mixed"])
    def test_checkpointed(dname):
        """Non-reentrant checkpointing: the first forward saves the placeholder (no inner), the recomputation the
        real inner; gradients bitwise those without checkpointing, through the C++ node."""
        from torch.utils.checkpoint import checkpoint

        rdt, ldt = DTYPES[dname]
        prob = _problem((12, 40), rdt, ldt, True, "cpu", seed=11)
        flags = []
        real_fwd = kc.compose_fwd

        def spy(*args, **kw):
            flags.append(args[9])  # save_inner
            return real_fwd(*args, **kw)

        kc.compose_fwd = spy
        try:
            def fn(r, lo, m):
                return TRITON.apply(r, lo, m, prob[3], prob[4], None, 0.6, 1e-6, rdt).float().square()

            res = []
            for use_ckpt in (False, True, True):
                result, lora, mag = [t.detach().clone().requires_grad_() for t in prob[:3]]
                out = checkpoint(fn, result, lora, mag, use_reentrant=False) if use_ckpt else fn(result, lora, mag)
                out.backward(prob[5].float())
                res.append([out.detach(), result.grad, lora.grad, mag.grad])
        finally:
            kc.compose_fwd = real_fwd
        _assert_bitwise(res[1], res[0], dname + " checkpointed (first)")
        _assert_bitwise(res[2], res[0], dname + " checkpointed (templates)")
        # only a key's first call reaches compose_fwd (the Python launcher, which registers the template): the plain
        # forward (inner saved) and the checkpointed first forward (no inner); the recomputation's key (inner saved)
        # is the plain forward's, served by its template like every later call
        assert flags == [True, False], flags

    def test_reference_counts_unchanged():
        """The node hands Python objects across the C API in both directions: many calls through the Python
        fallback (fp64: the eager path, no template) and through templates leave every reference count as it was
        (a borrowed reference stolen by mistake frees ``torch.float64`` after enough calls: a segfault)."""
        dts = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
        cases = [(_problem((4, 16), torch.float64, torch.float64, True, "cpu"), torch.float64),
                 (_problem((4, 16), torch.bfloat16, torch.float32, True, "cpu"), torch.bfloat16)]

        def all_cases():
            for prob, dt in cases:
                _run(native, True, prob, dt)

        all_cases()  # registers what can be registered
        objs = dts + (None, True, False)
        gc.collect()  # pending garbage would drop references to None / True during the loop
        before = [sys.getrefcount(o) for o in objs]
        for _ in range(30):
            all_cases()
        gc.collect()
        after = [sys.getrefcount(o) for o in objs]
        assert after == before, list(zip(objs, before, after))

    def test_placeholder_reaching_backward_raises():
        prob = _problem((6, 16), torch.float32, torch.float32, False, "cpu")
        result, lora, mag = [t.detach().clone().requires_grad_() for t in prob[:3]]
        y = native.NODE.compose(result, lora, mag, prob[3], None, 0.5, 1e-6, torch.float32, True)  # discard
        with pytest.raises(RuntimeError, match="discarded by gradient checkpointing"):
            y.backward(prob[5])

    def test_compiled_autograd_over_the_node():
        """``torch._dynamo.compiled_autograd`` (a trainer's ``torch.compile`` of the backward) over the C++ node:
        the backward runs and gives the Python node's eager gradients bitwise."""
        ca = pytest.importorskip("torch._dynamo.compiled_autograd")
        if not hasattr(ca, "_enable"):
            pytest.skip("this torch has no compiled_autograd._enable")
        prob = _problem((7, 16), torch.float32, torch.float32, False, "cpu")
        ref = _run(native, False, prob, torch.float32)
        result, lora, mag, norm, _, dy = [t.detach() if t is not None else None for t in prob]
        for t in (result, lora, mag):
            t.requires_grad_(True)
        y = TRITON.apply(result, lora, mag, norm, None, None, 0.73, 1e-6, torch.float32)
        assert type(y.grad_fn).__name__ == "CppFunction"
        torch._dynamo.reset()
        try:
            with ca._enable(torch.compile(backend="eager")):
                y.backward(dy)
        finally:
            torch._dynamo.reset()
        _assert_bitwise([y.detach(), result.grad, lora.grad, mag.grad], ref, "compiled autograd, C++ node")

    # (x / base weight, adapters / magnitude) dtypes and CPU autocast of the whole-layer node's cases
    DTYPES_L = {
        "fp32": (torch.float32, torch.float32, False),
        "bf16": (torch.bfloat16, torch.bfloat16, False),  # pure bf16
        "amp": (torch.bfloat16, torch.float32, True),  # HF Trainer's AMP on a bf16 model: fp32 adapters, autocast
        "amp_fp32_model": (torch.float32, torch.float32, True),  # AMP on an fp32 model: autocast casts x and W too
    }

    def _layer_problem(dname, shape, n, r, need=(True, True, True, True), seed=1, bias=False):
        """Two DoRA Linear layers reading one input (q / k style): (x leaf, [(W, A, B, magnitude, norm, base bias or
        None)] * 2, dys)."""
        xdt, adt, _ = DTYPES_L[dname]
        g = torch.Generator().manual_seed(seed)
        k = shape[-1]
        x = torch.randn(shape, generator=g).to(xdt).requires_grad_(need[0])
        layers = []
        for _ in range(2):
            w = (torch.randn(n, k, generator=g) * 0.2).to(xdt)
            a = (torch.randn(r, k, generator=g) * 0.2).to(adt).requires_grad_(need[1])
            b = (torch.randn(n, r, generator=g) * 0.2).to(adt).requires_grad_(need[2])
            m = (torch.rand(n, generator=g) + 0.5).to(adt).requires_grad_(need[3])
            bb = torch.randn(n, generator=g).to(xdt) if bias else None
            layers.append((w, a, b, m, torch.rand(n, generator=g) + 0.5, bb))
        dys = [torch.randn(tuple(shape[:-1]) + (n,), generator=g) for _ in range(2)]
        return x, layers, dys

    def _run_layers(prob, dname, use_layer, ckpt=False, scale=0.7, eps=1e-6, from_y=False):
        """Both layers' forward + backward, as the node's ``dora_linear`` (``use_layer``) or as the separate nodes
        the lean forward runs otherwise (three ``F.linear`` and the C++ composition node); the input goes through
        an op first, so that its two layers' four gradient contributions are accumulated by autograd in order.
        Returns [y0, y1 (or the checkpointed loss), x.grad, then A, B, magnitude grads of each layer]."""
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint

        from fastdora.ops.compose import saves_discarded

        x0, layers, dys = prob
        x0 = x0.detach().requires_grad_(x0.requires_grad)
        layers = [(w, a.detach().requires_grad_(a.requires_grad), b.detach().requires_grad_(b.requires_grad),
                   m.detach().requires_grad_(m.requires_grad), n, bb) for w, a, b, m, n, bb in layers]
        autocast = DTYPES_L[dname][2]

        def fn(x_in):
            x = x_in * 1.0 if x_in.requires_grad else x_in
            outs = []
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                for w, a, b, m, n, bb in layers:
                    if use_layer:
                        discard = saves_discarded()
                        y = native.NODE.dora_linear(x, w, bb, a, b, m, n, scale, eps, discard, from_y)
                    else:
                        res = F.linear(x, w, bb)
                        y = TRITON.apply(res, F.linear(F.linear(x, a), b), m, n, bb, None, scale, eps, res.dtype)
                    assert type(y.grad_fn).__name__ == "CppFunction"
                    outs.append(y)
            return outs

        if ckpt:
            loss = checkpoint(lambda x_in: sum((o.float() * d).sum() for o, d in zip(fn(x_in), dys)), x0,
                              use_reentrant=False)
            outs = [loss]
        else:
            outs = fn(x0)
            loss = sum((o.float() * d).sum() for o, d in zip(outs, dys))
        loss.backward()
        return [o.detach() for o in outs] + [x0.grad] + [t.grad for layer in layers for t in layer[1:4]]

    @pytest.mark.parametrize("dname", list(DTYPES_L))
    def test_layer_node_bitwise_vs_separate_nodes(dname):
        """The whole DoRA Linear layer as one C++ node (``dora_linear``): its output and every gradient (input,
        lora_A, lora_B, magnitude of two layers sharing the input) bitwise those of the separate nodes, plain and
        under non-reentrant checkpointing, at odd shapes incl. one row, rank 1 and one input feature (the layouts
        where autograd's mm derivatives take their column-major branch); first calls and templates."""
        shapes = [((2, 3, 24), 40, 4), ((7, 17), 24, 1), ((1, 24), 16, 1), ((1, 1, 1), 16, 3), ((5, 1), 8, 2)]
        before = native.NODE.stats()["layer"]
        for shape, n, r in shapes:
            for bias in (False, True):  # the base layer's frozen bias
                prob = _layer_problem(dname, shape, n, r, bias=bias)
                for ckpt in (False, True):
                    ref = _run_layers(prob, dname, False, ckpt)
                    for attempt in ("first", "again"):
                        _assert_bitwise(_run_layers(prob, dname, True, ckpt), ref,
                                        f"{dname} {shape} n={n} r={r} bias={bias} ckpt={ckpt} ({attempt})")
        # 2 biases x 2 layers x 2 runs per case; checkpointing: the first forward and the recomputation
        assert native.NODE.stats()["layer"] - before == len(shapes) * 2 * (2 * 2 + 2 * 2 * 2)

    @pytest.mark.parametrize("need", [(False, True, True, True), (True, False, True, True), (True, True, False, True),
                                      (True, True, True, False), (False, False, False, True),
                                      (True, False, False, False), (False, True, False, False)])
    def test_layer_node_partial_input_grads(need):
        """Frozen input / lora_A / lora_B / magnitude: only the requested gradients, bitwise the separate nodes'."""
        for dname in ("fp32", "amp"):
            prob = _layer_problem(dname, (3, 5, 24), 32, 4, need=need, seed=5, bias=True)
            _assert_bitwise(_run_layers(prob, dname, True), _run_layers(prob, dname, False), f"{dname} need={need}")

    def test_layer_node_inference_and_saved_tensors():
        """No grad: the same output as the separate path's inference composition, no graph. With grad: what the
        node saves through the saved-tensor hooks is x, lora_A's output and inner (three activations)."""
        import torch.nn.functional as F

        x, layers, _ = _layer_problem("bf16", (4, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]
        with torch.no_grad():
            y = native.NODE.dora_linear(x, w, None, a, b, m, n, 0.5, 1e-6, False, False)
            res = F.linear(x, w)
            ref = TRITON.compose_fwd(res, F.linear(F.linear(x, a), b), m, n, 0.5, 1e-6, None, None, res.dtype,
                                     False)[0]
        assert y.grad_fn is None and torch.equal(y, ref)
        with torch.inference_mode():  # inference tensors (no version counters)
            xi, wi, ai, bi, mi, ni = (t.clone() for t in (x, w, a, b, m, n))
            assert torch.equal(native.NODE.dora_linear(xi, wi, None, ai, bi, mi, ni, 0.5, 1e-6, False, False), ref)
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            native.NODE.dora_linear(x.detach().requires_grad_(), w, None, a, b, m, n, 0.5, 1e-6, False, False)
        assert packed == [(4, 24), (4, 4), (4, 40)], packed

    @pytest.mark.parametrize("which", ["base", "lora_A", "lora_B"])
    def test_layer_node_weight_modified_in_place_raises(which):
        """A weight the backward reads, changed in place after the forward: autograd's error, naming the weight;
        the same change to a weight no requested gradient reads (lora_A's with a frozen input) is not an error,
        as with the separate nodes (lora_A's node saves its weight only for the input's gradient)."""
        x, layers, dys = _layer_problem("fp32", (4, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]
        weight = {"base": w, "lora_A": a, "lora_B": b}[which]
        y = native.NODE.dora_linear(x, w, None, a, b, m, n, 0.5, 1e-6, False, False)
        with torch.no_grad():
            weight.mul_(2)
        with pytest.raises(RuntimeError, match=f"modified by an inplace operation.*{which}"):
            y.backward(dys[0])
        if which == "lora_A":
            x_frozen = x.detach()
            y = native.NODE.dora_linear(x_frozen, w, None, a, b, m, n, 0.5, 1e-6, False, False)
            with torch.no_grad():
                a.mul_(2)
            y.backward(dys[0])
            assert b.grad is not None and a.grad is not None

    def test_layer_node_placeholder_reaching_backward_raises():
        x, layers, dys = _layer_problem("fp32", (4, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]
        y = native.NODE.dora_linear(x, w, None, a, b, m, n, 0.5, 1e-6, True, False)
        with pytest.raises(RuntimeError, match="discarded by gradient checkpointing"):
            y.backward(dys[0])

    def _dm_reference(prob, dname, scale=0.7, eps=1e-6):
        """fp64 magnitude gradients of ``_run_layers``' two layers: sum_tokens(dy * inner) / max(norm, eps), with
        inner from the layer's inputs in fp64 (dm does not depend on the composition's rounding)."""
        x, layers, dys = prob
        out = []
        for (w, a, b, m, n, bb), dy in zip(layers, dys):
            x64 = x.detach().double().reshape(-1, x.shape[-1])
            inner = x64 @ w.double().t() + scale * (x64 @ a.detach().double().t()) @ b.detach().double().t()
            out.append((dy.double().reshape(inner.shape) * inner).sum(0) / n.double().clamp_min(eps))
        return out

    @pytest.mark.parametrize("dname", list(DTYPES_L))
    def test_layer_node_dm_from_output(dname):
        """``dm_from_y`` (option ``dm_from_output``): the node saves its output y instead of inner and takes the
        magnitude's gradient as sum(dy * y) / m. The output and every other gradient stay bitwise those of the
        separate nodes; the magnitude's gradient is as close to the fp64 value as the separate nodes' (one rounding
        per element either way: y's instead of inner's), plain and checkpointed, at odd shapes. With a base-layer
        bias the flag is ignored (y - bias would cancel): bitwise the separate nodes."""
        shapes = [((2, 3, 24), 40, 4), ((7, 17), 24, 1), ((1, 24), 16, 1), ((5, 1), 8, 2)]
        for shape, n, r in shapes:
            for bias in (False, True):
                prob = _layer_problem(dname, shape, n, r, bias=bias, seed=3)
                for ckpt in (False, True):
                    what = f"{dname} {shape} n={n} r={r} bias={bias} ckpt={ckpt}"
                    ref = _run_layers(prob, dname, False, ckpt)
                    got = _run_layers(prob, dname, True, ckpt, from_y=True)
                    if bias:
                        _assert_bitwise(got, ref, what)
                        continue
                    dm_idx = [len(got) - 4, len(got) - 1]  # each layer's magnitude gradient (A, B, m per layer)
                    keep = [i for i in range(len(got)) if i not in dm_idx]
                    _assert_bitwise([got[i] for i in keep], [ref[i] for i in keep], what)
                    for i, exact in zip(dm_idx, _dm_reference(prob, dname)):
                        err_y = (got[i].double() - exact).abs().max().item()
                        err_inner = (ref[i].double() - exact).abs().max().item()
                        scale_ = exact.abs().max().item()
                        tol = (2e-2 if dname != "fp32" else 1e-5) * scale_ + 1e-6
                        assert err_y <= tol and err_y <= 4 * err_inner + 1e-3 * tol, (what, err_y, err_inner, tol)

    def test_layer_node_dm_from_output_saves_the_output():
        """What the node saves with ``dm_from_y``: x, lora_A's output and the node's output itself (no inner
        written); without autograd's view of it being changed in place, the backward runs; an in-place change of the
        output before the backward is autograd's error, naming the option that switches this off. fp16 keeps inner."""
        x, layers, dys = _layer_problem("bf16", (4, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]
        packed = []

        def pack(t):
            packed.append(t)
            return t

        xg = x.detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = native.NODE.dora_linear(xg, w, None, a, b, m, n, 0.5, 1e-6, False, True)
        assert [tuple(t.shape) for t in packed] == [(4, 24), (4, 4), (4, 40)]
        assert packed[2].data_ptr() == y.data_ptr()
        y.float().mul(dys[0]).sum().backward()
        assert m.grad is not None and torch.isfinite(m.grad).all()
        y = native.NODE.dora_linear(xg, w, None, a, b, m, n, 0.5, 1e-6, False, True)
        y.mul_(2)
        with pytest.raises(RuntimeError, match="(?s)modified by an inplace operation.*dm_from_output=False"):
            y.float().sum().backward()
        packed.clear()
        h16 = [t.to(torch.float16) if t.dtype == torch.bfloat16 else t for t in (x, w, a, b, m)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y16 = native.NODE.dora_linear(h16[0].requires_grad_(), h16[1], None, h16[2], h16[3], h16[4], n, 0.5,
                                          1e-6, False, True)
        assert len(packed) == 3 and packed[2].data_ptr() != y16.data_ptr()

    @pytest.mark.parametrize("from_y", [False, True])
    def test_layer_node_last_save_of_a_checkpoint_frees_the_recomputation(from_y):
        """The node as the last op a non-reentrant checkpoint's region saves for: checkpointing's early stop raises
        from the pack hook of that last saved tensor, inside the node's save. Nothing of the recomputation may stay
        alive after the backward (saving the output itself can make a node -> output -> node cycle that keeps the
        recomputation's tensors alive: out of GPU memory after a few training steps)."""
        import weakref

        from torch.utils.checkpoint import checkpoint

        x0, layers, dys = _layer_problem("fp32", (8, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]
        seen = []

        def block(x):
            h = torch.nn.functional.silu(x)
            seen.append(weakref.ref(h))
            return native.NODE.dora_linear(h, w, None, a, b, m, n, 0.5, 1e-6, False, from_y)

        gc.disable()
        try:
            x = x0.detach().requires_grad_()
            checkpoint(block, x, use_reentrant=False).mul(dys[0]).sum().backward()
            assert len(seen) == 2 and all(r() is None for r in seen), [r() is None for r in seen]
        finally:
            gc.enable()
        assert m.grad is not None

    def test_lean_forward_layer_node_selection(monkeypatch):
        """The lean forward takes the whole-layer node exactly where it is exact (also with a frozen base-layer
        bias): not with a trainable base weight or bias, PEFT's input cast (fp32 adapters on bf16 activations without
        autocast), the internal setting ``layer_node`` off, or where the dispatch says the eager path; outputs and
        gradients are bitwise the same either way."""
        import fastdora
        from fastdora import dispatch
        from peft import LoraConfig, get_peft_model
        from torch import nn

        from ..helpers import perturb_

        def build(bias, dtype, **opts):
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(32, 48, bias=bias), nn.GELU(), nn.Linear(48, 16, bias=False))
            pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], use_dora=True))
            perturb_(pm)
            pm.to(dtype)
            if dtype == torch.bfloat16 and opts.pop("fp32_adapters", False):
                for n_, p in pm.named_parameters():
                    if p.requires_grad:
                        p.data = p.data.float()
            fastdora.enable(pm, **opts)
            return pm

        def run(pm, dtype, use_layer):
            monkeypatch.setattr(dispatch, "compose_impl", lambda *a, **k: TRITON)
            monkeypatch.setattr(dispatch, "layer_node", (lambda x, w, m, k: TRITON.layer_node(x)) if use_layer
                                else (lambda *a: None))
            x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
            before = native.NODE.stats()["layer"]
            y = pm(x)
            y.float().square().sum().backward()
            trained = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
            return native.NODE.stats()["layer"] - before, [y.detach()] + [p.grad for _, p in trained], \
                [n for n, _ in trained]

        cases = [(dict(bias=False, dtype=torch.float32), 2), (dict(bias=True, dtype=torch.float32), 2),
                 (dict(bias=True, dtype=torch.bfloat16), 2), (dict(bias=False, dtype=torch.bfloat16), 2),
                 (dict(bias=False, dtype=torch.bfloat16, fp32_adapters=True), 0),
                 (dict(bias=False, dtype=torch.float32, layer_node=False), 0)]
        for kw, want in cases:
            dtype = kw["dtype"]
            opts = {k: v for k, v in kw.items() if k != "layer_node"}
            for from_out in (False, True):  # option dm_from_output: bias-free layers' magnitude gradients from y
                # layer_node: an internal setting, read at every layer call (enable, forward and backward inside)
                with _config.override(layer_node=kw.get("layer_node", True)):
                    n_layer, got, names = run(build(**opts, dm_from_output=from_out), dtype, True)
                    n_sep, ref, _ = run(build(**opts, dm_from_output=from_out), dtype, False)
                assert (n_layer, n_sep) == (want, 0), (kw, n_layer, n_sep)
                if not (from_out and want):
                    _assert_bitwise(got, ref, str(kw))
                    continue
                # layer "2" has no bias: its magnitude gradient from y; layer "0"'s (bias=True) still bitwise
                mags = [n for n in names if "lora_magnitude_vector" in n and (not kw["bias"] or ".2." in n)]
                keep = [i for i, n in enumerate(names) if n not in mags]
                _assert_bitwise([got[0]] + [got[1 + i] for i in keep], [ref[0]] + [ref[1 + i] for i in keep], str(kw))
                tol = dict(rtol=2e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
                for n in mags:
                    i = 1 + names.index(n)
                    torch.testing.assert_close(got[i], ref[i], **tol, msg=f"{kw} {n}")
        for param in ("weight", "bias"):  # a trainable base weight or bias: the separate nodes for that layer
            pm = build(bias=True, dtype=torch.float32)
            getattr(pm.base_model.model[0].base_layer, param).requires_grad_(True)
            assert run(pm, torch.float32, True)[0] == 1

    def test_lean_forward_dm_from_output_zero_magnitude(monkeypatch):
        """A magnitude with a zero element (sum(dy * y) / m is undefined there): the lean forward keeps inner for
        that layer, and its magnitude gradient (incl. the zero row's) is bitwise the separate nodes'; the check runs
        once per magnitude update (cached on its version), and after the zero is gone the output is saved again."""
        import fastdora
        from fastdora import dispatch
        from peft import LoraConfig, get_peft_model
        from torch import nn

        from ..helpers import perturb_

        monkeypatch.setattr(dispatch, "compose_impl", lambda *a, **k: TRITON)

        def build():
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=False))
            pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], use_dora=True))
            perturb_(pm)
            fastdora.enable(pm)
            mag = pm.base_model.model[2].lora_magnitude_vector["default"]
            with torch.no_grad():
                mag.weight[3] = 0.0
            return pm, mag

        def run(use_layer):
            monkeypatch.setattr(dispatch, "layer_node", (lambda x, w, m, k: TRITON.layer_node(x)) if use_layer
                                else (lambda *a: None))
            pm, mag = build()
            x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
            saved = []

            def pack(t):
                saved.append(t)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = pm(x)
            (y * torch.linspace(-1, 2, y.shape[-1])).sum().backward()  # dy nonzero in the zero magnitude's row
            return pm, mag, y, saved, [y.detach()] + [p.grad for p in pm.parameters() if p.requires_grad]

        pm, mag, y, saved, got = run(True)
        assert mag.__dict__["_fastdora_m_nonzero"][2] is False
        assert not any(t.data_ptr() == y.data_ptr() for t in saved)  # layer "2" saved inner, not its output
        ref = run(False)[4]
        # layer "0" (no zero): its magnitude gradient (output 3) from y, close; everything else bitwise
        _assert_bitwise(got[:3] + got[4:], ref[:3] + ref[4:], "zero magnitude")
        torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-6)
        assert got[-1][3] != 0 and torch.isfinite(got[-1]).all()
        monkeypatch.setattr(dispatch, "layer_node", lambda x, w, m, k: TRITON.layer_node(x))
        with torch.no_grad():
            mag.weight[3] = 0.5  # a new version: checked again
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = pm(torch.randn(5, 32))
        assert mag.__dict__["_fastdora_m_nonzero"][2] is True
        assert any(t.data_ptr() == y.data_ptr() for t in saved)

    @pytest.mark.parametrize("dname", ["fp32", "bf16", "fp16"])
    def test_lean_forward_magnitude_check_once_per_step(dname, monkeypatch):
        """Training steps through the whole-layer node: each optimizer step makes every magnitude stale, and one
        ``_check_magnitudes`` call (one host sync) per step answers for all of the model's layers; the layers save
        their outputs (``dm_from_output``). An fp16 model never checks (its outputs are not saved for dm) and saves
        inner. Gradients match stock PEFT's."""
        import fastdora
        from fastdora import dispatch
        from fastdora import layers as L
        from peft import LoraConfig, get_peft_model
        from torch import nn

        from ..helpers import perturb_

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dname]
        monkeypatch.setattr(dispatch, "compose_impl", lambda *a, **k: TRITON)
        monkeypatch.setattr(dispatch, "layer_node", lambda x, w, m, k: TRITON.layer_node(x))
        calls = []
        orig = L._check_magnitudes
        monkeypatch.setattr(L, "_check_magnitudes", lambda mag, m: calls.append(mag) or orig(mag, m))

        def build():
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 40, bias=False),
                                 nn.GELU(), nn.Linear(40, 16, bias=False))
            pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2", "4"], use_dora=True))
            perturb_(pm)
            return pm.to(dtype)

        ref, model = build(), build()
        fastdora.enable(model)
        opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in (ref, model)]
        for step in range(3):
            for micro in range(2):
                x = torch.randn(5, 32, generator=torch.Generator().manual_seed(10 * step + micro)).to(dtype)
                saved = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    y = model(x)
                y.float().square().mean().backward()
                ref(x).float().square().mean().backward()
                assert any(t.data_ptr() == y.data_ptr() for t in saved) == (dtype != torch.float16)
            assert len(calls) == (0 if dtype == torch.float16 else step + 1)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                if p.requires_grad:
                    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
                    torch.testing.assert_close(p.grad.float(), q.grad.float(), **tol, msg=f"step {step} {n}")
            for opt in opts:
                opt.step()
                opt.zero_grad()

    def test_node_entry_argument_errors():
        """Each fast-call entry names itself and its argument count; a flag whose truth value raises propagates."""
        x, layers, _ = _layer_problem("fp32", (4, 24), 40, 4)
        w, a, b, m, n, _ = layers[0]

        class Bad:
            def __bool__(self):
                raise ValueError("no truth value")

        for fn, args in ((native.NODE.dora_linear, (x, w, None, a, b, m, n, 0.5, 1e-6, False)),
                         (native.NODE.compose, (x, x, m, n, None, 0.5, 1e-6, torch.float32))):
            name = fn.__name__
            want = len(args) + 1
            with pytest.raises(TypeError, match=f"{name} takes {want} arguments"):
                fn(*args)
            with pytest.raises(ValueError, match="no truth value"):
                fn(*args, Bad())

    def _assert_bitwise_but_magnitude(got, ref, names, what, dm_from_output):
        """Bitwise everywhere; with ``dm_from_output`` the magnitude gradients (named ``...lora_magnitude_vector...``)
        only close (their rounding: y's instead of inner's)."""
        if not dm_from_output:
            return _assert_bitwise(got, ref, what)
        off = len(got) - len(names)
        mags = {off + i for i, name in enumerate(names) if "lora_magnitude_vector" in name}
        assert mags, names
        _assert_bitwise([t for i, t in enumerate(got) if i not in mags],
                        [t for i, t in enumerate(ref) if i not in mags], what)
        for i in mags:
            torch.testing.assert_close(got[i], ref[i], rtol=1e-5, atol=1e-6, msg=f"{what}: magnitude gradient {i}")

    @pytest.mark.parametrize("dm_from_output", [False, True])
    @pytest.mark.parametrize("mode", ["model", "process_wide"])
    def test_layer_node_first_call_inside_checkpoint(mode, dm_from_output, monkeypatch):
        """A model whose very first call runs inside non-reentrant checkpointing (HF Trainer with gradient
        checkpointing): the checkpoint's first forward and its recomputation must save the same tensors, so the
        whole-layer node must serve both or neither. ``enable(model)`` installs the lean forward up front; in
        process-wide mode a layer's first call installs it only outside a checkpoint's first forward (in the
        recomputation). Two checkpointed steps run without a CheckpointError, bitwise the separate nodes' results."""
        import fastdora
        from fastdora import dispatch
        from peft import LoraConfig, get_peft_model
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        from fastdora import layers as _layers

        from ..helpers import perturb_

        monkeypatch.setattr(dispatch, "compose_impl", lambda *a, **k: TRITON)

        def train(use_layer):
            monkeypatch.setattr(dispatch, "layer_node", (lambda x, w, m, k: TRITON.layer_node(x)) if use_layer
                                else (lambda *a: None))
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=False))
            # process-wide mode: options are the process defaults while enabled (here: the layers' later calls)
            monkeypatch.setattr(_layers, "default_options",
                                lambda: _config.make_options(dm_from_output=dm_from_output))
            if mode == "process_wide":
                fastdora.enable(dm_from_output=dm_from_output)
            try:
                pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], use_dora=True))
                if mode == "model":
                    fastdora.enable(pm, dm_from_output=dm_from_output)
            finally:
                if mode == "process_wide":
                    fastdora.disable()
            perturb_(pm)
            before = native.NODE.stats()["layer"]
            out = []
            for step in range(2):
                x = torch.randn(5, 32, generator=torch.Generator().manual_seed(step)).requires_grad_()
                y = checkpoint(pm, x, use_reentrant=False)
                y.square().sum().backward()
                out += [y.detach(), x.grad]
            trained = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
            return (native.NODE.stats()["layer"] - before, out + [p.grad for _, p in trained],
                    [n for n, _ in trained])

        n_layer, got, names = train(True)
        n_sep, ref, _ = train(False)
        # model: 2 layers x (first forward + recomputation) x 2 steps; process-wide: the first step's first forward
        # and recomputation take PEFT's chain (the recomputation installs the lean forward)
        assert (n_layer, n_sep) == (8 if mode == "model" else 4, 0), (n_layer, n_sep)
        # process-wide: the first step ran PEFT's chain (inner) in both runs; the magnitude gradients accumulate
        _assert_bitwise_but_magnitude(got, ref, names, mode, dm_from_output)

    def test_dispatch_layer_node_rules(monkeypatch):
        from fastdora import dispatch

        x, w, m = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
        assert dispatch.layer_node(x, w, m, "auto") is None  # CPU tensors: the eager path, no node
        assert dispatch.layer_node(x, w, m, "triton") is None
        assert TRITON.layer_node(x) is native.NODE
        assert TRITON.layer_node(x.t()) is None and TRITON.layer_node(torch.randn(8)) is None  # strided, 1-D
        saved = native.NODE
        native.NODE = None
        try:
            assert TRITON.layer_node(x) is None  # the Python node's process: no C++ node, no whole-layer call
        finally:
            native.NODE = saved

    def test_peft_model_through_the_node():
        """A PEFT DoRA model converted by fastdora with kernels='triton' on CPU tensors is not routed to Triton
        (dispatch keeps CPU on the exact PyTorch path); here the Triton implementation is forced, as on CUDA: a
        2-layer MLP's outputs and every parameter gradient bitwise equal with the C++ node and with the Python
        node."""
        import fastdora
        from fastdora import dispatch
        from peft import LoraConfig, get_peft_model
        from torch import nn

        from ..helpers import perturb_

        def build():
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16, bias=False))
            pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], use_dora=True))
            perturb_(pm)
            fastdora.enable(pm, dm_from_output=False)  # bitwise (see test_layer_node_dm_from_output)
            return pm

        real, real_layer = dispatch.compose_impl, dispatch.layer_node
        dispatch.compose_impl = lambda *a, **k: TRITON
        dispatch.layer_node = lambda x, w, m, k: TRITON.layer_node(x)  # as on CUDA: the whole-layer node where active
        try:
            outs = []
            for use_node in (False, True, True):
                layer_calls = native.NODE.stats()["layer"]
                pm = build()
                x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
                saved = native.NODE
                native.NODE = saved if use_node else None
                try:
                    y = pm(x)
                    want = "CppFunction" if use_node else "_DoraComposeBackward"
                    assert type(y.grad_fn).__name__ == want, type(y.grad_fn).__name__
                    y.square().sum().backward()
                finally:
                    native.NODE = saved
                # the whole-layer node serves both layers where it is active
                assert native.NODE.stats()["layer"] - layer_calls == (2 if use_node else 0)
                outs.append([y.detach()] + [p.grad for p in pm.parameters() if p.requires_grad])
        finally:
            dispatch.compose_impl, dispatch.layer_node = real, real_layer
        _assert_bitwise(outs[1], outs[0], "peft model, C++ node (first)")
        _assert_bitwise(outs[2], outs[0], "peft model, C++ node (again)")


# ------------------------------------------------------------------------------------------------------ GPU tests


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory):
    # without CUDA, tests/conftest.py skips these (all marked gpu); the interpreter subprocess leaves them to the parent
    if _INNER:
        pytest.skip("the GPU tests run in the parent process, not under TRITON_INTERPRET")
    os.environ.setdefault("FASTDORA_CACHE_DIR", str(tmp_path_factory.mktemp("fdcache")))
    from fastdora.kernels import native

    impl = _triton()  # registers the node's Python fallbacks first
    native.node(required=True)
    return impl, native


@pytest.mark.gpu
def test_gpu_bitwise_vs_python_node(gpu_node):
    _, native = gpu_node
    _ab_cases(native, "cuda", [(1, 16), (37, 48), (300, 520), (2, 129, 256)])


@pytest.mark.gpu
@pytest.mark.parametrize("dm_from_output", [False, True], ids=["", "dm_from_output"])
@pytest.mark.parametrize("setup", ["amp", "bf16"])
def test_gpu_peft_model_checkpointed(gpu_node, setup, dm_from_output):
    """A transformers Llama (PEFT DoRA, fastdora) with its own gradient checkpointing, AMP and pure bf16: loss and
    every gradient bitwise equal with the C++ node and the Python node; the node served the calls. With
    ``dm_from_output`` (the default) the magnitude gradients come from the saved outputs: those within bf16 rounding
    of the Python node's, everything else bitwise."""
    _, native = gpu_node
    import fastdora
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        m = LlamaForCausalLM(cfg).cuda()
        if setup == "bf16":
            m = m.to(torch.bfloat16)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
        pm = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if setup == "bf16":  # pure bf16: PEFT made the adapters fp32 (autocast_adapter_dtype); the trainers' bf16 runs
            pm.to(torch.bfloat16)
        with torch.no_grad():
            for n_, p in pm.named_parameters():
                if "lora_B" in n_:
                    p.normal_(0, 0.02)
        assert fastdora.enable(pm, kernels="triton", dm_from_output=dm_from_output).native_node == "active"
        pm.train()
        return pm

    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1)).cuda()
    outs = []
    for use_node in (False, True, True):
        pm = build()
        saved = native.NODE
        native.NODE = saved if use_node else None
        fast, native_before, layer_before = saved.stats()["fast"], saved.stats()["native"], saved.stats()["layer"]
        try:
            for _ in range(2):  # the second step: norms cached, templates registered
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup == "amp"):
                    loss = pm(input_ids=ids, labels=ids).loss
                loss.backward()
        finally:
            native.NODE = saved
        if use_node:
            assert saved.stats()["fast"] > fast, "the C++ node's templates were never used"
            assert saved.stats()["native"] > native_before, "the C++ node never launched directly"
            # every DoRA layer call (7 per decoder layer, first forward and recomputation, 2 steps) as ONE node
            assert saved.stats()["layer"] - layer_before == 2 * 7 * 2 * 2, saved.stats()
        outs.append([loss.detach()] + [p.grad for p in pm.parameters() if p.requires_grad])
        torch.cuda.synchronize()
    names = [n_ for n_, p in pm.named_parameters() if p.requires_grad]
    mags = set()
    if dm_from_output:
        mags = {1 + i for i, n_ in enumerate(names) if "lora_magnitude_vector" in n_}
    for k in (1, 2):
        what = f"{setup}: C++ node vs Python node ({k})"
        _assert_bitwise([t for i, t in enumerate(outs[k]) if i not in mags],
                        [t for i, t in enumerate(outs[0]) if i not in mags], what)
        for i in mags:  # sum(dy * y) / m vs sum(dy * inner) / norm: y's rounding instead of inner's
            got, ref = outs[k][i].double(), outs[0][i].double()
            assert (got - ref).abs().max() <= 2e-2 * ref.abs().max(), (what, names[i - 1])
    if mags:  # and they did differ: the outputs were saved (inner is not)
        assert any(not torch.equal(outs[1][i], outs[0][i]) for i in mags)


@pytest.mark.gpu
def test_gpu_graph_capture_through_the_node(gpu_node):
    """A CUDA graph captured over the node's forward and backward (templates registered before): the forward
    launches directly inside the capture, the backward sees the capture (the driver's cuStreamIsCapturing) and takes
    the Python launcher's two-kernel reduction; the replayed outputs and gradients equal the eager Python node's
    (bitwise; the magnitude gradient's sum order differs between the fused and the two-kernel reduction: 1e-5)."""
    impl, native = gpu_node
    rdt = torch.bfloat16
    prob = _problem((64, 96), rdt, rdt, False, "cuda", seed=3)
    ref = _run(native, False, prob, rdt)
    _run(native, True, prob, rdt)  # registers the templates
    result, lora, mag, norm, _, dy = [t.detach().clone() if t is not None else None for t in prob]
    for t in (result, lora, mag):
        t.requires_grad_(True)

    def step():
        y = impl.apply(result, lora, mag, norm, None, None, 0.73, 1e-6, rdt)
        y.backward(dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
            for t in (result, lora, mag):
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = native.NODE.stats()
    with torch.cuda.graph(graph):
        y = step()
    during = native.NODE.stats()
    assert during["native"] == before["native"] + 1, "the forward did not launch directly in the capture"
    assert during["slow"] == before["slow"] + 1, "the backward did not leave the templates during the capture"
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    got = [y.detach(), result.grad, lora.grad, mag.grad]
    _assert_bitwise(got[:3], ref[:3], "graph replay")
    torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-6)
