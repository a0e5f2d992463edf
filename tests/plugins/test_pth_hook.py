"""The LLaMA-Factory ``.pth`` hook: silent and harmless when fastdora is gone, cheap at interpreter start (imports
nothing; fastdora only once LLaMA-Factory's modules are imported), and ``install`` / ``uninstall`` / ``status``."""

from __future__ import annotations

import os
import shutil
import textwrap

from fastdora.plugins import llamafactory as lf

from ._support import run_python

# a stand-in LLaMA-Factory: the three modules the hook patches
FAKE_PARSER = textwrap.dedent("""
    import dataclasses

    @dataclasses.dataclass
    class FinetuningArguments:
        finetuning_type: str = "lora"

        def __post_init__(self):
            pass

    _TRAIN_ARGS = [FinetuningArguments]
    _INFER_ARGS = [FinetuningArguments]
""")


def _fake_llamafactory(root) -> str:
    pkg = root / "fake_lf" / "llamafactory"
    (pkg / "hparams").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "hparams" / "__init__.py").write_text("")
    (pkg / "hparams" / "parser.py").write_text(FAKE_PARSER)
    return str(root / "fake_lf")


def _site(root, boot_file: str) -> str:
    site = root / "site"
    site.mkdir()
    (site / lf.PTH_NAME).write_text(lf.pth_text(boot_file))
    return str(site)


def test_pth_is_a_comment_and_one_import_line():
    lines = lf.pth_text("/somewhere/llamafactory_boot.py").splitlines()
    assert len(lines) == 2 and lines[0].startswith("#") and lines[1].startswith("import ")


def test_leftover_pth_is_silent_when_the_boot_file_is_gone(tmp_path):
    """``pip uninstall fastdora`` removes the package (and the boot file) but not the ``.pth``."""
    site = _site(tmp_path, str(tmp_path / "gone" / "llamafactory_boot.py"))
    code = f"import site, sys; site.addsitedir({site!r}); assert 'fastdora' not in sys.modules"
    # -I -S: isolated, without site-packages (so fastdora is not importable); then only our site dir
    proc = run_python(["-I", "-S"], code, cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_leftover_pth_is_silent_when_fastdora_is_not_importable(tmp_path):
    """The boot file still there (an editable install's source tree) but fastdora not importable: importing
    LLaMA-Factory must work, print nothing, and the hook takes itself off sys.meta_path."""
    boot = tmp_path / "src" / "llamafactory_boot.py"
    boot.parent.mkdir()
    shutil.copy(lf.BOOT_FILE, boot)
    site = _site(tmp_path, str(boot))
    fake = _fake_llamafactory(tmp_path)
    code = textwrap.dedent(f"""
        import importlib.util, site, sys
        assert importlib.util.find_spec("fastdora") is None
        site.addsitedir({site!r})
        hooks = lambda: [f for f in sys.meta_path if getattr(f, "_fastdora_llamafactory_hook", False)]
        assert len(hooks()) == 1
        assert "threading" not in sys.modules  # the boot imports nothing but the built-in _thread
        sys.path.insert(0, {fake!r})
        import llamafactory.hparams.parser as parser
        assert parser._TRAIN_ARGS[0].__module__ == "llamafactory.hparams.parser"  # untouched
        assert "fastdora" not in sys.modules and hooks() == []
    """)
    proc = run_python(["-I", "-S"], code, cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_pth_start_imports_nothing_heavy(tmp_path):
    site = _site(tmp_path, lf.BOOT_FILE)
    code = textwrap.dedent(f"""
        import site, sys
        before = set(sys.modules)
        site.addsitedir({site!r})
        new = sorted(set(sys.modules) - before)
        assert new == [], new
        assert any(getattr(f, "_fastdora_llamafactory_hook", False) for f in sys.meta_path)
    """)
    proc = run_python(["-I", "-S"], code, cwd=str(tmp_path))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_hook_patches_llamafactory_when_fastdora_is_there(tmp_path):
    site = _site(tmp_path, lf.BOOT_FILE)
    fake = _fake_llamafactory(tmp_path)
    code = textwrap.dedent(f"""
        import dataclasses, site, sys
        site.addsitedir({site!r})
        assert "fastdora" not in sys.modules  # not before LLaMA-Factory is imported
        sys.path.insert(0, {fake!r})
        import llamafactory.hparams.parser as parser
        names = {{f.name for f in dataclasses.fields(parser._TRAIN_ARGS[0])}}
        assert {{"use_fast_dora", "fast_dora_kernels", "fast_dora_dm_from_output"}} <= names, names
        assert parser._INFER_ARGS[0] is parser._TRAIN_ARGS[0]
        print("patched")
    """)
    proc = run_python([], code, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "patched\n" and "[fastdora]" not in proc.stderr


def test_install_status_uninstall(tmp_path, capsys):
    site = str(tmp_path)
    assert lf.status(site)["installed"] is False
    path = lf.install(site)
    assert os.path.basename(path) == lf.PTH_NAME and os.path.exists(path)
    st = lf.status(site)
    assert st["installed"] and st["pth_current"] and st["pth_boot_file"] == lf.BOOT_FILE

    assert lf.main(["status", "--site-dir", site]) == 0
    assert "fastdora: installed" in capsys.readouterr().out

    with open(path, "w", encoding="utf-8") as f:  # a .pth of another (older) fastdora location
        f.write(lf.pth_text("/old/site-packages/fastdora/plugins/llamafactory_boot.py"))
    st = lf.status(site)
    assert st["installed"] and not st["pth_current"]
    assert st["pth_boot_file"] == "/old/site-packages/fastdora/plugins/llamafactory_boot.py"
    lf.main(["status", "--site-dir", site])
    assert "install` again" in capsys.readouterr().out

    assert lf.main(["uninstall", "--site-dir", site]) == 0
    assert "removed" in capsys.readouterr().out and not os.path.exists(path)
    assert lf.uninstall(site) is None
    lf.main(["status", "--site-dir", site])
    assert "not installed" in capsys.readouterr().out
