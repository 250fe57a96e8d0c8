"""`ajet serve`: one HTTP server holding the recording proxy and the episode API, training continuously on the
episodes that clients anywhere begin and finish (docs/serve.md; the source: ajet/serve/).

    ajet serve --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8765] [--resume]
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from ajet.config import AjetConfig
from ajet.guard import server_secret
from ajet.rollout import Rollout, RolloutContext, RunMode
from ajet.serve import ServeSource

INTERRUPTED_EXIT = 130  # the exit status after Ctrl-C (128 + SIGINT, as a shell reports it)


def serve(cfg: AjetConfig) -> Path:
    """Run `ajet serve` until `trainer.total_steps` steps are trained; returns the experiment folder.

    Raises:
        ConfigError: what `cfg.for_mode("serve")` refuses (ajet/config/experiment.py): a non-loopback `serve.host`
            without a secret (`serve.secret` or AJET_SECRET), `serve.local_workers` without a `workflow`; or any
            config problem `ajet.trainer.run` raises.
        SystemExit: `INTERRUPTED_EXIT` after Ctrl-C, once the server has stopped (one line on stderr says where
            the run is and how to continue it; no traceback).
    """
    from ajet.trainer import run

    cfg = cfg.for_mode("serve")   # its checks, and proxy.host = serve.host (ajet/config/)
    host = cfg.serve.host
    secret, generated = server_secret(cfg.serve.secret)

    interrupted = threading.Event()

    def make_source(ctx: RolloutContext) -> ServeSource:
        ctx.console.print(f"episode API secret: {secret if generated else '(from serve.secret / AJET_SECRET)'}; "
                          f"clients: AJET_URL=http://{host}:<port shown below> AJET_SECRET=<secret>")
        return ServeSource(ctx, secret, interrupted)

    with _ctrl_c(interrupted):
        try:
            return run(cfg, serve_mode(cfg, make_source))
        except KeyboardInterrupt:
            print(f"ajet serve: stopped by Ctrl-C; finished episodes are stored in {cfg.exp_path()}: continue with "
                  "the same command and --resume", file=sys.stderr, flush=True)
            raise SystemExit(INTERRUPTED_EXIT) from None


def serve_mode(cfg: AjetConfig, make_source) -> RunMode:
    """`ajet serve`'s run mode: the config's datasets handed out to clients by `make_source(ctx)`'s `ServeSource`
    (wrapped by `DynamicSampling` when enabled), on `serve.port`, its status on the progress bar and step lines."""
    from ajet.rollout.dynamic_sampling import with_dynamic_sampling
    from ajet.tasks import read_datasets

    def setup(ctx: RolloutContext) -> Rollout:
        source = make_source(ctx)
        return Rollout(with_dynamic_sampling(source, ctx.cfg), live_status=source.live_status,
                       step_line=source.step_line)

    return RunMode(setup, read_datasets, port=cfg.serve.port, server=True)


@contextlib.contextmanager
def _ctrl_c(interrupted: threading.Event):
    """While serving: the first Ctrl-C (SIGINT) sets `interrupted` and raises KeyboardInterrupt (the server stops
    without waiting for clients: `ServeSource.close`); a second one while it stops ends the process at once
    (exit status `INTERRUPTED_EXIT`). Outside the main thread (no signal handler can be set there) nothing changes."""
    def on_sigint(_signum, _frame):
        if interrupted.is_set():
            print("ajet serve: second Ctrl-C: exiting now", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED_EXIT)
        interrupted.set()
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:          # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

