"""`ajet gateway` under live traffic: a simulated user population with delayed feedback (docs/gateway.md).

The gateway is the real `python -m ajet gateway --backbone=debug` on SmolLM2-135M-Instruct (CPU), started as a
subprocess with a config this script writes. The users are asyncio tasks, each an unmodified `openai.AsyncOpenAI`
client running the math tutorial's agent (tutorial/example_math_agent/math_workflow.py: its system prompt, its
`calculate` tool, the first turn forced to call it, up to 3 turns) on the tutorial's training questions
(tasks/train.jsonl), one conversation after another, without any ajet header: the gateway finds each
conversation's session from its prefixes. A share of the users stream (`--stream-frac`, tool calls assembled
from the deltas). When a conversation ends the user closes its session (`POST /v1/sessions/{id}/close`: the agent
knows its task is over) and, except for `--silent-frac` of the conversations (whose users never answer), posts
its feedback after a random delay of 5-120 s (times `--delay-scale`): the tutorial's own reward of the answer
(`--feedback tutorial`: `math_agent_reward`, 1 for the right number + 0.1 for a valid and 0.1 for a grounded
calculator call) or just whether the number is right (`--feedback right`: `ajet.judges.math_answer_judge`).

Updates go through the evaluation gate (`gateway.gate.mode: eval`): before a new policy serves, it runs the
tutorial's workflow and judge greedily on the first `--gate-tasks` problems of tasks/val.jsonl (held out: none is
a training question) and is refused when its `--gate-metric` is more than `--max-drop` below the serving
policy's. `--harmful` makes every update harmful (lr 1e-2 instead of `--lr`) to show that the gate refuses it and
that no answer is ever sampled from it. `--poison` tries to poison the gateway: before each feedback its user also
posts a reward of 1e300 or NaN for the session (each must be a 400), every other session is then rated 10 (the top of
the default `gateway.reward_range`, accepted) so that the groups' rewards differ and updates move the weights, and
every update runs at lr 1e30, which makes the candidate's weights so large that its logits, and so its answers'
logprobs, are not finite (a NaN-producing update): the gate must refuse each, and no answer may come from one.

    python benchmarks/live_traffic.py [--minutes 30] [--users 8] [--delay-scale 1] [--harmful]
    python benchmarks/live_traffic.py --minutes 3 --delay-scale 0.1          # a short smoke run
    python benchmarks/live_traffic.py --harmful --until-gate 1 ...           # until the gate has decided once
    python benchmarks/live_traffic.py --poison --until-gate 1 ...            # 1e300 / NaN rewards, NaN updates

After `--minutes` no new conversation starts; those in flight finish, feedback not yet due is not sent, and the
gateway is killed with SIGKILL. The figures then come from the clients' own records and the gateway's
gateway.sqlite: served accuracy (right numbers / conversations) per `--window-min` window of the conversations'
start, the feedback reward per window, p50/p99 latency of the model calls (send to last byte), p99 of the calls in
flight at a swap (their interval contains a gate decision or a served version change) against the others, swaps
accepted and refused by the gate (with both figures), requests failed (must be 0) and feedback lost
(acknowledged with a 200 but not in gateway.sqlite after the kill; must be 0), and the policy versions that
answered, and the peak memory of the gateway process (RSS) and of its process tree (RSS and PSS, sampled every
second). `--json PATH` also writes them as JSON.

`--lora RANK` trains a LoRA adapter beside the one base model (`model.lora`) instead of all the weights;
`--micro-batch-tokens` sets the update's chunk (`algorithm.micro_batch_tokens`); `--engine vllm` generates through
a vLLM server the gateway starts (`engine: {kind: vllm}`, from .venvs/vllm: .ci/make_vllm_env.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorial" / "example_math_agent"
sys.path.insert(0, str(TUTORIAL))
from math_workflow import CALCULATE_TOOL, MAX_TURNS, SYSTEM_PROMPT, CalculatorTool, math_agent_reward  # noqa: E402

from ajet import Task, WorkflowOutput  # noqa: E402
from ajet.judges import math_answer_judge  # noqa: E402

sys.path.insert(0, str(ROOT))
from benchmarks.engines import TreeMemory  # noqa: E402

SECRET = "live-traffic-benchmark-secret"
FORCED = {"type": "function", "function": {"name": "calculate"}}


def write_config(run_dir: Path, args) -> Path:
    """The gateway's config (YAML, absolute paths) and its gate's held-out file, in `run_dir`."""
    val = [json.loads(line) for line in (TUTORIAL / "tasks" / "val.jsonl").read_text().splitlines() if line.strip()]
    (run_dir / "gate_val.jsonl").write_text("".join(json.dumps(t) + "\n" for t in val[:args.gate_tasks]))
    lr = _lr(args)
    wf = TUTORIAL / "math_workflow.py"
    lora = f", lora: {{rank: {args.lora}, alpha: {2 * args.lora}}}" if args.lora else ""
    engine = (f'engine: {{kind: vllm, python: "{args.vllm_python}", kv_cache_gb: 1}}' if args.engine == "vllm"
              else "engine: {kind: in_process}")
    conf = run_dir / "gateway.yaml"
    conf.write_text(textwrap.dedent(f"""
        experiment_name: live_traffic
        workflow: "{wf}:MathAgentWorkflow"
        judge: "{wf}:math_agent_reward"
        model: {{path: {args.model}, max_model_len: 2048{lora}}}
        data: {{val_path: "{run_dir / 'gate_val.jsonl'}"}}
        rollout: {{num_repeat: {args.num_repeat}, temperature: {args.temperature}, max_tokens: {args.max_tokens}}}
        trainer: {{total_steps: 100000, tasks_per_step: {args.tasks_per_step}, save_freq: 0, seed: {args.seed},
                   tensorboard: false}}
        algorithm: {{lr: {lr}, micro_batch_tokens: {args.micro_batch_tokens}}}
        {engine}
        gateway:
          session_idle_s: 60
          feedback_deadline_s: {max(30.0, 150 * args.delay_scale):g}
          on_no_feedback: drop
          gate: {{mode: "{args.gate}", metric: {args.gate_metric}, max_drop: {args.max_drop}, keep_versions: 2}}
    """))
    return conf


def _lr(args) -> float:
    """The updates' learning rate: `--lr`, 1e-2 with `--harmful`, 1e30 with `--poison`."""
    return 1e30 if args.poison else 1e-2 if args.harmful else args.lr


