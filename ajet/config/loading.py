"""Reading a YAML experiment file into an `AjetConfig`: unknown keys named with a "did you mean", dotted
overrides, every offending key in one `ConfigError`."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ajet.config.base import describe
from ajet.config.experiment import AjetConfig, Mode
from ajet.errors import ConfigError


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, mode: Mode = "train",
                overrides_source: str = "command line") -> AjetConfig:
    """Read a YAML experiment file into an `AjetConfig`.

    Args:
        path: the YAML file.
        overrides: dotted keys set on the command line (`parse_overrides`, and the flags such as `--steps`),
            applied to the YAML's mapping before validation, e.g. {"trainer.exp_dir": "/tmp/x"}; a value is what
            the same key's line in the YAML would hold (a relative path in it resolves as the YAML's own do).
            A digit names an item of a list (`data.train.0.weight`).
        mode: the command the config is checked for (`AjetConfig.mode`): train, eval, serve, gateway or sft.
        overrides_source: how messages name where the overrides came from (`ajet.Job.from_yaml`: its keywords).

    Returns:
        The validated config, its `config_dir` the file's folder.

    Raises:
        ConfigError: missing/unreadable file, bad YAML, unknown key (with a "did you mean"), wrong type or
            value, missing required key. The message names the file (an override's key: `command line`) and
            every offending key.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    cfg = config_from_mapping(data, str(path), overrides, mode, overrides_source)
    cfg.config_dir = path.resolve().parent
    return cfg


def config_from_mapping(data: dict[str, Any], source: str, overrides: dict[str, Any] | None = None,
                        mode: Mode = "train", overrides_source: str | None = "command line") -> AjetConfig:
    """An `AjetConfig` from a mapping of config keys (a YAML file's, or `ajet.Job`'s keyword arguments), checked as
    `load_config` checks a file: unknown keys with a "did you mean", then the models' own validation.

    Args:
        data: the config's keys, nested by section (not changed).
        source: how messages name where `data` came from (the YAML file, `Job(...)`).
        overrides: dotted keys applied to `data` before validation (see `load_config`).
        mode: the command the config is checked for (`AjetConfig.mode`).
        overrides_source: how messages name where the overrides came from ("command line": `command line: unknown
            key ...` and `(from the command line)` after a bad value); None: as `source`, with no suffix.

    Returns:
        The validated config (its `config_dir` None: relative paths resolve against the cwd).

    Raises:
        ConfigError: an unknown key (with a "did you mean"), wrong type or value, missing required key; the
            message names `source` (an override's key: `overrides_source`) and every offending key.
    """
    import copy

    # an empty section (`rollout:` with every child commented out) means "all defaults"
    data = {k: copy.deepcopy(v) for k, v in data.items() if not (v is None and k in _SECTIONS)}
    overrides = overrides or {}
    in_yaml, given = _unknown_keys(data, AjetConfig, ""), _unknown_keys(_override_tree(overrides), AjetConfig, "")
    if in_yaml or given:
        raise ConfigError("\n".join(([f"{source}: " + "\n".join(in_yaml)] if in_yaml else []) +
                                     ([f"{overrides_source or source}: " + "\n".join(given)] if given else [])))
    for dotted, value in overrides.items():
        _set_dotted(data, dotted, value)
    try:
        return AjetConfig.model_validate({**data, "mode": mode})
    except ValidationError as exc:
        raise ConfigError(f"{source}:\n" + "\n".join(
            describe(e) + (_from_command_line(e, overrides, overrides_source) if overrides_source else "")
            for e in exc.errors())) from exc


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """The command line's `KEY=VALUE` words as {dotted key: value}: `trainer.total_steps=5` -> 5.

    VALUE is read as YAML (`yaml.safe_load`), as the same key's line in the YAML file would be: `0.7` a float,
    `true` a bool, `null` (or nothing after `=`) None, `[1, 2]` a list, `{a: 1}` a mapping, `'5'` the string "5",
    anything else a string. A key given twice: the later wins.

    Raises:
        ConfigError: a word without `=`, an empty or malformed key (`=3`, `a..b=1`), or a value that is not
            YAML (`[1,2`).
    """
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not _KEY.fullmatch(key):
            raise ConfigError(f"`{item}` is not an override: write KEY=VALUE with a config key, dotted for a "
                              f"section's (e.g. trainer.total_steps=5)")
        try:
            out[key] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override `{item}`: the value is not valid YAML ({getattr(exc, 'problem', exc)}); "
                              f"for a string, quote it: '{key}=\"{text}\"'") from exc
    return out


