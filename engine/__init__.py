"""The batchstring engine: continuous batching of LLM requests over one device, without Triton.

One idea per module: `engine` (the loop and the step), `scheduler` (who runs next, and what a
step did to them), `policy` (continuous or static batching), `block_manager` (the paged KV cache's
blocks), `batch` (the step's inputs, built as arrays), `runner` (the exported step on ONNX Runtime
or TorchScript), `sequence` (a request's tokens and cache state), `output` (its text, stop strings
and responses), `sampling` (its parameters), `tokenizer`, `stats`, `config`, `errors`.
`model_repository/llm/1/model.py` adapts it to Triton.
"""
