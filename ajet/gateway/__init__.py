"""`ajet gateway`: one stable model endpoint for deployed agents that trains on the feedback their sessions get
(docs/gateway.md).

    ajet gateway --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8766] [--resume]

    app.py       the HTTP front: the proxy's four dialects without per-episode URLs, feedback, /healthz
    ops.py       /metrics (Prometheus text) and per-key rate limits
    sessions.py  sessions: found by header or by prefix, closed when idle, rated by feedback or the judge
    gate.py      the evaluation gate before a new policy serves, rollback
    versions.py  each served version as a trainer checkpoint (what --resume serves), kept versions
    replay.py    the replay gate's evaluation set: recent rated sessions' first requests, judged
    store.py     gateway.sqlite: sessions, calls, responses, feedback (durable before the client hears back)
    source.py    rated sessions as episodes: the rollout source of the one training loop (ajet/trainer.py)

The command (`gateway`, `gateway rollback`) that wires these into the training loop: ajet/commands/gateway.py.

The config needs no task file: without one, `data` names `live_traffic` below (a placeholder that only satisfies
the config's one-task-source rule: the gateway's run mode reads no dataset, and no episode runs it).
`data.val_path` still gives held-out validation (`trainer.val_freq`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

LIVE_TRAFFIC = "ajet.gateway:live_traffic"


def live_traffic(split: str) -> Iterator[dict[str, Any]]:
    """The gateway's stand-in task source (`data.generator` when the config names none): one placeholder task,
    so that the config names a task source; the gateway's run mode reads no training dataset (its episodes are
    its sessions)."""
    yield {"task_id": "live", "query": "(live traffic: every session is its own task)"}


def task_source_overrides(conf: str | Path) -> dict[str, Any]:
    """`{"data.generator": LIVE_TRAFFIC}` when the YAML file names no training task source, else {}."""
    import yaml

    try:
        data = (yaml.safe_load(Path(conf).read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return {}                                 # load_config reports the problem
    named = isinstance(data, dict) and any(data.get(k) for k in ("train_path", "train", "generator", "env_service"))
    return {} if named else {"data.generator": LIVE_TRAFFIC}


__all__ = ["LIVE_TRAFFIC", "live_traffic", "task_source_overrides"]
