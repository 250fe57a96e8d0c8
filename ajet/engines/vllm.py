"""`VLLMEngine`: ajet's `Engine` over vLLM servers, with the trainer's full weights pushed to them after each update.

Generation: one `ajet.engines.remote.RemoteEngine` per server (token ids in, sampled ids and processed logprobs
out, per-call seeds, stop strings, max tokens), behind `ajet.engines.pool.ServerPool` (sticky per
conversation, least loaded first). The servers are either one `VLLMServer` that this engine starts and owns
(`engine.urls` empty) or the servers at `engine.urls`.

Weights (`sync_weights`), after every update: the policy's state dict is written as one safetensors file into a new
folder `<weights_dir>/v<N>` (written under a temporary name, then renamed: a server never reads a half-written
file; the previous version's folder is removed once every server holds the new one), then each server gets

    POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": "<weights_dir>/v<N>"}}
    POST /reset_prefix_cache           (no prefix computed by the old weights is reused)

both dev-mode routes (VLLM_SERVER_DEV_MODE=1).

Tied embeddings: vLLM on CPU prepacks each linear layer's weight for its GEMM kernel (oneDNN), and a reload
repacks the layers whose weights it loaded. A file without `lm_head.weight` left a tied SmolLM2-135M server's output
head on the old weights (every weight moved by 1% of its mean magnitude: logprobs off by up to 0.087 against the
trainer's; 1.7e-5 with `lm_head.weight` in the file). So every sync writes `lm_head.weight`, and the server ajet
starts serves the model untied (`serving_folder`: `tie_word_embeddings: false`, the head a copy of the embedding),
which gives the head a layer of its own that every reload loads, whatever the architecture's loader does with tied
names; the trainer's model stays tied, and the two copies are equal after every sync. While a sync runs, new requests wait and the requests in flight
are let finish first, so every completion is produced by exactly one version of the weights, the one its
`Completion.policy_version` names (the version is moved only once every server has reloaded). On this CPU a
135M model's sync took about 1 s (docs/engines.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from ajet.engines.base import TokenCallback
from ajet.engines.vllm_server import EngineUnavailable, VLLMServer
from ajet.llm_call import Completion, SamplingParams

if TYPE_CHECKING:
    import torch

    from ajet.config import AjetConfig

SERVED_NAME = "ajet-policy"


class VLLMEngine:
    """Generates through vLLM servers and serves the trainer's weights after each `sync_weights`.

    Args:
        base_urls: the servers' OpenAI base URLs ("http://host:port/v1"), at least one.
        model: the served model name requests carry.
        weights_dir: where `sync_weights` writes each version's folder (created when needed); the servers must
            read it at the same path.
        server: the `VLLMServer` this engine owns (stopped by `close`), or None for servers run by someone else.
        timeout_s: limit of one HTTP request to a server, seconds (generation and weight routes).
        scratch: folders this engine made for its server (its model folder), removed by `close`.

    Attributes:
        policy_version: the optimizer step of the weights every server holds (0: the model folder's).
        weights_lock: taken by the backbone around an update (a plain re-entrant lock: generation goes on while the
            trainer computes; only `sync_weights` holds new requests back).
        generated_tokens: completion tokens returned so far.
        last_sync: the figures of the last `sync_weights` (empty before).
    """

    def __init__(self, base_urls: list[str], model: str, weights_dir: str | Path, server: VLLMServer | None = None,
                 timeout_s: float = 600.0, scratch: list[Path] | tuple[Path, ...] = ()):
        from ajet.engines.pool import ServerPool
        from ajet.engines.remote import RemoteEngine

        if not base_urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.model = model
        self.weights_dir = Path(weights_dir)
        self.server = server
        self.timeout_s = timeout_s
        self.scratch = list(scratch)
        self.pool = ServerPool([RemoteEngine(u, model, timeout_s=timeout_s) for u in self.base_urls])
        self.weights_lock = threading.RLock()
        self.generated_tokens = 0
        self.last_sync: dict[str, float] = {}
        self._gate = threading.Condition()
        self._in_flight = 0          # generate calls admitted and not finished
        self._syncing = False        # a sync waits for (or holds) the servers: new calls wait
        self._served_dir: Path | None = None

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.pool.policy_version = value

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """`ajet.engines.base.Engine.generate` on one of the servers; waits while a weight sync runs (polling every
        20 ms). Raises as `RemoteEngine.generate` does (ValueError: the context is too long; RuntimeError: the
        server failed or cannot be reached)."""
        while True:
            with self._gate:
                if not self._syncing:
                    self._in_flight += 1
                    break
            await asyncio.sleep(0.02)
        try:
            completion = await self.pool.generate(prompt_ids, params, on_tokens)
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()
        self.generated_tokens += len(completion.token_ids)
        return completion

    def sync_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Make every server serve `state_dict` (the policy's weights under their Hugging Face names, e.g. a
        `LlamaForCausalLM.state_dict()`) as policy version `version`; blocks the calling thread.

        New generate calls wait from the start of the sync; the calls in flight finish first (on the old weights,
        whose version they carry). Returns the figures logged with the step: `weight_sync_s` (seconds, the whole
        sync, waiting for calls in flight included), `weight_save_s` (writing the file), `weight_reload_s` (the
        servers' reload and prefix-cache reset).

        Raises:
            RuntimeError: a server refused or failed the reload (its answer in the message); the servers may
                then hold different weights: the run should stop.
            OSError: the weights folder cannot be written.
        """
        t0 = time.perf_counter()
        with self._gate:
            self._syncing = True
            self._gate.wait_for(lambda: self._in_flight == 0)
        try:
            folder = save_weights(state_dict, self.weights_dir / f"v{version}")
            t1 = time.perf_counter()
            for url in self.base_urls:
                root = url.removesuffix("/v1")
                post_json(f"{root}/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(folder)}}, self.timeout_s)
                post_json(f"{root}/reset_prefix_cache", None, self.timeout_s)
            t2 = time.perf_counter()
            old, self._served_dir = self._served_dir, folder
            if old is not None and old != folder:
                shutil.rmtree(old, ignore_errors=True)
            self.policy_version = version
        finally:
            with self._gate:
                self._syncing = False
                self._gate.notify_all()
        self.last_sync = {"weight_sync_s": time.perf_counter() - t0, "weight_save_s": t1 - t0,
                          "weight_reload_s": t2 - t1}
        return dict(self.last_sync)

    def raise_if_failed(self) -> None:
        """Raise when generation cannot go on: the server this engine started has stopped (killed or crashed). The
        trainer calls it after each rollout, so that a run whose server died stops there with this one line
        (the calls it lost failed their episodes; the episodes recorded stay in the trajectory store).

        Raises:
            EngineUnavailable: the server's URL, its exit status, the last lines of its log and the log's path.
        """
        from ajet.engines.vllm_server import log_tail

        server = self.server
        if server is not None and server.process is not None and not server.alive():
            raise EngineUnavailable(f"the vLLM server ajet started ({self.base_urls[0]}) stopped during the run "
                                    f"(exit status {server.process.returncode}): {log_tail(server.log_path)} "
                                    f"(log: {server.log_path})")

    def close(self) -> None:
        """Close the HTTP sessions still open and stop the owned server (if any). Idempotent."""
        try:
            asyncio.run(self.pool.aclose())
        except RuntimeError:           # called from inside a running event loop: the sessions go with it
            pass
        if self.server is not None:
            self.server.stop()
        for folder in [self._served_dir, *self.scratch]:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._served_dir, self.scratch = None, []


def save_weights(state_dict: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write `state_dict` as `folder/model.safetensors`, atomically: into a temporary sibling folder first, renamed
    to `folder` once complete (an existing `folder` is replaced). A tensor that shares storage with an earlier key
    (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is written as a copy under its own name, so
    that the server reloads its output head too (see the module docstring).
    Returns `folder`. Raises OSError when it cannot write."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    tensors = {}
    for key, t in state_dict.items():
        t = t.detach().cpu()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        tensors[key] = t.clone() if ident in seen else t.contiguous()
        seen.add(ident)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def serving_folder(model_path: str | Path, folder: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """The model folder the server ajet starts loads: `state_dict` (the trainer's weights now, under Hugging Face
    names) with `lm_head.weight` written out, and `model_path`'s other files (config, tokenizer, generation config),
    the config with `tie_word_embeddings: false` (see the module docstring). `folder` is replaced. Returns it.

    Raises:
        OSError: `model_path` has no config.json, or `folder` cannot be written.
    """
    model_path = Path(model_path)
    config = json.loads((model_path / "config.json").read_text())
    state = dict(state_dict)
    if config.get("tie_word_embeddings", True) and "lm_head.weight" not in state:
        embed = next((k for k in state if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            state["lm_head.weight"] = state[embed]
    if "lm_head.weight" in state:
        config["tie_word_embeddings"] = False
    save_weights(state, folder)
    for f in model_path.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth",
                                                                            ".safetensors.index.json",
                                                                            ".bin.index.json")):
            shutil.copy2(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def post_json(url: str, body: dict | None, timeout_s: float) -> object:
    """POST `body` (JSON; None: no body) to `url`; returns the decoded JSON answer (None when empty).
    Raises RuntimeError naming the URL for an HTTP error status (with the start of its body) or a transport error."""
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        hint = " (start the server with VLLM_SERVER_DEV_MODE=1)" if exc.code == 404 else ""
        raise RuntimeError(f"{url} answered HTTP {exc.code}{hint}: {detail}") from exc
    except OSError as exc:
        raise RuntimeError(f"{url} failed: {type(exc).__name__}: {exc}") from exc
    return json.loads(raw) if raw.strip() else None


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model name `base_url`/models lists. Raises EngineUnavailable when the server cannot be read."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=timeout_s) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise EngineUnavailable(f"engine.urls: {base_url}/models did not list a model ({type(exc).__name__}: "
                                f"{exc}): is a vLLM server running there?") from exc


def vllm_engine(cfg: AjetConfig, model_path: str, state_dict: dict[str, torch.Tensor]) -> VLLMEngine:
    """The engine that `engine: {kind: vllm}` describes: the servers at `engine.urls`, or one `VLLMServer` started
    now on `serving_folder(model_path, <run folder>/engine/model, state_dict)` (`state_dict`: the policy's weights
    as the trainer holds them), its log at `<run folder>/engine/vllm.log`.

    Raises:
        ConfigError: `agents:` is set (one adapter per role is not served through vLLM yet).
        EngineUnavailable: no python with vLLM, or the server failed to start (one line, the log's last lines).
    """
    from ajet.errors import ConfigError

    e = cfg.engine
    if cfg.agents:
        raise ConfigError("engine.kind vllm serves one policy: `agents:` (one LoRA adapter per role) needs "
                          "engine.kind in_process")
    run = cfg.exp_path() / "engine"
    weights_dir = Path(e.weights_dir) if e.weights_dir else run / "weights"
    if e.urls:
        return VLLMEngine(e.urls, e.model or served_model(e.urls[0]), weights_dir)
    folder = serving_folder(model_path, run / "model", state_dict)
    server = VLLMServer(str(folder), run / "vllm.log", python=e.python, served_model_name=SERVED_NAME,
                        kv_cache_gb=e.kv_cache_gb, max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype,
                        seed=cfg.trainer.seed, max_num_seqs=cfg.rollout.max_batch_size, extra_args=e.extra_args,
                        start_timeout_s=e.start_timeout_s)
    url = server.start()
    return VLLMEngine([url], SERVED_NAME, weights_dir, server=server, scratch=[folder])
