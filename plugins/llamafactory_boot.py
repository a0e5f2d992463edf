"""Interpreter-start hook of the LLaMA-Factory integration (executed by ``fastdora_llamafactory.pth``).

Kept tiny and import-free on purpose: it runs at the start of EVERY Python process of the environment where
``python -m fastdora.plugins.llamafactory install`` wrote the ``.pth`` file (that is what makes it survive
``torchrun``, whose workers are fresh interpreters). It imports neither fastdora, torch nor LLaMA-Factory (nor
``threading``: only the built-in ``_thread``): it only puts a finder on ``sys.meta_path`` that, when
``llamafactory.hparams.parser`` / ``llamafactory.model.loader`` / ``llamafactory.train.tuner`` are imported (by
whoever imports them), lets the module load normally and then calls ``fastdora.plugins.llamafactory.patch_<module>``
on it. So fastdora is imported only in processes that start LLaMA-Factory. Any error here is swallowed: the hook
must never break an interpreter. When fastdora is no longer importable there (uninstalled, the ``.pth`` left
behind), the hook says nothing and takes itself off ``sys.meta_path``.
"""

import _thread
import sys

_TARGETS = {
    "llamafactory.hparams.parser": "patch_parser",
    "llamafactory.model.loader": "patch_loader",
    "llamafactory.train.tuner": "patch_tuner",
}


class _PatchingLoader:
    def __init__(self, inner, name):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            try:
                from fastdora.plugins import llamafactory as _plugin  # LLaMA-Factory already imported torch
            except ModuleNotFoundError as exc:
                if (exc.name or "").split(".")[0] == "fastdora":  # fastdora is gone: a leftover .pth, stay silent
                    uninstall()
                    return
                raise
            getattr(_plugin, _TARGETS[self._name])(module)
        except Exception as exc:  # never break LLaMA-Factory itself
            sys.stderr.write(f"[fastdora] LLaMA-Factory hook could not patch {self._name}: {exc!r}\n")

    def __getattr__(self, item):  # get_resource_reader, get_source, is_package, ...
        return getattr(self._inner, item)


class FastDoraLlamaFactoryFinder:
    """Meta-path finder that patches three LLaMA-Factory modules right after they execute."""

    _fastdora_llamafactory_hook = True

    def __init__(self):
        self._busy = _thread._local()  # re-entrance guard: other finders may delegate back to us

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            return self._find(fullname, path, target)
        finally:
            self._busy.on = False

    def _find(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or getattr(finder, "_fastdora_llamafactory_hook", False):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install():
    try:
        if not any(getattr(f, "_fastdora_llamafactory_hook", False) for f in sys.meta_path):
            sys.meta_path.insert(0, FastDoraLlamaFactoryFinder())
    except Exception:  # pragma: no cover - never break interpreter start
        pass


def uninstall():
    try:
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_fastdora_llamafactory_hook", False)]
    except Exception:  # pragma: no cover
        pass


install()
