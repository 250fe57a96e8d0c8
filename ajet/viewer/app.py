"""`ajet view EXP_DIR`: a local, read-only web app over an experiment folder (Starlette + uvicorn).

The page (`static/`: plain HTML/CSS/JS, no CDN, no build step) calls this JSON API:

    GET /api/run                                   run overview: config, per-step metrics and store counts, plots
    GET /api/groups?step=N[&attempt=A]             GRPO groups of a step
    GET /api/episodes?step=N&failed=&fork=&agent=&group=&q=&order=&offset=&limit=
    GET /api/episode/{episode_id}[?attempt=A]      calls, tool results, output, reward, sample summaries
    GET /api/episode/{episode_id}/sample/{i}[?attempt=A]   the sample token by token (`RunReader.sample_tokens`)
    GET /api/gateway[?windows=W]                   a gateway's folder: versions served, gate decisions, rollbacks,
                                                   sessions, feedback over W time windows (`GatewayReader`; 404
                                                   when the folder holds no gateway.sqlite)
    GET /plots/{name}.png                          EXP_DIR/plots/*.png

Every view reads `trajectories.sqlite` read-only (`RunReader`), so it can stay open while the run writes.
Bad parameters answer 400 and unknown episodes 404, each with {"error": "..."}; an integer parameter
outside its range (`INT_RANGES`, e.g. `step=99999999999999999999`) is a 400 naming it and the range.
A request whose `Host` header names another host than localhost, 127.0.0.1, [::1] or the host the viewer
was started on answers 403 (`HostGuard`: `ajet.guard`, shared with the gateway and `ajet serve`): a web page
that rebinds its own name to 127.0.0.1 (DNS rebinding) cannot read the run's trajectories. Any port is accepted, so an SSH tunnel
(`ssh -L 9000:localhost:8420`) still works.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ajet.guard import LOCAL_HOSTS, Guard, Refused, allowed_hosts
from ajet.viewer.gateway_reader import GatewayReader
from ajet.viewer.run_reader import NotFound, RunReader

STATIC_DIR = Path(__file__).parent / "static"
# metrics.jsonl keys the overview charts, in order (a key a run does not log is left out)
OVERVIEW_KEYS = ["reward/mean", "reward/std", "rollout/episodes", "rollout/failed", "rollout/zero_std_groups",
                 "rollout/oversampled_tasks", "tracker/merge_ratio", "tracker/token_ratio", "merge/parent_by_id",
                 "merge/parent_by_text", "train/kl", "train/clip_frac", "train/entropy", "train/grad_norm",
                 "time/step_s", "time/rollout_s", "train/update_s", "rollout/tokens_per_s", "policy_version"]


SQLITE_INT_MAX = 2**63 - 1   # SQLite's INTEGER is a signed 64-bit int: a larger Python int raises OverflowError
# the allowed range (inclusive) of every integer query parameter of the API
INT_RANGES: dict[str, tuple[int, int]] = {"step": (0, SQLITE_INT_MAX), "attempt": (0, SQLITE_INT_MAX),
                                          "offset": (0, SQLITE_INT_MAX), "limit": (1, 500), "windows": (1, 500)}


def _int(request: Request, name: str, default: int | None = None) -> int | None:
    """Query parameter `name` as an int in `INT_RANGES[name]` (`default` when absent).

    Raises:
        ValueError: not an integer, or outside the range (the message names the parameter and the range).
    """
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    return _in_range(raw, f"query parameter `{name}`", *INT_RANGES[name])


def _in_range(raw: str, what: str, lo: int, hi: int) -> int:
    """`raw` (decimal digits, optional sign) as an int in lo..hi. Raises ValueError naming `what` and the range."""
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    if not re.fullmatch(r"\s*[+-]?[0-9]{1,4300}\s*", raw):   # int()'s digit limit: no ValueError from its size
        raise ValueError(f"{what} must be an integer in {lo}..{hi}, got {shown!r}")
    value = int(raw)
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in {lo}..{hi}, got {shown}")
    return value


def _viewer_error(err: Refused) -> Response:
    """A guard's refusal in the viewer's error shape `{"error": "..."}`."""
    return JSONResponse({"error": err.message}, status_code=err.status)


def HostGuard(app: Any, allowed: list[str]) -> Guard:   # noqa: N802 - the middleware's name since the viewer had it
    """ASGI middleware (`ajet.guard.Guard`): answers 403 {"error": ...} to an HTTP request whose `Host` header
    (port ignored) is not one of `allowed` (compared lower-case; IPv6 literals in brackets, e.g. "[::1]"), and 415
    to a POST that is not JSON. Guards against DNS rebinding: a page on attacker.example whose name is made to
    resolve to 127.0.0.1 still sends `Host: attacker.example`."""
    return Guard(app, [h.lower() for h in allowed], "open the address `ajet view` printed", _viewer_error)


def _json(fn: Callable[[Request], Any]) -> Callable[[Request], Response]:
    """Wrap a sync view: its return value as JSON; NotFound -> 404, ValueError -> 400, with {"error": ...}."""
    def view(request: Request) -> Response:
        try:
            return JSONResponse(fn(request))
        except NotFound as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
    return view


def create_app(exp_dir: str | Path, host: str = "127.0.0.1") -> Starlette:
    """The viewer app for one experiment folder, answering requests for localhost, 127.0.0.1, [::1] and `host`
    (the address it is served on; 0.0.0.0 and :: add nothing: browse it by a name given here).

    Raises:
        AjetError: the folder holds no trajectories.sqlite.
    """
    run = RunReader(exp_dir)
    gw = GatewayReader(run.exp_dir)
    # load the tokenizer now, in the background, so that the first token view does not wait for it
    threading.Thread(target=run.token_text, args=([],), daemon=True, name="ajet-view-tokenizer").start()

    def overview(request: Request) -> dict[str, Any]:
        metrics = run.metrics()
        keys = [k for k in OVERVIEW_KEYS if any(k in m for m in metrics)]
        # the guards' counts and why episodes were left out (ajet/algorithm/), then the workflow's own metrics
        keys += sorted({k for m in metrics for k in m if k.startswith(("guards/", "rollout/not_trained/"))})
        keys += sorted({k for m in metrics for k in m if k.startswith("workflow/")})
        model = run.config.get("model") or {}
        plots = sorted(p.name for p in (run.exp_dir / "plots").glob("*.png")) if (run.exp_dir / "plots").is_dir() else []
        return {"exp_dir": str(run.exp_dir), "experiment_name": run.config.get("experiment_name", run.exp_dir.name),
                "model": model.get("path"), "backbone": run.config.get("backbone"), "chart_keys": keys,
                "metrics": [{k: m.get(k) for k in ["step", *keys]} for m in metrics],
                "policy_version": next((m["policy_version"] for m in reversed(metrics) if "policy_version" in m), None),
                "steps": run.steps(), "plots": plots, "has_samples_table": run.has_samples_table(),
                "gateway": gw.present}

    def gateway(request: Request) -> dict[str, Any]:
        if not gw.present:
            raise NotFound(f"no gateway.sqlite in {run.exp_dir}: this folder is not an `ajet gateway` experiment")
        return gw.overview(_int(request, "windows", 50))

    def groups(request: Request) -> list[dict[str, Any]]:
        step = _int(request, "step")
        if step is None:
            raise ValueError("query parameter `step` is required")
        return run.groups(step, _int(request, "attempt"))

    def episodes(request: Request) -> dict[str, Any]:
        qp = request.query_params
        failed = {"": None, "1": True, "true": True, "0": False, "false": False}.get(qp.get("failed", ""))
        if qp.get("failed", "") not in ("", "1", "true", "0", "false"):
            raise ValueError(f"query parameter `failed` must be 1 or 0, got {qp['failed']!r}")
        return run.episodes(_int(request, "step"), _int(request, "attempt"), failed=failed,
                            fork=qp.get("fork") or None, agent=qp.get("agent") or None, group=qp.get("group") or None,
                            q=qp.get("q") or None, order=qp.get("order") or "group", offset=_int(request, "offset", 0),
                            limit=_int(request, "limit", 50))

    def episode(request: Request) -> dict[str, Any]:
        return run.episode(request.path_params["episode_id"], _int(request, "attempt"))

    def sample(request: Request) -> dict[str, Any]:
        index = _in_range(request.path_params["index"], "the sample index", 0, SQLITE_INT_MAX)
        return run.sample_tokens(request.path_params["episode_id"], index, _int(request, "attempt"))

    def plot(request: Request) -> Response:
        name = request.path_params["name"]
        path = run.exp_dir / "plots" / f"{name}.png"
        if not re.fullmatch(r"[\w.-]+", name) or not path.is_file():
            return JSONResponse({"error": f"no plot {name}.png in {run.exp_dir / 'plots'}"}, status_code=404)
        return FileResponse(path, media_type="image/png")

    def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    allowed = allowed_hosts(host) or list(LOCAL_HOSTS)   # served on every interface: browse it by a local name
    return Starlette(middleware=[Middleware(HostGuard, allowed=allowed)], routes=[
        Route("/", index),
        Route("/api/run", _json(overview)),
        Route("/api/gateway", _json(gateway)),
        Route("/api/groups", _json(groups)),
        Route("/api/episodes", _json(episodes)),
        Route("/api/episode/{episode_id}", _json(episode)),
        Route("/api/episode/{episode_id}/sample/{index}", _json(sample)),
        Route("/plots/{name}.png", plot),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ])


def serve(exp_dir: str | Path, port: int = 8420, host: str = "127.0.0.1") -> None:
    """Serve the viewer until Ctrl-C (blocks). Binds `host` (127.0.0.1: this machine only).

    Raises:
        AjetError: the folder holds no trajectories.sqlite.
        PortInUseError: the port is taken (checked before the URL is printed).
    """
    import uvicorn

    from ajet.ports import bind_port

    app = create_app(exp_dir, host=host)
    sock = bind_port(host, port, "--port N")   # bound here, so uvicorn never meets a taken port
    port = sock.getsockname()[1]
    print(f"ajet view: http://{host}:{port}/  ({Path(exp_dir).resolve()}; Ctrl-C stops)", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it shut down on (as uvicorn.run, end quietly)
        pass
