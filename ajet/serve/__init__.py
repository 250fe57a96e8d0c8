"""`ajet serve`: one HTTP server holding the recording proxy and the episode API, training continuously on
the episodes that clients anywhere begin and finish (docs/serve.md).

    ajet serve --conf X.yaml [--backbone debug] [--host 127.0.0.1] [--port 8765] [--resume]

The training loop is the one in ajet/trainer.py, started by the command (ajet/commands/serve.py); this package
holds its rollout source, `ServeSource`: the `EpisodeQueue` (ajet/rollout/episode_queue.py) with the episode API
(api.py) mounted beside the proxy's routes on the proxy's own uvicorn server. Started without `--conf`, `ajet serve`
is a job server instead: jobs.py queues the submitted jobs and runs each as its own `ajet serve --conf`, jobs_api.py
is the job API in front of them.
"""

from __future__ import annotations

import threading

from ajet.episode import Episode
from ajet.guard import Guard, allowed_hosts
from ajet.rollout import RolloutContext
from ajet.rollout.episode_queue import EpisodeQueue


LINGER_S = 30.0        # at most this long the finished server keeps answering clients not yet told, seconds
CLIENT_ACTIVE_S = 10.0  # ... that were heard from this recently (twice a client's longest retry backoff), seconds


class ServeSource(EpisodeQueue):
    """The episode queue, plus what serving it needs: the API mounted on the proxy's app, and (on resume)
    the earlier attempts' finished-but-untrained episodes adopted back into their groups.

    Args:
        ctx: the run's rollout context.
        secret: the admin key named `secret` (None: only `keys`).
        interrupted: set by Ctrl-C: stop without waiting for clients.
        keys: (name, key, scope) of `serve.keys` and the keys a job server handed over (ajet/serve/keys.py).
    """

    def __init__(self, ctx: RolloutContext, secret: str | None, interrupted: threading.Event | None = None,
                 keys: list[tuple[str, str, str]] = ()):
        from ajet.judges import load_judge

        cfg = ctx.cfg
        judge = load_judge(cfg)
        super().__init__(ctx.sampler(), cfg.rollout.num_repeat, cfg.trainer.tasks_per_step, cfg.trainer.total_steps,
                         ctx.first_step, ctx.attempt, ctx.record, judge, cfg.serve.episode_idle_timeout_s)
        self.ctx, self.secret, self.keys = ctx, secret, list(keys)
        self.interrupted = interrupted or threading.Event()   # set by Ctrl-C (`serve`): stop now, tell no one
        self.workers = None
        if cfg.serve.local_workers:
            from ajet.rollout.in_process import load_workflow
            from ajet.serve.local_workers import LocalWorkers

            self.workers = LocalWorkers(self, load_workflow(cfg), cfg.serve.local_workers, cfg.rollout.episode_timeout_s)

    def bind(self, proxy) -> None:
        from ajet.serve.api import build_api, compose

        super().bind(proxy)
        if self.ctx.cfg.trainer.resume:
            self.adopt(self.ctx.store.untrained())
            if self.counts["adopted"]:
                self.ctx.console.print(f"adopted {self.counts['adopted']} finished, untrained episodes of earlier attempts")
        # the shared guard first (ajet/guard.py): a foreign Host is a 403, a POST that is not JSON a 415
        proxy.app = Guard(compose(proxy.app, build_api(self, self.secret, self.keys), self.activity),
                          allowed_hosts(self.ctx.cfg.serve.host), "call the address `ajet serve` printed")

    def collect(self, step: int):
        if self.workers is not None and not self.workers.started:   # the proxy is serving by now
            self.workers.start()
        return super().collect(step)

    def live_status(self, ep: Episode) -> str:
        """The progress bar's status after each finished episode: policy version, running, abandoned, clients,
        the episode's reward."""
        m = self.metrics()
        return (f"policy v{m['serve/policy_version']} | running {m['serve/running']} | abandoned "
                f"{m['serve/abandoned']} | clients {m['serve/clients']} | last reward "
                f"{ep.reward if ep.reward is not None else 'failed'}")

    @staticmethod
    def step_line(m: dict) -> str:
        """What a finished step's console line adds: the clients, running and abandoned episodes of `m` (the
        step's metrics)."""
        return f" | clients {m['serve/clients']}, running {m['serve/running']}, abandoned {m['serve/abandoned']}"

    def close(self) -> None:
        """Answer on before the server stops until every client heard from lately knows what happened, instead
        of finding the server gone: 410 `run_finished` after the last step, 503 `server_restarting` when the
        trainer stopped before it (the clients wait for the server restarted with `--resume`). After a Ctrl-C
        nothing is waited for: the proxy's stop answers the calls in flight, and clients retry a refused
        connection until the server is back."""
        super().close()
        if self.interrupted.is_set():
            return
        # resumed: the killed attempt's clients retry (every <= 5 s) unknown to this server; let each hear it once
        listen_s = CLIENT_ACTIVE_S if self.ctx.cfg.trainer.resume else 0.0
        untold = self.wait_until_clients_told(LINGER_S, CLIENT_ACTIVE_S, listen_s)
        if untold:
            self.ctx.console.print(f"stopping without telling {len(untold)} client(s) still busy after {LINGER_S:g}s: "
                                   + ", ".join(untold[:5]))
