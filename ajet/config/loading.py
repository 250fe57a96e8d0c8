"""Reading a YAML experiment file into an `AjetConfig`: unknown keys named with a "did you mean", dotted
overrides, every offending key in one `ConfigError`."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ajet.config.base import describe
from ajet.config.experiment import AjetConfig, Mode
from ajet.errors import ConfigError


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, mode: Mode = "train") -> AjetConfig:
    """Read a YAML experiment file into an `AjetConfig`.

    Args:
        path: the YAML file.
        overrides: dotted keys applied before validation, e.g. {"trainer.exp_dir": "/tmp/x"}.
        mode: the command the config is checked for (`AjetConfig.mode`): train, eval, serve, gateway or sft.

    Returns:
        The validated config, its `config_dir` the file's folder.

    Raises:
        ConfigError: missing/unreadable file, bad YAML, unknown key (with a "did you mean"), wrong type or
            value, missing required key. The message names the file and every offending key.
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
    # an empty section (`rollout:` with every child commented out) means "all defaults"
    data = {k: v for k, v in data.items() if not (v is None and k in _SECTIONS)}
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    errors = _unknown_keys(data, AjetConfig, "")
    if errors:
        raise ConfigError(f"{path}: " + "\n".join(errors))
    try:
        cfg = AjetConfig.model_validate({**data, "mode": mode})
    except ValidationError as exc:
        raise ConfigError(f"{path}:\n" + "\n".join(describe(e) for e in exc.errors())) from exc
    cfg.config_dir = path.resolve().parent
    return cfg


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


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for dotted "a.b", creating missing (or empty) sections."""
    node = data
    *parents, leaf = dotted.split(".")
    for i, key in enumerate(parents):
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"cannot apply override `{dotted}`: `{'.'.join(parents[:i + 1])}` is a value, "
                              f"not a section")
        node = node[key]
    node[leaf] = value


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


