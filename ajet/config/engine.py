"""Which engine generates: `engine:` (ajet's in-process engine or vLLM servers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ajet.config.base import _Section


class EngineConfig(_Section):
    """Which engine generates rollouts, evaluations and live answers (docs/engines.md).

    `in_process`: ajet's own engine, in the trainer's process, on the very weights the update trains. `vllm`: a vLLM
    OpenAI server that ajet starts and owns (from the venv of `python`, on a free port of 127.0.0.1, its log in the
    run folder, stopped with the run), or the servers at `urls`; after every update the full weights are written to
    `weights_dir` and reloaded by each server (vLLM's dev-mode `reload_weights`), or with `model.lora` / `agents:`
    only the adapters, loaded under names never reused (vLLM's `/v1/load_lora_adapter`)."""

    kind: Literal["in_process", "vllm"] = Field(
        "in_process", description="`in_process` (ajet's engine, in this process) or `vllm` (a vLLM OpenAI server, "
                                  "started by ajet unless `urls` names running ones)")
    urls: list[str] = Field(default_factory=list, description="kind vllm: OpenAI base URLs of vLLM servers you run "
                            "(e.g. http://10.0.0.2:8000/v1; several are load-balanced, sticky per conversation), each "
                            "started with `--logprobs-mode processed_logprobs` and VLLM_SERVER_DEV_MODE=1; empty: "
                            "ajet starts one")
    model: str | None = Field(None, description="kind vllm with `urls`: the served model name (None: the first that "
                                                "/v1/models lists)")
    python: str | None = Field(None, description="kind vllm: the python of the venv holding vLLM (None: "
                               "$AJET_VLLM_PYTHON, else .venvs/vllm/bin/python in the working folder or ajet's "
                               "checkout, else the machine's cached vLLM venv; `ajet backbone-env vllm` builds it)")
    kv_cache_gb: int = Field(2, ge=1, description="kind vllm on CPU: the started server's KV cache, GiB (vLLM's "
                                                  "VLLM_CPU_KVCACHE_SPACE, whole GiB)")
    start_timeout_s: float = Field(600.0, gt=0, description="kind vllm: how long the started server may take to "
                                                            "answer /health, seconds")
    weights_dir: str | None = Field(None, description="kind vllm: the folder the updated weights are written to for "
                                    "the servers to reload (None: `engine/weights` in the run folder); with `urls` on "
                                    "other machines, a folder they read at the same path")
    extra_args: list[str] = Field(default_factory=list, description="kind vllm: more arguments for the started "
                                  "server's command line (e.g. [--gpu-memory-utilization, '0.5'])")
