"""Triton-free LLM engine: sequences, a scheduler, a paged KV cache and a model runner."""
