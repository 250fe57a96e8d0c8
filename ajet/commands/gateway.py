"""`ajet gateway`: one stable model endpoint for deployed agents that trains on the feedback their sessions get
(docs/gateway.md; its parts: ajet/gateway/). `ajet gateway rollback`: serve an earlier policy version.
`ajet gateway keys`: new random api keys in the YAML form of `gateway.keys`.

    ajet gateway --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8766] [--resume]
    ajet gateway rollback --conf X.yaml [--exp-dir DIR] [--to VERSION] [--wait S]
    ajet gateway keys [--client N] [--admin N]
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ajet.config import AjetConfig
from ajet.errors import ConfigError
from ajet.rollout import Rollout, RolloutContext, RunMode


def gateway(cfg: AjetConfig) -> Path:
    """Serve the gateway and train on its rated sessions until `trainer.total_steps` updates; returns the
    experiment folder.

    Every request but /healthz must carry a key: `gateway.secret` (else AJET_SECRET; an admin key) or one of
    `gateway.keys` (client or admin). Without a secret and without an admin key in `gateway.keys`, a secret is
    generated and printed at start (on a loopback host only).

    Raises:
        ConfigError: what `cfg.for_mode("gateway")` refuses (ajet/config/experiment.py): a non-loopback
            `gateway.host` without a secret; `on_no_feedback: judge` or `n` > 1 without a `judge`;
            `gateway.gate.mode: eval` without `data.val_path` or a `workflow`, `replay` without a `judge`;
            `algorithm.dynamic_sampling` (its zero-variance refill needs same-prompt groups); or any config
            problem `ajet.trainer.run` raises; a `gateway.keys` entry whose `key_env` is unset or short.
    """
    from ajet import progress
    from ajet.gateway.app import GatewayApp
    from ajet.gateway.gate import LiveHold, VersionGate
    from ajet.gateway.ops import RateLimiter
    from ajet.gateway.sessions import SessionBook
    from ajet.gateway.source import GatewaySource
    from ajet.gateway.store import GatewayStore
    from ajet.guard import allowed_hosts, secret_beside
    from ajet.judges import load_judge
    from ajet.trainer import run

    cfg = cfg.for_mode("gateway")   # its checks, and its defaults: adv_estimator, proxy.host (ajet/config/)
    g = cfg.gateway
    keys = _keys(cfg)
    secret, generated = secret_beside(g.secret, keys)   # None when gateway.keys holds an admin key and none is set
    hosts = allowed_hosts(g.host, g.allowed_hosts)
    judge = load_judge(cfg) if g.on_no_feedback == "judge" or g.n > 1 else None

    def make_source(ctx: RolloutContext) -> GatewaySource:
        store = GatewayStore(ctx.cfg.exp_path() / "gateway.sqlite")
        try:
            gate = VersionGate(cfg, store, LiveHold(), ctx.console)
        except BaseException:
            store.close()
            raise
        if generated:                              # printed even with --quiet: no client can call without it
            ctx.console.print(f"gateway secret: {secret} (generated: clients send it as their SDK's api key; set "
                              "gateway.secret or AJET_SECRET to keep one across restarts)")
        progress.note(ctx.console, (
            f"gateway: api key required (every request but /healthz; {_describe_keys(keys, secret)}"
            f"{'' if g.allow_query_key else ', never from the URL'}); rewards within [{g.reward_range[0]:g}, "
            f"{g.reward_range[1]:g}]"
            f"; advantage {cfg.algorithm.adv_estimator}; sessions close after {g.session_idle_s:g}s "
            f"idle; feedback deadline {g.feedback_deadline_s:g}s, then {g.on_no_feedback}"
            + (f"; best-of-{g.n}: the judge picks each answer" if g.n > 1 else "")
            + (f"; gate: held-out {g.gate.metric} may drop at most {g.gate.max_drop:g} below the best served"
               if g.gate.mode == "eval" else
               f"; gate: {g.gate.metric} on a replay of the {g.gate.replay_sessions} latest rated sessions (judged) "
               f"may drop at most {g.gate.max_drop:g}" if g.gate.mode == "replay" else
               "; gate off: every update is served")))

        def book(proxy) -> SessionBook:
            return SessionBook(proxy, store, g.session_idle_s, g.feedback_deadline_s, g.on_no_feedback, judge,
                               n=g.n, retention_s=None if g.retention_days is None else g.retention_days * 86400,
                               reward_range=g.reward_range)

        def app(proxy, book_):
            limiter = None if g.rate_limit_rps is None else RateLimiter(
                g.rate_limit_rps, g.rate_limit_burst or max(1, math.ceil(g.rate_limit_rps)))
            return GatewayApp(proxy, book_, secret, lambda: gate.served_version(proxy.engine), limiter, gate, hosts,
                              max_queued=g.max_queued, decoding=cfg.rollout.max_batch_size // g.n,
                              read_timeout_s=g.read_timeout_s, keys=keys, allow_query_key=g.allow_query_key)

        return GatewaySource(ctx, book, app, gate)

    def setup(ctx: RolloutContext) -> Rollout:   # the source is also the update policy: through the gate
        source = make_source(ctx)
        return Rollout(source, update=source, after_training=source.serve_after_training)

    if cfg.trainer.resume:                          # before the trainer picks the checkpoint it resumes from
        _discard_uncommitted(cfg)
    return run(cfg, RunMode(setup, port=g.port, server=True))   # no datasets: its episodes are its sessions


def _keys(cfg: AjetConfig) -> list[tuple[str, str, str]]:
    """(name, key, scope) of every `gateway.keys` entry, `key_env` read now. Checked here, not when the config is
    loaded, so that no message shows a key.

    Raises:
        ConfigError: an entry with both or neither of `key` and `key_env`, an unset or short `key_env`, the
            name `secret` (gateway.secret's), two entries with one name, or a key equal to another one (or to the
            secret).
    """
    from ajet.guard import SECRET_NAME, configured_secret, key_ring

    try:
        if any(k.name == SECRET_NAME for k in cfg.gateway.keys):
            raise ValueError(f"the name `{SECRET_NAME}` is gateway.secret's: name the key otherwise")
        keys = [(k.name, k.value(), k.scope) for k in cfg.gateway.keys]
        key_ring(configured_secret(cfg.gateway.secret), keys)
    except ValueError as e:
        raise ConfigError(f"gateway.keys: {e}") from None
    return keys


def _describe_keys(keys: list[tuple[str, str, str]], secret: str | None) -> str:
    """"the secret (admin), 2 client keys (alice, bob), 1 admin key (ops)" for the start line."""
    from ajet.guard import describe_keys

    return ", ".join([*(["the secret (admin)"] if secret is not None else []), *describe_keys(keys)])


def keys_main(client: int = 1, admin: int = 1) -> int:
    """`ajet gateway keys [--client N] [--admin N]`: print `client` + `admin` new random keys (`ajet.guard.new_key`:
    43 URL-safe characters, 256 bits from the `secrets` module) as a `gateway:` YAML block to paste into a config.
    Returns 0."""
    from ajet.guard import new_key

    print("# new api keys for gateway.keys (keep them secret; hand each client its own)")
    print("gateway:")
    print("  keys:")
    for scope, count in (("client", client), ("admin", admin)):
        for i in range(1, count + 1):
            print(f"    - {{name: {scope}-{i}, scope: {scope}, key: \"{new_key()}\"}}")
    return 0


def _discard_uncommitted(cfg: AjetConfig) -> None:
    """Remove the checkpoint of a version an update wrote but never committed (no `versions` row: the gateway
    was stopped between the two, ajet/gateway/versions.py), so that `--resume` serves the last committed one."""
    from ajet.gateway.store import GatewayStore
    from ajet.gateway.versions import VersionStore

    path = cfg.exp_path() / "gateway.sqlite"
    if not path.is_file():
        return
    store = GatewayStore(path)
    try:
        removed = VersionStore(cfg.exp_path(), cfg.gateway.gate.keep_versions).discard_uncommitted(store.versions())
    finally:
        store.close()
    for folder in removed:
        print(f"gateway: removed {folder.name}: its version was written but never served (stopped before its "
              "record)", flush=True)


def rollback_main(conf: str, exp_dir: str | None = None, to: int | None = None, wait_s: float = 30.0,
                  overrides: dict[str, Any] | None = None) -> int:
    """`ajet gateway rollback --conf X [--exp-dir DIR] [--to V] [--wait S] [KEY=VALUE ...]`: record the wish in the
    experiment's gateway.sqlite, wait up to `wait_s` for a running gateway to do it, and say what happened (the
    config: `conf` with `overrides`, dotted keys, applied). Returns the exit status: 0 done (or recorded for a
    gateway started later with --resume), 1 refused.

    Raises:
        ConfigError: no gateway.sqlite in the experiment folder, or `to` was never served there.
    """
    from ajet.config import load_config
    from ajet.gateway.gate import request_rollback
    from ajet.gateway.store import GatewayStore

    cfg = load_config(conf, {**(overrides or {}), **({"trainer.exp_dir": exp_dir} if exp_dir else {})},
                      mode="gateway")
    path = cfg.exp_path() / "gateway.sqlite"
    if not path.is_file():
        raise ConfigError(f"no gateway ran in {cfg.exp_path()} (no gateway.sqlite): pass the --exp-dir the gateway "
                          "was started with")
    store = GatewayStore(path)
    try:
        served = sorted({v["version"] for v in store.versions()})
        if to is not None and to not in served:
            raise ConfigError(f"--to {to}: that version was never served by this gateway (served: "
                              f"{', '.join(map(str, served)) or 'none'})")
        row = request_rollback(store, to, wait_s)
    finally:
        store.close()
    if row["done_at"] is None:
        print(f"rollback {row['id']} recorded in {path}: a running gateway does it within a second of its trainer "
              f"being free; a gateway started later with --resume does it at start")
        return 0
    print(f"rollback {row['id']}: {row['message']}")
    return 0 if row["ok"] else 1
