"""The engine's core: one iteration at a time — schedule, run, update, outputs.

No threads and no clocks of its own: tests, benchmarks and the serving shell (engine/serving.py)
drive it the same way, through `add`, `step`, `abort` and `generate`. A step passes values from
stage to stage, each stage the one owner of its part:
  scheduler.schedule()            -> ScheduledStep (rows and their work; owns the KV cache's blocks)
  speculator.propose(work)        -> drafts, given room by scheduler.grant_drafts (engine/speculation.py)
  isolation.run(work)             -> StepResult (what ran, what failed on its own, engine/isolation.py)
  speculator.verify(ran)          -> Ran, accepted tokens only
  scheduler.update(...)           -> the rows that ended (stop, length)
  structured.after_step(...)      -> grammars fed, forced runs appended (engine/structured_output.py)
  policy.defers / released        -> static batching's held answers (engine/policy.py)
and this module turns what the step did into each request's responses. Random numbers come from
one owner (engine/randomness.py).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np

from batchstring.engine.adapters import AdapterSlots, BaseShape, load_adapter
from batchstring.engine.batch import StepBatch, split_cost
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.config import INPUT_BYTES_PER_TOKEN, EngineConfig
from batchstring.engine.errors import EngineBroken, InvalidRequest
from batchstring.engine.faults import with_faults
from batchstring.engine.grammar import GrammarCompiler
from batchstring.engine.isolation import IsolatedStep, Ran, StepResult
from batchstring.engine.memory import plan_cache
from batchstring.engine.output import OutputSink, OutputStream, RequestOutput, TokenLogprob
from batchstring.engine.policy import policy_for
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.runner import PagedCacheRunner, RuntimeSpec, build_runner
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.scheduler import Scheduler
from batchstring.engine.sequence import Sequence
from batchstring.engine.speculation import Speculator
from batchstring.engine.stats import EngineStats
from batchstring.engine.structured_output import StructuredOutput
from batchstring.engine.tokenizer import TextCodec


class EngineCore:
    def __init__(self, config: EngineConfig, runner: PagedCacheRunner | None = None) -> None:
        self.config = config
        model_dir = Path(config.model_dir)
        self.spec = RuntimeSpec.load(model_dir / "runtime.json")
        self.codec = TextCodec.from_file(model_dir / "tokenizer.json", self.spec.vocab_size)
        self.cache = plan_cache(config, self.spec, model_dir)
        num_blocks = -(-self.cache.tokens // config.block_size)
        self.max_len = min(self.spec.context_length, num_blocks * config.block_size)
        self.max_input_bytes = config.input_bytes(self.spec.context_length)
        self._input_bytes_rule = ("max_input_bytes" if config.max_input_bytes else
                                  f"max_input_bytes auto: {INPUT_BYTES_PER_TOKEN} bytes per token of the model's "
                                  f"{self.spec.context_length}-token context")
        blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, self.max_len,
                              config.enable_prefix_caching, self.spec.window)
        self.stats = EngineStats()
        self.random = RandomStreams()
        self.policy = policy_for(config.scheduling)
        if (config.adapters or config.adapter_dir) and not self.spec.adapters:
            raise ValueError(f"{model_dir} was exported without adapters: export it again with `batchstring export "
                             "--adapters` to serve LoRA adapters")
        self.adapters = AdapterSlots(BaseShape.of(self.spec), config.max_adapters, _adapter_dtype(self.spec))
        for name, path in config.adapter_dirs().items():  # the configured ones must load: the server refuses to start
            self.adapters.add(load_adapter(name, path, self.adapters.base, self.adapters.dtype))
        self.scheduler = Scheduler(config, blocks, self.policy, self.spec.eos_token_ids, self.adapters)
        # Drafts only beside chunked prefill: rows that decode while prompts prefill (engine/speculation.py)
        drafting = config.enable_chunked_prefill and self.policy.chunks
        self.speculator = Speculator(config.speculative_tokens if drafting else 0, config.speculative_step_tokens,
                                     self.spec.eos_token_ids, self.stats, self.random)
        runner = runner or build_runner(config.runtime, model_dir, self.spec, num_blocks, config.block_size,
                                        config.device, config.threads, self.cache.arena_bytes,
                                        config.small_step_threads, config.cuda_graphs)
        runner.adapters = self.adapters
        self.runner = with_faults(runner, config.fault_marker)
        self.isolation = IsolatedStep(self.runner, blocks, self.stats, self.random, self.spec.eos_token_ids,
                                      max(1, self.spec.num_heads // self.spec.num_kv_heads), split_cost(config))
        self.grammars = GrammarCompiler(model_dir / "tokenizer.json", self.spec.vocab_size, self.spec.eos_token_ids)
        self.structured = StructuredOutput(self.grammars, self.spec.eos_token_ids, config.skip_forced_tokens,
                                           self.random)
        self._ids = itertools.count()

    # ----- requests in -------------------------------------------------------------------------

    def make_sequence(self, prompt: str, params: SamplingParams, sink: OutputSink, *, request_id: str | None = None,
                      stream: bool = False, include_input: bool = False, group: int = 0,
                      deadline: float | None = None, cache_salt: bytes = b"", priority: int = 1,
                      adapter: str | None = None) -> Sequence:
        """Tokenises and checks a request against the model's and the cache's limits (any thread).
        `adapter`: the served LoRA adapter it runs with (its blocks are cached apart from others')."""
        lora = self.adapters.check(adapter) if adapter else None
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        if size > self.max_input_bytes:
            raise InvalidRequest(f"text_input is {size} bytes; at most {self.max_input_bytes} bytes are allowed "
                                 f"({self._input_bytes_rule}); the prompt and max_tokens together may hold at "
                                 f"most {self.max_len} tokens")
        try:
            ids = self.codec.encode(prompt)
        except ValueError as exc:
            raise InvalidRequest(f"text_input: {exc}") from None
        if not ids:
            raise InvalidRequest("text_input is empty; send at least one character")
        if len(ids) + params.max_tokens > self.max_len:
            limit = "the model's context" + ("" if self.max_len == self.spec.context_length else " / KV cache")
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens and max_tokens is {params.max_tokens}; their sum must be at most "
                f"{self.max_len} ({limit}); shorten the prompt or lower max_tokens")
        if params.logit_bias and params.logit_bias[-1][0] >= self.spec.vocab_size:
            raise InvalidRequest(f"sampling_parameters.logit_bias names token id {params.logit_bias[-1][0]}; "
                                 f"the model's token ids are 0 to {self.spec.vocab_size - 1}")
        request_id = request_id or f"req-{next(self._ids)}"
        output = OutputStream(request_id, prompt, len(ids), sink, self.codec, params, stream=stream,
                              include_input=include_input)
        if lora is not None:  # the same prompt under another adapter has other keys and values
            cache_salt += b"\0adapter:" + lora.key
        seq = Sequence(request_id, ids, params, output, group=group, deadline=deadline, cache_salt=cache_salt,
                       priority=priority, adapter=lora)
        self.structured.attach(seq)  # compiled here, on the caller's thread: never on the step's path
        return seq

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def abort(self, seq: Sequence, why: str) -> None:
        """Stops work nobody will read (cancelled, past its deadline, its caller unreachable): its
        cache is freed now and it gets a final `abort` response."""
        if seq.finished or seq.padding:
            return  # answered already, or in all but delivery
        self.stats.cancelled += 1
        self._finish(seq, "abort", error=why)

    def expire(self, now: float) -> None:
        """Aborts every request whose caller's deadline has passed."""
        for seq in [s for s in self.scheduler.all() if s.deadline is not None and now > s.deadline]:
            self.abort(seq, "the request's deadline passed before it finished")

    def drain(self, error: str) -> None:
        """Answers every request held, with a retryable `error` (shutdown, a broken engine)."""
        for seq in self.scheduler.all():
            if seq.padding:
                self._deliver_deferred(seq, self.policy.take(seq))
            else:
                self.fail(seq, error)

    def fail(self, seq: Sequence, error: str) -> None:
        """A retryable error for a request the engine cannot serve."""
        if not seq.finished:
            self.scheduler.retire(seq)
            seq.output.deliver(seq.output.final(seq.output_ids, "abort", error, retryable=True))

    # ----- the step ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration; False when there was nothing to run. Raises EngineBroken when the device
        fails every step (see engine/isolation.py)."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            self._update_gauges()  # requests may have left without a step (aborted, expired)
            return False
        work = scheduled.work
        drafts = self.speculator.propose(work)
        if drafts:
            work = self.scheduler.grant_drafts(work, drafts)
        result = self.isolation.run(work)
        self._check(result)
        ran = [self.speculator.verify(r) for r in result.ran]  # drafts: accepted tokens only
        ended = [self._update(r) for r in ran]
        self._respond(scheduled.prefill, ran, ended, result.failed)
        return True

    def _check(self, result: StepResult) -> None:
        """Admissions back off after a step too big for memory; a step that failed for every
        request raises EngineBroken when a one-token probe step fails too (engine/isolation.py)."""
        if result.oversized is not None:
            self.scheduler.lower_admit_cap(result.oversized)
        if result.failed and not result.ran:
            probe = self.isolation.probe()
            with self.scheduler.scratch(probe, 1) as room:  # no room to ask: not evidence of a broken device
                if room and not self.isolation.device_works(probe):
                    raise EngineBroken("every request of a step failed and so did a one-token probe step "
                                       f"({result.failed[0][1]})")

    def _update(self, r: Ran) -> dict[Sequence, str]:
        """The rows of `r` that ended, with why, once the scheduler and structured output took its tokens."""
        ended = self.scheduler.update(r.work, r.batch.sampled, r.out.tokens)
        forced = self.structured.after_step(r.batch.sampled, r.out.tokens, ended)
        self.stats.forced_tokens += forced
        self.stats.generated_tokens += forced
        return ended

    def generate(self, seqs: list[Sequence]) -> None:
        """In-process use: runs until every sequence is answered. If the engine breaks, every one of
        them gets its error and EngineBroken is raised at once."""
        for seq in seqs:
            self.add(seq)
        while any(not s.finished for s in seqs):
            try:
                self.step()
            except EngineBroken as exc:
                self.drain(str(exc))
                raise

    def warm_up(self) -> None:
        """Throw-away steps before serving: the runtime's first-run work (allocations, kernel
        selection) is not paid by the first callers; stats start after it."""
        params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, ignore_eos=True)
        seqs = [self.make_sequence("def warm_up(x):\n" * (i + 1), params, lambda out: None) for i in range(4)]
        try:
            self.generate(seqs)
        except EngineBroken as exc:
            raise EngineBroken(f"warm-up failed on {self.config.device} with {self.config.runtime}: {exc}") from None
        self.stats.reset()

    # ----- after the step ----------------------------------------------------------------------

    def _respond(self, prefill: bool, ran: list[Ran], ended: list[dict[Sequence, str]],
                 failed: list[tuple[Sequence, BaseException]]) -> None:
        self.stats.record_step(sum(len(r.work) for r in ran) + len(failed), prefill)
        for r, finished in zip(ran, ended):
            self._record_tokens(r.batch, prefill)
            rows = [i for i, seq in enumerate(r.batch.sampled) if seq.output.per_token and not seq.padding]
            if rows:
                self._push_tokens(r, rows, finished)
            for seq, reason in finished.items():
                if not seq.finished:
                    error = seq.constraint.error if reason == "error" else None  # its grammar's dead end
                    self._finish(seq, reason, error, ended_by_eos=reason == "stop",
                                 code="INVALID_ARG" if error else None)
        for seq, exc in failed:
            self.stats.failures_isolated += 1
            self._finish(seq, "error", error=f"model step failed for this request: {exc}")
        for seq, final in self.policy.released(self.scheduler.running, self.max_len):
            self._deliver_deferred(seq, final)
        self._update_gauges()

    def _record_tokens(self, batch: StepBatch, prefill: bool) -> None:
        self.stats.generated_tokens += len(batch.sampled)
        if prefill:
            now = time.monotonic()
            for seq in batch.sampled:
                if seq.first_token_at is None:
                    seq.first_token_at = now
                    self.stats.prompt_tokens += len(seq.prompt_ids)

    def _push_tokens(self, r: Ran, rows: list[int], finished: dict[Sequence, str]) -> None:
        """Text (streamed pieces, stop strings) and log-probabilities, for the rows that need them."""
        sample_index = None
        sampled = r.batch.sampled
        for i in rows:
            seq = sampled[i]
            token = int(r.out.tokens[i])
            if seq.finished or (finished.get(seq) == "stop" and token in self.scheduler.eos):
                continue  # cut by a stop string at an earlier token of its draft row, or an end-of-sequence token

            entry = None
            if seq.params.logprobs is not None:  # such rows are always among the sampled ones
                if sample_index is None:
                    sample_index = {int(row): m for m, row in enumerate(r.batch.inputs.sampling.sample_rows)}
                m, n = sample_index[i], seq.params.logprobs
                top = tuple(zip(r.out.top_ids[m, :n].tolist(), r.out.top_logprobs[m, :n].tolist()))
                entry = TokenLogprob(token, float(r.out.logprobs[m]), top)
            if seq.output.push(token, len(seq.output_ids), entry):
                later = next((j for j, s in enumerate(sampled[i + 1 :]) if s is not seq), len(sampled) - i - 1)
                del seq.output_ids[len(seq.output_ids) - later :]  # kept drafts past the stop string
                finished.pop(seq, None)
                self._finish(seq, "stop", cut=True)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, *, ended_by_eos: bool = False,
                cut: bool = False, code: str | None = None) -> None:
        final = seq.output.final(seq.output_ids, reason, error, ended_by_eos=ended_by_eos, cut=cut, code=code)
        self.stats.record_finish(reason)
        if error is None and self.policy.defers(seq, final, self.scheduler.running):
            return  # static batching: answered with the rest of its batch
        self.policy.forget(seq)
        self.scheduler.retire(seq)
        seq.output.deliver(final)

    def _deliver_deferred(self, seq: Sequence, final: RequestOutput) -> None:
        self.scheduler.retire(seq)
        seq.output.deliver(final)

    def _update_gauges(self) -> None:
        """The current-state figures of `stats` (the metrics publisher reads them)."""
        s, scheduler, blocks = self.stats, self.scheduler, self.scheduler.blocks
        s.running, s.waiting = len(scheduler.running), len(scheduler.waiting)
        s.kv_usage, s.preemptions = blocks.usage, scheduler.preemptions
        s.prefix_query_tokens, s.prefix_hit_tokens = blocks.query_tokens, blocks.hit_tokens
        s.cached_blocks = blocks.cached_blocks



def _adapter_dtype(spec: RuntimeSpec) -> np.dtype:
    """Adapters are held in the export's dtype; bfloat16 ones in float32 on the host (numpy has no
    bfloat16), cast as the runner moves them to the device."""
    return np.dtype("float32" if spec.dtype == "bfloat16" else spec.dtype)
