"""Random checkpoints of real shapes, for benchmarks and tests that need a model we cannot download.

A real vocabulary size matters (the sampler and the head scale with it), so the tokenizer is a
genuine byte-level BPE of exactly the size asked for: the 256 byte symbols, then merges of
existing tokens into new ones until the vocabulary is full, and an end-of-text special token.
Weights are random (seeded): outputs are meaningless, shapes and costs are real.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with `vocab_size` tokens (the last one is EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from engine.tokenizer import byte_level_chars

    symbols = byte_level_chars()
    vocab = {s: i for i, s in enumerate(symbols)}
    merges: list[tuple[str, str]] = []
    # Breadth first: every token of one length extends by each byte before the next length starts,
    # in a fixed scrambled order of bytes so that common characters are not all first.
    order = [symbols[(b * 167) % 256] for b in range(256)]
    level = list(symbols)
    while len(vocab) < vocab_size - 1:
        longer = []
        for left in level:
            for right in order:
                if len(vocab) >= vocab_size - 1:
                    break
                vocab[left + right] = len(vocab)
                merges.append((left, right))
                longer.append(left + right)
        level = longer
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return tokenizer


def random_checkpoint(path: Path, config, seed: int = 0, dtype=None) -> Path:
    """Writes a random `*ForCausalLM` of `config` (a transformers config) and a tokenizer of its
    vocabulary size to `path`, as `save_pretrained` does."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(config.vocab_size)
    eos_id = tokenizer.token_to_id(EOS)
    if config.eos_token_id is None:
        config.eos_token_id = eos_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(path)
    return path


def small_llama_config(vocab_size: int, **overrides):
    """The default model's shape (4 layers, hidden 256, GQA 4/2) with another vocabulary."""
    from transformers import LlamaConfig

    values = {"vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": True, **overrides}
    return LlamaConfig(**values)


def describe(path: Path) -> str:
    config = json.loads((path / "config.json").read_text())
    return (f"{config['model_type']}, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"vocabulary {config['vocab_size']}")
