"""Test instrumentation for the Axolotl end-to-end test (not part of fastdora): an Axolotl plugin that adds
``probe.ProbeCallback`` (trained model's logits + what fastdora did, saved at train end in the training process).

YAML: ``plugins: [axolotl_probe.ProbePlugin]`` with this directory on PYTHONPATH.
"""

from axolotl.integrations.base import BasePlugin

from probe import ProbeCallback


class ProbePlugin(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        return [ProbeCallback(cfg.base_model)]
