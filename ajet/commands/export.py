"""`ajet export --format hf`: a finished run's recorded samples as a Hugging Face `datasets` folder.

One row per sample (an episode forked into several samples gives several rows), from the same reader as
`ajet sft` (`ajet.commands.sft.read_recorded`: successful episodes, `min_reward` and `agent` filters, stored order):

    episode_id, attempt, step   where the sample comes from in the run's store (str, int, int)
    agent                       the sample's agent tag (str)
    reward                      its episode's reward (float)
    messages                    the conversation in chat format: the last merged call's request messages and the
                                answer it returned, each {role, content, tool_calls, tool_call_id} (content as
                                text; tool_calls [{id, type, function: {name, arguments (a JSON string)}}], [] when
                                none; tool_call_id None except on tool messages)
    tools                       that call's tool definitions, as a JSON string ("[]" when none)
    prompt_ids                  `[prompt_len]` the recorded prompt token ids
    completion_ids              `[response_len]` every id after the prompt (sampled and appended between calls)
    loss_mask                   `[response_len]` 1 where the engine sampled the token (as recorded)
    input_ids                   `[prompt_len + response_len]` prompt_ids + completion_ids
    completion_mask             `[prompt_len + response_len]` 0 over the prompt, then loss_mask
    assistant_masks             the same as completion_mask (the name TRL's `assistant_only_loss` reads)

TRL's `SFTTrainer` treats a dataset with `input_ids` as tokenized already; `SFTConfig(completion_only_loss=True)`
then trains only where `completion_mask` is 1 (or `assistant_only_loss=True` with `assistant_masks`): the
recorded tokens and loss mask, as `ajet sft` trains them. docs/sft.md says more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ajet.errors import AjetError, ConfigError


def rows(exp_dir: str | Path, min_reward: float | None = None, agent: str | None = None) -> list[dict[str, Any]]:
    """The export's rows (columns in the module docstring), one per kept sample, in stored order.

    Raises:
        ConfigError: `exp_dir` holds no recorded run (see `ajet.commands.sft.read_recorded`).
    """
    from ajet.commands.sft import read_recorded

    out = []
    for e in read_recorded(exp_dir, min_reward, agent):
        calls = {c.get("call_id"): c for c in e.record.get("calls", [])}
        for s in e.samples:
            last = calls.get((s.get("call_ids") or [None])[-1], {})
            messages = [_message(m) for m in last.get("messages") or []]
            if last.get("response_message"):
                messages.append(_message(last["response_message"]))
            prompt, response, mask = list(s["prompt_ids"]), list(s["response_ids"]), list(s["loss_mask"])
            full_mask = [0] * len(prompt) + mask
            out.append({"episode_id": e.episode_id, "attempt": e.attempt, "step": e.step,
                        "agent": s.get("agent_tag") or "", "reward": e.reward, "messages": messages,
                        "tools": json.dumps(last.get("tools") or []), "prompt_ids": prompt,
                        "completion_ids": response, "loss_mask": mask, "input_ids": prompt + response,
                        "completion_mask": full_mask, "assistant_masks": list(full_mask)})
    return out


def export_hf(exp_dir: str | Path, out: str | Path, min_reward: float | None = None,
              agent: str | None = None) -> tuple[Path, int]:
    """Write the kept samples of `exp_dir` to `out` with `datasets.Dataset.save_to_disk` (read back with
    `datasets.load_from_disk(out)`); returns (out, rows written).

    Raises:
        AjetError: the `datasets` package is missing (names the extra), `out` exists, or no sample passes the filters.
        ConfigError: `exp_dir` holds no recorded run.
    """
    try:
        import datasets
    except ImportError as exc:
        raise AjetError("ajet export needs the `datasets` package: pip install 'ajet[datasets]'") from exc
    out = Path(out)
    if out.exists():
        raise AjetError(f"{out} exists already: name a new folder for the export")
    data = rows(exp_dir, min_reward, agent)
    if not data:
        raise ConfigError(f"no recorded sample of {exp_dir} passes the filters (min_reward={min_reward}, "
                          f"agent={agent})")
    message = {"role": datasets.Value("string"), "content": datasets.Value("string"),
               "tool_calls": [{"id": datasets.Value("string"), "type": datasets.Value("string"),
                               "function": {"name": datasets.Value("string"), "arguments": datasets.Value("string")}}],
               "tool_call_id": datasets.Value("string")}
    ids = datasets.Sequence(datasets.Value("int64"))
    mask = datasets.Sequence(datasets.Value("int8"))
    features = datasets.Features({
        "episode_id": datasets.Value("string"), "attempt": datasets.Value("int64"), "step": datasets.Value("int64"),
        "agent": datasets.Value("string"), "reward": datasets.Value("float64"), "messages": [message],
        "tools": datasets.Value("string"), "prompt_ids": ids, "completion_ids": ids, "loss_mask": mask,
        "input_ids": ids, "completion_mask": mask, "assistant_masks": mask})
    datasets.Dataset.from_list(data, features=features).save_to_disk(str(out))
    return out, len(data)


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """One message in the export's fixed shape (see the module docstring)."""
    content = m.get("content")
    if isinstance(content, list):   # content parts: their text, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        calls.append({"id": c.get("id") or "", "type": c.get("type") or "function",
                      "function": {"name": fn.get("name") or "",
                                   "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    return {"role": m.get("role") or "", "content": content if isinstance(content, str) else "", "tool_calls": calls,
            "tool_call_id": m.get("tool_call_id")}
