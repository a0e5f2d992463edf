"""Build a tiny Llama model, its tokenizer and small datasets locally (no model hub needed).

Used by every example and by ``integration_tests/``::

    python examples/_tiny.py OUT_DIR          # writes OUT_DIR/model (model + tokenizer) and OUT_DIR/data/*.jsonl

or from Python: ``build_all(out_dir)`` -> dict of paths. Deterministic: the same files for the same arguments.
Needs ``torch``, ``transformers`` and ``tokenizers``.
"""

from __future__ import annotations

import json
import os
import random
import sys

__all__ = ["build_tokenizer", "build_model", "build_datasets", "build_all", "checkpointing_args", "PROBE_TEXT"]

_WORDS = (
    "the a an one two three red green blue small large quick slow cat dog bird fish tree river stone cloud "
    "runs jumps sleeps eats sees finds makes takes over under near far into from with without and or but "
    "because when while after before today tomorrow morning night light dark warm cold happy sad old new"
).split()

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' }}{% generation %}{{ message['content'] + eos_token }}"
    "{% endgeneration %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)

#: a fixed text every check feeds the trained model with (logits comparisons)
PROBE_TEXT = "the quick red cat runs over the old stone bridge while two birds sleep near the river"


def _sentence(rng: random.Random, lo: int = 6, hi: int = 14) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))


def build_tokenizer(out_dir: str, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on generated text, saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [_sentence(rng) for _ in range(400)] + [PROBE_TEXT, "User: Assistant: Human: ### Instruction: Response:"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=256,
        padding_side="right",
    )
    fast.chat_template = _CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, tokenizer=None, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A randomly initialised tiny ``LlamaForCausalLM`` (fp32), saved with ``save_pretrained``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def build_datasets(out_dir: str, n: int = 64, seed: int = 0) -> dict:
    """Small jsonl datasets: plain text, alpaca (instruction/input/output), conversational and preference pairs."""
    rng = random.Random(seed)
    os.makedirs(out_dir, exist_ok=True)
    rows = {"text": [], "alpaca": [], "messages": [], "preference": []}
    for _ in range(n):
        q, a, b = _sentence(rng, 4, 8), _sentence(rng), _sentence(rng)
        rows["text"].append({"text": f"{q} . {a}"})
        rows["alpaca"].append({"instruction": q, "input": "", "output": a})
        rows["messages"].append(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        rows["preference"].append({"prompt": q, "chosen": " " + a, "rejected": " " + b})
    paths = {}
    for name, items in rows.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            for r in items:
                f.write(json.dumps(r) + "\n")
    return paths


def build_all(out_dir: str, n: int = 64) -> dict:
    """``out_dir/model`` (tokenizer + model) and ``out_dir/data/*.jsonl``; skipped when already built."""
    model_dir = os.path.join(out_dir, "model")
    data_dir = os.path.join(out_dir, "data")
    if not os.path.exists(os.path.join(model_dir, "model.safetensors")):
        tok = build_tokenizer(model_dir)
        build_model(model_dir, tok)
    paths = build_datasets(data_dir, n=n)
    return {"model": model_dir, "data_dir": data_dir, **paths}


def checkpointing_args(args_cls, use_reentrant: bool = False, enabled: bool = True) -> dict:
    """Activation checkpointing keywords for ``args_cls`` (``TrainingArguments`` or a subclass such as TRL's
    ``SFTConfig``): transformers >= 5.25 names them ``activation_checkpointing`` / ``activation_checkpointing_kwargs``
    (the ``gradient_checkpointing`` names are deprecated aliases there, to be removed in v6); older releases know only
    ``gradient_checkpointing`` / ``gradient_checkpointing_kwargs``."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(args_cls)}
    name = "activation_checkpointing" if "activation_checkpointing" in known else "gradient_checkpointing"
    return {name: enabled, f"{name}_kwargs": {"use_reentrant": use_reentrant}}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/_tiny.py OUT_DIR")
    print(json.dumps(build_all(sys.argv[1]), indent=2))
