"""The servers that take episodes from outside: `serve:` (the episode API) and `gateway:` (with its gate)."""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import Field, field_validator

from ajet.config.base import _Section


GATEWAY_ESTIMATOR = "reinforce_plus_plus"
"""The gateway's `algorithm.adv_estimator` when the config sets none and `gateway.n` is 1: live sessions have
no same-prompt groups for GRPO's baseline (see ajet/gateway/source.py)."""

class GatewayKey(_Section):
    """One entry of `gateway.keys` or `serve.keys`: an api key with a name (what the gateway's sessions and
    feedback record, and what its rate limits count by) and a scope. The key itself is `key`, or read at start from
    the environment variable `key_env` (as `secret` falls back to AJET_SECRET). `ajet gateway keys` prints new
    ones."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$", description="the key's name "
                      "(letters, digits, _ . @ -): the server's start line lists it; the gateway's sessions, feedback "
                      "and rate limits are attributed to it")
    key: str | None = Field(None, min_length=16, description="the api key itself, at least 16 characters (or "
                            "`key_env`)")
    key_env: str | None = Field(None, min_length=1, description="the environment variable holding the key, read "
                                "at start (instead of `key`)")
    scope: Literal["client", "admin"] = Field("client", description="`client`: in the gateway the model APIs, "
                                              "and feedback, reading and closing the sessions this key opened; in "
                                              "`ajet serve` running episodes and reading jobs; `admin`: every route "
                                              "(rollback, /v1/admin/*, /metrics; submitting and stopping jobs) and "
                                              "every session")

    def value(self) -> str:
        """The key: `key`, else the environment variable `key_env` (read when called: at the server's start, so
        that no error message ever shows a key).

        Raises:
            ValueError: both or neither of `key` and `key_env` given; `key_env` unset, empty or shorter than 16
                characters.
        """
        if (self.key is None) == (self.key_env is None):
            raise ValueError(f"key {self.name!r}: give exactly one of `key` and `key_env`")
        if self.key is not None:
            return self.key
        found = os.environ.get(self.key_env or "", "")
        if len(found) < 16:
            raise ValueError(f"key {self.name!r}: the environment variable {self.key_env} is "
                             f"{'unset' if not found else 'shorter than 16 characters'}: export it (e.g. a key "
                             "`ajet gateway keys` prints) before starting the server")
        return found


class ServeConfig(_Section):
    """`ajet serve`: the training server that clients anywhere run episodes against (docs/serve.md).

    host: bind address (a non-loopback host needs `secret`). port: 0 picks a free one. secret: an admin key, the
    bearer token of the episode API (None: AJET_SECRET, else generated and printed at start unless `keys` holds an
    admin key). keys: more named keys, each `client` (episodes) or `admin` (everything).
    episode_idle_timeout_s: an episode with no call or heartbeat for this long is abandoned and its task
    handed to the next client. local_workers: how many episodes of the config's `workflow` the server runs
    itself at once (0: only remote clients run episodes).
    """

    host: str = Field("127.0.0.1", description="bind address of the episode API (a non-loopback host needs `secret`)")
    port: int = Field(8765, ge=0, le=65535, description="TCP port of the episode API; 0 picks a free one")
    secret: str | None = Field(
        None, min_length=16, description="bearer token of the episode API, at least 16 characters (None: AJET_SECRET,"
                                         " else generated and printed at start unless `keys` holds an admin key);"
                                         " an admin key")
    keys: list[GatewayKey] = Field(default_factory=list, description="named api keys, each `client` (running "
                                   "episodes, reading the run's status without other clients) or `admin` "
                                   "(everything): `{name, key | key_env, scope}`; `ajet gateway keys` prints new ones")
    episode_idle_timeout_s: float = Field(
        300.0, gt=0, description="an episode with no call or heartbeat for this many seconds is abandoned and its "
                                 "task handed to the next client")
    local_workers: int = Field(0, ge=0, description="episodes the server runs itself with the config's "
                                                     "`workflow` (a class or a command), beside remote clients")


class GatewayGateConfig(_Section):
    """`gateway.gate`: the evaluation gate in front of every weight update of `ajet gateway` (docs/gateway.md).
    With mode `eval`, a new policy runs the config's held-out evaluation (`data.val_path`, the config's workflow
    and judge, the `eval:` settings) while live requests wait; it is served only when its `metric` is at most
    `max_drop` below the serving policy's, else the engine (and the training) goes back to the serving weights
    and the refusal is recorded in gateway.sqlite. With mode `replay` the evaluation is a replay of the first
    request of the `replay_sessions` most recently rated sessions, answered by both policies and scored by the
    config's judge (ajet/gateway/replay.py). Every served version is checkpointed, so `ajet gateway rollback`
    can serve an earlier one."""

    mode: Literal["off", "eval", "replay"] = Field(
        "off", description="`eval`: a new policy is served only after the held-out evaluation (data.val_path) finds "
                           "its metric at most max_drop below the serving policy's; `replay`: the same rule on a "
                           "replay of recent rated sessions' first requests, scored by the config's judge (both "
                           "policies answer the same set at each update); `off`: every update is served at once")
    metric: str = Field("pass@1", min_length=1, description="the evaluation figure compared: pass@1, reward_mean, "
                        "pass@<n> or workflow/<name> (a `val/` prefix is accepted); higher is better")
    max_drop: float = Field(0.05, ge=0, description="a new policy whose metric is more than this below the best "
                            "figure a served version had (mode eval; mode replay: the serving policy's on the same set) "
                            "is refused (not served); an invalid evaluation (eval.max_failed_frac) is refused too")
    min_score: float | None = Field(None, description="an absolute floor: a new policy whose metric is below this is "
                                    "refused whatever the serving policy scores (None: no floor). A policy whose "
                                    "answers are degenerate (empty, only end-of-text, non-finite logprobs) is always "
                                    "refused")
    replay_sessions: int = Field(16, ge=1, le=10_000, description="mode `replay`: how many sessions are replayed, "
                                 "those whose latest feedback arrived last (each its first request, eval.n answers)")
    keep_versions: int = Field(3, ge=1, description="served policy versions kept, whatever the mode: each is a "
                               "trainer checkpoint in exp_dir/checkpoints (with model.lora the adapter only) that "
                               "`--resume` continues from; the versions served last (and the one served) are kept, "
                               "the ones `ajet gateway rollback` can go back to")


class GatewayConfig(_Section):
    """`ajet gateway`: one stable model endpoint for deployed agents, training on the feedback their sessions
    get (docs/gateway.md). A session is one conversation (header `X-Ajet-Session`, or found by its prefix)."""

    host: str = Field("127.0.0.1", description="bind address; a non-loopback host needs `secret`")
    port: int = Field(8766, ge=0, le=65535, description="port; 0 picks a free one (printed at start)")
    secret: str | None = Field(None, min_length=16, description="an admin key: the bearer token of every route "
                               "(also AJET_SECRET); None: generated and printed at start unless `keys` holds an "
                               "admin key")
    keys: list[GatewayKey] = Field(default_factory=list, description="named api keys, each `client` (model calls "
                                   "and its own sessions) or `admin` (everything): `{name, key | key_env, scope}`; "
                                   "`ajet gateway keys` prints new ones")
    allow_query_key: bool = Field(False, description="accept the api key in the URL (`?key=`) too; off: only "
                                  "headers (Authorization: Bearer, x-api-key, x-goog-api-key), since a URL ends up "
                                  "in browser history, Referer headers and proxy logs")
    allowed_hosts: list[str] = Field(default_factory=list, description="more Host names the gateway answers besides "
                                     "localhost, 127.0.0.1, [::1] and `host` (e.g. the name of a reverse proxy in "
                                     "front of it); others get a 403. Empty with a wildcard host (0.0.0.0, ::): any")
    reward_range: tuple[float, float] = Field((-10.0, 10.0), description="[low, high]: the rewards accepted; a "
                                              "feedback outside it (or not finite) is a 400 naming the range, a judge "
                                              "score outside it drops the session")
    session_idle_s: float = Field(300.0, gt=0, description="a session without a request for this long closes, "
                                  "seconds; later requests of the conversation open a new session")
    feedback_deadline_s: float = Field(86400.0, gt=0, description="a closed session without feedback this long "
                                       "after it closed is judged or dropped (on_no_feedback), seconds")
    on_no_feedback: Literal["judge", "drop"] = Field("drop", description="what a session without feedback by "
                                                     "the deadline gets: `judge` (the config's judge scores its "
                                                     "last answer) or `drop` (never trained on)")
    n: int = Field(1, ge=1, le=16, description="best-of-N: each request is sampled this many times in one engine "
                   "batch, the config's judge scores each and the highest is answered (streams get it once all are "
                   "sampled); the session and its unchosen candidates (rewarded with their judge scores) form one "
                   "GRPO group. 1: one sample, no judge")
    rate_limit_rps: float | None = Field(None, gt=0, description="requests per second each client may send, "
                                         "sustained: each key of `keys` by its name, other callers by source address "
                                         "(whatever session they send); over it a 429 with Retry-After. None: no "
                                         "limit")
    rate_limit_burst: int | None = Field(None, ge=1, description="requests a client may send at once after a quiet "
                                         "spell (its token bucket's size); None: rate_limit_rps rounded up")
    max_queued: int = Field(64, ge=0, description="model calls that may wait for the engine beyond the "
                            "`rollout.max_batch_size` it decodes together (divided by `n`); a call beyond them is "
                            "answered 503 with Retry-After at once instead of waiting without bound")
    read_timeout_s: float = Field(30.0, gt=0, description="a request's headers and body must arrive within this "
                                  "many seconds of its first byte (of the connection, for its first request), else "
                                  "the connection is closed; a model call takes a place in the queue (max_queued) "
                                  "only once its body is complete")
    retention_days: float | None = Field(None, gt=0, description="trained or dropped sessions closed longer ago "
                                         "than this are deleted from gateway.sqlite, days; None: kept forever")
    after_training: Literal["serve", "stop"] = Field(
        "serve", description="after the last update (trainer.total_steps): `serve` keeps serving the last served "
                             "policy until the process is stopped (requests recorded, feedback accepted and kept for "
                             "a later --resume with more steps, rollbacks done; nothing trains); `stop` shuts the "
                             "gateway down")
    gate: GatewayGateConfig = Field(default_factory=GatewayGateConfig, description="the evaluation gate before a "
                                    "new policy serves, and the versions kept for rollback")

    @field_validator("reward_range")
    @classmethod
    def _bounded_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(x) for x in v) or v[0] >= v[1]:
            raise ValueError(f"must be [low, high] with finite low < high (e.g. [-10, 10]), got {list(v)}")
        return v
