"""`ajet doctor`: does this model's chat template let ajet merge an episode's calls exactly?

It renders a synthetic multi-turn tool conversation incrementally (the prompt of each assistant turn,
then that turn, then what follows) and in full, and reports where the renderings disagree and what ajet
does about each finding. Only the tokenizer is loaded (no weights, except a one-time conversion of the
embedded default model).

    ajet doctor --model smollm2-135m-instruct
    ajet doctor --model Qwen/Qwen3-0.6B --chat-template my_template.jinja
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is (2 + 3) * 4, and 7 - 1?"},
    {"role": "assistant", "content": "<think>\nTwo sums first.\n</think>\n\nLet me compute.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "2 + 3"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "7 - 1"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "content": "6"},
    {"role": "assistant", "content": "<think>\n5 * 4 = 20.\n</think>\n\n(2 + 3) * 4 = 20 and 7 - 1 = 6."},
    {"role": "user", "content": "Thanks! And 20 + 6?"},
    {"role": "assistant", "content": "26."},
]


@dataclass
class Finding:
    """One check: `ok` False means ajet has to work around it (`action` says how)."""

    check: str
    ok: bool
    detail: str
    action: str


def diagnose(tokenizer, own_template: str | None = None) -> tuple[bool, list[Finding]]:
    """Run every check on `tokenizer.chat_template`. Returns (append_only, findings).

    own_template: the model's own template before ajet chose one (default: the tokenizer's), for the
    tool-support finding.
    """
    from ajet.chat_template import supports_tools

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=gen)

    eot = tokenizer.eos_token
    findings: list[Finding] = []
    own = tokenizer.chat_template if own_template is None else own_template
    has_tools = supports_tools(own)
    findings.append(Finding("tool support", has_tools,
                            "the model's template renders `tools` and assistant `tool_calls`" if has_tools
                            else "the model's own template has no tool support",
                            "none needed" if has_tools else "ajet uses its Qwen2.5-style tool template "
                            "(model.chat_template: null or 'tools'); the checks below are on that template"))
    full = render(CONVERSATION, True)
    append_only, eot_kept, separators, resplits = True, True, set(), 0
    for k, msg in enumerate(CONVERSATION):
        if msg["role"] != "assistant":
            continue
        prompt, turn = render(CONVERSATION[:k], True), render(CONVERSATION[: k + 1], False)
        later = render(CONVERSATION[: k + 2], True) if k + 1 < len(CONVERSATION) else turn
        if not (turn.startswith(prompt) and later.startswith(turn) and (k + 1 >= len(CONVERSATION) or full.startswith(turn))):
            append_only = False
            a, b = (prompt, turn) if not turn.startswith(prompt) else (turn, full)
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            why = ("earlier <think> blocks are stripped" if "<think>" in a[at - 40: at + 40] and "<think>" not in b[at - 40: at + 40]
                   else "an earlier turn renders differently once the conversation goes on")
            findings.append(Finding(f"append-only at assistant turn {k}", False,
                                    f"{why}: incremental {a[max(0, at - 30): at + 30]!r} vs full {b[max(0, at - 30): at + 30]!r}",
                                    "calls after such a turn are rendered in full and fork into a new sample "
                                    "(reason template_not_append_only); sampled tokens are still trained once each"))
            continue
        reply = turn[len(prompt):]
        cut = reply.rfind(eot)
        if cut < 0:
            eot_kept = False
        else:
            separators.add(reply[cut + len(eot):])
        ids_incremental = tokenizer.encode(prompt, add_special_tokens=False) + tokenizer.encode(reply, add_special_tokens=False)
        resplits += ids_incremental != tokenizer.encode(turn, add_special_tokens=False)
    if append_only:
        findings.append(Finding("append-only", True, "each turn's rendering is a prefix of every later rendering",
                                "calls that continue one another extend the parent's exact tokens and merge into one sample"))
    findings.append(Finding("end-of-turn token", eot_kept,
                            f"assistant turns end with {eot!r}" if eot_kept else f"the template drops {eot!r} after assistant turns",
                            "none needed" if eot_kept else "ajet keeps the sampled end-of-turn token in context and trains it"))
    seps = sorted(s for s in separators if s)
    findings.append(Finding("separator after end-of-turn", not seps,
                            f"the template writes {', '.join(map(repr, seps))} after the end-of-turn token" if seps else "none",
                            "separator tokens are context (loss mask 0) between the sampled reply and the next turn"))
    joined = full.count("<tool_response>") == 2 and render(CONVERSATION[:4], False).count(eot) == render(CONVERSATION[:5], False).count(eot)
    findings.append(Finding("parallel tool results", True,
                            "rendered as one turn" if joined else "rendered as separate turns",
                            "the results are context between two calls (loss mask 0); merging is unaffected"))
    findings.append(Finding("re-tokenizing history", resplits == 0,
                            "rendered history re-tokenizes to the same ids" if resplits == 0
                            else f"{resplits} turn(s) re-tokenize to different ids at a turn boundary",
                            "ajet never re-tokenizes sampled text: prompts extend the sampled ids (token-in-token-out)"))
    return append_only, findings


def main(model: str, chat_template: str | None = None) -> int:
    """Print the report for `model`; exit status 0 (append-only) or 1 (not append-only).

    Raises:
        ConfigError: `model` is a folder without tokenizer files, or a local path that is no folder.
    """
    from rich.console import Console
    from rich.table import Table

    from transformers import AutoTokenizer

    from ajet.model import load_tokenizer, resolve_model_path

    own = AutoTokenizer.from_pretrained(resolve_model_path(model, require="tokenizer")).chat_template
    tok = load_tokenizer(model, chat_template)
    append_only, findings = diagnose(tok, own if chat_template is None else tok.chat_template)
    table = Table(title=f"ajet doctor: {model}", show_lines=True)
    for col in ("check", "", "finding", "what ajet does"):
        table.add_column(col, overflow="fold")
    for f in findings:
        table.add_row(f.check, "[green]ok[/]" if f.ok else "[yellow]note[/]", f.detail, f.action)
    console = Console()
    console.print(table)
    console.print("verdict: " + ("[green]append-only[/]: multi-turn episodes merge into one sample per conversation"
                                  if append_only else "[yellow]not append-only[/]: some calls fork (see above)"))
    return 0 if append_only else 1
