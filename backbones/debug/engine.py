"""In-process batched generation with a transformers causal LM (the debug backbone's engine).

Concurrent `generate` calls (from the proxy's event loop) are queued; one worker thread takes every
request waiting (up to `max_batch_size`), left-pads them into one batch and decodes them together with a
KV cache. Each row samples with its own request's temperature and top_p, from its own random generator
(seeded by the request's `seed`, else drawn from the engine's generator when the request is admitted), so a
request's tokens do not depend on what else is in its batch.

Sampling distribution: `ajet.sampling_dist.processed_logprobs` (logits / T, nucleus-truncated to top_p,
renormalised); a token is drawn from it and its logprob under it is recorded, the quantity the trainer
recomputes, so the PPO ratio is exactly 1 before the first update. Temperature 0 is greedy decoding: the
argmax token, with its logprob recorded under T=1 and no truncation (report only; greedy tokens have no
sampling distribution and are not trained on as sampled).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ajet.engine import TokenCallback
from ajet.llm_call import Completion, SamplingParams, TokenDelta
from ajet.sampling_dist import processed_logprobs


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    on_tokens: TokenCallback | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)


class HFEngine:
    """Batched sampler over a `transformers` causal LM that lives in this process.

    Args:
        model: a `PreTrainedModel` (its weights are shared with the trainer: updates are served at once).
        eos_token_ids: ids that end a completion (end-of-turn and end-of-text).
        pad_token_id: id used for left padding (never attended to).
        max_batch_size: most prompts decoded together.
        max_model_len: prompt + completion limit, tokens.
        decode_fn: ids -> text, used only to check `stop` strings.
        batch_wait_s: after the first request arrives, how long (seconds) to wait for others to join its
            batch; episodes that start together then decode together instead of one after another.
    """

    def __init__(self, model, eos_token_ids: list[int], pad_token_id: int, max_batch_size: int = 32,
                 max_model_len: int = 4096, decode_fn=None, batch_wait_s: float = 0.02):
        self.model = model
        self.eos_token_ids = set(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.decode_fn = decode_fn
        self.batch_wait_s = batch_wait_s
        self.policy_version = 0
        self.weights_lock = threading.Lock()  # held while generating; the trainer takes it to update
        self.generated_tokens = 0
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._generator = torch.Generator(device="cpu").manual_seed(0)
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="ajet-engine", daemon=True)
        self._worker.start()

    # ---- public API -------------------------------------------------------------------------------
    def seed(self, seed: int) -> None:
        """Reseed the running sampler (calls that pass their own `seed` are unaffected)."""
        self._generator.manual_seed(seed)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """Queue one prompt and await its completion; `on_tokens` hears of every token as it is sampled.
        See `ajet.engine.Engine.generate`."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the context holds {self.max_model_len}")
        loop = asyncio.get_running_loop()
        req = _Request(list(prompt_ids), params, loop, loop.create_future(), on_tokens)
        self._queue.put(req)
        return await req.future

    def close(self) -> None:
        """Stop the worker thread; queued requests fail with RuntimeError."""
        self._closed = True
        self._queue.put(None)
        self._worker.join(timeout=30)

    # ---- worker -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            deadline = time.perf_counter() + self.batch_wait_s
            while len(batch) < self.max_batch_size:  # gather what arrives within the batching window
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                with self.weights_lock:
                    results = self._generate_batch(batch)
                for req, res in zip(batch, results):
                    req.loop.call_soon_threadsafe(_resolve, req.future, res, None)
            except Exception as exc:  # noqa: BLE001 - every waiting request must hear about it
                for req in batch:
                    req.loop.call_soon_threadsafe(_resolve, req.future, None, exc)
        while not self._queue.empty():
            req = self._queue.get_nowait()
            if req is not None:
                req.loop.call_soon_threadsafe(_resolve, req.future, None, RuntimeError("engine is shut down"))

    @torch.inference_mode()
    def _generate_batch(self, batch: list[_Request]) -> list[Completion]:
        device = next(self.model.parameters()).device
        B = len(batch)
        lens = [len(r.prompt_ids) for r in batch]
        L = max(lens)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's last prompt token sits at column L-1
            input_ids[i, L - lens[i]:] = torch.tensor(r.prompt_ids)
            attn[i, L - lens[i]:] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)

        budgets = [max(1, min(r.params.max_tokens, self.max_model_len - n)) for r, n in zip(batch, lens)]
        rows = RowSampling.of([r.params for r in batch], self._generator, device)

        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        k_top = max(r.params.top_logprobs for r in batch)
        out_top: list[list[list[tuple[int, float]]]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        was_training = self.model.training
        self.model.eval()
        past = None
        cur_ids, cur_pos = input_ids, position_ids
        for _t in range(max(budgets)):
            out = self.model(input_ids=cur_ids, attention_mask=attn, position_ids=cur_pos,
                             past_key_values=past, use_cache=True)
            past = out.past_key_values
            logprobs, tokens = rows.sample(out.logits[:, -1, :])               # [B, vocab], [B]
            token_lp = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()  # [B]
            if k_top:
                top_lp, top_ids = (x.tolist() for x in logprobs.topk(k_top, dim=-1))  # [B, k_top] each
            for i in range(B):
                if finish[i] is not None:
                    continue
                tok = int(tokens[i])
                out_ids[i].append(tok)
                out_lp[i].append(token_lp[i])
                k = batch[i].params.top_logprobs
                tops = [list(zip(top_ids[i][:k], top_lp[i][:k]))] if k else None
                if k:
                    out_top[i].append(tops[0])
                if batch[i].on_tokens is not None:
                    batch[i].loop.call_soon_threadsafe(batch[i].on_tokens, TokenDelta([tok], [token_lp[i]], tops))
                if tok in self.eos_token_ids or self._hit_stop(out_ids[i], batch[i].params.stop):
                    finish[i] = "stop"
                elif len(out_ids[i]) >= budgets[i]:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            cur_ids = tokens[:, None]
            cur_pos = cur_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        if was_training:
            self.model.train()
        self.generated_tokens += sum(len(x) for x in out_ids)
        return [Completion(out_ids[i], out_lp[i], finish[i] or "length", self.policy_version,
                           out_top[i] if batch[i].params.top_logprobs else None) for i in range(B)]

    def _hit_stop(self, ids: list[int], stop: tuple[str, ...]) -> bool:
        if not stop or self.decode_fn is None:
            return False
        tail = self.decode_fn(ids[-16:])
        return any(s and s in tail for s in stop)    # an empty stop string is ignored, never a 1-token stop


@dataclass
class RowSampling:
    """Each row's sampling distribution and random generator for one batch.

    Attributes:
        temperature: `[B]` the distribution's temperature (1 for greedy rows: their logprob is reported under T=1).
        top_p: `[B]` nucleus mass (1 for greedy rows).
        greedy: `[B]` bool, True where the request asked for temperature 0 (argmax decoding).
        generators: one `torch.Generator` per row (CPU): the request's `seed`, else a seed drawn from the engine's
            generator, so each row's draws are independent of the other rows in the batch.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    generators: list[torch.Generator]

    @classmethod
    def of(cls, params: list[SamplingParams], engine_generator: torch.Generator, device) -> RowSampling:
        """The rows for requests with `params` `[B]`; draws one seed from `engine_generator` per unseeded row."""
        greedy = [p.temperature == 0 for p in params]
        gens = []
        for p in params:
            seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=engine_generator))
            gens.append(torch.Generator(device="cpu").manual_seed(seed))
        return cls(torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device),
                   torch.tensor([1.0 if g else p.top_p for p, g in zip(params, greedy)], device=device),
                   torch.tensor(greedy, device=device), gens)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row from `logits` `[B, vocab]` (the last position's).

        Returns:
            (logprobs `[B, vocab]` float32 under each row's processed distribution (-inf outside its nucleus),
            tokens `[B]` long: a draw from that distribution (never outside the nucleus), or the argmax for
            greedy rows).
        """
        logprobs = processed_logprobs(logits, self.temperature, self.top_p)       # [B, V]
        probs = logprobs.exp().cpu()                                              # [B, V], 0 outside the nucleus
        drawn = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(self.generators)])
        tokens = torch.where(self.greedy.cpu(), logits.argmax(-1).cpu(), drawn).to(logits.device)
        return logprobs, tokens


def _resolve(future: asyncio.Future, result, exc) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
