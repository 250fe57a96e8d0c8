"""In-process generation with a transformers causal LM (the debug backbone's engine), built for agents.

Continuous batching (Yu et al. 2022, "Orca"): one worker thread runs decode steps over the rows in flight. Before
each step it admits the requests that have arrived (up to `max_batch_size` rows): each is prefilled on its own
and joins the running batch at that step; a row that finishes (end-of-turn, stop string, max_tokens) leaves
the batch at once and its caller is answered. The batch's KV cache is one transformers `DynamicCache` whose
layers are slabs written in place (`ajet/engines/kv_slab.py`: a decode step writes its column, a joining row is
written into a free row, a leaving row's place is taken by the batch's last row; the whole cache is copied only
when the slab runs out of rows or columns), left-padded to the longest row (each row's tokens are a contiguous
suffix of the columns; the attention mask hides the padding, position ids count each row's own tokens).

Logits only where a token is sampled: prefill asks the model for the last position only (`logits_to_keep=1`),
never `[rows, prompt, vocab]`.

Prefix reuse (`ajet/engines/prefix_cache.py`): every prefilled prompt and every finished sequence leaves its
KV in a bounded LRU cache, and a new prompt prefills only the tokens after the longest stored prefix it shares
(an episode's next call extends its last one token for token; a GRPO group's episodes share their first
prompt). Entries from older weights are never used.

Queue time: a request waits in the queue until a row is free (more requests than `max_batch_size`) and the
worker is not stepping aside for an update; it reports the wait to its `ajet.engines.base.QueueTicket` (queued on
arrival, admitted when its prefill starts), so that an episode's timeout does not count it.

Sampling: each row samples (`sample_rows`: torch.multinomial's exponential race, batched) with its own request's
temperature and top_p, from its own random generator (seeded by the request's `seed`, else drawn from the engine's
generator when the request is admitted), so a request's tokens do not depend on which other requests share its
steps. The distribution is `ajet.sampling_dist.processed_logprobs` (logits / T, nucleus-truncated to top_p,
renormalised); the token's logprob under it is recorded, the quantity the trainer recomputes, so the PPO ratio is 1
before the first update. Temperature 0 is greedy decoding: the argmax token, its logprob recorded under T=1 with no
truncation (report only; greedy tokens have no sampling distribution and are not trained on as sampled).

LoRA adapter per agent role (`agents:` in the config): with `adapter_for`, each request is served with the adapter
of the agent that made it (`ajet.engines.base.calling_agent()`, read when the request arrives); a batch may mix adapters:
every forward passes peft's `adapter_names` (one per row, peft's mixed-adapter batch inference), so a row's tokens
and logprobs are those of its own adapter whichever rows share its steps. Prefix-cache entries are per adapter.

Weights: the worker holds `weights_lock` (a `WeightsLock`) while it has rows in flight, and steps aside between two
decode steps as soon as an update (or a checkpoint) waits for it; it resumes once the update has released it. An
update therefore lands between two tokens of a completion in flight, never inside a forward pass (asynchronous
training: rollouts keep decoding across updates, as in PipelineRL's in-flight weight updates, Piche et al. 2025).
What a completion records: each token the version of the weights that sampled it (`Completion.token_versions`
when they differ, the call's `policy_version` being the first token's), and the logprob under those weights; the
keys/values of its earlier tokens stay those the older weights computed (the row's cache is not recomputed), so
after a swap the recorded logprobs are the behaviour policy's exactly, and the trainer's importance-sampling
correction (`ajet.algorithm.loss.truncated_is_weights`) accounts for the difference to its own policy. Prefix-cache
entries are tagged with the version that started them and are never reused after an update.

Serving while training (`switch_weights`; the gateway, docs/gateway.md): the engine serves a model that the update
does not train (the trainer trains its own copy), so decoding never stops for an update. The new weights come in
by a switch that queues like a request: the worker admits nothing past it, lets the rows in flight finish on the
weights they started with, copies the new weights in between two decode steps (under `weights_lock`, no row in
the batch), then admits again. Every completion is then sampled by one version, the one it records.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from transformers import DynamicCache

from ajet.engines.kv_slab import drop_moves, slab_cache
from ajet.engines.prefix_cache import KV, PrefixCache
from ajet.engines.base import QueueTicket, TokenCallback, calling_agent, queue_ticket
from ajet.heap import trim_free_memory
from ajet.llm_call import Completion, SamplingParams, TokenDelta
from ajet.sampling_dist import processed_logprobs

if TYPE_CHECKING:
    from ajet.config import AjetConfig


class WeightsLock:
    """A lock that the engine's worker holds while decoding and yields at its next step boundary to any thread
    that waits for it (`with lock:`: an update, a checkpoint), so an update never waits for the engine to run
    out of work, and never lands inside a decode step.

    `with lock:` (any thread but the worker) blocks until the worker is between steps; the worker uses
    `acquire_when_free` (waits while anyone else asks) and `wanted` (someone asks: release now).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._waiting = 0

    def __enter__(self) -> WeightsLock:
        with self._cv:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cv:
                self._waiting -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
        with self._cv:
            self._cv.notify_all()

    def wanted(self) -> bool:
        """Whether another thread waits for the lock."""
        return self._waiting > 0

    def acquire_when_free(self) -> None:
        """The worker's acquire: first let every waiting thread have its turn."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting == 0)
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()
        with self._cv:
            self._cv.notify_all()


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_tokens: TokenCallback | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)
    ticket: QueueTicket | None = None      # the caller's account of this request's queue time (`ajet.engines.base`)
    adapter: str | None = None             # the LoRA adapter serving it (None: the model as it is)
    cancelled: bool = False                # its caller stopped waiting: never admitted, its row leaves unanswered

    def fail(self, exc: BaseException) -> None:
        _post(self.loop, _resolve, self.future, None, exc)


_WAKE = object()   # a queue item that only wakes the worker


class _Switch:
    """A weight switch waiting in the engine's queue (`HFEngine.switch_weights`): `apply` runs on the worker once
    every row admitted before it has finished; `done` is set after, with `error` when it raised or the engine
    stopped."""

    def __init__(self, apply: Callable[[], None], version: int):
        self.apply, self.version = apply, version
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.queued_at = time.perf_counter()
        self.drained_at: float | None = None     # when the rows in flight had finished (the copy starts)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


@dataclass
class _Row:
    """One request in flight: its sampling distribution, generator and what it has produced."""

    req: _Request
    temperature: float            # the distribution's temperature (1 for greedy rows: their logprob is under T=1)
    top_p: float                  # nucleus mass (1 for greedy rows)
    greedy: bool                  # temperature 0 asked: argmax decoding
    generator: torch.Generator    # this row's draws only
    budget: int                   # most tokens to sample
    version: int                  # policy version at admission
    n_ctx: int = 0                # tokens whose keys/values this row has in the cache
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)   # the version that sampled each token
    out_top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None


def sample_rows(logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from `logits` `[B, vocab]` (each row's last position).

    A sampled row draws by the exponential race that `torch.multinomial(probs, 1)` runs on the CPU (the Gumbel-max
    trick written with exponentials: token = argmax_i p_i / q_i, q_i ~ Exp(1) drawn per vocabulary entry from the row's
    generator), written out for the whole batch: the uniform numbers come from each row's generator (float64, as
    torch's `exponential_` draws them), `q = -log1p(-u)` is taken for all rows in one vectorised call. The tokens and
    the generators' states after are bit for bit those of `torch.multinomial` on each row (tested), at about half its
    cost (35 -> 17 ms for 32 rows of SmolLM2's 49k entries on the 2-core CPU). Each token has its own noise, so a
    float-rounding change of the probabilities moves a draw only where two tokens' p_i / q_i nearly tie: weights
    that differ by rounding (another backbone's update) sample the same tokens for a seed, which inverting one CDF
    (every boundary moves) does not give.

    Returns:
        (logprobs `[B, vocab]` float32 under each row's processed distribution (-inf outside its nucleus),
        tokens `[B]` long on the CPU: a draw from that distribution with the row's generator (never outside the
        nucleus: p_i = 0 there, so p_i / q_i = 0), or the argmax for greedy rows).
    """
    device = logits.device
    temperature = torch.tensor([r.temperature for r in rows], device=device)    # [B]
    top_p = torch.tensor([r.top_p for r in rows], device=device)                # [B]
    logprobs = processed_logprobs(logits, temperature, top_p)                   # [B, V]
    tokens = logits.argmax(-1).cpu()                                            # [B]
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        chosen = logprobs if len(sampled) == len(rows) else logprobs[torch.tensor(sampled, device=device)]
        probs = chosen.exp().cpu()                                              # [S, V] float32, 0 outside the nucleus
        u = torch.empty(probs.shape, dtype=torch.float64)                       # [S, V] ~ U[0, 1)
        for k, i in enumerate(sampled):
            u[k].uniform_(generator=rows[i].generator)
        q = torch.log1p(u.neg_()).neg_().to(torch.float32)                      # [S, V] ~ Exp(1), as exponential_
        q.clamp_(min=torch.finfo(torch.float32).tiny)                           # u = 0 (p 2^-53) gives p / tiny, not 0 / 0
        tokens[sampled] = (probs / q).argmax(-1)                                # [S]
    return logprobs, tokens


