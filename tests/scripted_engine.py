"""An engine that answers instantly with scripted replies (for proxy tests; the proxy stays real).

Each reply text is tokenized with the policy tokenizer and closed with the end-of-turn id, so the
proxy, template, tool-call parser and tracker all run on real token ids.
"""

from __future__ import annotations

from ajet.llm_call import Completion, SamplingParams


class ScriptedEngine:
    def __init__(self, tokenizer, replies: list[str | list[int]]):
        """replies: texts (tokenized, then end-of-turn appended) or exact id lists (returned as given)."""
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.policy_version = 0
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        reply = self.replies[len(self.prompts) % len(self.replies)]
        self.prompts.append(list(prompt_ids))
        if isinstance(reply, list):
            ids = list(reply)
        else:
            ids = self.tokenizer.encode(reply, add_special_tokens=False)[: params.max_tokens - 1]
            ids.append(self.tokenizer.eos_token_id)
        self.sampled.append(ids)
        return Completion(ids, [-0.5] * len(ids), "stop", self.policy_version)