POISON = (b"1e300", b"NaN")      # rewards a poisoner sends (raw JSON: NaN is not valid JSON, 1e300 is)


class GatewayProcess:
    """`python -m ajet gateway` in a subprocess; its output goes to `log`; `url` once it serves. `memory` samples
    its process tree every second (the gateway and what it starts: a vLLM server with `--engine vllm`)."""

    def __init__(self, conf: Path, exp: Path, log: Path, threads: int):
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "ajet", "gateway", "--conf", str(conf), "--backbone",
                                      "debug", "--exp-dir", str(exp), "--port", "0"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=conf.parent,
                                     env={**os.environ, "AJET_SECRET": SECRET, "OMP_NUM_THREADS": str(threads)})
        self.memory = TreeMemory(self.proc.pid, time.monotonic())
        self.url = ""
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                if "proxy on http://" in line and not self.url:
                    self.url = line.split("proxy on ")[1].split()[0]
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(900) or not self.url:
            self.kill()
            raise SystemExit(f"ajet gateway did not start; see {log}")

    def kill(self) -> None:
        self.memory.stop()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)


class Population:
    """The simulated users and what they saw: `calls` (start, end, ok, stream), `convs` (one dict per
    conversation), `acked` (session id -> reward the gateway acknowledged with a 200)."""

    def __init__(self, url: str, tasks: list[dict], args):
        self.url, self.tasks, self.args = url, tasks, args
        self.rng = random.Random(args.seed)
        self.calls: list[tuple[float, float, bool, bool]] = []
        self.convs: list[dict] = []
        self.acked: dict[str, float] = {}
        self.feedback_errors: list[str] = []
        self.poison: list[tuple[str, int]] = []      # (the raw reward sent, the status answered)
        self.close_errors: list[str] = []
        self.failures: list[str] = []
        self.pending: set[asyncio.Task] = set()
        self.unsent = 0

    async def run(self, seconds: float) -> None:
        self.t0 = time.time()
        self.end = self.t0 + seconds
        self.http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=900)
        users = [asyncio.create_task(self.user(u, stream=u < round(self.args.users * self.args.stream_frac)))
                 for u in range(self.args.users)]
        if self.args.until_gate:
            users.append(asyncio.create_task(self.wait_for_gate()))
        await asyncio.gather(*users)
        for task in list(self.pending):        # feedback not yet due when the time is up: not sent
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        await self.http.aclose()

    async def wait_for_gate(self) -> None:
        """`--until-gate N`: keep the traffic going past `--minutes` until the gate has decided N updates
        (GET /v1/admin/versions), at most until `--max-minutes`."""
        cap = self.t0 + self.args.max_minutes * 60
        while time.time() < cap:
            await asyncio.sleep(10)
            r = await self.http.get("/v1/admin/versions")
            if r.status_code == 200 and len(r.json().get("gate", [])) >= self.args.until_gate:
                return
            self.end = max(self.end, min(cap, time.time() + 30))

    async def user(self, u: int, stream: bool) -> None:
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=SECRET, max_retries=0,
                                    timeout=self.args.client_timeout)
        while time.time() < self.end:
            task = self.rng.choice(self.tasks)
            silent = self.rng.random() < self.args.silent_frac
            delay = self.rng.uniform(5, 120) * self.args.delay_scale
            conv = {"user": u, "stream": stream, "task_id": task["task_id"], "start": time.time() - self.t0,
                    "silent": silent, "response_ids": []}
            try:
                answer, counts, session = await self.converse(client, task["query"], stream, conv)
            except Exception as exc:  # noqa: BLE001 - a failed request is a figure, not a crash
                self.failures.append(f"user {u}: {type(exc).__name__}: {str(exc)[:200]}")
                conv["failed"] = True
                self.convs.append(conv)
                continue
            t, out = Task(task["task_id"], task["query"], task["answer"]), WorkflowOutput(final_answer=answer,
                                                                                       metrics=counts)
            conv.update(session=session, right=math_answer_judge(t, out), end=time.time() - self.t0,
                        reward=math_agent_reward(t, out) if self.args.feedback == "tutorial"
                        else math_answer_judge(t, out))
            self.convs.append(conv)
            r = await self.http.post(f"/v1/sessions/{session}/close")
            if r.status_code != 200:
                self.close_errors.append(f"{r.status_code} {r.text[:200]}")
            if not silent:
                fb = asyncio.create_task(self.feedback(session, conv["reward"], delay))
                self.pending.add(fb)
                fb.add_done_callback(self.pending.discard)
        await client.close()

    async def converse(self, client, query: str, stream: bool, conv: dict) -> tuple[str, dict, str]:
        """The tutorial's agent loop (math_workflow.MathAgentWorkflow) over the SDK; returns (final answer,
        calculator counts, session id)."""
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": query}]
        calculator, answer, session = CalculatorTool(query), "", ""
        for turn in range(1, MAX_TURNS + 1):
            kwargs = dict(model="ajet-policy", messages=messages, tools=[CALCULATE_TOOL],
                          tool_choice=FORCED if turn == 1 else "auto")
            start = time.time()
            try:
                raw = await client.chat.completions.with_raw_response.create(stream=stream, **kwargs)
                session = raw.headers.get("x-ajet-session") or session
                if stream:
                    text, tool_calls, rid = await _read_stream(raw.parse())
                else:
                    message = raw.parse().choices[0].message
                    rid = raw.parse().id
                    text, tool_calls = message.content or "", [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in message.tool_calls or []]
            except Exception:
                self.calls.append((start - self.t0, time.time() - self.t0, False, stream))
                raise
            self.calls.append((start - self.t0, time.time() - self.t0, True, stream))
            conv["response_ids"].append(rid)
            answer = text
            if not tool_calls:
                break
            messages.append({"role": "assistant", "content": text or None, "tool_calls": tool_calls})
            for call in tool_calls:
                result = await calculator.call(call["function"]["name"], call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return answer, calculator.counts, session

    async def feedback(self, session: str, reward: float, delay: float) -> None:
        if time.time() + delay > self.end:
            self.unsent += 1
            return
        await asyncio.sleep(delay)
        if self.args.poison:                      # a poisoned reward first: it must be refused (400)
            raw = POISON[len(self.poison) % len(POISON)]
            body = b'{"session_id": "' + session.encode() + b'", "reward": ' + raw + b"}"
            r = await self.http.post("/v1/feedback", content=body, headers={"Content-Type": "application/json"})
            self.poison.append((raw.decode(), r.status_code))
            if len(self.poison) % 2:              # and the range's top on every other session: updates move
                reward = 10.0
        r = await self.http.post("/v1/feedback", json={"session_id": session, "reward": reward})
        if r.status_code == 200:
            self.acked[session] = reward
        else:
            self.feedback_errors.append(f"{r.status_code} {r.text[:200]}")


async def _read_stream(stream) -> tuple[str, list[dict], str]:
    """(text, tool calls as message dicts, response id) of a streamed chat completion."""
    text, calls, rid = [], {}, ""
    async for chunk in stream:
        rid = chunk.id or rid
        for choice in chunk.choices:
            delta = choice.delta
            text.append(delta.content or "")
            for tc in delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                "function": {"name": "", "arguments": ""}})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["function"]["name"] += tc.function.name or ""
                    c["function"]["arguments"] += tc.function.arguments or ""
    return "".join(text), [calls[i] for i in sorted(calls)], rid


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(pop: Population, db_path: Path, t_gateway_start: float, args, metrics_text: str,
           memory: TreeMemory) -> dict:
    """The figures, from the clients' records, gateway.sqlite (read after the kill) and `memory` (the gateway's
    process tree, sampled every second)."""
    db = sqlite3.connect(db_path)
    stored = {}
    for sid, reward in db.execute("SELECT session_id, reward FROM feedback WHERE source = 'client'"):
        stored.setdefault(sid, []).append(reward)
    lost = [s for s, r in pop.acked.items() if r not in stored.get(s, [])]
    versions = dict(db.execute("SELECT response_id, policy_version FROM responses"))
    gate = [dict(zip(("step", "candidate_version", "serving_version", "serving_figure", "candidate_figure",
                      "served", "reason", "at"), row))
            for row in db.execute("SELECT step, candidate_version, serving_version, serving_figure, candidate_figure,"
                                  " served, reason, at FROM gate ORDER BY at")]
    served_rows = [dict(zip(("version", "step", "how", "figure", "at"), row))
                   for row in db.execute("SELECT version, step, how, figure, at FROM versions ORDER BY serve_id")]
    db.close()
    moments = sorted([g["at"] - pop.t0 for g in gate] + [v["at"] - pop.t0 for v in served_rows if v["how"] != "start"])
    ok_lat = [(e - s, any(s <= m <= e for m in moments)) for s, e, ok, _ in pop.calls if ok]
    during = [d for d, at_swap in ok_lat if at_swap]
    between = [d for d, at_swap in ok_lat if not at_swap]
    # an update's span: its training and switch (the step's train/update_s + train/weight_switch_s) up to its
    # decision (gate row, or version served)
    update_s = {}
    metrics_path = db_path.parent / "metrics.jsonl"
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            row = json.loads(line)
            if row.get("train/update_s") is not None:
                update_s[row["step"]] = row["train/update_s"] + (row.get("train/weight_switch_s") or 0.0)
    ends = {g["step"]: g["at"] for g in gate} | {v["step"]: v["at"] for v in served_rows if v["how"] != "start"}
    spans = [(ends[k] - pop.t0 - update_s.get(k, 0.0), ends[k] - pop.t0) for k in ends]
    in_update = [(e - s, any(s <= b and a <= e for a, b in spans)) for s, e, ok, _ in pop.calls if ok]
    done = [c for c in pop.convs if not c.get("failed")]
    win = args.window_min * 60
    windows = []
    for w in range(int(max((c["start"] for c in done), default=0) // win) + 1):
        cs = [c for c in done if w * win <= c["start"] < (w + 1) * win]
        vs = sorted({versions.get(r) for c in cs for r in c["response_ids"]} - {None})
        windows.append({"window": f"{w * args.window_min:g}-{(w + 1) * args.window_min:g} min",
                        "conversations": len(cs), "accuracy": sum(c["right"] for c in cs) / max(1, len(cs)),
                        "mean_feedback_reward": sum(c["reward"] for c in cs) / max(1, len(cs)),
                        "policy_versions": vs})
    refused_steps = {g["step"] for g in gate if not g["served"]}
    answered_by = {}
    for c in done:
        for r in c["response_ids"]:
            v = versions.get(r)
            answered_by[v] = answered_by.get(v, 0) + 1
    served_versions = [v["version"] for v in served_rows]
    return {
        "minutes": args.minutes, "users": args.users, "harmful": args.harmful, "poison": args.poison,
        "lr": _lr(args), "feedback": args.feedback, "engine": args.engine, "lora_rank": args.lora,
        "micro_batch_tokens": args.micro_batch_tokens,
        "gateway_peak_rss_gb": round(memory.peak_root_rss / 2**30, 2),
        "tree_peak_rss_gb": round(memory.peak_rss / 2**30, 2), "tree_peak_pss_gb": round(memory.peak_pss / 2**30, 2),
        "tree_max_processes": memory.max_processes,
        "poisoned_feedback_sent": len(pop.poison),
        "poisoned_feedback_400": sum(1 for _, status in pop.poison if status == 400),
        "poisoned_feedback_accepted": sum(1 for _, status in pop.poison if status == 200),
        "gateway_start_s": round(pop.t0 - t_gateway_start, 1),
        "conversations": len(done), "model_calls": len(pop.calls),
        "streamed_calls": sum(1 for c in pop.calls if c[3]),
        "requests_failed": sum(1 for c in pop.calls if not c[2]) + len(pop.close_errors),
        "failures": pop.failures[:5] + pop.close_errors[:5],
        "feedback_acknowledged": len(pop.acked), "feedback_lost": len(lost),
        "feedback_refused": len(pop.feedback_errors), "feedback_errors": pop.feedback_errors[:5],
        "feedback_not_due_at_end": pop.unsent, "silent_conversations": sum(1 for c in done if c["silent"]),
        "latency_p50_s": _pct([d for d, _ in ok_lat], 0.5), "latency_p99_s": _pct([d for d, _ in ok_lat], 0.99),
        "p99_during_swaps_s": _pct(during, 0.99), "calls_during_swaps": len(during),
        "p99_between_swaps_s": _pct(between, 0.99), "calls_between_swaps": len(between),
        "p99_during_updates_s": _pct([d for d, u in in_update if u], 0.99),
        "calls_during_updates": sum(1 for _, u in in_update if u),
        "p99_outside_updates_s": _pct([d for d, u in in_update if not u], 0.99),
        "calls_outside_updates": sum(1 for _, u in in_update if not u),
        "updates": len(spans), "update_s": [round(b - a, 1) for a, b in spans],
        "swaps_served": sum(1 for v in served_rows if v["how"] != "start"),
        "swaps_accepted": sum(1 for g in gate if g["served"]), "swaps_refused": len(refused_steps),
        "gate": [{k: g[k] for k in ("step", "candidate_version", "serving_version", "serving_figure",
                                    "candidate_figure", "served")} | {"at_min": round((g["at"] - pop.t0) / 60, 1)}
                 for g in gate],
        "served_versions": served_versions, "answers_by_policy_version": answered_by,
        "refused_version_served": any(v["step"] in refused_steps and v["how"] in ("gate", "ungated")
                                      for v in served_rows),
        "windows": windows,
        "metrics_non_200": [line for line in metrics_text.splitlines()
                            if line.startswith("ajet_gateway_requests_total") and 'status="200"' not in line],
    }


def print_report(r: dict) -> None:
    trained = f"LoRA rank {r['lora_rank']}" if r["lora_rank"] else "full fine-tuning"
    print(f"\n== live traffic: {r['minutes']:g} min, {r['users']} users, lr {r['lr']:g}"
          f"{' (HARMFUL)' if r['harmful'] else ''}{' (POISON)' if r['poison'] else ''}, feedback={r['feedback']}, "
          f"engine {r['engine']}, {trained} ==")
    print(f"peak memory: the gateway process {r['gateway_peak_rss_gb']:.2f} GB RSS; its process tree "
          f"({r['tree_max_processes']} processes at most) {r['tree_peak_rss_gb']:.2f} GB RSS, "
          f"{r['tree_peak_pss_gb']:.2f} GB PSS")
    print(f"gateway ready after {r['gateway_start_s']} s; {r['conversations']} conversations, {r['model_calls']} model "
          f"calls ({r['streamed_calls']} streamed), {r['silent_conversations']} conversations never answered")
    for w in r["windows"]:
        print(f"  {w['window']:>10}: served accuracy {100 * w['accuracy']:5.1f}% of {w['conversations']:4d} "
              f"conversations, mean feedback reward {w['mean_feedback_reward']:.3f}, policy versions "
              f"{w['policy_versions']}")
    if len(r["windows"]) > 1:
        first, last = r["windows"][0]["accuracy"], r["windows"][-1]["accuracy"]
        print(f"served accuracy, last window - first: {100 * (last - first):+.1f} points")
    print(f"latency p50 {r['latency_p50_s']:.2f} s, p99 {r['latency_p99_s']:.2f} s; p99 during swaps "
          f"{r['p99_during_swaps_s']:.2f} s ({r['calls_during_swaps']} calls), between swaps "
          f"{r['p99_between_swaps_s']:.2f} s ({r['calls_between_swaps']} calls)")
    print(f"updates {r['updates']} (training s: {r['update_s']}); p99 of the calls overlapping an update "
          f"{r['p99_during_updates_s']:.2f} s ({r['calls_during_updates']} calls), of the others "
          f"{r['p99_outside_updates_s']:.2f} s ({r['calls_outside_updates']} calls)")
    print(f"weight swaps served {r['swaps_served']}; updates accepted by the gate {r['swaps_accepted']}, refused "
          f"{r['swaps_refused']}")
    for g in r["gate"]:
        print(f"  step {g['step']} at {g['at_min']} min: candidate v{g['candidate_version']} "
              f"{g['candidate_figure']} vs serving v{g['serving_version']} {g['serving_figure']} -> "
              f"{'served' if g['served'] else 'REFUSED'}")
    print(f"served versions {r['served_versions']}; answers by policy version {r['answers_by_policy_version']}; "
          f"a refused update served: {r['refused_version_served']}")
    print(f"requests failed {r['requests_failed']} {r['failures'] or ''}")
    print(f"feedback acknowledged {r['feedback_acknowledged']}, lost {r['feedback_lost']}, refused "
          f"{r['feedback_refused']} {r['feedback_errors'] or ''}, not yet due at the end {r['feedback_not_due_at_end']}")
    if r["poison"]:
        print(f"poisoned rewards (1e300, NaN) sent {r['poisoned_feedback_sent']}: answered 400 "
              f"{r['poisoned_feedback_400']}, accepted {r['poisoned_feedback_accepted']}")
    if r["metrics_non_200"]:
        print("non-200 in /metrics: " + "; ".join(r["metrics_non_200"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall time of the traffic")
    p.add_argument("--users", type=int, default=8, help="concurrent users")
    p.add_argument("--stream-frac", type=float, default=0.25, help="share of the users that stream")
    p.add_argument("--silent-frac", type=float, default=0.1, help="share of conversations never given feedback")
    p.add_argument("--delay-scale", type=float, default=1.0, help="feedback delay = uniform(5, 120) s times this")
    p.add_argument("--feedback", choices=["tutorial", "right"], default="tutorial",
                   help="tutorial: math_agent_reward; right: 1 for the right number, else 0")
    p.add_argument("--window-min", type=float, default=5.0, help="accuracy window, minutes")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--harmful", action="store_true", help="every update at lr 1e-2: the gate must refuse it")
    p.add_argument("--poison", action="store_true", help="1e300 and NaN rewards (each must be a 400) and every "
                   "update at lr 1e30 (non-finite answers: the gate must refuse it)")
    p.add_argument("--num-repeat", type=int, default=4, help="rollout.num_repeat: sessions per group")
    p.add_argument("--tasks-per-step", type=int, default=4, help="trainer.tasks_per_step: groups per update")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--gate", choices=["eval", "off"], default="eval")
    p.add_argument("--gate-metric", default="reward_mean")
    p.add_argument("--gate-tasks", type=int, default=32, help="held-out problems the gate evaluates")
    p.add_argument("--max-drop", type=float, default=0.1)
    p.add_argument("--until-gate", type=int, default=0, metavar="N",
                   help="go on past --minutes until the gate has decided N updates (at most --max-minutes)")
    p.add_argument("--max-minutes", type=float, default=60.0, help="the cap of --until-gate")
    p.add_argument("--client-timeout", type=float, default=900.0,
                   help="seconds a model call may take before its client gives up (a failed request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="the gateway's OMP_NUM_THREADS (torch's CPU threads)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train a LoRA adapter of this rank (alpha 2 x rank) beside the one base model instead of "
                        "all the weights (model.lora; 0: full fine-tuning)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="algorithm.micro_batch_tokens: tokens per forward/backward chunk of an update (the "
                        "update's activations scale with it)")
    p.add_argument("--engine", choices=["in_process", "vllm"], default="in_process",
                   help="engine.kind: generation in the gateway's process, or a vLLM server it starts")
    p.add_argument("--vllm-python", default=str(ROOT / ".venvs" / "vllm" / "bin" / "python"),
                   help="the vLLM venv's python (.ci/make_vllm_env.sh) for --engine vllm")
    p.add_argument("--run-dir", help="keep the gateway's config, log and experiment folder here")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()

    # absolute: the gateway runs from the run folder, so a relative --run-dir would not name its config there
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="ajet-live-traffic-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    tasks = [json.loads(line) for line in (TUTORIAL / "tasks" / "train.jsonl").read_text().splitlines() if line]
    conf, exp = write_config(run_dir, args), run_dir / "exp"
    t_start = time.time()
    print(f"starting ajet gateway ({run_dir / 'gateway.log'}) ...", flush=True)
    gw = GatewayProcess(conf, exp, run_dir / "gateway.log", args.threads)
    metrics_text = ""
    try:
        pop = Population(gw.url, tasks, args)
        print(f"gateway on {gw.url}; {args.users} users for {args.minutes:g} min", flush=True)
        asyncio.run(pop.run(args.minutes * 60))
        try:
            metrics_text = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {SECRET}"},
                                     timeout=120).text
        except httpx.HTTPError as exc:      # the gateway is gone (its log says why): the clients' figures stand
            print(f"/metrics could not be read: {type(exc).__name__}: {exc}; gateway exit status {gw.proc.poll()}")
    finally:
        gw.kill()
    (run_dir / "clients.json").write_text(json.dumps(
        {"t0": pop.t0, "calls": pop.calls, "convs": pop.convs, "acked": pop.acked, "unsent": pop.unsent,
         "failures": pop.failures, "close_errors": pop.close_errors, "feedback_errors": pop.feedback_errors}))
    r = report(pop, exp / "gateway.sqlite", t_start, args, metrics_text, gw.memory)
    print_report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1, default=str))
    poisoned = r["poisoned_feedback_accepted"] > 0 or (args.poison and r["swaps_accepted"] > 0)
    return 0 if r["requests_failed"] == 0 and r["feedback_lost"] == 0 and not poisoned else 1


if __name__ == "__main__":
    sys.exit(main())