class HFEngine:
    """Continuous-batching sampler over a `transformers` causal LM that lives in this process.

    Args:
        model: a `PreTrainedModel` (its weights are shared with the trainer: updates are served at once).
        eos_token_ids: ids that end a completion (end-of-turn and end-of-text).
        pad_token_id: kept for callers; padding columns are masked, their ids never reach the model.
        max_batch_size: most rows decoded together; later requests wait for a row to finish.
        max_model_len: prompt + completion limit, tokens.
        decode_fn: ids -> text, used only to check `stop` strings.
        batch_wait_s: when the engine is idle and a request arrives, how long (seconds) to wait for others
            before the first step (episodes that start together are admitted together).
        prefix_cache_bytes: byte budget of the KV prefix cache (0 disables prefix reuse).
        adapter_for: agent tag (`ajet.engines.base.calling_agent()`, None outside the proxy) -> the name of the peft LoRA
            adapter of `model` that serves the call; None: every call is served by the model as it is.
        heap_trim_interval_s: when rows leave the batch, hand the C heap's free memory back to the system
            (`ajet.heap.trim_free_memory`) if this many seconds have passed since the last time; 0: never.
            The worker's freed KV blocks stay in its malloc arena otherwise (a 160-problem evaluation of the
            main job held 3.3 GB of them). A 160-problem `ajet eval` of the main job peaked at 5.62 GB resident with
            5 s, 4.51 GB with 1 s and 4.07 GB with 0.2 s (216-252 s each, the same answers), measured while every
            join and leave still copied the batch's slabs; with rows joining in place, 3.57 GB at 1 s.

    Attributes:
        policy_version: the optimizer step of the weights served; the trainer bumps it after an update.
        weights_lock: a `WeightsLock`, held by the worker while rows are in flight; the trainer takes it to
            update (the worker steps aside between two decode steps).
        generated_tokens, prefilled_tokens: totals so far (tokens sampled; prompt tokens run through the model).
        prefix_cache: the `PrefixCache` (its `reused_tokens` are the prompt tokens not prefilled).
    """

    def __init__(self, model, eos_token_ids: list[int], pad_token_id: int, max_batch_size: int = 32,
                 max_model_len: int = 4096, decode_fn=None, batch_wait_s: float = 0.02,
                 prefix_cache_bytes: int = 1 << 30, adapter_for: Callable[[str | None], str] | None = None,
                 heap_trim_interval_s: float = 1.0):
        self.model = model
        self.heap_trim_interval_s = heap_trim_interval_s
        self._last_trim = time.perf_counter()
        self.adapter_for = adapter_for
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.decode_fn = decode_fn
        self.batch_wait_s = batch_wait_s
        self.policy_version = 0
        self.weights_lock = WeightsLock()
        self.generated_tokens = 0
        self.prefilled_tokens = 0
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._queue: queue.Queue[_Request | _Switch | object | None] = queue.Queue()
        self._switch: _Switch | None = None   # a weight switch taken from the queue: no admission until it is done
        self._pending_switches = 0
        self._drop_prefixes = threading.Event()   # `drop_prefixes` asked: the worker clears before its next step
        self._generator = torch.Generator(device="cpu").manual_seed(0)
        self._rng_lock = threading.Lock()      # the generator's draws against `rng_state` from another thread
        self._closed = False
        # the running batch: rows in flight, their cache [B, kv_heads, L, head_dim] per layer, mask [B, L]
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._attn: torch.Tensor | None = None
        self._was_training = False
        self._cache_kw = _cache_kwarg(model)
        self._worker = threading.Thread(target=self._run, name="ajet-engine", daemon=True)
        self._worker.start()

    # ---- public API -------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """Reseed the engine's generator (calls that pass their own `seed` are unaffected)."""
        with self._rng_lock:
            self._generator.manual_seed(seed)

    def rng_state(self) -> torch.Tensor:
        """The engine's generator state (what seeds requests without a `seed`), for a checkpoint; safe from any
        thread while the engine decodes."""
        with self._rng_lock:
            return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state from `rng_state`; safe from any thread."""
        with self._rng_lock:
            self._generator.set_state(state)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """Queue one prompt and await its completion; `on_tokens` hears of every token as it is sampled.
        See `ajet.engines.base.Engine.generate`.

        Cancelling the awaiting task (a closed episode, a proxy stopping) frees the request's row before the next
        decode step, or takes it out of the queue.

        Raises:
            ValueError: the prompt does not leave room for one token in `max_model_len`, or is empty.
            RuntimeError: the engine failed during this request's steps, or is shut down.
        """
        if self._closed:
            raise RuntimeError("engine is shut down")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the context holds {self.max_model_len}")
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, loop, loop.create_future(), on_tokens, ticket=queue_ticket(),
                       adapter=self.adapter_for(calling_agent()) if self.adapter_for is not None else None)
        if req.ticket is not None:
            req.ticket.queued()          # until `_admit` starts its prefill: time the episode's timeout skips
        self._queue.put(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True         # read by the worker before its next step (`_drop_cancelled`)
            raise

    def switch_weights(self, apply: Callable[[], None], version: int) -> dict[str, float]:
        """Serve new weights as policy `version` without cutting any completion in two (serving while training:
        the update trained another copy of the weights, and `apply` copies them into the served model).

        The switch queues behind the requests already waiting; once the worker takes it, it admits nothing more,
        lets every row in flight finish on the weights it started with (bounded by their `max_tokens`), then runs
        `apply()` on the worker thread under `weights_lock` (between two decode steps, no row in the batch),
        moves `policy_version`, forgets the cached prefixes, and admits again: requests queued after the switch
        are answered by the new weights only. Blocks the calling thread (never the worker's) until done.

        Returns:
            `weight_switch_s` (seconds from the call to the new weights serving) and `weight_copy_s` (of that, the
            `apply` itself; the rest is the rows in flight finishing).

        Raises:
            RuntimeError: the engine is shut down (or stopped before the switch).
            Exception: whatever `apply` raised (the old weights stay served, `policy_version` unchanged).
        """
        if self._closed:
            raise RuntimeError("engine is shut down")
        sw = _Switch(apply, version)
        self._pending_switches += 1
        try:
            self._queue.put(sw)
            sw.done.wait()
        finally:
            self._pending_switches -= 1
        if sw.error is not None:
            raise sw.error
        end = time.perf_counter()
        return {"weight_switch_s": end - sw.queued_at, "weight_copy_s": end - (sw.drained_at or end)}

    def drop_prefixes(self) -> None:
        """Free the cached prefixes without waiting: the worker clears `prefix_cache` before its next step (at
        once when idle). Serving while training, the update asks it so that its own memory does not come on top
        of them; it never waits for a decode step."""
        self._drop_prefixes.set()
        self._queue.put(_WAKE)

    @property
    def pending_switches(self) -> int:
        """Weight switches asked for and not yet done (queued, or waiting for the rows in flight to finish)."""
        return self._pending_switches

    @property
    def active_rows(self) -> int:
        """Requests being decoded now (rows of the running batch; a snapshot, from any thread)."""
        return len(self._rows)

    def raise_if_failed(self) -> None:
        """Nothing to check: the engine generates in this process and starts no server (see `Engine`)."""

    def close(self) -> None:
        """Stop the worker thread; requests in flight or queued fail with RuntimeError."""
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=30)

    # ---- worker -----------------------------------------------------------------------------------
    def _run(self) -> None:
        holding = False
        stopping = False
        while not stopping:
            if self._drop_prefixes.is_set():
                self._drop_prefixes.clear()
                self.prefix_cache.clear()
                trim_free_memory()
            if holding and self.weights_lock.wanted():   # an update waits: let it in between two decode steps
                self._release()
                holding = False
            joiners, stopping = self._take_new() if self._switch is None else ([], False)
            if stopping or self._closed:         # close() also stops a full batch that reads no queue
                stopping = True
                for req in joiners:
                    req.fail(RuntimeError("engine is shut down"))
                break
            try:
                if (joiners or self._rows) and not holding:
                    self.weights_lock.acquire_when_free()
                    holding = True
                    self._was_training = self.model.training
                    self.model.eval()
                with torch.inference_mode():
                    self._drop_cancelled()
                    self._admit([req for req in joiners if not req.cancelled])
                    if self._rows:
                        self._decode_step()
            except Exception as exc:  # noqa: BLE001 - every waiting request must hear about it
                self._fail_all(exc, joiners)
            if self._switch is not None and not self._rows:   # the rows before the switch are done: switch now
                if not holding:
                    self.weights_lock.acquire_when_free()
                    holding = True
                    self._was_training = self.model.training
                self._do_switch()
            if holding and not self._rows:
                self._release()
                holding = False
        if holding:
            self._release()
        self._fail_all(RuntimeError("engine is shut down"), [])
        if self._switch is not None:
            self._switch.fail(RuntimeError("engine is shut down"))
        while not self._queue.empty():
            req = self._queue.get_nowait()
            if req is not None and req is not _WAKE:
                req.fail(RuntimeError("engine is shut down"))

    def _do_switch(self) -> None:
        """Run the pending switch (worker thread, `weights_lock` held, no row in flight)."""
        sw, self._switch = self._switch, None
        sw.drained_at = time.perf_counter()
        try:
            with torch.no_grad():
                sw.apply()
            self.policy_version = sw.version
            self.prefix_cache.clear()            # computed by the weights just replaced
        except BaseException as exc:  # noqa: BLE001 - the caller hears of it; the worker serves on
            sw.fail(exc)
            return
        sw.done.set()

    def _release(self) -> None:
        if self._was_training:
            self.model.train()
        self.weights_lock.release()

    def _take_new(self) -> tuple[list[_Request], bool]:
        """Requests to admit before the next step (as many as free rows allow) and whether to stop. Idle: block
        for the first, then gather what arrives within `batch_wait_s`. Busy: only what is already queued. A weight
        switch (`_Switch`) ends the gathering: nothing more is admitted until it is done."""
        free = self.max_batch_size - len(self._rows)
        idle = not self._rows
        taken: list[_Request] = []
        deadline = 0.0
        while len(taken) < free:
            try:
                if not idle:
                    nxt = self._queue.get_nowait()
                elif not taken:
                    nxt = self._queue.get()              # idle: wait for the first
                else:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if nxt is None:
                if idle and taken:
                    self._queue.put(None)                # seen again on the next call: stop after this step
                    break
                return taken, True
            if nxt is _WAKE:                             # only wakes the worker (e.g. `drop_prefixes`)
                if idle and not taken:
                    return [], False
                continue
            if isinstance(nxt, _Switch):
                self._switch = nxt
                break
            taken.append(nxt)
            if idle and len(taken) == 1:
                deadline = time.perf_counter() + self.batch_wait_s
        return taken, False

    def _drop_cancelled(self) -> None:
        """Rows whose caller stopped waiting (`_Request.cancelled`) leave the batch unanswered: nobody reads their
        tokens, and the row serves the queue instead of decoding to the request's `max_tokens`."""
        gone = [i for i, r in enumerate(self._rows) if r.req.cancelled]
        if gone and len(gone) == len(self._rows):
            self._rows, self._cache, self._attn = [], None, None
        elif gone:
            self._drop_rows(gone)

    def _fail_all(self, exc: BaseException, joiners: list[_Request]) -> None:
        """Fail every row in flight and every request taken but not yet a row; reset the batch."""
        for req in [r.req for r in self._rows] + joiners:   # answered ones ignore it (see `_resolve`)
            req.fail(exc)
        self._rows, self._cache, self._attn = [], None, None

    def _new_row(self, req: _Request) -> _Row:
        p = req.params
        greedy = p.temperature == 0
        if p.seed is not None:
            seed = p.seed
        else:
            with self._rng_lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        budget = max(1, min(p.max_tokens, self.max_model_len - len(req.prompt_ids)))
        return _Row(req, 1.0 if greedy else p.temperature, 1.0 if greedy else p.top_p, greedy,
                    torch.Generator(device="cpu").manual_seed(seed), budget, self.policy_version)

    def _admit(self, joiners: list[_Request]) -> None:
        """Prefill each joiner (only the tokens after its longest cached prefix; logits at its last position
        only), sample its first token, and add the rows still going to the running batch."""
        if not joiners:
            return
        device = next(self.model.parameters()).device
        rows, kvs, logits = [], [], []
        for req in joiners:
            if req.ticket is not None:
                req.ticket.admitted()
            row = self._new_row(req)
            prompt = req.prompt_ids
            r, past = self.prefix_cache.lookup(prompt, row.version, req.adapter)
            cache = DynamicCache(past) if past is not None else DynamicCache()
            try:
                new = torch.tensor([prompt[r:]], device=device)                         # [1, n_new]
                out = self.model(input_ids=new, position_ids=torch.arange(r, len(prompt), device=device)[None],
                                 attention_mask=torch.ones((1, len(prompt)), dtype=torch.long, device=device),
                                 use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}, **self._adapters([req]))
            except Exception as exc:  # noqa: BLE001 - this prompt failed (e.g. an id outside the vocabulary)
                req.fail(RuntimeError(f"prefill failed: {type(exc).__name__}: {exc}"))
                continue
            self.prefilled_tokens += len(prompt) - r
            kv = [(layer.keys, layer.values) for layer in cache.layers]   # [1, H, len(prompt), D] (filled in place)
            self.prefix_cache.insert(prompt, kv, row.version, req.adapter)   # the group's other episodes open with it
            row.n_ctx = len(prompt)
            rows.append(row)
            kvs.append(kv)
            logits.append(out.logits[0, -1])
        if not rows:
            return
        self._record(rows, torch.stack(logits))                                         # [J, V]
        for row in rows:
            if row.finish is not None:
                self._answer(row)
        self._join([(row, kv) for row, kv in zip(rows, kvs) if row.finish is None])

    def _join(self, joining: list[tuple[_Row, KV]]) -> None:
        """Append rows (each with its cache, `[1, H, n, D]` per layer) to the running batch, every row left-padded to
        the longest so that each row's last token sits in the last column: the first rows make the slabs
        (`kv_slab.slab_cache`), later ones are written into them in place (`SlabLayer.append_rows`)."""
        if not joining:
            return
        lens = [kv[0][0].shape[2] for _, kv in joining]
        L_old = 0 if self._cache is None else self._attn.shape[1]
        L = max([L_old, *lens])
        device = joining[0][1][0][0].device
        if self._cache is None:
            self._cache = slab_cache([kv for _, kv in joining])                       # [B', H, L, D] per layer
        else:
            for li, layer in enumerate(self._cache.layers):
                layer.append_rows([kv[li] for _, kv in joining], self.max_batch_size)
        masks = [_pad_left(torch.ones((1, n), dtype=torch.long, device=device), L - n) for n in lens]
        if self._attn is not None:
            masks.insert(0, _pad_left(self._attn, L - L_old))
        self._attn = torch.cat(masks, dim=0)                                            # [B', L]
        self._rows += [row for row, _ in joining]

    def _decode_step(self) -> None:
        """Feed every row its last sampled token, sample the next, and let finished rows leave."""
        device = self._attn.device
        B = len(self._rows)
        input_ids = torch.tensor([[r.out_ids[-1]] for r in self._rows], device=device)          # [B, 1]
        position_ids = torch.tensor([[r.n_ctx] for r in self._rows], device=device)            # [B, 1]
        self._attn = torch.cat([self._attn, torch.ones((B, 1), dtype=torch.long, device=device)], dim=1)
        out = self.model(input_ids=input_ids, attention_mask=self._attn, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: self._cache},
                         **self._adapters([r.req for r in self._rows]))
        for r in self._rows:
            r.n_ctx += 1
        self._record(self._rows, out.logits[:, -1])
        done = [i for i, r in enumerate(self._rows) if r.finish is not None]
        if done:
            self._leave(done)

    def _record(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Sample one token per row from `logits` `[B, V]`; record it, stream it, and mark finished rows."""
        logprobs, tokens = sample_rows(logits, rows)
        token_lp = logprobs.gather(1, tokens.to(logprobs.device)[:, None]).squeeze(1).tolist()   # [B]
        k_top = max(r.req.params.top_logprobs for r in rows)
        if k_top:
            top_lp, top_ids = (x.tolist() for x in logprobs.topk(k_top, dim=-1))             # [B, k_top] each
        for i, row in enumerate(rows):
            tok = int(tokens[i])
            row.out_ids.append(tok)
            row.out_lp.append(token_lp[i])
            row.out_versions.append(self.policy_version)
            k = row.req.params.top_logprobs
            tops = [list(zip(top_ids[i][:k], top_lp[i][:k]))] if k else None
            if k:
                row.out_top.append(tops[0])
            if row.req.on_tokens is not None:
                _post(row.req.loop, row.req.on_tokens, TokenDelta([tok], [token_lp[i]], tops))
            if tok in self.eos_token_ids or self._hit_stop(row.out_ids, row.req.params.stop):
                row.finish = "stop"
            elif len(row.out_ids) >= row.budget:
                row.finish = "length"
        self.generated_tokens += len(rows)

    def _leave(self, done: list[int]) -> None:
        """Answer the finished rows at indices `done`, keep their KV for the episode's next call, and drop them
        (and the padding columns no row needs any more) from the batch."""
        L = self._attn.shape[1]
        for i in done:
            row = self._rows[i]
            kv = [(layer.keys[i:i + 1, :, L - row.n_ctx:].clone(), layer.values[i:i + 1, :, L - row.n_ctx:].clone())
                  for layer in self._cache.layers]                                  # [1, H, n_ctx, D]
            self.prefix_cache.insert(row.req.prompt_ids + row.out_ids[:-1], kv, row.version, row.req.adapter)
            self._answer(row)
        if len(done) == len(self._rows):
            self._rows, self._cache, self._attn = [], None, None
        else:
            self._drop_rows(done)
        if self.heap_trim_interval_s and time.perf_counter() - self._last_trim >= self.heap_trim_interval_s:
            trim_free_memory()          # freed slabs and evicted prefixes: handed back
            self._last_trim = time.perf_counter()

    def _drop_rows(self, done: list[int]) -> None:
        """Drop the batch rows at indices `done`, in place: the staying rows at or past the new batch size take their
        places (`kv_slab.drop_moves`; the batch's order changes, which nothing reads), then the leading columns no
        staying row needs are dropped."""
        src, dst = drop_moves(len(self._rows), done)
        size = len(self._rows) - len(done)
        for s, d in zip(src, dst):
            self._rows[d] = self._rows[s]
        del self._rows[size:]
        device = self._attn.device
        src_t, dst_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)   # [k] each
        if src:
            self._attn[dst_t] = self._attn[src_t]
        attn = self._attn[:size]                                # [B', L]
        first = int(attn.any(0).long().argmax())                # leading columns that are padding in every row
        for layer in self._cache.layers:
            layer.drop_rows(src_t, dst_t, size)                 # one row copied per leaving row before the new end
            layer.trim_front(first)
        self._attn = attn[:, first:]

    def _adapters(self, reqs: list[_Request]) -> dict[str, list[str]]:
        """The forward's `adapter_names` keyword (peft: one adapter per batch row) for rows serving `reqs`, or
        nothing when the engine serves no adapters."""
        return {"adapter_names": [r.adapter for r in reqs]} if self.adapter_for is not None else {}

    def _answer(self, row: _Row) -> None:
        mixed = any(v != row.version for v in row.out_versions)      # an update landed while it decoded
        c = Completion(row.out_ids, row.out_lp, row.finish or "length", row.version,
                       row.out_top if row.req.params.top_logprobs else None, row.out_versions if mixed else None)
        _post(row.req.loop, _resolve, row.req.future, c, None)

    def _hit_stop(self, ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop or self.decode_fn is None:
            return False
        tail = self.decode_fn(ids[-16:])
        return any(s and s in tail for s in stop)    # an empty stop string is ignored, never a 1-token stop


def _pad_left(mask: torch.Tensor, n: int) -> torch.Tensor:
    """An attention mask `[B, L]` with `n` zero columns prepended: `[B, n + L]`."""
    return torch.cat([mask.new_zeros((mask.shape[0], n)), mask], dim=1) if n else mask


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run `callback(*args)` on the caller's event loop; nothing when that loop is closed (the caller is gone,
    e.g. an evaluation's proxy stopped while a request it gave up on was still decoding): never an exception
    in the worker, which serves everyone else's rows."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _resolve(future: asyncio.Future, result, exc) -> None:
    if future.done():          # cancelled by the caller, or already answered
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _cache_kwarg(model) -> str:
    """The name `model.forward` takes the KV cache under: `cache` from transformers 5.2x on (the old
    `past_key_values` still works there but warns on every call), `past_key_values` before (verl's venv pins an
    older transformers). A PEFT wrapper is looked through to its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def engine_for(model, tokenizer, cfg: AjetConfig, adapter_for=None) -> HFEngine:
    """The in-process engine serving `model` (also the verl backbone's engine on CPU): stops at the tokenizer's
    EOS and the generation config's, batch and length limits from `cfg`, seeded with `trainer.seed`; with
    `adapter_for` (agent tag -> adapter name, `ajet.agent_adapters.adapter_router`) each call is served with its
    role's LoRA adapter."""
    eos = {tokenizer.eos_token_id}
    if model.generation_config is not None and model.generation_config.eos_token_id is not None:
        g = model.generation_config.eos_token_id
        eos |= set(g if isinstance(g, list) else [g])
    engine = HFEngine(model, sorted(eos), tokenizer.pad_token_id, max_batch_size=cfg.rollout.max_batch_size,
                      max_model_len=cfg.model.max_model_len, decode_fn=tokenizer.decode, adapter_for=adapter_for)
    engine.seed(cfg.trainer.seed)
    return engine
