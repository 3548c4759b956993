"""Slots and the request queue of the server. One worker thread runs one request at a time (slots
run in turn, never batched); each slot keeps the KV state (`Session`) of its last conversation so
that a request continuing it reuses the longest common token prefix. Knows nothing of HTTP.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine import GenerationResult, Model, Session, common_prefix
from ..errors import ExpertCacheError

# A slot's cached tokens count as the request's conversation when their common prefix covers
# at least this fraction of the request or of the slot (llama-server's --slot-prompt-similarity
# is the first half of this rule); otherwise the least recently used slot is taken, so that two
# conversations sharing only a system prompt do not keep evicting each other.
SIMILARITY = 0.5
# Requests that may wait for the worker (`--max-queue`); more are refused (`QueueFull`). Each holds
# its connection, its prompt and its parsed body; an unbounded queue under load only grows until
# its clients time out.
MAX_QUEUE = 64


class ShuttingDown(ExpertCacheError):
    """What a job queued, running or submitted once `Scheduler.stop` began gets: the API answers
    503 `server_shutting_down` (a last error event in a stream that has begun)."""

    status = 503
    code = "server_shutting_down"

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message)


class QueueFull(ExpertCacheError):
    """What a job submitted while one runs and `max_queue` others wait gets: the API answers 503
    `server_overloaded` with `Retry-After` (the server, not this client, is over its load: a
    load balancer tries another replica, and OpenAI's clients retry after the delay)."""

    status = 503
    code = "server_overloaded"
    # Short: a place frees as soon as one request ends, and clients back off further on their own.
    retry_after = 1

    def __init__(self, max_queue: int):
        super().__init__(f"the server is busy: its queue is full (--max-queue {max_queue}: at most {max_queue} "
                         "request(s) wait while one runs); try again later")


@dataclass(slots=True)
class Slot:
    id: int
    session: Session | None = None  # created on first use; holds up to the context of one slot
    last_used: int = 0              # a tick of the scheduler; 0 = never used

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens if self.session is not None else []


def choose_slot(slots: list[Slot], ids: list[int], cache_prompt: bool = True) -> Slot:
    """The slot whose cached tokens share the longest prefix with `ids` (ties: the least recently
    used), if that prefix is a real match (see SIMILARITY); else the least recently used slot."""
    lru = min(slots, key=lambda s: s.last_used)
    if not cache_prompt:
        return lru
    best, best_n = lru, -1
    for s in sorted(slots, key=lambda s: s.last_used):
        n = common_prefix(s.tokens, ids)
        if n > best_n:
            best, best_n = s, n
    if best_n > 0 and (best_n >= SIMILARITY * len(ids) or best_n >= SIMILARITY * len(best.tokens)):
        return best
    return lru


@dataclass
class Job:
    """One request: prompt ids and generate() keyword arguments. Callbacks run on the worker thread."""

    ids: list[int]
    gen: dict
    cache_prompt: bool = True
    on_text: Callable[[str], None] | None = None
    on_done: Callable[[GenerationResult | None, BaseException | None], None] = lambda res, err: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    slot: int | None = None  # the slot that served it, once it ran


@dataclass
class Stats:
    """Server counters since start; they only grow (exposed as Prometheus `_total` counters)."""

    requests: int = 0           # every request the worker took: aborted and failed ones too
    aborted: int = 0
    errors: int = 0
    prompt_tokens: int = 0      # processed prompt tokens (not reused from the prompt cache)
    cached_tokens: int = 0      # prompt tokens reused from a slot's KV state
    predicted_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_seconds: float = 0.0
    processing: int = 0         # gauge: requests running now (0 or 1)
    deferred: int = 0           # gauge: requests waiting in the queue
    refused: int = 0            # requests refused because the queue was full (never taken)

    def record(self, res: GenerationResult) -> None:
        self.requests += 1
        self.aborted += res.finish_reason == "abort"
        self.prompt_tokens += res.prompt_processed
        self.cached_tokens += res.cached_tokens
        self.predicted_tokens += len(res.token_ids)
        self.prompt_seconds += res.prompt_seconds
        self.predicted_seconds += res.gen_seconds


class Scheduler:
    """A FIFO queue of jobs served by one worker thread over `n_slots` KV sessions; at most
    `max_queue` jobs wait while the worker is busy (0: none)."""

    def __init__(self, model: Model, n_slots: int = 1, cache_prompt: bool = True, max_queue: int = MAX_QUEUE):
        if n_slots < 1:
            raise ValueError(f"n_slots {n_slots} must be at least 1")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue {max_queue!r} must be an integer >= 0")
        self.model, self.cache_prompt, self.max_queue = model, cache_prompt, max_queue
        self.slots = [Slot(i) for i in range(n_slots)]
        self.stats = Stats()
        self._lock = threading.Lock()  # guards stats against a concurrent /metrics scrape
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._tick = 0
        self._thread: threading.Thread | None = None
        self._current: Job | None = None
        self.stopping = threading.Event()  # set by stop(): no job runs or waits from then on

    def start(self) -> None:
        old = self._thread
        if old is not None and self.stopping.is_set():
            # A stop() gave up on a worker still inside a job that ignores cancellation. A second
            # worker beside it would run the one model from two threads: wait for it to end (at
            # the stop's sentinel, once its job returns).
            old.join()
            self._thread = None
        if self._thread is None:
            self.stopping.clear()  # an app started again after a stop serves again
            self._thread = threading.Thread(target=self._run, name="expertcache-worker", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End every job with `ShuttingDown` and wait for the worker to end: a running one stops
        at its next token (or prefill micro-batch), queued ones are dropped unrun, and later
        submits are answered at once. The slots' KV state stays consistent (as for a client that
        left). Safe to call again."""
        with self._lock:  # a submit() either queued its job before this (drained below) or sees `stopping`
            self.stopping.set()
        current = self._current
        if current is not None:
            current.cancelled.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self.stats.deferred -= 1
                job.cancelled.set()
                job.on_done(None, ShuttingDown())
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None  # else kept: start() waits for it rather than run a second worker

    def submit(self, job: Job) -> None:
        """Queue `job`, or end it at once: with `ShuttingDown` once stop() began, with
        `QueueFull` when it would wait behind `max_queue` others."""
        with self._lock:
            if self.stopping.is_set():
                err: ExpertCacheError = ShuttingDown()
            elif self._live_deferred() + self.stats.processing > self.max_queue:
                self.stats.refused += 1
                err = QueueFull(self.max_queue)
            else:
                self.stats.deferred += 1
                self._queue.put(job)
                return
        job.on_done(None, err)

    def _live_deferred(self) -> int:
        """Jobs submitted and not yet running whose client still waits (with the lock held).
        `stats.deferred` keeps a job the worker has taken from the queue until it counts it as
        processing: read from the queue alone, that job counted nowhere, and one more was let wait.
        A queued job whose client left waits for nobody: the worker drops it unrun."""
        with self._queue.mutex:
            left = sum(1 for job in self._queue.queue if job is not None and job.cancelled.is_set())
        return self.stats.deferred - left

    def snapshot(self) -> Stats:
        with self._lock:
            s = Stats(**{k: getattr(self.stats, k) for k in Stats.__dataclass_fields__})
            s.deferred = self._live_deferred()
            return s

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self.stats.deferred -= 1
                self.stats.processing += 1
            self._current = job
            try:
                res, err = self._serve(job)
            finally:
                self._current = None
                with self._lock:
                    self.stats.processing -= 1
            # Only now: a client that sends its next request as soon as it has its answer found
            # this one still processing, and was refused at --max-queue (0: at once).
            job.on_done(res, err)

    def _serve(self, job: Job) -> tuple[GenerationResult | None, BaseException | None]:
        """Run `job`; what its `on_done` is to get."""
        stopping = self.stopping.is_set()  # stop() began as the worker took the job
        if job.cancelled.is_set() or stopping:  # the client left while the request was queued
            with self._lock:  # counted in `requests` too: aborted and failed are parts of it
                self.stats.requests += 1
                self.stats.aborted += 1
            return None, ShuttingDown() if stopping else None
        use_cache = self.cache_prompt and job.cache_prompt
        slot = choose_slot(self.slots, job.ids, use_cache)
        self._tick += 1
        slot.last_used, job.slot = self._tick, slot.id

        def on_text(piece: str) -> bool:
            if job.on_text is not None:
                job.on_text(piece)
            return not job.cancelled.is_set()

        # Asked between prefill micro-batches: a client that left stops its prompt there.
        extra = {"should_stop": job.cancelled.is_set}
        try:
            # Made here, inside the try: a session that cannot be made (out of memory) fails this
            # request only; raised outside, it ended the worker and no request was answered again.
            if slot.session is None:
                slot.session = self.model.new_session()
            if not use_cache:
                slot.session.truncate(0)
            res = self.model.generate(job.ids, session=slot.session, on_text=on_text, **job.gen, **extra)
        except Exception as e:  # noqa: BLE001 - reported to the waiting request; the worker keeps serving
            # Dropped, not truncated: its KV state may be half-written, and its buffers may be
            # shaped for weights since replaced. The next request on the slot makes a new one.
            slot.session = None
            with self._lock:
                self.stats.requests += 1
                self.stats.errors += 1
            return None, e
        with self._lock:
            self.stats.record(res)
        if res.finish_reason == "abort" and self.stopping.is_set():
            return None, ShuttingDown()  # cut short by stop(), not by its client
        return res, None
