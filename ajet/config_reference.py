"""The configuration reference (docs/configuration.md), generated from the config models of `ajet.config`.

Every field of `AjetConfig` and of every model below it, including the models held in lists, dicts and unions
(`data.train[]`, `harnesses.NAME`, `tools.mcp_servers.NAME`, the two `workflow:` mappings), gets one row: its
YAML key, type, default, allowed values (a `Literal`'s values and the numeric bounds pydantic enforces), unit,
description (the field's `Field(description=...)`) and which backbones honour it, read from the declarations
in `ajet.backbones.capabilities` (its field walker `config_fields` and its `declaration` per backbone).

    python -m ajet.config_reference --write docs/configuration.md     # regenerate the page
    python -m ajet.config_reference --check docs/configuration.md     # exit 1 when the page is out of date

It lives in `ajet/` (not in docs tooling) because it is generated from the installed package's own models and
declarations and checked by the test suite, which runs without the docs extra.
`tests/test_config_reference.py` fails when a field has no description or the committed page differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ajet.backbones.capabilities import AJET_SIDE, DECLARATIONS, ConfigField, Support, config_fields, declaration
from ajet.config import AjetConfig

#: units of fields whose name does not end in a unit suffix (`_s`, `_bytes`, `_mb`, `_chars`, `_tokens`)
UNITS = {
    "max_model_len": "tokens", "max_tokens": "tokens", "loss_scale_factor": "tokens",
    "max_staleness": "policy versions", "save_freq": "steps", "val_freq": "steps", "total_steps": "steps",
    "tasks_per_step": "tasks", "max_oversample": "tasks", "success_reward": "reward", "max_tasks": "tasks",
    "num_repeat": "episodes",
    "max_concurrency": "episodes", "max_batch_size": "prompts", "n": "episodes", "max_turns": "model calls",
    "max_calls_per_episode": "tool calls", "max_failed_steps": "steps", "local_workers": "episodes",
    "ray_workers": "actors", "max_processes": "processes",
}
_SUFFIX_UNITS = (("_s", "seconds"), ("_bytes", "bytes"), ("_mb", "MiB"), ("_chars", "characters"),
                 ("_tokens", "tokens"))


@dataclass(frozen=True)
class Group:
    """One table of the page: the fields a model declares, shown under the YAML path of the model.

    Attributes:
        path: the YAML path of the model ("" for the top level, `data.train[]`, `harnesses.NAME`, ...).
        title: the heading; model: the pydantic model; fields: its own fields, in declaration order.
    """

    path: str
    title: str
    model: type[BaseModel]
    fields: tuple[ConfigField, ...]


def groups(model: type[BaseModel] = AjetConfig, prefix: str = "", title: str | None = None) -> Iterator[Group]:
    """Every table of the reference, depth first: `model`'s own fields, then each section below it (walked by
    `ajet.backbones.capabilities.config_fields`), then each model held in a list, dict or union field."""
    walked = list(config_fields(model, prefix))
    by_parent: dict[str, list[ConfigField]] = {}
    for f in walked:
        by_parent.setdefault(f.path.rpartition(".")[0], []).append(f)
    sections = {prefix.rstrip("."): (model, title)} | {f.path: (f.section, None) for f in walked if f.section}
    for path, (m, t) in sections.items():
        own = tuple(by_parent.get(path, ()))
        yield Group(path, t or (f"`{path}`" if path else "top level"), m, own)
        for f in own:
            if f.section is None:
                for sub_prefix, sub_title, sub in _held_models(f):
                    yield from groups(sub, sub_prefix, sub_title)


def _held_models(f: ConfigField) -> Iterator[tuple[str, str, type[BaseModel]]]:
    """(prefix, title, model) for each model a list, dict or union field holds (not a plain section)."""
    ann = f.owner.model_fields[f.name].annotation
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is list and _is_model(args[0]):
        yield f"{f.path}[].", f"`{f.path}[]` (each item)", args[0]
    elif origin is dict and _is_model(args[1]):
        yield f"{f.path}.NAME.", f"`{f.path}.NAME` (each entry)", args[1]
    elif origin in (typing.Union, types.UnionType):
        for a in args:
            if _is_model(a):
                yield from _held_models_of_union(f, a)
            elif typing.get_origin(a) is list and _is_model(typing.get_args(a)[0]):
                yield f"{f.path}[].", f"`{f.path}[]` (each item)", typing.get_args(a)[0]


def _held_models_of_union(f: ConfigField, m: type[BaseModel]) -> Iterator[tuple[str, str, type[BaseModel]]]:
    models = [a for a in typing.get_args(f.owner.model_fields[f.name].annotation) if _is_model(a)]
    if len(models) > 1:       # `workflow: {harness: ...}` or `{command: ...}`: named by their first key
        yield f"{f.path}.", f"`{f.path}` as `{{{next(iter(m.model_fields))}: ...}}`", m


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def all_fields() -> list[tuple[Group, ConfigField]]:
    """Every (table, field) of the reference."""
    return [(g, f) for g in groups() for f in g.fields]


# ---- the cells -------------------------------------------------------------------------------------------------
def type_text(ann: Any) -> str:
    """A type annotation as a reader writes it: `str | None`, `list[str]`, `dict[str, Any]`, a model's name."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "None"
    if origin is Literal:
        kinds = sorted({type(a).__name__ for a in args})
        return " | ".join(kinds)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_text(a) for a in args))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if ann is Any:
        return "Any"
    return getattr(ann, "__name__", str(ann))


