"""How episodes are run and recorded: `rollout:` and the recording proxy's `proxy:`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ajet.config.base import _Section


class RolloutConfig(_Section):
    """How episodes are run. num_repeat episodes per task form one GRPO group."""

    num_repeat: int = Field(4, ge=1, description="episodes per task; the task's episodes form one GRPO group")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of training episodes")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: sample from the smallest set of tokens whose"
                                                      " probability reaches top_p, in (0, 1]")
    max_tokens: int = Field(256, gt=0, description="per call, tokens")
    sampling_policy: Literal["client", "config"] = Field(
        "config", description="whose sampling parameters win: config (the config's temperature and top_p replace the "
                              "client's; a client's max_tokens is capped by rollout.max_tokens) or client (the "
                              "client's values where it gives them)")
    max_concurrency: int = Field(64, ge=1, description="episodes running at once")
    episode_timeout_s: float = Field(
        600.0, gt=0, description="an episode running longer fails (TimeoutError); the time its calls wait in the "
                                 "engine's queue (more calls than the engine's rows) does not count: only the "
                                 "episode's own time does (generating, tools, the agent's code). With --with-ray the "
                                 "worker cannot see the queue and counts the wall clock")
    max_batch_size: int = Field(32, ge=1, description="engine: prompts generated together")
    failed_episode_policy: Literal["drop_episode", "drop_group"] = Field(
        "drop_episode", description="a failed episode (raised, timed out, non-finite or missing reward) is never "
                                    "trained on; drop_group also leaves the rest of its GRPO group out of the update")
    ray_workers: int = Field(0, ge=0, description="with --with-ray: episodes run on this many Ray actors, 1 CPU "
                                                  "each, spread over the cluster's nodes (0: in this process)")
    ray_address: str | None = Field(None, description="the Ray cluster to join (--ray-address): HOST:PORT of its "
                                                      "head node, or `auto` for the cluster `ray start` made on this "
                                                      "machine; None starts a local Ray. Read by --with-ray, the verl "
                                                      "backbone and, on GPU, the trinity backbone")


class ProxyConfig(_Section):
    """The recording proxy. host: 127.0.0.1 keeps it private to this machine; set 0.0.0.0 only when the
    agents run elsewhere (episode tokens are still required). accepted_models: None accepts any `model`."""

    host: str = Field("127.0.0.1", description="bind address of the proxy: 127.0.0.1 keeps it private to this "
                                               "machine; 0.0.0.0 only when the agents run elsewhere (episode tokens "
                                               "are still required)")
    max_body_bytes: int = Field(8 * 2**20, gt=0, description="largest request body, bytes (8 MiB by default); a "
                                                             "larger one gets a 413")
    accepted_models: list[str] | None = Field(
        None, description="the `model` names a request may give besides the served name; None accepts any name, else "
                          "another name gets a 404 model_not_found listing these")
    retry_after_s: int = Field(1, ge=0, description="the Retry-After header, seconds, of the 503 the proxy answers "
                                                    "when the engine fails")
