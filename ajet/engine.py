"""The `Engine` protocol: what the proxy needs from a backbone's inference server.

An engine turns prompt token ids into sampled completion token ids with their logprobs
(token-in-token-out). The debug backbone's engine generates in-process with transformers; the verl
and trinity backbones wrap vLLM servers.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from ajet.llm_call import Completion, SamplingParams, TokenDelta

TokenCallback = Callable[[TokenDelta], None]


@runtime_checkable
class Engine(Protocol):
    """Generates completions for prompt token ids.

    Attributes:
        policy_version: the optimizer step of the weights currently served (0 = initial weights).
    """

    policy_version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       on_tokens: TokenCallback | None = None) -> Completion:
        """Sample one completion for `prompt_ids` `[prompt_len]`.

        `on_tokens`, when given, is called on the caller's event loop with each batch of newly sampled
        tokens while generation runs (the proxy streams them to the client); the deltas concatenate to the
        returned completion's ids. An engine that cannot stream may never call it: the proxy then streams
        the finished completion at once.

        Raises:
            ValueError: the prompt plus `params.max_tokens` does not fit the model's context.
            RuntimeError: the engine failed or was shut down.
        """
        ...
