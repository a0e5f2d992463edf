"""Test instrumentation for the LLaMA-Factory end-to-end test (not part of fastdora).

Put this directory on PYTHONPATH (torchrun workers inherit it): when ``llamafactory.train.tuner`` is imported, its
``_training_function`` gets ``probe.ProbeCallback`` appended to its callbacks (logits of the trained model + what
fastdora did, saved at train end in the training process). The tokenizer directory comes from
FASTDORA_PROBE_TOKENIZER.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # integration_tests/ (probe.py)


class _Loader:
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec) if hasattr(self._inner, "create_module") else None

    def exec_module(self, module):
        self._inner.exec_module(module)
        orig = module._training_function

        def _training_function(config):
            from probe import ProbeCallback

            config["callbacks"].append(ProbeCallback())
            return orig(config)

        module._training_function = _training_function

    def __getattr__(self, item):
        return getattr(self._inner, item)


class _Finder:
    busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "llamafactory.train.tuner" or self.busy:
            return None
        self.busy = True
        try:
            for f in sys.meta_path:
                if f is self or not hasattr(f, "find_spec"):
                    continue
                spec = f.find_spec(fullname, path, target)
                if spec is not None:
                    spec.loader = _Loader(spec.loader)
                    return spec
        finally:
            self.busy = False
        return None


sys.meta_path.insert(0, _Finder())
