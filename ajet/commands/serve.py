"""`ajet serve`: one HTTP server holding the recording proxy and the episode API, training continuously on the
episodes that clients anywhere begin and finish (docs/serve.md; the source: ajet/serve/).

    ajet serve --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8765] [--resume]
    ajet serve --exp-root DIR [--keys FILE] [--host 127.0.0.1] [--port 8765] [--resume]    (no config: waits for jobs)
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from ajet.config import AjetConfig
from ajet.guard import describe_keys, secret_beside, server_secret
from ajet.interrupt import StopSignals, Stopped, exit_status, signal_name
from ajet.rollout import Rollout, RolloutContext, RunMode
from ajet.serve import ServeSource
from ajet.serve.keys import check, read_file, server_keys

INTERRUPTED_EXIT = exit_status(signal.SIGINT)  # the exit status after Ctrl-C (128 + SIGINT, as a shell reports it); 143 after
# SIGTERM


def serve(cfg: AjetConfig) -> Path:
    """Run `ajet serve` until `trainer.total_steps` steps are trained; returns the experiment folder.

    Raises:
        ConfigError: what `cfg.for_mode("serve")` refuses (ajet/config/experiment.py): a non-loopback `serve.host`
            without a secret (`serve.secret` or AJET_SECRET), `serve.local_workers` without a `workflow`; a
            `serve.keys` entry whose `key_env` is unset or short, two keys with one name or one key twice
            (ajet/serve/keys.py); or any config problem `ajet.trainer.run` raises.
        SystemExit: `INTERRUPTED_EXIT` after Ctrl-C (143 after SIGTERM), once the server has stopped (one line
            on stderr says where the run is and how to continue it; no traceback). A second one exits at once.
    """
    from ajet.trainer import run

    cfg = cfg.for_mode("serve")   # its checks, and proxy.host = serve.host (ajet/config/)
    host = cfg.serve.host
    keys, secret, generated = server_keys(cfg.serve.keys, cfg.serve.secret)

    interrupted = threading.Event()

    def make_source(ctx: RolloutContext) -> ServeSource:
        shown = (secret if generated else "(from serve.secret / AJET_SECRET)") if secret else "none (serve.keys)"
        ctx.console.print(f"episode API secret: {shown}; {_describe_keys(keys)}"
                          f"clients: AJET_URL=http://{host}:<port shown below> AJET_SECRET=<secret or key>")
        return ServeSource(ctx, secret, interrupted, keys)

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


def _describe_keys(keys: list[tuple[str, str, str]]) -> str:
    """"keys: 2 client keys (alice, bob), 1 admin key (ops); " for the start line ("" without keys)."""
    parts = describe_keys(keys)
    return f"keys: {', '.join(parts)}; " if parts else ""


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


def serve_jobs(host: str, port: int, root: Path, resume: bool = False, backbone: str | None = None,
               keys_file: Path | None = None) -> None:
    """`ajet serve` without `--conf`: wait for jobs submitted over HTTP (`AjetClient.submit`), run them one after
    another in `root/<job id>/`, forward the episode API and model calls to the running one (ajet/serve/jobs_api.py).
    Runs until Ctrl-C / SIGTERM.

    Args:
        host, port: where the server listens (0: a free port, printed).
        root: the server's folder: jobs.json (the queue) and one experiment folder per job.
        resume: continue the queue in `root` (its running job from its newest checkpoint).
        backbone: the backbone every job runs with (None: each job's config decides).
        keys_file: `--keys FILE`: `serve: {keys: [...]}`, the server's client and admin keys, handed to every job's
            server too (ajet/serve/keys.py). Without an admin key among them a secret is used: AJET_SECRET, else
            generated and printed.

    Raises:
        ConfigError: a non-loopback `host` without a secret (AJET_SECRET); `root` holds an unfinished queue and
            `resume` is off; a `keys_file` that `ajet.serve.keys.read_file` refuses.
        SystemExit: `INTERRUPTED_EXIT` after Ctrl-C (143 after SIGTERM), once the running job has stopped cleanly
            (one line on stderr says how to continue).
    """
    import uvicorn

    from ajet.errors import ConfigError
    from ajet.guard import is_loopback
    from ajet.serve.jobs import JobQueue
    from ajet.serve.jobs_api import build_jobs_app

    if not is_loopback(host) and server_secret(None)[1]:
        raise ConfigError(f"--host {host} is reachable from other machines: set AJET_SECRET (the admin key that "
                          "submits and stops jobs, and the secret of the episode API)")
    keys = read_file(keys_file) if keys_file is not None else []
    secret, generated = secret_beside(None, keys)   # None when --keys holds an admin key and AJET_SECRET is unset
    check(keys, secret, f"--keys {keys_file}")
    queue = JobQueue(root, secret, resume, backbone, keys)
    app = build_jobs_app(queue, secret, keys)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="ajet-jobs-http", daemon=True)
    stopped, signum = threading.Event(), signal.SIGINT
    with StopSignals(stopped.set) as stop:
        try:
            thread.start()
            while not server.started and thread.is_alive():
                thread.join(0.05)
            if not server.started:
                raise ConfigError(f"ajet serve: could not listen on {host}:{port} (in use? pick another --port)")
            bound = server.servers[0].sockets[0].getsockname()[1]
            admin = (secret if generated else "(from AJET_SECRET)") if secret else "none but --keys'"
            print(f"job server on http://{host}:{bound} (root {queue.root}); admin key: {admin}; "
                  f"{_describe_keys(keys)}submit with AjetClient(url, key).submit(job)", flush=True)
            queue.start()
            stopped.wait()
        except BaseException as exc:
            if stop.signum is None and not isinstance(exc, KeyboardInterrupt):
                server.should_exit = True
                queue.close()
                raise
            signum = stop.signum or (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)
        running = queue.close()
        server.should_exit = True
        thread.join(10)
    print(f"ajet serve: stopped by {signal_name(signum)}; the job queue is kept in {queue.root}"
          + (f" ({running} was running)" if running else "") + ": continue with the same command and --resume",
          file=sys.stderr, flush=True)
    raise SystemExit(exit_status(signum))
