"""The Triton boundary of the C++ node's direct launch: the version allow-list, the self-check, the build key."""

from __future__ import annotations

import warnings

import pytest
import torch

from fastdora import config
from fastdora.kernels import native


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.6.0+git1234abc"])
def test_verified_versions_allow_the_direct_launch(version):
    assert native.direct_launch_refusal(version, setting=True, cuda=True) is None


@pytest.mark.parametrize("version", ["3.9.0", "3.5.1", "4.0.0", "3.60.0"])
def test_other_versions_use_tritons_launcher(version):
    why = native.direct_launch_refusal(version, setting=True, cuda=True)
    assert why is not None and version in why and "3.6.x" in why


def test_refusals_without_cuda_setting_or_version():
    assert native.direct_launch_refusal("3.6.0", setting=False, cuda=True) == "FASTDORA_NATIVE_LAUNCH=0"
    assert native.direct_launch_refusal("3.6.0", setting=True, cuda=False) == "no CUDA device"
    assert "unknown" in native.direct_launch_refusal(None, setting=True, cuda=True)


@pytest.mark.parametrize("version,standard", [("2.11.0+cu130", "c++17"), ("2.12.0", "c++20"), ("2.13.0+cpu", "c++20"),
                                              ("2.15.0+cu132", "c++20"), ("3.0.0a0+git1234", "c++20"),
                                              ("unknown", "c++20")])
def test_cxx_standard_follows_torch(version, standard):
    """torch >= 2.12 builds extensions as C++20 and torch 2.14's ATen headers refuse C++17 (the C++ node then failed
    to build on torch 2.15: ``'strong_ordering' in namespace 'std' does not name a type``)."""
    from fastdora import _native

    assert _native._cxx_standard(version) == standard


def test_build_key_includes_tritons_version(monkeypatch):
    from fastdora import _native

    monkeypatch.setattr(_native, "triton_version", lambda: "3.6.0")
    a = _native._build_key(b"src")
    monkeypatch.setattr(_native, "triton_version", lambda: "3.9.0")
    b = _native._build_key(b"src")
    assert a != b and _native._build_key(b"src") == b


class _FakeNode:
    """What _decide_launch uses of the C++ module."""

    def __init__(self, driver=None):
        self.driver, self.direct = driver, []

    def load_driver(self):
        return self.driver

    def set_native_launch(self, on):
        self.direct.append(bool(on))


def _decide(monkeypatch, version, self_check):
    node = _FakeNode()
    monkeypatch.setattr(native, "_triton_version", lambda: version)
    monkeypatch.setattr(native.torch.cuda, "is_available", lambda: True)
    calls = []

    def check(mod):
        calls.append(mod)
        return self_check

    monkeypatch.setattr(native, "_self_check", check)
    saved = dict(native._state)
    try:
        with config.override(native_launch=True), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            native._decide_launch(node)
        return native._state["launch"], calls, [str(x.message) for x in w]
    finally:
        native._state.clear()
        native._state.update(saved)


def test_unverified_version_never_runs_the_self_check_or_the_direct_launch(monkeypatch):
    launch, calls, warned = _decide(monkeypatch, "3.9.0", None)
    assert launch.startswith("Triton's launcher (Triton 3.9.0 is not among") and not calls and not warned


def test_verified_version_passing_the_self_check_launches_directly(monkeypatch):
    launch, calls, warned = _decide(monkeypatch, "3.6.0", None)
    assert launch == "direct" and len(calls) == 1 and not warned


def test_a_failed_self_check_falls_back_with_a_warning(monkeypatch):
    launch, calls, warned = _decide(monkeypatch, "3.6.0", "dm differs between the direct launch and Triton's launcher")
    assert launch == "Triton's launcher (dm differs between the direct launch and Triton's launcher)"
    assert len(calls) == 1 and any("self-check" in m for m in warned)


def test_compare_is_bitwise():
    a = torch.tensor([1.0, 2.0])
    assert native._compare((a, a, a, a), (a.clone(), a.clone(), a.clone(), a.clone())) is None
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(3.0))
    assert "dm" in native._compare((a, a, a, b), (a, a, a, a))
    assert "y" in native._compare((a.half(), a, a, a), (a, a, a, a))
    assert "d_lora" in native._compare((a, a, None, a), (a, a, a, a))


def test_enable_report_names_the_launch():
    from fastdora.patching import EnableReport

    rep = EnableReport(options=config.make_options(), native_node="active",
                       native_launch="Triton's launcher (Triton 3.9.0 is not among the versions ...)")
    assert "kernel launch: Triton's launcher (Triton 3.9.0" in str(rep)


@pytest.mark.gpu
def test_self_check_passes_on_this_gpu():
    pytest.importorskip("triton")
    from fastdora.ops.compose import triton_impl

    triton_impl()
    native.reset()
    try:
        native.node(required=True)
        version = native._triton_version()
        if native.direct_launch_refusal(version, True, True) is None:
            assert native.launch_status() == "direct", native.launch_status()
            assert native._self_check(native.NODE) is None
        else:
            assert native.launch_status().startswith("Triton's launcher (Triton")
    finally:
        native.reset()


@pytest.mark.gpu
def test_unverified_version_still_computes_the_same(monkeypatch):
    """With a faked unverified Triton version the node runs through Triton's launcher with the same results."""
    pytest.importorskip("triton")
    from fastdora.ops.compose import triton_impl

    impl = triton_impl()
    dev = torch.device("cuda")
    r, lo = (torch.randn(256, 512, device=dev, dtype=torch.bfloat16) for _ in range(2))
    m = torch.rand(512, device=dev) + 0.5
    n = torch.rand(512, device=dev) + 0.5
    ref = impl.compose_fwd(r, lo, m, n, 0.5, 1e-6, None, None, torch.bfloat16, False)[0]
    native.reset()
    monkeypatch.setattr(native, "_triton_version", lambda: "3.9.0")
    try:
        node = native.node(required=True)
        assert native.launch_status().startswith("Triton's launcher (Triton 3.9.0")
        for _ in range(3):  # the first call registers the template, the later ones launch through it
            y = node.compose(r, lo, m.clone().requires_grad_(), n, None, 0.5, 1e-6, torch.bfloat16, False)
            assert torch.equal(y, ref)
        assert node.stats()["native"] == 0
    finally:
        native.reset()
