"""`ajet serve`: one HTTP server holding the recording proxy and the episode API, training continuously on the
episodes that clients anywhere begin and finish (docs/serve.md; the source: ajet/serve/).

    ajet serve --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8765] [--resume]
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from ajet.config import AjetConfig
from ajet.guard import server_secret
from ajet.interrupt import StopSignals, Stopped, exit_status, signal_name
from ajet.rollout import Rollout, RolloutContext, RunMode
from ajet.serve import ServeSource

INTERRUPTED_EXIT = exit_status(signal.SIGINT)  # the exit status after Ctrl-C (128 + SIGINT, as a shell reports it); 143 after
# SIGTERM


def serve(cfg: AjetConfig) -> Path:
    """Run `ajet serve` until `trainer.total_steps` steps are trained; returns the experiment folder.

    Raises:
        ConfigError: what `cfg.for_mode("serve")` refuses (ajet/config/experiment.py): a non-loopback `serve.host`
            without a secret (`serve.secret` or AJET_SECRET), `serve.local_workers` without a `workflow`; or any
            config problem `ajet.trainer.run` raises.
        SystemExit: `INTERRUPTED_EXIT` after Ctrl-C (143 after SIGTERM), once the server has stopped (one line
            on stderr says where the run is and how to continue it; no traceback). A second one exits at once.
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

    # the first Ctrl-C / SIGTERM stops the server without waiting for its clients (`ServeSource.close`); outside
    # the main thread (no signal handler can be set there) nothing changes
    with StopSignals(interrupted.set) as stop:
        try:
            return run(cfg, serve_mode(cfg, make_source))
        except BaseException as exc:   # after a stop: whatever the muted cleanup raised is not the story
            if stop.signum is None and not isinstance(exc, KeyboardInterrupt):
                raise
            signum = stop.signum or (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)
    print(f"ajet serve: stopped by {signal_name(signum)}; finished episodes are stored in {cfg.exp_path()}: continue "
          "with the same command and --resume", file=sys.stderr, flush=True)
    raise SystemExit(exit_status(signum))


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
