"""The engine loop: admit, step, sample, stream, retire — one step at a time on one device.

Requests come in from any thread through `submit`; everything else happens on the engine's own
thread (or in the caller's, for in-process use through `generate`). A step that raises is split
in halves and retried, so only a request that fails on its own gets an error.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequest, is_out_of_memory
from engine.runner import Runner, RuntimeSpec, build_batch, build_runner
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledStep, Scheduler
from engine.sequence import OutputSink, RequestOutput, Sequence
from engine.tokenizer import TextCodec

_STOP = object()
# Asking whether a request was cancelled is a round trip to Triton (~50 us). Running sequences
# are asked every step (their cache must be freed within one iteration); waiting ones hold no
# cache and are asked at most this often.
WAITING_CANCEL_CHECK_SECONDS = 0.1


@dataclass
class EngineStats:
    """Monotonic counters and current gauges; read by the metrics publisher from another thread."""

    steps: int = 0
    prefill_steps: int = 0
    step_seqs: int = 0  # sum of step batch sizes: step_seqs / steps = mean batch
    last_step_size: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    failures_isolated: int = 0
    oom_events: int = 0
    cancelled: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    step_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> steps of that size


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        self.config = config
        model_dir = Path(config.model_dir)
        self.spec = RuntimeSpec.load(model_dir / "runtime.json")
        self.codec = TextCodec.from_file(model_dir / "tokenizer.json", self.spec.vocab_size)
        num_blocks = -(-config.kv_cache_tokens // config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.runner = runner or build_runner(config.runtime, model_dir, self.spec, num_blocks * config.block_size,
                                             config.device, config.threads)
        self.scheduler = Scheduler(config, self.blocks)
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Condition()
        self._stopping = False
        self._waiting_checked = 0.0
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

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
        limit = min(self.spec.context_length, self.blocks.num_blocks * self.blocks.block_size)
        if len(ids) + params.max_tokens > limit:
            raise InvalidRequest(
                f"prompt is {len(ids)} tokens and max_tokens is {params.max_tokens}; their sum must be at most "
                f"{limit} (the model's context{'' if limit == self.spec.context_length else ' / KV cache'}); "
                "shorten the prompt or lower max_tokens"
            )
        return Sequence(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt=prompt,
            prompt_ids=ids,
            params=params,
            sink=sink,
            decoder=self.codec.stream_decoder(),
            stream=stream,
            include_input=include_input,
            group=group,
            is_cancelled=is_cancelled or (lambda: False),
        )

    def warm_up(self) -> None:
        """Runs a few throw-away steps before serving, so that the runtime's first-run work
        (allocations, kernel selection) is not paid by the first callers; stats start after it."""
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        self.generate([self.make_sequence("def warm_up(x):\n" * (i + 1), params, lambda out: None)
                       for i in range(4)])
        self.stats = EngineStats()

    def submit(self, *seqs: Sequence) -> None:
        """Thread-safe; the sequences join at the next iteration."""
        for seq in seqs:
            self._inbox.put(seq)

    def queued(self) -> int:
        return self._inbox.qsize() + len(self.scheduler.waiting)

    def wait_for_room(self) -> None:
        """Blocks while `max_waiting_seqs` requests are already queued (backpressure to the caller)."""
        with self._room:
            self._room.wait_for(lambda: self._stopping or self.queued() < self.config.max_waiting_seqs)

    # ----- the loop ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchstring-engine", daemon=True)
        self._thread.start()

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
        while True:
            busy = self.scheduler.has_work()
            try:
                item = self._inbox.get(block=not busy, timeout=None)
            except queue.Empty:
                item = None
            if item is _STOP or not self._take(item):
                break
            self.step()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.held:
                self._release(seq)
            else:
                self._finish(seq, "abort", error="the model is shutting down; retry on another instance")

    def _take(self, first: object) -> bool:
        """Moves everything queued into the scheduler; False when asked to stop."""
        item = first
        while item is not None:
            if item is _STOP:
                return False
            self.scheduler.add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        return True

    def step(self) -> bool:
        """One iteration. Returns False when there was nothing to do."""
        self._drop_cancelled()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            self._update_gauges()
            return False
        results = self._run(scheduled.seqs)
        self._record(scheduled)
        for seq, outcome in results:
            if isinstance(outcome, BaseException):
                self.stats.failures_isolated += 1
                self._finish(seq, "error", error=f"model step failed for this request: {outcome}")
            else:
                self._advance(seq, outcome)
        self._release_completed_groups()
        self._update_gauges()
        return True

    def generate(self, seqs: list[Sequence]) -> None:
        """In-process use without a thread: submit and step until every sequence is finished."""
        for seq in seqs:
            self.scheduler.add(seq)
        while any(not s.finished for s in seqs):
            self.step()

    # ----- one step, isolated ------------------------------------------------------------------

    def _run(self, seqs: list[Sequence]) -> list[tuple[Sequence, np.ndarray | BaseException]]:
        """Runs the step; on failure bisects so that only sequences failing alone are failed."""
        try:
            self._inject_fault(seqs)
            logits = self.runner.step(build_batch(seqs, self.blocks.block_size))
        except Exception as exc:  # any runtime failure: isolate it, never kill the loop
            if is_out_of_memory(exc):
                self.stats.oom_events += 1
                if len(seqs) > 1:
                    self.scheduler.lower_cap(len(seqs))
            if len(seqs) == 1:
                return [(seqs[0], exc)]
            mid = len(seqs) // 2
            return self._run(seqs[:mid]) + self._run(seqs[mid:])
        for seq in seqs:
            seq.num_cached = seq.num_tokens
        return list(zip(seqs, logits))

    def _inject_fault(self, seqs: list[Sequence]) -> None:
        marker = self.config.fault_marker
        if marker and any(marker in s.prompt for s in seqs):
            raise MemoryError(f"out of memory (injected: a prompt in this step contains {marker!r})")

    # ----- after the step ----------------------------------------------------------------------

    def _advance(self, seq: Sequence, logits: np.ndarray) -> None:
        if seq.held:  # a padding row of a static batch: computed like the others, output discarded
            seq.output_ids.append(int(np.argmax(logits)))
            if seq.num_tokens >= self.spec.context_length:
                self._release(seq)
            return
        p = seq.params
        early = len(seq.output_ids) < p.min_tokens
        banned = list(self.spec.eos_token_ids) if early and not p.ignore_eos else []
        token = seq.sampler(logits, banned)
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            self.stats.prompt_tokens += len(seq.prompt_ids)
        if token in self.spec.eos_token_ids and not p.ignore_eos:
            self._finish(seq, "stop")
            return
        seq.text += seq.decoder.push(token)
        if not early and p.stop and self._cut_at_stop(seq):
            self._finish(seq, "stop", flush=False)  # held-back bytes were after the stop string
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.spec.context_length:
            self._finish(seq, "length")
        elif seq.stream:
            self._emit(seq, finished=False)

    @staticmethod
    def _cut_at_stop(seq: Sequence) -> bool:
        longest = max(map(len, seq.params.stop))
        start = max(0, len(seq.text) - longest - 8)  # new matches can only end in the new piece
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    def _emit(self, seq: Sequence, finished: bool, reason: str | None = None, error: str | None = None) -> None:
        out = self._output(seq, finished, reason, error)
        if out is not None:
            seq.sink(out)

    def _output(self, seq: Sequence, finished: bool, reason: str | None, error: str | None) -> RequestOutput | None:
        """What is safe to show now (text that may still become a stop string is held back)."""
        piece = ""
        if error is None:
            hold = 0 if finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
            end = max(seq.emitted, len(seq.text) - hold)
            piece = seq.text[seq.emitted : end] if seq.stream else seq.text
            seq.emitted = end
            if seq.include_input and not seq.responses:
                piece = seq.prompt + piece
            if not piece and not finished:
                return None
        seq.responses += 1
        return RequestOutput(seq.request_id, piece, finished, reason, len(seq.prompt_ids), len(seq.output_ids), error)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True) -> None:
        if flush and error is None:
            seq.text += seq.decoder.flush()
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        out = self._output(seq, True, reason, error)
        if reason in ("stop", "length") and self._batch_still_running(seq):
            seq.held = out  # static: the answer waits for the batch, the row keeps computing
            return
        self.scheduler.retire(seq)
        with contextlib.suppress(Exception):  # a vanished client must not take the loop down
            seq.sink(out)

    def _batch_still_running(self, seq: Sequence) -> bool:
        """Static scheduling is request-level batching: a batch holds its rows and its answers
        until its longest sequence is done (as a padded `generate` call does)."""
        return self.config.scheduling == "static" and any(
            s.group == seq.group and s is not seq and not s.held for s in self.scheduler.running)

    def _release(self, seq: Sequence) -> None:
        out, seq.held = seq.held, None
        self.scheduler.retire(seq)
        with contextlib.suppress(Exception):
            seq.sink(out)

    def _release_completed_groups(self) -> None:
        if self.config.scheduling != "static":
            return  # only static scheduling holds rows; skip the scan on the continuous hot path
        held = [s for s in self.scheduler.running if s.held]
        for seq in held:
            if not self._batch_still_running(seq):
                self._release(seq)

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        candidates = list(self.scheduler.running)
        if now - self._waiting_checked >= WAITING_CANCEL_CHECK_SECONDS:
            candidates += self.scheduler.waiting
            self._waiting_checked = now
        for seq in candidates:
            if seq.held:
                continue  # already answered in all but delivery
            if seq.is_cancelled():
                self.stats.cancelled += 1
                self._finish(seq, "abort")

    def _record(self, step: ScheduledStep) -> None:
        s = self.stats
        n = len(step.seqs)
        s.steps += 1
        s.step_seqs += n
        s.last_step_size = n
        s.step_sizes[n] = s.step_sizes.get(n, 0) + 1
        if step.prefill:
            s.prefill_steps += 1

    def _update_gauges(self) -> None:
        s = self.stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.kv_usage = self.blocks.usage
        s.preemptions = self.scheduler.preemptions
        if self.queued() < self.config.max_waiting_seqs:
            with self._room:
                self._room.notify_all()

