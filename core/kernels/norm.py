"""Triton factored-norm kernel. PLACEHOLDER: filled in by the kernels work (issue 3)."""


def supports(weight, lora_A, lora_B) -> bool:
    return False


factored_norm_triton = None
