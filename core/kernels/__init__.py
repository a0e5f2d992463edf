"""Triton kernels (private ``_x_kernel`` functions + launchers). Imported lazily by ``fastdora.dispatch``."""
