"""What each backbone honours: one declaration per backbone for every `AjetConfig` field, and the check that
refuses a config setting the chosen backbone would not honour (instead of training without it).

Every config field, by its YAML path (`trainer.async.max_staleness`), is declared in exactly one of two ways:

    AJET_SIDE    the fields no backbone reads: ajet itself implements them, identically whichever backbone trains
                 (the proxy, the rollout loop, the context tracker, the GRPO advantages, logging, evaluation);
    DEBUG, VERL, TRINITY
                 path -> `Support` for the fields a backbone reads, the same paths in all three:
                 HONOURED / honoured(note)  its own update implements the field as ajet documents it;
                 translated(key)            it becomes the backbone's own config key(s), named;
                 refused(reason, unless=..., unless_text=...)
                                            the backbone cannot honour it: a value other than the field's
                                            default (or, with `unless`, one the predicate rejects) is refused.

A declared path is either a leaf or a whole section judged as one value (`model.lora`: None or the adapter
settings); the sections without a declaration of their own are declared leaf by leaf, so a new field in them has
no declaration until someone writes one.

`check_supported(cfg)` raises `ConfigError` for each refused setting, naming the key, its value, the backbone and
the backbones that do honour it. It runs where the CLI loads a config (`ajet` and `ajet serve`, before any backbone
package is imported) and in the verl and trinity config translations. A field nobody declared is refused the same
way once it is set to a non-default value: never silently ignored.

Adding a config field is a one-line change per place: its path in AJET_SIDE when no backbone reads it, else one
line `"section.key": <Support>,` in each of DEBUG, VERL and TRINITY. Then regenerate the support table of
docs/backbones.md (the text between its `capabilities` marker comments):

    python -m ajet.backbones.capabilities --write docs/backbones.md

`tests/test_backbone_capabilities.py` walks every config field x every backbone (a field without a declaration
fails it) and fails while the committed table differs from the generated one.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ajet.config import AjetConfig
from ajet.errors import ConfigError

Kind = Literal["honoured", "translated", "refused"]


@dataclass(frozen=True)
class Support:
    """How one backbone treats one config field.

    Attributes:
        kind: "honoured" (implemented as documented), "translated" (becomes the backbone's own key(s)) or
            "refused" (the backbone cannot honour it).
        note: honoured: how, when it is not obvious; translated: the backbone's key(s); refused: why, and what
            to do instead.
        unless: refused only: a predicate on the field's value, True for the values the backbone honours after
            all (None: only the field's default).
        unless_text: those values in words, completing "honours it only when ..." (e.g. "unset or 0").
    """

    kind: Kind
    note: str = ""
    unless: Callable[[Any], bool] | None = None
    unless_text: str = ""

    def honours(self, value: Any, default: Any) -> bool:
        """Whether a config holding `value` (the field's default being `default`) is honoured."""
        if self.kind != "refused":
            return True
        if self.unless is not None:
            return bool(self.unless(value))
        return default is not PydanticUndefined and value == default


HONOURED = Support("honoured")
AJET = Support("honoured", "ajet, whichever backbone trains")


def honoured(note: str) -> Support:
    """Honoured, with a note on how (shown in the docs table)."""
    return Support("honoured", note)


def translated(key: str) -> Support:
    """Honoured by becoming the backbone's own config key(s) `key` (dotted, as in the backbone's YAML)."""
    return Support("translated", key)


def refused(reason: str, unless: Callable[[Any], bool] | None = None, unless_text: str = "") -> Support:
    """Not honoured: a value other than the default (or one `unless` rejects) is a ConfigError giving `reason`."""
    return Support("refused", reason, unless, unless_text)


def _unset_or_zero(v: Any) -> bool:
    return v is None or v == 0


# ---- the declarations ------------------------------------------------------------------------------------------

# read by no backbone: ajet implements these itself, the same whichever backbone trains
AJET_SIDE = frozenset("""
    workflow harnesses judge backbone
    model.chat_template
    data.train_path data.train data.val_path data.format data.split data.val_split data.test_path data.test_split
    data.columns data.generator data.generator_args data.env_service data.shuffle data.max_tasks
    rollout.sampling_policy rollout.max_concurrency rollout.episode_timeout_s rollout.failed_episode_policy
    rollout.ray_workers rollout.ray_address
    proxy.host proxy.max_body_bytes proxy.accepted_models proxy.retry_after_s
    algorithm.name algorithm.adv_estimator algorithm.adv_eps algorithm.norm_adv_by_std
    algorithm.dynamic_sampling.enabled algorithm.dynamic_sampling.max_oversample
    algorithm.dynamic_sampling.success_reward algorithm.guards.stale_policy
    algorithm.train_greedy_calls algorithm.group_by_agent_tag algorithm.trainable_targets
    trainer.save_freq trainer.exp_dir trainer.tensorboard trainer.loggers trainer.plots trainer.save_trajectories
    trainer.resume trainer.max_failed_steps trainer.val_freq trainer.val_before_train trainer.keep_best
    trainer.best_metric trainer.best_mode trainer.stop_on_invalid_eval trainer.progress trainer.progress_interval_s
    serve.host serve.port serve.secret serve.keys serve.episode_idle_timeout_s serve.local_workers
    tools.mcp_servers tools.max_calls_per_episode tools.call_timeout_s tools.startup_timeout_s
    tools.health_check_interval_s tools.max_result_chars
    tools.agent.system_prompt tools.agent.max_turns tools.agent.first_tool_choice
    eval.n eval.temperature eval.top_p eval.pass_threshold eval.max_failed_frac
    llm_judge.rubric llm_judge.base_url llm_judge.api_key llm_judge.model llm_judge.frozen_model_path
    llm_judge.temperature llm_judge.max_tokens llm_judge.max_score llm_judge.parse_failure_reward
    reward_model.base_url reward_model.model reward_model.api_key reward_model.timeout_s
""".split())

_NO_STALENESS = ("ajet's importance-sampling correction of off-policy tokens is in the debug backbone's loss only: "
                 "{who} would train stale tokens uncorrected")
_NO_IS_CAP = "the importance-sampling correction it caps is applied by the debug backbone's loss only"
_NO_DISTILL = "on-policy distillation is implemented by the debug backbone's loss only"
_NO_TOP_P = ("{who} scores a batch at one temperature without nucleus truncation, so samples drawn with top_p < 1 "
             "would be refused at the first update")
_NO_AGENTS = ("{who} trains one policy: an adapter per agent role (a mixed-adapter batch, an optimizer each) is "
              "implemented by the debug backbone only")
_ONLY_VERL = "the `verl:` block configures the verl backbone only"
_ONLY_TRINITY = "the `trinity:` block configures the trinity backbone only"
_GATEWAY_UNTESTED = "`ajet gateway` is tested with the debug backbone only so far; use --backbone=debug"
_SFT_UNTESTED = ("fine-tuning on recorded traces (`ajet sft`) is implemented and tested in the debug backbone's "
                 "update only so far; use --backbone=debug")

_GATEWAY_KEYS = ("host", "port", "secret", "keys", "allow_query_key", "allowed_hosts", "reward_range",
                 "session_idle_s", "feedback_deadline_s", "on_no_feedback", "n", "rate_limit_rps", "rate_limit_burst",
                 "max_queued", "read_timeout_s", "retention_days", "after_training", "gate.mode", "gate.metric", "gate.max_drop", "gate.min_score",
                 "gate.replay_sessions", "gate.keep_versions")


def _gateway(support: Support) -> dict[str, Support]:
    """Every `gateway.*` key declared as `support` (a backbone serves `ajet gateway` whole or not at all)."""
    return {f"gateway.{k}": support for k in _GATEWAY_KEYS}


# backbones/debug/backbone.py: ajet's own update, in this process
DEBUG: dict[str, Support] = {
    "experiment_name": HONOURED,
    "model.path": HONOURED,
    "model.dtype": HONOURED,
    "model.device": HONOURED,
    "model.max_model_len": HONOURED,
    "model.lora": HONOURED,
    "model.gradient_checkpointing": honoured("transformers' activation checkpointing of every decoder layer during "
                                             "the update (the engine generates without it; unset: off)"),
    "agents": honoured("one peft adapter per role, served in one batch (each row with its role's adapter), an "
                       "optimizer each"),
    "rollout.num_repeat": HONOURED,
    "rollout.temperature": HONOURED,
    "rollout.top_p": honoured("each token is scored under the top_p it was sampled with"),
    "rollout.max_tokens": HONOURED,
    "rollout.max_batch_size": HONOURED,
    "algorithm.episode_weight": HONOURED,
    "algorithm.distill": HONOURED,
    "algorithm.lr": HONOURED,
    "algorithm.weight_decay": HONOURED,
    "algorithm.clip_ratio_low": HONOURED,
    "algorithm.clip_ratio_high": HONOURED,
    "algorithm.clip_ratio_c": HONOURED,
    "algorithm.kl_coef": HONOURED,
    "algorithm.loss_agg_mode": HONOURED,
    "algorithm.loss_scale_factor": HONOURED,
    "algorithm.ppo_epochs": HONOURED,
    "algorithm.mini_batches": HONOURED,
    "algorithm.micro_batch_tokens": HONOURED,
    "algorithm.max_grad_norm": HONOURED,
    "trainer.total_steps": HONOURED,
    "trainer.tasks_per_step": HONOURED,
    "trainer.seed": HONOURED,
    "trainer.async.max_staleness": honoured("with K > 0 the loss is importance-corrected token by token"),
    "trainer.async.is_cap": HONOURED,
    **_gateway(HONOURED),
    "sft": honoured("token-level cross-entropy on the loss-mask-1 tokens, mean over tokens"),
    "engine": honoured("`vllm`: ajet's vLLM engine generates (a server ajet starts from its own venv, or "
                       "`engine.urls`) and reloads the full weights after every update (with LoRA or `agents:`, "
                       "loads the adapters under new names; docs/engines.md)"),
    "verl": refused(_ONLY_VERL),
    "trinity": refused(_ONLY_TRINITY),
}

# backbones/verl/config.py `verl_overrides`: verl's actor trains on ajet's samples and advantages
VERL: dict[str, Support] = {
    "experiment_name": translated("trainer.experiment_name"),
    "model.path": translated("actor_rollout_ref.model.path (vLLM/SGLang need a Hugging Face id or folder)"),
    "model.dtype": translated("actor_rollout_ref.rollout.dtype, actor_rollout_ref.{actor,ref}.fsdp_config."
                              "mixed_precision"),
    "model.device": honoured("`auto` or this machine's device (CUDA GPUs when present, else CPU)"),
    "model.max_model_len": translated("actor_rollout_ref.rollout.max_model_len"),
    "model.lora": translated("actor_rollout_ref.model.{lora_rank,lora_alpha,target_modules} (with verl's "
                             "vLLM/SGLang rollout, or ajet's vLLM engine: the adapter alone is synced)"),
    "model.gradient_checkpointing": translated("actor_rollout_ref.model.enable_gradient_checkpointing (unset: "
                                               "verl's default, on)"),
    "agents": refused(_NO_AGENTS.format(who="verl's actor")),
    "rollout.num_repeat": translated("actor_rollout_ref.rollout.n"),
    "rollout.temperature": translated("actor_rollout_ref.rollout.temperature"),
    "rollout.top_p": refused(_NO_TOP_P.format(who="verl's actor")),
    "rollout.max_tokens": translated("actor_rollout_ref.rollout.response_length"),
    "rollout.max_batch_size": translated("actor_rollout_ref.rollout.max_num_seqs"),
    "algorithm.episode_weight": refused("verl's seq-mean-* modes divide by the episode count ajet passes as "
                                        "`global_batch_size`; per-sample weights are not wired"),
    "algorithm.distill": refused(_NO_DISTILL),
    "algorithm.lr": translated("actor_rollout_ref.actor.optim.lr"),
    "algorithm.weight_decay": translated("actor_rollout_ref.actor.optim.weight_decay"),
    "algorithm.clip_ratio_low": translated("actor_rollout_ref.actor.clip_ratio_low"),
    "algorithm.clip_ratio_high": translated("actor_rollout_ref.actor.clip_ratio_high"),
    "algorithm.clip_ratio_c": translated("actor_rollout_ref.actor.clip_ratio_c"),
    "algorithm.kl_coef": translated("actor_rollout_ref.actor.{use_kl_loss,kl_loss_coef}, kl_loss_type low_var_kl"),
    "algorithm.loss_agg_mode": translated("actor_rollout_ref.actor.loss_agg_mode"),
    "algorithm.loss_scale_factor": translated("actor_rollout_ref.actor.loss_scale_factor"),
    "algorithm.ppo_epochs": translated("actor_rollout_ref.actor.ppo_epochs"),
    "algorithm.mini_batches": honoured("ajet splits the step by episode: one verl update_actor call each"),
    "algorithm.micro_batch_tokens": translated("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    "algorithm.max_grad_norm": translated("actor_rollout_ref.actor.optim.clip_grad"),
    "trainer.total_steps": translated("trainer.total_training_steps"),
    "trainer.tasks_per_step": translated("data.train_batch_size"),
    "trainer.seed": translated("data.seed"),
    "trainer.async.max_staleness": refused(_NO_STALENESS.format(who="verl's actor"), _unset_or_zero, "unset or 0"),
    "trainer.async.is_cap": refused(_NO_IS_CAP),
    **_gateway(refused(_GATEWAY_UNTESTED)),
    "sft": refused(_SFT_UNTESTED),
    "engine": honoured("`vllm`: ajet's vLLM engine generates (a server ajet starts from its own venv, or "
                       "`engine.urls`; CPU or CUDA) and reloads the actor's full weights, from verl's per-tensor "
                       "export, after every update (with `model.lora`, loads the adapter under new names; "
                       "docs/engines.md)"),
    "verl": honoured("passed through to verl's config, applied last"),
    "trinity": refused(_ONLY_TRINITY),
}

# backbones/trinity/config.py `trinity_dict`: Trinity-RFT's trainer updates, ajet's engine generates
TRINITY: dict[str, Support] = {
    "experiment_name": translated("name"),
    "model.path": translated("model.model_path"),
    "model.dtype": honoured("ajet's engine generates in it; Trinity's trainer trains in fp32 on CPU"),
    "model.device": honoured("ajet's engine; Trinity's trainer uses CUDA when present"),
    "model.max_model_len": translated("model.max_model_len"),
    "model.lora": refused("LoRA is not wired into Trinity's trainer yet (it trains every parameter)"),
    "model.gradient_checkpointing": translated("trainer.trainer_config.model.enable_gradient_checkpointing (unset: "
                                               "on)"),
    "agents": refused(_NO_AGENTS.format(who="Trinity's trainer")),
    "rollout.num_repeat": translated("algorithm.repeat_times"),
    "rollout.temperature": translated("model.temperature"),
    "rollout.top_p": refused(_NO_TOP_P.format(who="Trinity's verl actor")),
    "rollout.max_tokens": translated("model.max_response_tokens"),
    "rollout.max_batch_size": honoured("ajet's engine generates"),
    "algorithm.episode_weight": honoured("Trinity weighs rows, i.e. `sample`; with `episode` a forked episode "
                                         "counts once per sample (a known difference)"),
    "algorithm.distill": refused(_NO_DISTILL),
    "algorithm.lr": translated("algorithm.optimizer.lr"),
    "algorithm.weight_decay": translated("algorithm.optimizer.weight_decay"),
    "algorithm.clip_ratio_low": translated("algorithm.policy_loss_fn_args.clip_range_low"),
    "algorithm.clip_ratio_high": translated("algorithm.policy_loss_fn_args.clip_range_high"),
    "algorithm.clip_ratio_c": translated("algorithm.policy_loss_fn_args.clip_ratio_c"),
    "algorithm.kl_coef": translated("algorithm.kl_loss_fn_args.kl_coef, kl_loss_fn low_var_kl"),
    "algorithm.loss_agg_mode": translated("algorithm.loss_agg_mode"),
    "algorithm.loss_scale_factor": refused("Trinity's seq-mean-token-sum-norm divides by the padded response width "
                                           "and takes no constant"),
    "algorithm.ppo_epochs": translated("trainer.trainer_config.actor.ppo_epochs"),
    "algorithm.mini_batches": refused("the trinity backbone trains the whole step as one mini-batch (verl 0.8 needs "
                                      "the row count to divide by the mini-batch)"),
    "algorithm.micro_batch_tokens": translated("trainer.max_token_len_per_gpu"),
    "algorithm.max_grad_norm": translated("algorithm.optimizer.clip_grad, trainer.grad_clip"),
    "trainer.total_steps": translated("trainer.total_steps"),
    "trainer.tasks_per_step": translated("buffer.batch_size"),
    "trainer.seed": honoured("ajet's engine and task order"),
    "trainer.async.max_staleness": refused(_NO_STALENESS.format(who="Trinity's trainer"), _unset_or_zero,
                                           "unset or 0"),
    "trainer.async.is_cap": refused(_NO_IS_CAP),
    **_gateway(refused(_GATEWAY_UNTESTED)),
    "sft": refused(_SFT_UNTESTED),
    "engine": honoured("`vllm`: ajet's vLLM engine generates (a server ajet starts from its own venv, or "
                       "`engine.urls`; CPU or CUDA) and reloads the trainer's full weights, from Trinity's "
                       "synchronizer, after every update (docs/engines.md)"),
    "verl": refused(_ONLY_VERL),
    "trinity": honoured("merged last into Trinity's typed Config"),
}

DECLARATIONS: dict[str, dict[str, Support]] = {"debug": DEBUG, "verl": VERL, "trinity": TRINITY}


# ---- the config's fields ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigField:
    """One field of `AjetConfig` or of a section below it.

    Attributes:
        path: the YAML path (aliases as written in YAML: `trainer.async.max_staleness`).
        owner: the pydantic model that declares it; name: its attribute there.
        section: the pydantic model it holds (`M` or `M | None`), None for a leaf.
    """

    path: str
    owner: type[BaseModel]
    name: str
    section: type[BaseModel] | None

    @property
    def default(self) -> Any:
        """The field's default value (PydanticUndefined for a required field)."""
        return self.owner.model_fields[self.name].get_default(call_default_factory=True)


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field of this annotation holds (`M` or `M | None`); None for anything else
    (scalars, lists, dicts, unions of several types: judged as one value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0]
    return None


def config_fields(model: type[BaseModel] = AjetConfig, prefix: str = "") -> Iterator[ConfigField]:
    """Every field of `model`, depth first: each section, then the fields inside it (recursively)."""
    for f in _own_fields(model, prefix):
        yield f
        if f.section is not None:
            yield from config_fields(f.section, f.path + ".")


def _own_fields(model: type[BaseModel], prefix: str) -> Iterator[ConfigField]:
    """The fields of `model` itself; those excluded from dumps (`config_dir`, set by the loader) are not
    settings and are skipped."""
    for name, info in model.model_fields.items():
        if info.exclude is not True:
            yield ConfigField(prefix + (info.alias or name), model, name, _section_of(info.annotation))


def declaration(backbone: str) -> dict[str, Support]:
    """What `backbone` honours: AJET_SIDE (as `AJET`) and its own declaration, by path.

    Raises:
        KeyError: `backbone` has no declaration.
    """
    return {**dict.fromkeys(AJET_SIDE, AJET), **DECLARATIONS[backbone]}


def undeclared(backbone: str, model: type[BaseModel] = AjetConfig) -> list[str]:
    """The leaf fields of `model` (default `AjetConfig`) that neither `backbone`'s declaration nor a declared
    section above them covers (a field added without a declaration)."""
    decl = declaration(backbone)
    return [f.path for f in config_fields(model) if f.section is None
            and not any(p in decl for p in _self_and_parents(f.path))]


def _self_and_parents(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


# ---- the check -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """One setting of a config that the chosen backbone does not honour.

    Attributes:
        path: the YAML path; value: its value in the config; backbone: the chosen backbone.
        reason: why it is not honoured; accepted: what the backbone honours instead ("unset", "at its default, 1",
            ...; "" for a field without a declaration); honoured_by: the backbones that would honour this value.
    """

    path: str
    value: Any
    backbone: str
    reason: str
    accepted: str
    honoured_by: tuple[str, ...]

    def message(self) -> str:
        """One line: the key and value, the backbone, why, and the backbones that honour it."""
        only = f" honours it only {self.accepted}" if self.accepted else " does not honour it"
        who = (f"honoured by {', '.join(self.honoured_by)}: remove it, or run with --backbone={self.honoured_by[0]}"
               if self.honoured_by else "no backbone honours it: remove it")
        return f"{self.path}={_show(self.value)}: the {self.backbone} backbone{only}: {self.reason}; {who}"


def refusals(cfg: AjetConfig, backbone: str | None = None) -> list[Refusal]:
    """The settings of `cfg` that `backbone` (default: `cfg.backbone`) does not honour, in field order: each
    refused declaration whose value is not honoured, and each undeclared field set to a non-default value.

    Raises:
        ConfigError: `backbone` has no declaration.
    """
    backbone = backbone or cfg.backbone
    if backbone not in DECLARATIONS:
        raise ConfigError(f"unknown backbone {backbone!r}: choose one of {', '.join(DECLARATIONS)}")
    decl = declaration(backbone)
    out = []
    for f, value in _settings(type(cfg), cfg, "", decl):
        support = decl.get(f.path)
        default = f.default
        if support is None:
            if default is PydanticUndefined or value != default:
                out.append(Refusal(f.path, value, backbone, "no declaration in ajet/backbones/capabilities.py says "
                                   "whether it honours this field, so it is refused rather than ignored", "", ()))
        elif not support.honours(value, default):
            others = tuple(b for b in DECLARATIONS if b != backbone
                           and _honours(declaration(b).get(f.path), value, default))
            out.append(Refusal(f.path, value, backbone, support.note, _accepted(support, default), others))
    return out


def check_supported(cfg: AjetConfig, backbone: str | None = None) -> None:
    """Refuse a config that sets what `backbone` (default: `cfg.backbone`) does not honour.

    Raises:
        ConfigError: one line per refused setting (see `Refusal.message`): the key and value, the backbone, why,
            and the backbones that honour it.
    """
    found = refusals(cfg, backbone)
    if found:
        raise ConfigError("\n".join(r.message() for r in found))


def _settings(model: type[BaseModel], obj: Any, prefix: str,
              decl: dict[str, Support]) -> Iterator[tuple[ConfigField, Any]]:
    """(field, value) at the granularity of the declaration: a declared section as one value, an undeclared
    section's fields one by one; below a section that is None, nothing (the section's own value says it)."""
    for f in _own_fields(model, prefix):
        value = getattr(obj, f.name)
        if f.section is None or f.path in decl or value is None:
            yield f, value
        else:
            yield from _settings(f.section, value, f.path + ".", decl)


def _honours(support: Support | None, value: Any, default: Any) -> bool:
    return support is not None and support.honours(value, default)


def _accepted(support: Support, default: Any) -> str:
    if support.unless_text:
        return f"when {support.unless_text}"
    return "when unset" if default is None else f"at its default, {_show(default)}"


def _show(value: Any) -> str:
    """A config value as YAML would show it, on one line (long values shortened)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the docs table --------------------------------------------------------------------------------------------
BEGIN = "<!-- capabilities:begin (generated by `python -m ajet.backbones.capabilities --write docs/backbones.md`) -->"
END = "<!-- capabilities:end -->"


def _cell(support: Support, default: Any) -> str:
    if support.kind == "translated":
        return f"`{support.note}`" if " (" not in support.note else \
            "`{}` ({}".format(*support.note.split(" (", 1))
    if support.kind == "honoured":
        return f"yes: {support.note}" if support.note else "yes"
    return f"**only {_accepted(support, default)}**: {support.note}"


def markdown_table() -> str:
    """The support table of docs/backbones.md, from the declarations: one row per field some backbone reads (in
    config order), then the fields ajet implements itself, by section."""
    fields = {f.path: f for f in config_fields()}
    names = list(DECLARATIONS)
    lines = ["| config key | " + " | ".join(f"`{b}`" for b in names) + " |", "|---" * (len(names) + 1) + "|"]
    for path, f in fields.items():
        if path in DEBUG:
            lines.append(f"| `{path}` | " + " | ".join(_cell(DECLARATIONS[b][path], f.default) for b in names) + " |")
    by_section: dict[str, list[str]] = {}
    for path in fields:
        if path in AJET_SIDE:
            head, _, rest = path.partition(".")
            by_section.setdefault(head if rest else "", []).append(rest or path)
    lines += ["", "Honoured by every backbone, because ajet implements them itself whichever backbone trains (no "
                  "backbone reads them):", ""]
    for head, keys in by_section.items():
        lines.append(f"- {f'`{head}`: ' if head else ''}" + ", ".join(f"`{k}`" for k in keys))
    return "\n".join(lines)


def write_docs(path: Path) -> bool:
    """Replace the text between the markers `BEGIN` and `END` in `path` with `markdown_table()`; returns whether
    the file changed.

    Raises:
        ValueError: `path` lacks one of the markers.
    """
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no `{BEGIN}` ... `{END}` markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    """`python -m ajet.backbones.capabilities --markdown` prints the table; `--write FILE` updates FILE."""
    p = argparse.ArgumentParser(prog="python -m ajet.backbones.capabilities",
                                description="The backbone support table, generated from the declarations.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the table")
    g.add_argument("--write", metavar="FILE", type=Path, help="rewrite the table between FILE's marker comments")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table())
    else:
        print(f"{args.write}: {'updated' if write_docs(args.write) else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
