"""The engine loop: admit, step, respond, retire — one step at a time on one device.

Requests come in from any thread through `submit`; everything else happens on the engine's own
thread (or in the caller's, for in-process use through `generate`). A step that raises is split
in halves and retried, so only a request that fails on its own gets an error.

The engine also knows when it is broken rather than unlucky: an error in its own loop, a step
that does not return (`stall_seconds`), or a device that fails every step (a step in which every
request failed, followed by a one-token probe step that fails too). Then every request it holds
gets a retryable error, it accepts nothing more, and `on_broken` tells its host (model.py turns
the model's readiness off, so that it is restarted).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.batch import StepBatch, Work, build_step
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.config import EngineConfig
from batchstring.engine.errors import InvalidRequest, is_out_of_memory
from batchstring.engine.faults import FaultInjector
from batchstring.engine.memory import auto_cache_tokens, free_bytes, weight_bytes
from batchstring.engine.output import OutputSink, OutputStream, TokenLogprob
from batchstring.engine.policy import policy_for
from batchstring.engine.runner import PagedCacheRunner, RuntimeSpec, StepOutput, build_runner
from batchstring.engine.sampling import SamplingParams
from batchstring.engine.scheduler import Scheduler
from batchstring.engine.sequence import Sequence
from batchstring.engine.stats import EngineStats
from batchstring.engine.tokenizer import TextCodec

_STOP = object()
WATCHDOG_SECONDS = 1.0


@dataclass(frozen=True)
class _Abandon:
    seq: Sequence
    why: str

# Asking whether a request was cancelled is a round trip to Triton (~50 us), so it happens at
# most this often (for every request at once), never per row per step.
CANCEL_CHECK_SECONDS = 0.1


class Engine:
    def __init__(self, config: EngineConfig, runner: PagedCacheRunner | None = None,
                 on_broken: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_broken = on_broken
        self.broken: str | None = None  # why the engine stopped serving, once it has
        model_dir = Path(config.model_dir)
        self.spec = RuntimeSpec.load(model_dir / "runtime.json")
        self.codec = TextCodec.from_file(model_dir / "tokenizer.json", self.spec.vocab_size)
        num_blocks = -(-(config.kv_cache_tokens or self._auto_cache_tokens(model_dir)) // config.block_size)
        self.max_len = min(self.spec.context_length, num_blocks * config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.max_num_seqs, self.max_len,
                                   config.enable_prefix_caching)
        self.runner = runner or build_runner(config.runtime, model_dir, self.spec, num_blocks * config.block_size,
                                             config.device, config.threads)
        self.policy = policy_for(config.scheduling)
        self.scheduler = Scheduler(config, self.blocks, self.policy, self.spec.eos_token_ids)
        self.stats = EngineStats()
        self.rng = np.random.default_rng()  # the random numbers of requests without a seed
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Condition()
        self._room_waiters = 0
        self._stopping = False
        self._checked_at = 0.0
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.faults = FaultInjector(config.fault_marker)
        self._step_started: float | None = None  # set while a step runs: the watchdog reads it

    def _auto_cache_tokens(self, model_dir: Path) -> int:
        free, source = free_bytes(self.config.device)
        return auto_cache_tokens(free, self.config.kv_cache_memory_fraction,
                                 weight_bytes(model_dir, self.config.runtime), self.spec.bytes_per_token,
                                 self.config.block_size, self.spec.context_length, source)

    # ----- requests in -------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: str,
        params: SamplingParams,
        sink: OutputSink,
        *,
        request_id: str | None = None,
        stream: bool = False,
        include_input: bool = False,
        group: int = 0,
        deadline: float | None = None,
        is_cancelled: Callable[[], bool] | None = None,
    ) -> Sequence:
        """Tokenises and checks a request against the model's and the cache's limits."""
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        if size > self.config.max_input_bytes:
            raise InvalidRequest(
                f"text_input is {size} bytes; at most {self.config.max_input_bytes} bytes are allowed"
            )
        try:
            ids = self.codec.encode(prompt)
        except ValueError as exc:
            raise InvalidRequest(f"text_input: {exc}") from None
        if not ids:
            raise InvalidRequest("text_input is empty; send at least one character")
        if len(ids) + params.max_tokens > self.max_len:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens and max_tokens is {params.max_tokens}; their sum must be at most "
                f"{self.max_len} (the model's context"
                f"{'' if self.max_len == self.spec.context_length else ' / KV cache'}); "
                "shorten the prompt or lower max_tokens"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        output = OutputStream(request_id, prompt, len(ids), sink, self.codec, params, stream=stream,
                              include_input=include_input, is_cancelled=is_cancelled)
        return Sequence(request_id, ids, params, output, group=group, deadline=deadline)

    def warm_up(self) -> None:
        """Runs a few throw-away steps before serving, so that the runtime's first-run work
        (allocations, kernel selection) is not paid by the first callers; stats start after it."""
        params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, ignore_eos=True)
        self.generate([self.make_sequence("def warm_up(x):\n" * (i + 1), params, lambda out: None)
                       for i in range(4)])
        self.stats = EngineStats()

    def submit(self, *seqs: Sequence) -> None:
        """Thread-safe; the sequences join at the next iteration (a broken engine refuses them)."""
        for seq in seqs:
            if self.broken:
                self._fail_retryable(seq)
            else:
                self._inbox.put(seq)

    def abandon(self, seq: Sequence, why: str) -> None:
        """Thread-safe: stop a request nobody will read (cancelled, its caller unreachable); its
        cache is freed at the next iteration and it gets a final `abort` response."""
        self._inbox.put(_Abandon(seq, why))

    def queued(self) -> int:
        return self._inbox.qsize() + len(self.scheduler.waiting)

    def wait_for_room(self) -> None:
        """Blocks while `max_waiting_seqs` requests are already queued (backpressure to the caller)."""
        with self._room:
            self._room_waiters += 1
            try:
                self._room.wait_for(lambda: self._stopping or self.queued() < self.config.max_waiting_seqs)
            finally:
                self._room_waiters -= 1

    # ----- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchstring-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watchdog, name="batchstring-watchdog", daemon=True).start()

    def stop(self) -> None:
        """Aborts what is left (each request gets its final response) and joins the thread."""
        with self._room:
            self._stopping = True
            self._room.notify_all()
        if self._thread:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        try:
            while not self.broken:
                busy = self.scheduler.has_work()
                try:
                    item = self._inbox.get(block=not busy, timeout=None)
                except queue.Empty:
                    item = None
                if item is _STOP or not self._take(item):
                    break
                self.step()
        except Exception as exc:  # a bug outside step isolation: nothing the engine holds is safe
            self._break(f"the engine loop failed ({type(exc).__name__}: {exc})")
        if self.broken:
            return
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.held:
                self._release(seq)
            else:
                self._finish(seq, "abort", error="the model is shutting down; retry on another instance",
                             retryable=True)

    def _break(self, why: str) -> None:
        """Stops serving for good: every request held gets a retryable error; the host is told."""
        if self.broken:
            return
        self.broken = why
        held = [*self.scheduler.running, *self.scheduler.waiting]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Sequence):
                held.append(item)
        for seq in held:
            if seq.held:
                self._release(seq)  # answered in all but delivery
            elif not seq.finished:
                self._fail_retryable(seq)
        with self._room:
            self._stopping = True
            self._room.notify_all()
        if self.on_broken:
            self.on_broken(why)

    def _fail_retryable(self, seq: Sequence) -> None:
        seq.output.deliver(seq.output.final(seq.output_ids, "abort", f"the model's engine failed ({self.broken}); "
                                            "it is being restarted: retry", retryable=True))

    def _watchdog(self) -> None:
        """From its own thread: a step that does not return breaks the engine (the engine thread
        cannot notice, it is the one stuck)."""
        while self._thread is not None and not self.broken:
            time.sleep(WATCHDOG_SECONDS)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.config.stall_seconds:
                self.broken = f"a step has not returned for {self.config.stall_seconds:g} s"
                if self.on_broken:
                    self.on_broken(self.broken)

    def _take(self, first: object) -> bool:
        """Moves everything queued into the scheduler; False when asked to stop."""
        item = first
        while item is not None:
            if item is _STOP:
                return False
            if isinstance(item, _Abandon):
                if not item.seq.finished and not item.seq.held:
                    self._abandon(item.seq, item.why)
            else:
                self.scheduler.add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        return True

    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        began = time.perf_counter()
        self._drop_abandoned()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            self._update_gauges()
            return False
        self.stats.record_step(len(scheduled.work), scheduled.prefill)
        if self.faults.marker:
            self.faults.in_loop([w.seq.output.prompt for w in scheduled.work])
        self._step_started = time.monotonic()
        done, failed = self._run(scheduled.work)
        self._step_started = None
        if failed and not done and not self._probe():
            self._break(f"every request of a step failed and so did a one-token probe step ({failed[0][1]})")
            return True
        for work, batch, out in done:
            self._after(work, batch, out, scheduled.prefill)
        for seq, exc in failed:
            self.stats.failures_isolated += 1
            self._finish(seq, "error", error=f"model step failed for this request: {exc}")
        for seq in self.policy.releasable(self.scheduler.running, self.max_len):
            self._release(seq)
        self._update_gauges()
        self.stats.step_seconds += time.perf_counter() - began
        return True

    def generate(self, seqs: list[Sequence]) -> None:
        """In-process use without a thread: submit and step until every sequence is finished."""
        for seq in seqs:
            self.scheduler.add(seq)
        while any(not s.finished for s in seqs):
            self.step()

    # ----- one step, isolated ------------------------------------------------------------------

    def _run(self, work: list[Work]) -> tuple[list[tuple[list[Work], StepBatch, StepOutput]],
                                              list[tuple[Sequence, BaseException]]]:
        """Runs the step; on failure bisects so that only sequences failing alone are failed.

        Admissions back off only when the step failed because of its size: the whole batch
        failed and both halves then succeeded.
        """
        try:
            if self.faults.marker:
                self.faults.before_step([w.seq.output.prompt for w in work])
            batch = build_step(work, self.blocks, self.rng)
            began = time.perf_counter()
            out = self.runner.step(batch)
            self.stats.runner_seconds += time.perf_counter() - began
            return [(work, batch, out)], []
        except Exception as exc:  # any runtime failure: isolate it, never kill the loop
            if is_out_of_memory(exc):
                self.stats.oom_events += 1
            if len(work) == 1:
                return [], [(work[0].seq, exc)]
            mid = len(work) // 2
            left, right = self._run(work[:mid]), self._run(work[mid:])
            if is_out_of_memory(exc) and not left[1] and not right[1]:
                self.scheduler.lower_admit_cap(len(work))
            return left[0] + right[0], left[1] + right[1]

    def _probe(self) -> bool:
        """Whether the device still runs a step: one token of a throw-away sequence (a step in
        which every request failed may just be a step of requests that fail on their own)."""
        probe = Sequence("probe", [self.spec.eos_token_ids[0] if self.spec.eos_token_ids else 0],
                         SamplingParams(max_tokens=1, temperature=0.0))
        if not self.blocks.can_grow(probe, 1):
            return True  # no room to ask; not evidence of a broken device
        self.blocks.grow(probe, 1)
        try:
            self.faults.before_step([])
            self.runner.step(build_step([Work(probe, 1)], self.blocks, self.rng))
            return True
        except Exception:
            return False
        finally:
            self.blocks.release(probe)

    # ----- after the step ----------------------------------------------------------------------

    def _after(self, work: list[Work], batch: StepBatch, out: StepOutput, prefill: bool) -> None:
        sampled = batch.sampled
        ended = dict(self.scheduler.update(work, sampled, out.tokens))
        self.stats.generated_tokens += len(sampled)
        if prefill:
            now = time.monotonic()
            for seq in sampled:
                if seq.first_token_at is None:
                    seq.first_token_at = now
                    self.stats.prompt_tokens += len(seq.prompt_ids)
        per_token = [i for i, seq in enumerate(sampled) if seq.output.per_token and not seq.held]
        if per_token:
            self._push_tokens(batch, out, per_token, ended)
        for seq, reason in ended.items():
            if not seq.finished:
                self._finish(seq, reason, ended_by_eos=reason == "stop")

    def _push_tokens(self, batch: StepBatch, out: StepOutput, rows: list[int], ended: dict) -> None:
        """Text (streamed pieces, stop strings) and log-probabilities, for the rows that need them."""
        sample_index = None
        for i in rows:
            seq = batch.sampled[i]
            if ended.get(seq) == "stop":
                continue  # an end-of-sequence token: no text
            token = int(out.tokens[i])
            entry = None
            if seq.params.logprobs is not None:  # such rows are always among the sampled ones
                if sample_index is None:
                    sample_index = {int(r): m for m, r in enumerate(batch.feeds["sample_rows"])}
                m, n = sample_index[i], seq.params.logprobs
                top = tuple(zip(out.top_ids[m, :n].tolist(), out.top_logprobs[m, :n].tolist()))
                entry = TokenLogprob(token, float(out.logprobs[m]), top)
            if seq.output.push(token, len(seq.output_ids), entry):
                ended.pop(seq, None)
                self._finish(seq, "stop", cut=True)
            elif seq.output.failed is not None:
                ended.pop(seq, None)
                self._abandon(seq, f"the response could not be sent ({seq.output.failed})")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, *, retryable: bool = False,
                ended_by_eos: bool = False, cut: bool = False) -> None:
        out = seq.output.final(seq.output_ids, reason, error, retryable=retryable, ended_by_eos=ended_by_eos, cut=cut)
        self.stats.record_finish(reason)
        if error is None and self.policy.hold(seq, self.scheduler.running):
            seq.output.held = out  # the row keeps computing until its batch is done
            return
        self.scheduler.retire(seq)
        seq.output.deliver(out)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.retire(seq)
        seq.output.deliver(seq.output.held)

    def _abandon(self, seq: Sequence, why: str) -> None:
        """Stops work nobody will read: cancelled, past its deadline, or its caller unreachable."""
        self.stats.cancelled += 1
        self._finish(seq, "abort", error=why)

    def _drop_abandoned(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < CANCEL_CHECK_SECONDS:
            return
        self._checked_at = now
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.held:
                continue  # already answered in all but delivery
            why = seq.output.abandoned(now, seq.deadline)
            if why:
                self._abandon(seq, why)

    def _update_gauges(self) -> None:
        s = self.stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.kv_usage = self.blocks.usage
        s.preemptions = self.scheduler.preemptions
        s.prefix_query_tokens, s.prefix_hit_tokens = self.blocks.query_tokens, self.blocks.hit_tokens
        s.cached_blocks = self.blocks.cached_blocks
        if self._room_waiters and self.queued() < self.config.max_waiting_seqs:
            with self._room:
                self._room.notify_all()
