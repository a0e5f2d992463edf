"""fastdora: exact DoRA for PEFT at LoRA's speed and memory.

    import fastdora
    report = fastdora.enable(peft_model)      # convert every DoRA layer of this model
    fastdora.enable()                          # or: process-wide, for every DoRA layer PEFT creates later
    fastdora.disable(peft_model)               # back to stock PEFT
"""

from .config import Options
from .cache import invalidate as invalidate_norm_cache
from .patching import EnableReport, disable, enable, process_wide_enabled
from .slots import step_scope
from .stats import active_path_counter

__version__ = "1.0.0"

__all__ = [
    "enable",
    "disable",
    "invalidate_norm_cache",
    "EnableReport",
    "Options",
    "active_path_counter",
    "process_wide_enabled",
    "step_scope",
    "__version__",
]
