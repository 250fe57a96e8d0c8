"""`VLLMEngine`: ajet's `Engine` over vLLM servers, with the trainer's full weights pushed to them after each update.

Generation: one `ajet.engines.remote.RemoteEngine` per server (token ids in, sampled ids and processed logprobs
out, per-call seeds, stop strings, max tokens), behind `ajet.engines.pool.ServerPool` (sticky per
conversation, least loaded first). The servers are either one `VLLMServer` that this engine starts and owns
(`engine.urls` empty) or the servers at `engine.urls`.

Weights: every backbone (debug, verl, trinity) serves its trainer's weights through `publish_weights`, after every
update and after a checkpoint is restored. Full weights (`sync_weights`): the policy's state dict is written as one
safetensors file into a new folder `<weights_dir>/v<N>` (written under a temporary name, then renamed: a server
never reads a half-written file; the previous version's folder is removed once every server holds the new one),
then each server gets

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

LoRA (`model.lora`, or one adapter per role with `agents:`): the servers keep the base model, and only the adapters
travel (`sync_adapters`). Each version's adapters are written in peft's format (`save_pretrained`) into
`<weights_dir>/<run>-v<N>/<adapter>/` and loaded into every server under a name never used before:
`<run>-v<N>` for the one adapter of `model.lora`, `<run>-<adapter>-v<N>` per role adapter with `agents:` (`<run>`:
a random id per engine, so that a resumed or another run against the same servers never meets an old name; vLLM
keys its adapters and their prefix-cache blocks by name, and a reused name served the wrong policy in production,
vLLM issue 48312). The routes are vLLM's runtime LoRA ones (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, `--enable-lora`):

    POST /v1/load_lora_adapter   {"lora_name": "<run>-v<N>", "lora_path": "<weights_dir>/<run>-v<N>/default"}
    POST /v1/unload_lora_adapter {"lora_name": "<run>-v<N-1>"}

No call waits: a call admitted before the load names the old adapter (its `model` field) and finishes on it; a call
admitted after names the new one; each records the version it named. An old version is unloaded (and its folder
removed) once the last call naming it has finished (vLLM's worker may read an adapter's folder again until then).
Version 0 is the adapters the engine starts with (`vllm_engine` loads them before the first call).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ajet.engines.base import TokenCallback, calling_agent
from ajet.engines.vllm_server import VLLM_LORA_RANKS, EngineUnavailable, VLLMServer
from ajet.llm_call import Completion, SamplingParams

if TYPE_CHECKING:
    import torch

    from ajet.config import AjetConfig

SERVED_NAME = "ajet-policy"
EXIT_GRACE_S = 30.0   # seconds a failed weight or adapter request waits for the owned server's exit, if it is exiting
_log = logging.getLogger(__name__)
# the served adapter a LoRA call was admitted under (set by `VLLMEngine.generate` in the call's task, read by the
# `RemoteEngine` that sends it as the request's `model`)
_ADMITTED: contextvars.ContextVar[str | None] = contextvars.ContextVar("ajet_vllm_admitted", default=None)


class VLLMEngine:
    """Generates through vLLM servers and serves the trainer's weights after each `sync_weights`.

    Args:
        base_urls: the servers' OpenAI base URLs ("http://host:port/v1"), at least one.
        model: the served model name requests carry.
        weights_dir: where `sync_weights` writes each version's folder (created when needed; a relative path is
            made absolute from this process's working folder); the servers must read it at the same path.
        server: the `VLLMServer` this engine owns (stopped by `close`), or None for servers run by someone else.
        timeout_s: limit of one HTTP request to a server, seconds (generation and weight routes).
        scratch: folders this engine made for its server (its model folder), removed by `close`.
        adapters: the LoRA adapters served (peft names: ["default"] for `model.lora`, `default` and the roles with
            `agents:`); empty: the servers serve full weights (`sync_weights`), else adapters (`sync_adapters`).
        adapter_for: agent tag -> adapter (`ajet.agent_adapters.adapter_router`); None: every call is served by
            `adapters[0]`.
        run_id: the `<run>` of the served adapters' names (None: 8 random hex digits).

    Attributes:
        policy_version: the optimizer step of the weights every server holds (0: the model folder's); with adapters,
            the version that calls are admitted under now (older ones may still be finishing).
        weights_lock: taken by the backbone around an update (a plain re-entrant lock: generation goes on while the
            trainer computes; only `sync_weights` holds new requests back).
        generated_tokens: completion tokens returned so far.
        last_sync: the figures of the last `sync_weights` (empty before).
    """

    def __init__(self, base_urls: list[str], model: str, weights_dir: str | Path, server: VLLMServer | None = None,
                 timeout_s: float = 600.0, scratch: list[Path] | tuple[Path, ...] = (), adapters: list[str] = (),
                 adapter_for: Callable[[str | None], str] | None = None, run_id: str | None = None):
        from ajet.engines.pool import ServerPool
        from ajet.engines.remote import RemoteEngine

        if not base_urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.model = model
        self.weights_dir = Path(weights_dir).absolute()      # the servers resolve it, not from this folder
        self.server = server
        self.timeout_s = timeout_s
        self.scratch = list(scratch)
        self.adapters = list(adapters)
        self.adapter_for = adapter_for
        self.run_id = run_id or secrets.token_hex(4)
        admitted = (lambda tag: _ADMITTED.get() or model) if self.adapters else None
        self.pool = ServerPool([RemoteEngine(u, model, timeout_s=timeout_s, adapter_for=admitted)
                                for u in self.base_urls])
        self.weights_lock = threading.RLock()
        self.generated_tokens = 0
        self.last_sync: dict[str, float] = {}
        self._gate = threading.Condition()
        self._in_flight = 0          # generate calls admitted and not finished
        self._syncing = False        # a sync waits for (or holds) the servers: new calls wait
        self._served_dir: Path | None = None
        # adapters: each load not yet unloaded (the last is current; the others drain), every name ever loaded, and
        # the thread that unloads drained loads
        self._loaded: list[_AdapterSet] = []
        self._used: set[str] = set()                 # every name this engine has loaded
        self._unloader = ThreadPoolExecutor(1, thread_name_prefix="ajet-lora-unload") if self.adapters else None

    def served_name(self, adapter: str, version: int) -> str:
        """The name adapter `adapter`'s version `version` is served under: `<run>-v<N>` with one adapter,
        `<run>-<adapter>-v<N>` with several (`agents:`)."""
        if len(self.adapters) == 1:
            return f"{self.run_id}-v{version}"
        return f"{self.run_id}-{adapter}-v{version}"

    @property
    def served_names(self) -> list[str]:
        """The adapter names loaded on the servers now (current and still-draining versions), oldest first."""
        with self._gate:
            return [name for loaded in self._loaded for name in loaded.names.values()]

    def _adapter_of(self, tag: str | None) -> str:
        return self.adapters[0] if self.adapter_for is None else self.adapter_for(tag)

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.pool.policy_version = value

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """`ajet.engines.base.Engine.generate` on one of the servers; waits while a full-weight sync runs (polling
        every 20 ms). With adapters the call never waits: it names the adapter of its agent's role
        (`calling_agent()`) at the version admitted now, and its completion records that version.
        Raises as `RemoteEngine.generate` does (ValueError: the context is too long; RuntimeError: the server
        failed or cannot be reached; also before any adapter is loaded)."""
        while True:
            with self._gate:
                if not self._syncing:
                    admitted = None
                    if self.adapters:
                        if not self._loaded:
                            raise RuntimeError("VLLMEngine.generate: no adapter loaded yet (call sync_adapters first)")
                        admitted = self._loaded[-1]
                        admitted.calls += 1
                    self._in_flight += 1
                    break
            await asyncio.sleep(0.02)
        token = _ADMITTED.set(admitted.names[self._adapter_of(calling_agent())]) if admitted is not None else None
        try:
            completion = await self.pool.generate(prompt_ids, params, on_tokens)
        finally:
            if token is not None:
                _ADMITTED.reset(token)
            with self._gate:
                self._in_flight -= 1
                drained = admitted is not None and admitted.leave()
                self._gate.notify_all()
            if drained:
                self._unloader.submit(self._unload, admitted)
        if admitted is not None:
            completion = dataclasses.replace(completion, policy_version=admitted.version)
        self.generated_tokens += len(completion.token_ids)
        return completion

    def sync_adapters(self, write: Callable[[Path], None], version: int) -> dict[str, float]:
        """Serve the adapters that `write(folder)` writes as policy version `version`; blocks the calling thread.

        `write(folder)` must write each adapter of `adapters` in peft's format into `folder/<adapter>/`
        (`backbones.debug.role_adapters.save_adapters`). They are loaded into every server under
        `served_name(adapter, version)`; from then on new calls name them, the calls in flight finish on the
        version they named, and each older version is unloaded once its last call has finished (see the module
        docstring). A name is never loaded twice: a version this engine has served before (a checkpoint restored
        over a newer version) is loaded under a new `run_id`. Returns `weight_sync_s` (seconds, the whole sync),
        `weight_save_s` (writing the adapters) and `weight_reload_s` (loading them into the servers).

        Raises:
            RuntimeError: the engine serves full weights.
            EngineUnavailable: a server refused or failed a load (its answer in the message; e.g. a server started
                without `--enable-lora`), or the server ajet started stopped (its exit status and log tail): the
                run stops (exit status 2, one line).
            OSError: the weights folder cannot be written.
        """
        if not self.adapters:
            raise RuntimeError("VLLMEngine.sync_adapters: this engine serves full weights (use sync_weights)")
        if any(self.served_name(a, version) in self._used for a in self.adapters):
            self.run_id = secrets.token_hex(4)
            _log.info("policy version %d is served again: its adapters are loaded under the run id %s", version,
                      self.run_id)
        t0 = time.perf_counter()
        names = {adapter: self.served_name(adapter, version) for adapter in self.adapters}
        folder = self.weights_dir / f"{self.run_id}-v{version}"
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        t1 = time.perf_counter()
        loaded = _AdapterSet(version, names, folder)
        self._used.update(names.values())
        for adapter, name in names.items():
            for url in self.base_urls:
                self._post(f"{url}/load_lora_adapter", {"lora_name": name, "lora_path": str(folder / adapter)},
                           _LORA_HINT)
        t2 = time.perf_counter()
        with self._gate:
            old = self._loaded[-1] if self._loaded else None
            self._loaded.append(loaded)
            self.policy_version = version
            if old is not None and old.retire():
                self._unloader.submit(self._unload, old)
        self.last_sync = {"weight_sync_s": time.perf_counter() - t0, "weight_save_s": t1 - t0,
                          "weight_reload_s": t2 - t1}
        return dict(self.last_sync)

    def _unload(self, loaded: _AdapterSet, servers: bool = True) -> None:
        """Unload `loaded`'s adapters from every server (with `servers`) and remove their folder (in the unloader
        thread; a failure is logged, not raised: the adapter then stays loaded, named by no call)."""
        for name in loaded.names.values() if servers else ():
            for url in self.base_urls:
                try:
                    post_json(f"{url}/unload_lora_adapter", {"lora_name": name}, self.timeout_s, _LORA_HINT)
                except RuntimeError as exc:
                    _log.warning("could not unload the LoRA adapter %s: %s", name, exc)
        with self._gate:
            if loaded in self._loaded:
                self._loaded.remove(loaded)
        shutil.rmtree(loaded.folder, ignore_errors=True)

    def sync_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Make every server serve `state_dict` (the policy's weights under their Hugging Face names, e.g. a
        `LlamaForCausalLM.state_dict()`) as policy version `version`; blocks the calling thread.

        New generate calls wait from the start of the sync; the calls in flight finish first (on the old weights,
        whose version they carry). Returns the figures logged with the step: `weight_sync_s` (seconds, the whole
        sync, waiting for calls in flight included), `weight_save_s` (writing the file), `weight_reload_s` (the
        servers' reload and prefix-cache reset).

        Raises:
            EngineUnavailable: a server refused or failed the reload (its answer in the message; the servers may
                then hold different weights), or the server ajet started stopped, before or during the sync (its
                exit status and log tail): the run stops (exit status 2, one line).
            OSError: the weights folder cannot be written.
        """
        t0 = time.perf_counter()
        with self._gate:
            self._syncing = True
            self._gate.wait_for(lambda: self._in_flight == 0)
        try:
            folder = save_weights(with_output_head(state_dict), self.weights_dir / f"v{version}")
            t1 = time.perf_counter()
            for url in self.base_urls:
                root = url.removesuffix("/v1")
                self._post(f"{root}/collective_rpc", {"method": "reload_weights",
                                                      "kwargs": {"weights_path": str(folder)}})
                self._post(f"{root}/reset_prefix_cache", None)
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

    def _post(self, url: str, body: dict | None, *hint_404: str) -> object:
        """`post_json` to one of the servers (a weight or adapter route).

        Raises:
            EngineUnavailable: the request failed. A request left without an answer waits up to `EXIT_GRACE_S`
                seconds for the server ajet started to exit (an OOM kill of its worker during an update, seen on
                the 2-core CPU: the connection drops seconds before the server exits); if it has stopped,
                `raise_if_failed`'s one line; otherwise the failure itself (the URL and the server's answer): the
                servers may now hold different weights, so the run stops there.
        """
        try:
            return post_json(url, body, self.timeout_s, *hint_404)
        except RuntimeError as exc:
            server = self.server
            dropped = not isinstance(exc.__cause__, urllib.error.HTTPError)      # no answer: the server may be exiting
            if dropped and server is not None and server.process is not None:
                try:
                    server.process.wait(timeout=EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            self.raise_if_failed()
            raise EngineUnavailable(f"{exc} (policy version {self.policy_version} is the last every server "
                                    f"loaded)") from exc

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
        """Close the HTTP sessions still open, unload this engine's adapters from servers it does not own, and stop
        the owned server (if any). Idempotent."""
        try:
            asyncio.run(self.pool.aclose())
        except RuntimeError:           # called from inside a running event loop: the sessions go with it
            pass
        if self._unloader is not None:
            self._unloader.shutdown(wait=True)
            self._unloader = None
            for loaded in list(self._loaded):      # servers of yours are left as they were
                self._unload(loaded, servers=self.server is None)
        if self.server is not None:
            self.server.stop()
        for folder in [self._served_dir, *self.scratch]:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._served_dir, self.scratch = None, []


@dataclasses.dataclass(eq=False)
class _AdapterSet:
    """One load of the adapters: the policy version, adapter -> served name, the folder they were read from, the
    calls admitted under it still running, and whether a newer load superseded it. Guarded by the engine's gate."""

    version: int
    names: dict[str, str]
    folder: Path
    calls: int = 0
    retired: bool = False

    def leave(self) -> bool:
        """One call finished; True when that drained a superseded load (it is to be unloaded now)."""
        self.calls -= 1
        return self.retired and self.calls == 0

    def retire(self) -> bool:
        """Superseded by a newer load; True when no call runs on it (it is to be unloaded now)."""
        self.retired = True
        return self.calls == 0


def save_weights(state_dict: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write `state_dict` as `folder/model.safetensors`, atomically: into a temporary sibling folder first, renamed
    to `folder` once complete (an existing `folder` is replaced). A tensor that shares storage with an earlier key
    (tied embeddings: `lm_head.weight` is `model.embed_tokens.weight`) is written as a copy under its own name, so
    that the server reloads its output head too (see the module docstring).
    Returns `folder`. Raises OSError when it cannot write."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _save_safetensors(state_dict, tmp / "model.safetensors")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def _save_safetensors(state_dict: dict[str, torch.Tensor], file: Path) -> None:
    """Write `state_dict` (on CPU) to the safetensors `file`, a tensor sharing storage with an earlier key as a copy
    under its own name (safetensors refuses shared tensors)."""
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    tensors = {}
    for key, t in state_dict.items():
        t = t.detach().cpu()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        tensors[key] = t.clone() if ident in seen else t.contiguous()
        seen.add(ident)
    save_file(tensors, str(file), metadata={"format": "pt"})


def save_hf_folder(model_path: str | Path, folder: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """Write `state_dict` (a policy's weights under their Hugging Face names) into the existing or new `folder` as a
    Hugging Face model folder: `model.safetensors` and `model_path`'s config.json and generation_config.json, as
    they are (`AutoModelForCausalLM.from_pretrained(folder)` loads it; the verl and trinity backbones' checkpoints
    with the vLLM engine). Other files in `folder` stay. Returns `folder`. Raises OSError when it cannot write or
    `model_path` has no config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    _save_safetensors(state_dict, folder / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        if name == "config.json" or (Path(model_path) / name).exists():
            shutil.copy2(Path(model_path) / name, folder / name)
    return folder


def with_output_head(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (a shallow copy) with `lm_head.weight` added as the input embedding when it has none: a tied
    model's state dict as some trainers export it (the head is the embedding), written out so that a server with an
    untied head (`serving_folder`) reloads its head too (see the module docstring)."""
    state = dict(state_dict)
    if "lm_head.weight" not in state:
        embed = next((k for k in state if k.endswith("embed_tokens.weight")), None)
        if embed is not None:
            state["lm_head.weight"] = state[embed]
    return state


def serving_folder(model_path: str | Path, folder: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    """The model folder the server ajet starts loads: `state_dict` (the trainer's weights now, under Hugging Face
    names) with `lm_head.weight` written out, and `model_path`'s other files (config, tokenizer, generation config),
    the config with `tie_word_embeddings: false` (see the module docstring). `folder` is replaced. Returns it.

    Raises:
        OSError: `model_path` has no config.json, or `folder` cannot be written.
    """
    model_path = Path(model_path)
    config = json.loads((model_path / "config.json").read_text())
    state = with_output_head(state_dict) if config.get("tie_word_embeddings", True) else dict(state_dict)
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


_DEV_HINT = " (start the server with VLLM_SERVER_DEV_MODE=1)"
_LORA_HINT = (" (start the server with --enable-lora --max-lora-rank <rank> and "
              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")


def post_json(url: str, body: dict | None, timeout_s: float, hint_404: str = _DEV_HINT) -> object:
    """POST `body` (JSON; None: no body) to `url`; returns the decoded JSON answer (None when empty; the text when
    it is not JSON, as vLLM's LoRA routes answer). Raises RuntimeError naming the URL for an HTTP error status
    (with the start of its body; `hint_404` appended for a 404) or a transport error."""
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        hint = hint_404 if exc.code == 404 else ""
        raise RuntimeError(f"{url} answered HTTP {exc.code}{hint}: {detail}") from exc
    except OSError as exc:
        raise RuntimeError(f"{url} failed: {type(exc).__name__}: {exc}") from exc
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model name `base_url`/models lists. Raises EngineUnavailable when the server cannot be read."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=timeout_s) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise EngineUnavailable(f"engine.urls: {base_url}/models did not list a model ({type(exc).__name__}: "
                                f"{exc}): is a vLLM server running there?") from exc


def vllm_engine(cfg: AjetConfig, model_path: str, state_dict: dict[str, torch.Tensor],
                write_adapters: Callable[[Path], None] | None = None) -> VLLMEngine:
    """The engine that `engine: {kind: vllm}` describes: the servers at `engine.urls`, or one `VLLMServer` started
    now on `serving_folder(model_path, <run folder>/engine/model, state_dict)` (`state_dict`: the policy's weights
    as the trainer holds them; with LoRA, the base model's), its log at `<run folder>/engine/vllm.log`. Servers at
    `engine.urls` are sent `state_dict` as version 0 before this returns (`sync_weights`: they may hold another
    run's weights), or with LoRA the adapters.

    With `model.lora` or `agents:` the server is started with LoRA enabled (the largest adapter rank, room for two
    versions of every adapter in a batch) and the engine serves adapters: `write_adapters(folder)` writes them in
    peft's format into `folder/<adapter>/` (`VLLMEngine.sync_adapters`), and version 0 is loaded before this
    returns.

    Raises:
        ConfigError: an adapter's rank exceeds what vLLM serves (512).
        ValueError: LoRA is configured and `write_adapters` is None.
        EngineUnavailable: no python with vLLM, the server failed to start (one line, the log's last lines), or it
            refused the first adapters (a server of yours without LoRA enabled).
    """
    from ajet.agent_adapters import DEFAULT_ADAPTER, adapter_lora, adapter_names, adapter_router
    from ajet.errors import ConfigError

    e = cfg.engine
    adapters = (adapter_names(cfg) or [DEFAULT_ADAPTER]) if cfg.agents or cfg.model.lora is not None else []
    lora_rank = None
    if adapters:
        if write_adapters is None:
            raise ValueError("vllm_engine: LoRA is configured, so write_adapters must write the adapters")
        rank = max(adapter_lora(cfg, name).rank for name in adapters)
        lora_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
        if lora_rank is None:
            raise ConfigError(f"engine.kind vllm: a LoRA rank of {rank} is above the {VLLM_LORA_RANKS[-1]} vLLM "
                              f"serves: lower model.lora.rank / agents.<role>.lora.rank, or use engine.kind in_process")
    run = cfg.exp_path() / "engine"
    weights_dir = Path(e.weights_dir) if e.weights_dir else run / "weights"
    lora = {"adapters": adapters, "adapter_for": adapter_router(cfg)}
    if e.urls:
        engine = VLLMEngine(e.urls, e.model or served_model(e.urls[0]), weights_dir, **lora)
        if not adapters:      # a server of yours holds what it was last given: version 0 is the trainer's weights
            try:
                engine.sync_weights(state_dict, 0)
            except RuntimeError as exc:
                engine.close()
                raise EngineUnavailable(f"engine.kind vllm: the server did not load the starting weights: {exc}") \
                    from exc
    else:
        folder = serving_folder(model_path, run / "model", state_dict)
        server = VLLMServer(str(folder), run / "vllm.log", python=e.python, served_model_name=SERVED_NAME,
                            kv_cache_gb=e.kv_cache_gb, max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype,
                            seed=cfg.trainer.seed, max_num_seqs=cfg.rollout.max_batch_size, extra_args=e.extra_args,
                            start_timeout_s=e.start_timeout_s, lora_rank=lora_rank, max_loras=2 * len(adapters))
        url = server.start()
        engine = VLLMEngine([url], SERVED_NAME, weights_dir, server=server, scratch=[folder], **lora)
    if adapters:
        try:
            engine.sync_adapters(write_adapters, 0)
        except RuntimeError as exc:
            engine.close()
            raise EngineUnavailable(f"engine.kind vllm: the server did not load the LoRA adapters: {exc}") from exc
    return engine


def publish_weights(engine, version: int, state_dict: Callable[[], dict[str, torch.Tensor]],
                    write_adapters: Callable[[Path], None] | None = None) -> dict[str, float]:
    """Serve the trainer's weights as policy `version`: the one weight sync of every backbone (debug, verl, trinity),
    after each update and after a checkpoint is restored (`--resume`: before the first call).

    - `engine` a `VLLMEngine` serving adapters (`model.lora`, `agents:`): `sync_adapters(write_adapters, version)`,
      the adapters under names never used before;
    - a `VLLMEngine` serving full weights: `sync_weights(state_dict(), version)`, the weights written as safetensors
      and reloaded by every server;
    - any other engine (ajet's in-process engine generates with the caller's model, which holds the weights
      already): only its `policy_version` is set.

    Args:
        state_dict: called only for a full-weight sync: the policy's weights under their Hugging Face names (e.g.
            verl's per-tensor export, Trinity's synchronizer state dict, `model.state_dict()`), on CPU or GPU.
        write_adapters: writes each served adapter in peft's format into `folder/<adapter>/` (with adapters only).

    Returns:
        The sync's figures for the step's metrics (`weight_sync_s`, `weight_save_s`, `weight_reload_s`, seconds;
        {} for an in-process engine).

    Raises:
        EngineUnavailable: a server failed the reload or load (the run stops; `VLLMEngine.sync_weights`).
        ValueError: the engine serves adapters and `write_adapters` is None.
        OSError: the weights folder cannot be written.
    """
    if not isinstance(engine, VLLMEngine):
        engine.policy_version = version
        return {}
    if engine.adapters:
        if write_adapters is None:
            raise ValueError("publish_weights: the vLLM engine serves LoRA adapters, so write_adapters must write them")
        return engine.sync_adapters(write_adapters, version)
    return engine.sync_weights(state_dict(), version)
