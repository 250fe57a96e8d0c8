"""`LLMCall`: one chat-completion call recorded by the proxy, with the engine's exact tokens.

This is the unit the context tracker merges into training samples. Token ids are the ones the engine
saw and sampled (token-in-token-out): nothing here is ever re-tokenized from text.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, fields
from typing import Any


def call_seed(run_seed: int, episode_key: str, call_index: int) -> int:
    """The sampler seed of one call: a hash of the run's seed, the episode and the call's index in it.

    Each call gets its own random stream, fixed before it reaches the engine, so its sampled tokens do
    not depend on the order in which requests arrive, how the engine batches them or the machine's load
    (the engine's own generator, consumed in admission order, would). BLAKE2b over the three values.

    Args:
        run_seed: `trainer.seed`.
        episode_key: names the episode independently of the run attempt (the trainer uses
            "<group id>/r<repeat index>", so a resumed step's episodes sample as the first attempt's did).
        call_index: 0-based index of the request within the episode, in the order its requests started.

    Returns:
        a seed in [0, 2**63).
    """
    digest = hashlib.blake2b(f"{run_seed}\0{episode_key}\0{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters actually used for one call (after the config policy is applied).

    Attributes:
        temperature: softmax temperature (logprobs are computed from logits / temperature); 0 means greedy
            decoding (argmax; the recorded logprob is then under temperature 1, and the token is not a sample).
        top_p: nucleus mass in (0, 1].
        max_tokens: upper bound on completion length, in tokens.
        seed: per-call RNG seed, or None for the engine's running generator (the trainer's proxy always sets
            one: the client's, else `call_seed(trainer.seed, episode, call index)`).
        stop: stop strings; the completion is cut after the first token that completes one.
        top_logprobs: how many most likely alternatives (id, logprob) to return per sampled token (0: none).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """The parameters of a stored `asdict()` form (JSON: `stop` as a list); keys this version does not know
        are dropped, missing ones take their defaults (None: all defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if k == "stop" else v) for k, v in (d or {}).items() if k in known})


@dataclass(frozen=True)
class TokenDelta:
    """Tokens an engine has just sampled for a completion still being generated (streaming).

    Attributes:
        token_ids: the new ids `[n_new]`, in order; all deltas of a completion concatenate to its `token_ids`.
        logprobs: their logprobs `[n_new]`.
        top_logprobs: per new token, the `params.top_logprobs` most likely (id, logprob) pairs, or None.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one prompt.

    Attributes:
        token_ids: sampled completion ids `[completion_len]`, including the end-of-turn token if sampled.
        logprobs: log pi_old(token) for each sampled id `[completion_len]`, under the sampling temperature.
        finish_reason: "stop" (end-of-turn or stop string) or "length" (hit max_tokens).
        policy_version: the optimizer step whose weights sampled this completion's first token (the
            weights served when the request was admitted).
        token_versions: the policy version that sampled each token `[completion_len]` when the weights
            changed while the completion decoded (asynchronous training), else None (all `policy_version`).
        top_logprobs: per sampled token, the `params.top_logprobs` most likely (id, logprob) pairs, most
            likely first `[completion_len][k]`; None when not asked for.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_versions: list[int] | None = None


@dataclass
class LLMCall:
    """One recorded call of one episode.

    Attributes:
        call_id: unique id ("call-<episode>-<n>").
        episode_id: the episode that made the call.
        agent_tag: which agent of a multi-agent workflow made it ("default" otherwise).
        index: position of the call within its episode (0-based, arrival order).
        messages: the request's messages, as received (OpenAI wire format).
        tools: the request's tool definitions (OpenAI wire format), or None.
        prompt_ids: the exact prompt the engine saw `[prompt_len]`.
        completion_ids: the exact ids the engine sampled `[completion_len]`.
        completion_logprobs: engine logprobs of `completion_ids` `[completion_len]`.
        finish_reason: "stop", "length" or "tool_calls" (as returned to the client).
        response_message: the assistant message returned to the client (content, tool_calls).
        sampling: the sampling parameters used.
        policy_version: optimizer step of the weights that sampled the completion's first token.
        token_versions: the version that sampled each completion token `[completion_len]` when an update
            landed while it decoded (asynchronous training), else None (every token `policy_version`).
        timings: seconds, e.g. {"prepare_s": .., "generate_s": .., "total_s": ..}.
        prompt_parent: the call whose exact tokens this prompt extends (token-in-token-out), or None.
        prompt_render_reason: why the prompt was rendered in full instead ("first_call", "reply_edited",
            "history_edited", "history_differs", "tools_changed", "template_not_append_only"); the tracker's
            fork reason when the call leaves the other calls' tokens.
        prompt_parent_by: how `prompt_parent` was found: "id" (a tool-call id the proxy issued in the parent's
            reply), "text" (messages compared as text), or "none" (no parent).
        forced_text: text appended to the prompt because `tool_choice` fixed the opening of a tool call
            (its tokens are the last ones of `prompt_ids`; never trained on).
        api: which API the call came through: "chat" (Chat Completions), "responses" or "messages"
            (Anthropic); an episode may mix them.
        strict_violations: one message per generated tool call whose arguments break the JSON schema of a
            `strict: true` tool (the proxy does not constrain decoding; see `ajet/proxy/strict.py`).
    """

    call_id: str
    episode_id: str
    agent_tag: str
    index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    response_message: dict[str, Any]
    sampling: SamplingParams
    policy_version: int
    timings: dict[str, float] = field(default_factory=dict)
    prompt_parent: str | None = None
    prompt_render_reason: str | None = None
    prompt_parent_by: str = "none"
    forced_text: str = ""
    strict_violations: list[str] = field(default_factory=list)
    api: str = "chat"
    token_versions: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (used for trajectories.jsonl, trajectories.sqlite and gateway.sqlite)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LLMCall:
        """The call of a stored `to_dict()` form. Keys this version does not know are dropped and missing optional
        ones take their defaults, so a record written by an older or newer ajet still reads.

        Raises:
            TypeError: a required field (call_id, ..., policy_version) is missing.
        """
        known = {f.name for f in fields(cls)} - {"sampling"}
        return cls(**{k: v for k, v in d.items() if k in known}, sampling=SamplingParams.from_dict(d.get("sampling")))
