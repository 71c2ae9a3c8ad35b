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

    from batchstring.engine.tokenizer import byte_level_chars

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


def random_checkpoint(path: Path, config, seed: int = 0, dtype=None, tokenizer_vocab: int | None = None) -> Path:
    """Writes a random `*ForCausalLM` of `config` (a transformers config) and a tokenizer of its
    vocabulary size (or of `tokenizer_vocab`, smaller: a padded vocabulary) to `path`, as
    `save_pretrained` does."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer(tokenizer_vocab or config.vocab_size)
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


def llama_3_2_1b_config():
    """Llama-3.2-1B's published shape: 1.24 B parameters, 128k vocabulary, tied embeddings,
    llama3 rotary scaling, three end-of-sequence ids in its generation config."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                       rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def tiny_llama_3_config():
    """Llama-3.2-1B's structure (grouped-query attention 4:1, tied embeddings, llama3 rotary
    scaling, a padded vocabulary) at a size a CPU test runs in seconds: `gpu-check --quick`."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1088, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256})


def gemma_3_1b_config():
    """Gemma 3 1B's published shape: 1.0 B parameters, a 262k vocabulary, tied embeddings, five
    sliding-window layers (512) to every global one, two rotary tables, q/k norms, GELU."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                            sliding_window=512, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                            layer_types=((["sliding_attention"] * 5 + ["full_attention"]) * 5)[:26],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
WINDOW = 24  # small enough that the verification's 100-token pasts and 32-token generations cross it
TWO_KINDS = ["sliding_attention", "full_attention"]
# What each family's tiny checkpoint sets beyond TINY: the features that family brings, switched on.
FAMILY_OPTIONS = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": TWO_KINDS},
    "qwen3": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "olmo2": {},
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
                "attention_multiplier": 0.0078125},
    "smollm3": {"no_rope_layers": [1, 0]},
    "phi3": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
                                 "original_max_position_embeddings": 32}},  # Phi-4-mini's kind, crossed in tests
    "starcoder2": {"use_bias": True, "sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "layer_types": TWO_KINDS},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "layer_types": TWO_KINDS},
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": WINDOW, "layer_types": TWO_KINDS,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64}},
}


def mixture_pair() -> dict:
    """Qwen3-MoE (8 experts of 1024, top-2) and dense Qwen3 whose MLP is as wide as two experts:
    the same active parameters per token, the MLP most of them (the `moe` benchmark)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    shape = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=None,
                 eos_token_id=None, pad_token_id=None)
    return {"dense": Qwen3Config(**shape, intermediate_size=2048),
            "mixture": Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                                      norm_topk_prob=True)}


def tiny_family_config(model_type: str):
    """A tiny config of `model_type`, from transformers' own config class, with the family's
    features on (windows, soft-caps, multipliers, partial or no rotary, rope scalings)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **TINY, **FAMILY_OPTIONS[model_type])


# shape, tokenizer size (Llama 3's, before its specials: the checkpoint's vocabulary is padded past it)
SHAPES = {"llama-3.2-1b": (llama_3_2_1b_config, 128000), "tiny-llama-3": (tiny_llama_3_config, 1024),
          "gemma-3-1b": (gemma_3_1b_config, 262144)}


def main(argv: list[str] | None = None) -> None:
    """`python -m batchstring.export.synthetic SHAPE PATH [--dtype bfloat16]`: a random checkpoint of that shape."""
    import argparse

    import torch

    p = argparse.ArgumentParser(prog="python -m batchstring.export.synthetic", description=main.__doc__)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    args = p.parse_args(argv)
    config, tokenizer_vocab = SHAPES[args.shape]
    random_checkpoint(args.path, config(), dtype=getattr(torch, args.dtype), tokenizer_vocab=tokenizer_vocab)
    print(f"wrote {args.path}: {describe(args.path)}")


if __name__ == "__main__":
    main()
