"""Trains the shipped default model: a byte-level BPE tokenizer and a ~4 M-parameter Llama.

`batchstring train` reproduces `export/default_model/` from the Python standard library with a
fixed seed in about ten minutes on two CPU cores. Nobody needs to run it to use the project;
it exists so that the weights we ship are explainable and can be rebuilt.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from batchstring.engine.tokenizer import TextCodec
from batchstring.export.corpus import Corpus, stdlib_corpus
from batchstring.export.layout import DEFAULT_MODEL_DIR

EOT = "<|endoftext|>"


@dataclass(frozen=True)
class TrainConfig:
    """Sized so that training fits in ~10 minutes on 2 cores and the weights in ~16 MB."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention, as in current Llama / Qwen models
    context_length: int = 512
    batch_size: int = 4
    steps: int = 700
    warmup_steps: int = 40
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_windows: int = 96


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All files as one id stream, each file followed by the end-of-text token."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def build_model(cfg: TrainConfig, eot_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def held_out_windows(stream: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    n = min(cfg.eval_windows, len(stream) // cfg.context_length)
    return stream[: n * cfg.context_length].reshape(n, cfg.context_length)


@torch.no_grad()
def bits_per_byte(model, windows: np.ndarray, token_bytes: list[bytes], unigram_logp: np.ndarray):
    """Model and unigram cross-entropy on the same predicted tokens, in bits per UTF-8 byte."""
    model.eval()
    nats = 0.0
    for row in windows:
        x = torch.from_numpy(row[None])
        logits = model(input_ids=x).logits[0, :-1]
        nats += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
    targets = windows[:, 1:].ravel()
    n_bytes = sum(len(token_bytes[t]) or 1 for t in targets)  # special tokens count as 1 byte
    unigram_nats = -float(unigram_logp[targets].sum())
    bits = 1 / (math.log(2) * n_bytes)
    return {
        "model_bits_per_byte": nats * bits,
        "unigram_bits_per_byte": unigram_nats * bits,
        "model_loss_nats_per_token": nats / len(targets),
        "unigram_loss_nats_per_token": unigram_nats / len(targets),
        "held_out_tokens": len(targets),
        "held_out_bytes": int(n_bytes),
    }


@torch.no_grad()
def sample_completion(model, tok: Tokenizer, prompt: str, new_tokens: int = 48) -> str:
    model.eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0].tolist())


def train(out_dir: Path = DEFAULT_MODEL_DIR, cfg: TrainConfig = TrainConfig(), corpus: Corpus | None = None) -> dict:
    console = Console()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rng = np.random.default_rng(cfg.seed)
    started = time.monotonic()

    corpus = corpus or stdlib_corpus()
    train_texts, held_texts = Corpus.read(corpus.train), Corpus.read(corpus.held_out)
    console.print(f"corpus: {len(train_texts)} train / {len(held_texts)} held-out files from {corpus.root.name}/")
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train_ids, held_ids = token_stream(tok, train_texts), token_stream(tok, held_texts)
    console.print(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids):,} train tokens")

    model = build_model(cfg, tok.token_to_id(EOT))
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    bar = tqdm(range(cfg.steps), desc=f"training {n_params / 1e6:.2f}M params", unit="step")
    ema = None
    for step in bar:
        starts = rng.integers(0, len(train_ids) - cfg.context_length, size=cfg.batch_size)
        x = torch.from_numpy(np.stack([train_ids[s : s + cfg.context_length] for s in starts]))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")

    # Ship bfloat16 weights (half the size); evaluate exactly what ships, upcast as export does.
    model = model.to(torch.bfloat16).float()
    report = evaluate(model, tok, train_ids, held_ids, cfg)
    report.update(parameters=n_params, train_tokens_seen=cfg.steps * cfg.batch_size * cfg.context_length,
                  train_seconds=round(time.monotonic() - started, 1), torch_threads=torch.get_num_threads(),
                  config=asdict(cfg))
    save(model, tok, out_dir, report)
    print_report(console, report)
    return report


def evaluate(model, tok: Tokenizer, train_ids: np.ndarray, held_ids: np.ndarray, cfg: TrainConfig) -> dict:
    counts = np.bincount(train_ids, minlength=cfg.vocab_size).astype(np.float64) + 1.0
    unigram_logp = np.log(counts / counts.sum())
    metrics = bits_per_byte(model, held_out_windows(held_ids, cfg), TextCodec(tok).token_bytes, unigram_logp)
    return {**metrics, "sample_prompt": "def ", "sample_completion": sample_completion(model, tok, "def ")}


def save(model, tok: Tokenizer, out_dir: Path, report: dict) -> None:
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=None, pad_token=EOT,
        model_max_length=model.config.max_position_embeddings,
    )
    hf_tok.save_pretrained(out_dir)
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def print_report(console: Console, report: dict) -> None:
    table = Table(title="held-out evaluation (Python stdlib, files never trained on)")
    for col in ("", "loss (nats/token)", "bits per byte"):
        table.add_column(col, justify="right")
    table.add_row("model", f"{report['model_loss_nats_per_token']:.3f}", f"{report['model_bits_per_byte']:.3f}")
    table.add_row("unigram", f"{report['unigram_loss_nats_per_token']:.3f}", f"{report['unigram_bits_per_byte']:.3f}")
    console.print(table)
    console.print(f"sample for {report['sample_prompt']!r}:\n{report['sample_completion']}")
