"""The `Engine` protocol: what the proxy needs from a backbone's inference server.

An engine turns prompt token ids into sampled completion token ids with their logprobs
(token-in-token-out). The debug backbone's engine generates in-process with transformers; the verl
and trinity backbones wrap vLLM servers.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ajet.llm_call import Completion, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """Generates completions for prompt token ids.

    Attributes:
        policy_version: the optimizer step of the weights currently served (0 = initial weights).
    """

    policy_version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample one completion for `prompt_ids` `[prompt_len]`.

        Raises:
            ValueError: the prompt plus `params.max_tokens` does not fit the model's context.
            RuntimeError: the engine failed or was shut down.
        """
        ...