def resolve_path(cfg: AjetConfig, p: str | Path) -> Path:
    """An absolute path for `p`: as is if absolute, else the config file's folder first, then the cwd."""
    p = Path(p).expanduser()
    if p.is_absolute():
        return p
    if cfg.config_dir is not None and (cfg.config_dir / p).exists():
        return cfg.config_dir / p
    return Path.cwd() / p


_SECTIONS = {k for k, f in AjetConfig.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for dotted "a.b", creating missing (or empty) sections; a digit names an item of a
    list (`data.train.0.weight`)."""
    node: Any = data
    keys = dotted.split(".")
    for i, key in enumerate(keys):
        where = ".".join(keys[:i])
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise ConfigError(f"cannot apply override `{dotted}`: `{where}` is a list of {len(node)} items; name "
                                  f"one by its index, 0 to {len(node) - 1}")
            key = int(key)
        elif not isinstance(node, dict):
            raise ConfigError(f"cannot apply override `{dotted}`: `{where}` is a value, not a section (set it "
                              f"whole: {where}=...)")
        if i == len(keys) - 1:
            node[key] = value
        elif isinstance(node, dict) and node.get(key) is None:
            if keys[i + 1].isdigit():
                raise ConfigError(f"cannot apply override `{dotted}`: `{'.'.join(keys[:i + 1])}` is not set in the "
                                  f"config; set the whole list: {'.'.join(keys[:i + 1])}=[...]")
            node[key] = {}
        node = node[key]


def _override_tree(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides' keys as nested sections, for the unknown-key check (a list's items are not walked)."""
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        keys = dotted.split(".")
        if any(k.isdigit() for k in keys):
            keys, value = keys[:next(i for i, k in enumerate(keys) if k.isdigit())], None
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {}) if isinstance(node.get(key, {}), dict) else {}
        node[keys[-1]] = value
    return tree


def _from_command_line(err: dict[str, Any], overrides: dict[str, Any], source: str = "command line") -> str:
    """" (from the command line)" (`source`) for a validation error at or under a key the overrides set."""
    key = ".".join(str(p) for p in err["loc"])
    return f" (from the {source})" if any(key == k or key.startswith(k + ".") for k in overrides) else ""


def _unknown_keys(data: dict[str, Any], model: type[BaseModel], prefix: str) -> list[str]:
    errors = []
    fields = {f.alias or k: f for k, f in model.model_fields.items() if not (f.exclude is True)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            elsewhere = [p for p in _key_paths(str(key)) if p != dotted]
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = (" It belongs " + " or ".join(f"under `{p.rpartition('.')[0]}` (`{p}`)" if "." in p else
                                                 f"at the top level (`{p}`)" for p in elsewhere) + "." if elsewhere
                    else f" did you mean `{prefix}{close[0]}`?" if close else "")
            errors.append(f"unknown key `{dotted}`.{hint} Allowed keys{' in ' + prefix[:-1] if prefix else ''}: "
                          f"{', '.join(sorted(fields))}")
            continue
        ann = fields[key].annotation
        if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            errors += _unknown_keys(value, ann, dotted + ".")
    return errors


def _key_paths(key: str, model: type[BaseModel] = AjetConfig, prefix: str = "") -> list[str]:
    """The dotted paths where `key` is a field in `model`'s sections (a `lr:` at the top level is `algorithm.lr`),
    walking every section, optional ones included (`sft:`)."""
    paths = []
    for name, f in model.model_fields.items():
        if f.exclude is True:
            continue
        name = f.alias or name
        if name == key:
            paths.append(prefix + name)
        sections = [a for a in (f.annotation, *getattr(f.annotation, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(sections) == 1:
            paths += _key_paths(key, sections[0], f"{prefix}{name}.")
    return paths


