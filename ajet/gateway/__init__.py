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

The config needs no task file (mode gateway reads no tasks: its episodes are its sessions); `data.val_path`
still gives held-out validation (`trainer.val_freq`) and the gate's evaluation set.
"""
