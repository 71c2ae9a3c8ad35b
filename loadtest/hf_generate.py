"""The `hf-generate` baseline: Hugging Face `generate` on padded static batches, in-process.

What a user would write without any serving system: take `batch` prompts, left-pad them, call
`generate` (greedy) for as many tokens as the longest request wants, return everyone's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchstring.export.layout import DEFAULT_MODEL_DIR
from batchstring.loadtest.workload import Item


@dataclass(frozen=True)
class BatchTiming:
    seconds: float
    items: list[Item]


class HFGenerate:
    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, padding_side="left")

    def run(self, items: list[Item], batch: int) -> list[BatchTiming]:
        timings = []
        for start in range(0, len(items), batch):
            chunk = items[start : start + batch]
            inputs = self.tokenizer([i.prompt for i in chunk], return_tensors="pt", padding=True)
            longest = max(i.max_tokens for i in chunk)
            began = time.perf_counter()
            with torch.no_grad():
                self.model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                    pad_token_id=self.tokenizer.pad_token_id)
            timings.append(BatchTiming(time.perf_counter() - began, chunk))
        return timings
