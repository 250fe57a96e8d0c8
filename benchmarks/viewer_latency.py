"""Time per view of `ajet view` on a generated store: 1,000 episodes over 20 steps (default), each episode
3 calls of a tool-using agent (system+task prompt, replies, tool results, realistic lengths), built as the
proxy records them and merged by the real context tracker, written by the real `TrajectoryStore`.

Each view is requested over HTTP from the real `ajet view` process on 127.0.0.1 (httpx, one client), `--reps`
times; the figures are the median and the slowest. The peer, in the same run, is what a person does
without the viewer: scan `trajectories.jsonl` (the same episodes) with `json.loads` for the step's episode
list, or for one episode; the ratio is viewer time / peer time.

    python benchmarks/viewer_latency.py [--episodes 1000] [--steps 20] [--reps 20] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ajet.llm_call import LLMCall, SamplingParams  # noqa: E402
from ajet.trajectory_store import TrajectoryStore  # noqa: E402
from ajet.tracker import merge_calls  # noqa: E402
from tests.viewer_server import running_viewer  # noqa: E402

TOOL = {"type": "function", "function": {"name": "calculate", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


def episode_record(step: int, task: int, repeat: int, rng: random.Random, vocab: int, turns: int = 3,
                   prompt_len: int = 300, reply_len: int = 40, tool_len: int = 30) -> tuple[dict, list[dict]]:
    """One episode as `Episode.to_dict()` writes it, and its samples (`Sample.to_dict()` + advantage, trained)."""
    eid = f"s{step}-t{task}-r{repeat}"
    toks = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    messages = [{"role": "system", "content": "You are a careful math agent."},
                {"role": "user", "content": f"Task {task}: what is {task} * 17 + {repeat}?"}]
    calls, prompt = [], toks(prompt_len)
    for i in range(turns):
        reply = toks(reply_len)
        text = f"<tool_call>calculate({task} * 17)</tool_call>" if i < turns - 1 else f"The answer is {task * 17}."
        calls.append(LLMCall(
            call_id=f"call-{eid}-{i}", episode_id=eid, agent_tag="default", index=i, messages=[dict(m) for m in messages],
            tools=[TOOL], prompt_ids=list(prompt), completion_ids=reply,
            completion_logprobs=[round(-rng.expovariate(2.0), 6) for _ in reply], finish_reason="stop",
            response_message={"role": "assistant", "content": text}, sampling=SamplingParams(max_tokens=48),
            policy_version=step - 1, timings={"total_s": rng.uniform(0.5, 3.0)},
            prompt_parent=f"call-{eid}-{i - 1}" if i else None, prompt_render_reason=None if i else "first_call"))
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": str(task * 17)}]
        prompt = prompt + reply + toks(tool_len)
    reward = rng.choice([0.0, 0.2, 1.0, 1.2])
    failed = rng.random() < 0.05
    record = {"episode_id": eid, "task": {"task_id": f"t{task}", "query": messages[1]["content"], "answer": str(task * 17),
                                          "metadata": {}},
              "group_id": f"{step}:t{task}", "repeat_index": repeat, "reward": None if failed else reward,
              "error": "Traceback (most recent call last):\nTimeoutError: episode timed out" if failed else None,
              "duration_s": rng.uniform(2, 20), "output": None if failed else {"final_answer": str(task * 17), "metadata": {},
                                                                                  "metrics": {"valid_tool_calls": 1}},
              "calls": [c.to_dict() for c in calls], "samples": []}
    samples = [] if failed else [{**s.to_dict(), "advantage": rng.gauss(0, 1), "trained": True}
                                 for s in merge_calls(calls, record["group_id"])]
    return record, samples


def generate(exp: Path, episodes: int, steps: int, model: str, seed: int = 0) -> None:
    """Write `episodes` episodes over `steps` steps (groups of 4) to exp/trajectories.sqlite and .jsonl."""
    rng = random.Random(seed)
    exp.mkdir(parents=True, exist_ok=True)
    (exp / "config.json").write_text(json.dumps({"experiment_name": "viewer_bench", "model": {"path": model},
                                                 "backbone": "debug"}))
    store = TrajectoryStore(exp / "trajectories.sqlite")
    per_step = episodes // steps
    with open(exp / "trajectories.jsonl", "w") as jl, open(exp / "metrics.jsonl", "w") as ml:
        for step in range(1, steps + 1):
            rewards = []
            for k in range(per_step):
                record, samples = episode_record(step, k // 4, k % 4, rng, vocab=49152)
                store.add_episode(step, 0, record)
                jl.write(json.dumps({"step": step, **record, "samples": samples}) + "\n")
                if samples:
                    store.add_samples(step, 0, samples)
                rewards.append(record["reward"] or 0.0)
            ml.write(json.dumps({"step": step, "reward/mean": statistics.fmean(rewards), "reward/std": statistics.pstdev(rewards),
                                 "tracker/merge_ratio": 3.0, "tracker/token_ratio": 2.1, "time/step_s": 60.0}) + "\n")
    store.close()


def timed(fn, reps: int) -> tuple[float, float]:
    """(median, max) seconds of `reps` calls of fn()."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer for the token text")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        exp = Path(tmp) / "exp"
        t0 = time.perf_counter()
        generate(exp, args.episodes, args.steps, args.model)
        size = (exp / "trajectories.sqlite").stat().st_size / 2**20
        print(f"generated {args.episodes} episodes x 3 calls over {args.steps} steps in {time.perf_counter() - t0:.1f} s "
              f"(trajectories.sqlite {size:.0f} MiB)")
        step = args.steps // 2
        with running_viewer(exp) as base, httpx.Client(base_url=base, timeout=120) as client:
            def get(path: str) -> dict:
                r = client.get(path)
                r.raise_for_status()
                return r.json()

            eid = get(f"/api/episodes?step={step}&failed=0&limit=1")["episodes"][0]["episode_id"]
            t_first = time.perf_counter()
            get(f"/api/episode/{eid}/sample/0")
            first_tokens = time.perf_counter() - t_first
            views = {
                "overview (/api/run)": lambda: get("/api/run"),
                "step: groups + episode page": lambda: (get(f"/api/groups?step={step}"), get(f"/api/episodes?step={step}")),
                "step, best advantage first": lambda: get(f"/api/episodes?step={step}&order=advantage_desc"),
                "step, failed only": lambda: get(f"/api/episodes?step={step}&failed=1"),
                "step, text search": lambda: get(f"/api/episodes?step={step}&q=what%20is%207"),
                "episode (calls, messages)": lambda: get(f"/api/episode/{eid}"),
                "sample token view": lambda: get(f"/api/episode/{eid}/sample/0"),
                "all steps, text search": lambda: get("/api/episodes?q=what%20is%207"),
            }
            results = {name: timed(fn, args.reps) for name, fn in views.items()}

        def peer_step() -> None:   # the step's episode list from trajectories.jsonl
            with open(exp / "trajectories.jsonl") as f:
                [r for r in map(json.loads, f) if r["step"] == step]

        def peer_episode() -> None:   # one episode from trajectories.jsonl
            with open(exp / "trajectories.jsonl") as f:
                next(r for r in map(json.loads, f) if r["episode_id"] == eid)
        peers = {"step": timed(peer_step, max(3, args.reps // 4)), "episode": timed(peer_episode, max(3, args.reps // 4))}

    print(f"ajet view over HTTP, {args.reps} requests per view (median / slowest), step {step}; first token view "
          f"(loads the {args.model} tokenizer): {first_tokens:.2f} s")
    for name, (med, worst) in results.items():
        peer = peers["episode"] if name.startswith(("episode", "sample")) else peers["step"]
        print(f"  {name:32s} {med * 1000:8.1f} ms / {worst * 1000:8.1f} ms   vs json scan of trajectories.jsonl "
              f"{peer[0] * 1000:8.1f} ms: ratio {med / peer[0]:.3f}")


if __name__ == "__main__":
    main()
