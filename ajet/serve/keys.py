"""The api keys of `ajet serve` (docs/serve.md, "Keys"): the secret (an admin key) and `serve.keys`, each
`{name, key | key_env, scope}` (`ajet.config.serving.GatewayKey`, the model `gateway.keys` uses too).

    client   runs episodes (begin, finish, abort, heartbeat, the model endpoint), reads the run's status without
             the other clients' figures, and on a job server lists and reads jobs
    admin    everything: also the status of every client, and submitting and stopping jobs

A job server (`ajet serve` without `--conf`) reads its keys from `--keys FILE` (a YAML file in the config's form,
`serve: {keys: [...]}`) and hands them to each job's own `ajet serve` in the environment variable `KEYS_ENV`, as it
hands over the secret in AJET_SECRET, so that a key works against the running job behind the job server's URL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from ajet.config.serving import GatewayKey
from ajet.errors import ConfigError
from ajet.guard import SECRET_NAME, KeyRing, key_ring, secret_beside

KEYS_ENV = "AJET_SERVE_KEYS"   # (name, key, scope) of the job server's keys, JSON, for each job's own server

Key = tuple[str, str, str]     # (name, key, scope)


def resolve(entries: Iterable[GatewayKey], where: str = "serve.keys") -> list[Key]:
    """(name, key, scope) of every entry, `key_env` read now (at the server's start, so that no message shows a key).

    Raises:
        ConfigError: naming `where`: an entry with both or neither of `key` and `key_env`, an unset or short
            `key_env`, or the name `secret` (the secret's).
    """
    try:
        keys = []
        for k in entries:
            if k.name == SECRET_NAME:
                raise ValueError(f"the name `{SECRET_NAME}` is the secret's: name the key otherwise")
            keys.append((k.name, k.value(), k.scope))
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return keys


def server_keys(configured_keys: Iterable[GatewayKey], configured: str | None) -> tuple[list[Key], str | None, bool]:
    """The keys `ajet serve --conf` checks: `serve.keys` plus the keys a job server handed over (`KEYS_ENV`), and
    its secret: `configured` (serve.secret), else AJET_SECRET, else None when an admin key is among the keys,
    else a new random one. Returns (keys, secret, whether the secret was generated).

    Raises:
        ConfigError: what `resolve` and `check` refuse; a `KEYS_ENV` that is not the JSON a job server writes.
    """
    keys = [*resolve(configured_keys), *from_env()]
    secret, generated = secret_beside(configured, keys)
    check(keys, secret)
    return keys, secret, generated


def check(keys: list[Key], secret: str | None, where: str = "serve.keys") -> KeyRing:
    """The `KeyRing` of the secret (named `secret`, admin) and `keys`.

    Raises:
        ConfigError: naming `where`: two keys with one name, or one key given twice (also as the secret).
    """
    try:
        return key_ring(secret, keys)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_file(path: Path) -> list[Key]:
    """The keys of a job server's `--keys FILE`: YAML `serve: {keys: [{name, key | key_env, scope}, ...]}`,
    `key_env` read now.

    Raises:
        ConfigError: an unreadable file, another form, an entry `GatewayKey` refuses, or what `resolve` refuses;
            the message names the file and the entry.
    """
    import yaml
    from pydantic import TypeAdapter, ValidationError

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--keys {path}: cannot read it ({str(e).splitlines()[0][:200]})") from None
    serve = data.get("serve") if isinstance(data, dict) and set(data) == {"serve"} else None
    if not isinstance(serve, dict) or set(serve) != {"keys"} or not isinstance(serve["keys"], list):
        raise ConfigError(f"--keys {path}: write the keys as `serve: {{keys: [{{name, key | key_env, scope}}, ...]}}` "
                          "and nothing else")
    try:
        entries = TypeAdapter(list[GatewayKey]).validate_python(serve["keys"])
    except ValidationError as exc:
        e = exc.errors()[0]
        raise ConfigError(f"--keys {path}: serve.keys.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None
    return resolve(entries, f"--keys {path}")


def to_env(keys: list[Key]) -> dict[str, str]:
    """The environment entry that hands `keys` to a job's own server ({} without keys)."""
    return {KEYS_ENV: json.dumps([list(k) for k in keys])} if keys else {}


def from_env() -> list[Key]:
    """The keys a job server handed over in `KEYS_ENV` ([] when it is unset).

    Raises:
        ConfigError: a value that is not a JSON list of [name, key, scope] (not one a job server wrote).
    """
    raw = os.environ.get(KEYS_ENV)
    if not raw:
        return []
    try:
        keys = [tuple(k) for k in json.loads(raw)]
        if not all(len(k) == 3 and all(isinstance(x, str) for x in k) for k in keys):
            raise ValueError
    except (ValueError, TypeError):
        raise ConfigError(f"the environment variable {KEYS_ENV} is set but is not the JSON list of [name, key, scope] "
                          "a job server hands its jobs: unset it") from None
    return keys  # type: ignore[return-value]
