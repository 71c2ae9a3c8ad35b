"""The batchstring engine: continuous batching of LLM requests over one device, without Triton.

One idea per module. `core` is the engine itself: a step passes values from stage to stage
(schedule -> drafts -> run -> verify -> update -> outputs), driven in-process by tests and
benchmarks and by `serving`, the shell that adds the engine's thread, inbox, backpressure,
watchdog, health and stop path. `scheduler` (who runs next, and what a step did to them; it owns
`block_manager`, the paged KV cache's blocks and prefix cache), `policy` (continuous or static
batching, static's held answers included), `isolation` (running a step so that only a request that
fails alone fails), `batch` (the step's inputs, built as arrays), `block_table` (the block table
and how a step's attention walks it), `cuda_graph_padding` (decode steps padded to static shapes
for CUDA graphs), `runner` (the exported step on ONNX Runtime or TorchScript, fed the typed inputs
of export/contract.py), `speculation` (drafts proposed and verified), `structured_output` (a
grammar's part in each step: masks, tokens fed, forced runs) over `grammar` (compiling grammars,
computing masks), `randomness` (every random stream a sampled row draws from), `sequence` (a
request's tokens and cache state), `output` (its text, stop strings and responses), `sampling_params`
(its parameters), `memory` (the cache's size), `cores` (the CPUs this process may use), `faults`
(test-only fault injection), `tokenizer`, `stats`, `config`, `errors`.
`model_repository/llm/1/model.py` adapts the serving shell to Triton.
"""