def allowed_text(f: ConfigField) -> str:
    """The values the field accepts beyond its type: a Literal's values, numeric bounds, length, pattern."""
    info = f.owner.model_fields[f.name]
    out = [", ".join(f"`{v}`" for v in _literals(info.annotation))] if _literals(info.annotation) else []
    for m in info.metadata:
        for cls, attr, op in ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<=")):
            if isinstance(m, cls):
                out.append(f"{op} {getattr(m, attr)}")
        if isinstance(m, at.MinLen):
            what = "character" if info.annotation is str else "item"
            out.append(f"at least {m.min_length} {what}{'s' if m.min_length != 1 else ''}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
    return "; ".join(out)


def _literals(ann: Any) -> list[Any]:
    if typing.get_origin(ann) is Literal:
        return list(typing.get_args(ann))
    return [v for a in typing.get_args(ann) for v in _literals(a)]


def default_text(f: ConfigField) -> str:
    """The default as YAML would take it (`None` for unset); "required" when there is none."""
    value = f.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "None"
    return f"`{json.dumps(value)}`"


def unit_text(f: ConfigField) -> str:
    """The field's unit: from `UNITS` by name, else from its name's suffix; "" for a unitless field."""
    if f.name in UNITS:
        return UNITS[f.name]
    return next((unit for suffix, unit in _SUFFIX_UNITS if f.name.endswith(suffix)), "")


def support_of(path: str, backbone: str) -> Support | None:
    """The declaration of `backbone` covering the field at `path` (itself or the nearest declared section above
    it; `[]` and `NAME` segments of held models are looked through); None when nothing covers it."""
    decl = declaration(backbone)
    parts = [p for p in path.replace("[]", "").split(".") if p != "NAME"]
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in decl:
            return decl[".".join(parts[:i])]
    return None


def backbones_text(f: ConfigField) -> str:
    """Which backbones honour the field: "all (ajet implements it)" for the fields no backbone reads, else each
    backbone that honours it, and each that refuses it with the values it still accepts."""
    parts = [p for p in f.path.replace("[]", "").split(".") if p != "NAME"]
    if any(".".join(parts[:i]) in AJET_SIDE for i in range(len(parts), 0, -1)):
        return "all (ajet implements it)"
    if f.section is not None and all(support_of(f.path, b) is None for b in DECLARATIONS):
        return "per key, below"
    yes, only = [], []
    for b in DECLARATIONS:
        s = support_of(f.path, b)
        if s is None:
            only.append(f"{b}: undeclared (refused when set)")
        elif s.kind == "refused":
            when = f"when {s.unless_text}" if s.unless_text else \
                ("when unset" if f.default is None else "at its default")
            only.append(f"{b} only {when}")
        else:
            yes.append(b)
    return "; ".join(([", ".join(yes)] if yes else []) + only)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def markdown() -> str:
    """The whole page: an introduction, then one table per model (see `groups`)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m ajet.config_reference --write docs/configuration.md` from ajet/config/ and "
        "ajet/backbones/capabilities.py; do not edit by hand -->",
        "",
        "Every key of an experiment YAML (`ajet --conf X.yaml`), generated from the config models in "
        "`ajet/config/`. An unknown key is an error naming it, with a \"did you mean\". *Backbones* says which "
        "backbones honour a key (details per backbone in [Backbones](backbones.md)): \"all\" for the keys ajet "
        "implements itself whichever backbone trains; a setting a backbone does not honour is refused when the "
        "config is loaded, never silently ignored.",
        "",
        "`NAME` stands for a name you choose (a harness, an MCP server); `[]` for each item of a list.",
        "",
        "## Overrides on the command line",
        "",
        "Any key can be set after the flags of a command that reads a config (`ajet --conf`, `ajet serve`, "
        "`gateway`, `gateway rollback`, `eval`, `sft`, `harnesses`), dotted for a key in a section, without editing "
        "the YAML:",
        "",
        "    ajet --conf tutorial/example_math_agent/math_agent.yaml --backbone=debug engine.kind=vllm "
        "trainer.total_steps=2 rollout.temperature=0.7",
        "",
        "- The value is read as YAML, as the same key's line in the file would be: `0.7` a number, `true`/`false`, "
        "`null` (or nothing after `=`), `[a, b]` a list, `{k: v}` a mapping, anything else a string. Quote a string "
        "that would read as something else inside the shell's quotes: `experiment_name='\"2024\"'`.",
        "- A digit names an item of a list: `data.train.1.weight=3`. A key set whole replaces the YAML's: "
        "`workflow='{command: [python, agent.py]}'`. A key given twice: the later wins.",
        "- The overrides are applied to the YAML's keys before they are checked, and checked the same way: an "
        "unknown key is an error with a \"did you mean\" (`command line: unknown key ...`), a wrong value the "
        "key's own error, marked \"(from the command line)\"; either exits with status 2 before anything loads.",
        "- A relative path in a value resolves as the same line in the YAML file would: task files and "
        "`file.py:Class` specs (workflow, judge) against the YAML file's folder first, then the current directory; "
        "`model.path` and `trainer.exp_dir` against the current directory. So a file named from the current "
        "directory is found unless the YAML's folder has one of the same name; an absolute path "
        "(`$PWD/tasks.jsonl`) is never ambiguous.",
        "- `--steps`, `--seed`, `--exp-dir`, `--backbone` and the other flags that set a key are short forms of "
        "it (`--steps 5` is `trainer.total_steps=5`); a flag and an override of the same key are refused.",
    ]
    for g in groups():
        lines += ["", f"## {g.title}", ""]
        doc = (g.model.__doc__ or "").strip().split("\n\n")[0]
        if doc and g.path:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | allowed | unit | description | backbones |", "|---" * 7 + "|"]
        for f in g.fields:
            info = f.owner.model_fields[f.name]
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{f.path}`", type_text(info.annotation), default_text(f), allowed_text(f), unit_text(f),
                info.description or "", backbones_text(f))) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`--markdown` prints the page; `--write FILE` writes it; `--check FILE` exits 1 when FILE differs."""
    p = argparse.ArgumentParser(prog="python -m ajet.config_reference",
                                description="The configuration reference, generated from ajet/config/.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the page")
    g.add_argument("--write", metavar="FILE", type=Path, help="write the page to FILE")
    g.add_argument("--check", metavar="FILE", type=Path, help="exit 1 when FILE is not the generated page")
    args = p.parse_args(argv)
    page = markdown()
    if args.markdown:
        print(page, end="")
    elif args.write:
        changed = not args.write.is_file() or args.write.read_text() != page
        args.write.write_text(page)
        print(f"{args.write}: {'updated' if changed else 'already up to date'}")
    else:
        if not args.check.is_file() or args.check.read_text() != page:
            print(f"{args.check} is out of date: run python -m ajet.config_reference --write {args.check}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
