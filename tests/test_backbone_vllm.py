"""`engine: {kind: vllm}` with `--backbone verl` and `--backbone trinity`: each backbone's `ajet` run, in its own
venv (.venvs/verl, .venvs/trinity), generates through a vLLM server (.venvs/vllm) on SmolLM2-135M, and after every
update the trainer's weights reach the server (verl's per-tensor export / Trinity's synchronizer -> safetensors ->
the server's `reload_weights`), for two steps of a one-call workflow.

Per backbone, two runs of the same config (2 steps, a checkpoint every step), both against the module's server
(`engine.urls`; `_kill_then_resume`):
1. killed with SIGKILL once step 2's episodes are stored (`AJET_TEST_KILL_AT=stored@2`: step 1's update and
   checkpoint are done, step 2 generated on the synced weights);
2. `--resume`d to the end (the server first gets the starting weights, then the checkpoint's, before the first
   call). Before the resumed run the test puts the starting weights back on the server, which the killed run left
   holding step 1's: a resume that skipped the checkpoint's weights would be served the wrong ones.
Checked, with a transformers forward in fp32 as the reference (vLLM's fp32 logprobs agree with it to ~2e-5,
tests/test_vllm_engine.py): in both runs step 1's calls record policy version 0 and step 2's version 1, and the
logprobs the server returned at step 2 are those of step 1's checkpoint (the trainer's weights after update 1),
not the starting weights'; after the resumed run the server answers a fixed prompt with the logprobs of step 2's
checkpoint; over the two attempts every (step, task, repeat) episode is trained by exactly one update and the
killed attempt's step-2 episodes are abandoned (the trajectory store's ledger).

A server ajet starts and owns (`engine: {kind: vllm}` without urls) is the LoRA test's, run first: its process
group must be gone after the SIGKILL (the watchdog). The module's server (tests/vllm_server.py's fixture)
starts after it, so that two servers never run at once. Trinity's kill and resume comes next. verl's is the
scale-out shape, last: verl on a Ray cluster of two nodes (one FSDP rank on each, `--with-ray` episode workers on
both), killed and resumed on that cluster. Its first run meets the module's server holding Trinity's trained
weights: its step-1 calls must have the starting weights' logprobs (ajet sends a server at `engine.urls` the
starting weights).

In CI a missing venv FAILS these tests (tests/backbone_conformance/venvs.py, tests/vllm_server.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from ajet.engines.vllm import SERVED_NAME, VLLMEngine
from ajet.trajectory_store import TrajectoryStore
from tests.backbone_conformance.main_job import live_episodes
from tests.backbone_conformance.venvs import venv_python
from tests.vllm_server import (  # noqa: F401 - module fixtures: the SmolLM2 folder and the module's server
    EAGER,
    START_LIMIT_S,
    _vllm_direct,
    _wait_group_gone,
    model_path,
    server,
    vllm_python,
)
from tests.two_nodes import CLUSTER_ENV, verl_cluster

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 14.38 alone and 15.06 in .ci/run on 2026-12-06
PEAK_MEMORY_GB = 16.0

RUN_S = START_LIMIT_S + 1500      # a bound on one CLI run on a loaded 2-core machine, not a speed target
SAME = 2e-3                       # |vLLM - transformers| logprob, max over a call's tokens, for the same weights
MOVED = 2e-2                      # at least this far apart somewhere: the update moved the weights (lr below)
CALLS_CHECKED = 4                 # step-2 calls whose logprobs are recomputed (per run)

WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class OneCall(Workflow):
    """One call; the reward is the answer's length mod 5 (a group almost never ties, so every step trains)."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": task.query}])
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 5), final_answer=text)


class OneCallWhere(OneCall):
    """OneCall, in a Ray episode worker: the output's metadata names the Ray node it ran on."""

    async def execute(self, task, tuner):
        import ray

        out = await super().execute(task, tuner)
        return WorkflowOutput(reward=out.reward, final_answer=out.final_answer,
                              metadata={"node_id": ray.get_runtime_context().get_node_id()})
'''


def _experiment(folder: Path, model: str, engine: dict, **model_extra) -> Path:
    """The run's folder: workflow, 4 tasks, and the config (2 steps of 2 tasks x 4 repeats, 16 tokens at T 1.0,
    lr 5e-5 (2e-3 with `lora` in `model_extra`), a checkpoint every step, no evaluation) with `engine`. Returns the
    config's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wf.py").write_text(WORKFLOW)
    tasks = [{"task_id": f"t{i}", "query": f"Name {i + 2} colours.", "answer": "-"} for i in range(4)]
    (folder / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    conf = {"experiment_name": "vllm_backbone", "workflow": "wf.py:OneCall",
            "model": {"path": model, "max_model_len": 1024, **model_extra},
            "data": {"train_path": "tasks.jsonl", "shuffle": False},
            "rollout": {"num_repeat": 4, "max_tokens": 16, "temperature": 1.0, "episode_timeout_s": RUN_S},
            "algorithm": {"lr": 2e-3 if "lora" in model_extra else 5e-5},
            "trainer": {"total_steps": 2, "tasks_per_step": 2, "save_freq": 1, "val_freq": 0, "tensorboard": False},
            "engine": engine}
    path = folder / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


def _env(**extra: str) -> dict[str, str]:
    # Ray's memory monitor would kill a worker at its default 95% on a machine shared with a vLLM server; a Ray
    # cluster someone started on this machine (`ray start`) is not joined: the run starts its own
    return {**os.environ, "RAY_memory_usage_threshold": "0.98", "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1",
            **extra}


def _run(python: str, conf: Path, backbone: str, *extra: str, env: dict, watch=None) -> tuple[int, str]:
    """`ajet --conf conf --backbone backbone --exp-dir exp -q extra...` in `conf`'s folder: (exit status, output).
    `watch(proc)` is called every second while it runs."""
    out = conf.parent / f"out-{len(list(conf.parent.glob('out-*')))}.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([python, "-m", "ajet", "--conf", conf.name, "--backbone", backbone, "--exp-dir", "exp",
                                 "-q", *extra], stdout=f, stderr=subprocess.STDOUT, cwd=conf.parent, env=env)
    deadline = time.monotonic() + RUN_S
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"ajet --backbone {backbone} ran past {RUN_S} s: {out.read_text()[-4000:]}")
        if watch is not None:
            watch(proc)
        time.sleep(1)
    return proc.returncode, out.read_text()


def _server_group(cwd: Path) -> int | None:
    """The process group (the watchdog's pid) of a running vLLM server started in folder `cwd` (ajet's working
    folder, which the server inherits), or None."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                if b"vllm.entrypoints.openai.api_server" in cmd and Path(os.readlink(d / "cwd")) == cwd:
                    return os.getpgid(int(d.name))
            except (OSError, ProcessLookupError):
                continue
    return None


def _calls(exp: Path, attempt: int) -> dict[int, list[dict]]:
    """step -> the calls of the episodes `attempt` stored at that step (trajectory store)."""
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        return {step: [c for e in store.episodes(step=step, attempt=attempt) for c in e["calls"]] for step in (1, 2)}
    finally:
        store.close()


@torch.no_grad()
def _logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """`[completion_len]` log-probabilities of `completion_ids` after `prompt_ids` under `model` at `temperature`
    (no nucleus: top_p 1), by a plain forward."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


def _max_diffs(calls: list[dict], model) -> list[float]:
    """max |recorded - `model`'s| logprob of each call."""
    out = []
    for c in calls:
        ref = _logprobs(model, c["prompt_ids"], c["completion_ids"], c["sampling"]["temperature"])
        out.append(float((ref - torch.tensor(c["completion_logprobs"])).abs().max()))
    return out


def _load(folder: Path | str):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _check_run(exp: Path, attempt: int, start, step1) -> None:
    """Step 1's calls (attempt 0 only: the resumed run starts at step 2) record version 0 and the starting weights'
    logprobs; step 2's record version 1 and step 1's checkpoint's logprobs (within SAME), not the starting
    weights' (MOVED apart somewhere)."""
    calls = _calls(exp, attempt)
    assert calls[2], f"attempt {attempt} stored no step-2 episode"
    assert {c["policy_version"] for c in calls[2]} == {1}, [c["policy_version"] for c in calls[2]]
    if attempt == 0:      # version 0 is the starting weights, whatever the server held before (engine.urls)
        assert calls[1] and {c["policy_version"] for c in calls[1]} == {0}
        first = _max_diffs(calls[1][:CALLS_CHECKED], start)
        assert max(first) < SAME, f"step-1 calls vs the starting weights: {first}"
    checked = calls[2][:CALLS_CHECKED]
    trained = _max_diffs(checked, step1)
    assert max(trained) < SAME, f"step-2 calls vs the trainer's weights after update 1: {trained}"
    assert max(_max_diffs(checked, start)) > MOVED, "the update did not move the served logprobs: nothing checked"


def _check_server_holds(url: str, tokenizer, model) -> None:
    """The server's greedy answer to a fixed prompt, with its logprobs, is `model`'s."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ids, lps = _vllm_direct(url, prompt, max_tokens=8, temperature=0.0)      # greedy: logprobs at T 1
    ref = _logprobs(model, prompt, ids, 1.0)
    diff = float((ref - torch.tensor(lps)).abs().max())
    assert diff < SAME, f"the server's logprobs vs the trainer's last weights: max |diff| {diff}"


def test_verl_lora_through_vllm_serves_each_update_as_a_new_adapter(model_path, tmp_path):  # noqa: F811
    """`model.lora` with verl and a server ajet starts: the adapter alone travels (verl's export of the LoRA
    weights, written in peft's format, loaded under a new name per version); step 2's calls record version 1 and
    have the logprobs of the base model with step 1's adapter (peft), not the base model's; the server, which ajet
    started, is gone after ajet's SIGKILL (the watchdog). Runs before the module's server starts (one server at a
    time)."""
    from peft import PeftModel

    python = venv_python("verl")
    engine = {"kind": "vllm", "python": vllm_python(), "kv_cache_gb": 1, "start_timeout_s": START_LIMIT_S,
              "extra_args": EAGER}
    conf = _experiment(tmp_path, model_path, engine, lora={"rank": 8, "alpha": 16})
    groups: list[int] = []

    def watch(_proc):
        if not groups and (g := _server_group(tmp_path.resolve())) is not None:
            groups.append(g)

    code, out = _run(python, conf, "verl", "--steps", "2", env=_env(AJET_TEST_KILL_AT="stored@2"), watch=watch)
    assert code == -signal.SIGKILL, out[-4000:]
    assert groups, f"no vLLM server was seen running: {out[-3000:]}"
    assert _wait_group_gone(groups[0]), "the vLLM server outlived the ajet process killed with SIGKILL"
    exp = tmp_path / "exp"
    log = (exp / "engine" / "vllm.log").read_text()
    loads = [ln for ln in log.splitlines() if '"POST /v1/load_lora_adapter HTTP/1.1" 200' in ln]
    assert len(loads) == 2, log[-3000:]                 # version 0 before the first call, version 1 after update 1
    start = _load(model_path)
    step1 = PeftModel.from_pretrained(_load(model_path), exp / "checkpoints" / "step_1" / "adapter").eval()
    _check_run(exp, 0, start, step1)
    shutil.rmtree(exp / "checkpoints")


def _kill_then_resume(python: str, conf: Path, backbone: str, url: str, model_path: str, *args: str,
                      env: dict) -> Path:
    """`ajet --conf conf --backbone backbone args...` against the server at `url`, killed with SIGKILL once step 2's
    episodes are stored, then `--resume`d to the end; each attempt checked (`_check_run`), and over the two every
    (step, task, repeat) trained by exactly one update, the killed attempt's step-2 episodes abandoned, and the
    server left holding step 2's checkpoint. Returns the run's exp folder (its checkpoints still there)."""
    from transformers import AutoTokenizer

    exp = conf.parent / "exp"
    code, out = _run(python, conf, backbone, *args, env={**env, "AJET_TEST_KILL_AT": "stored@2"})
    assert code == -signal.SIGKILL, out[-4000:]
    start = _load(model_path)
    step1 = _load(exp / "checkpoints" / "step_1")
    _check_run(exp, 0, start, step1)

    # resumed against a server that holds other weights than step 1's checkpoint: the killed run left it holding
    # those, so the resume meets the starting weights, put back by hand
    engine = VLLMEngine([url], SERVED_NAME, conf.parent / "reset")
    try:
        engine.sync_weights(start.state_dict(), 0)
    finally:
        engine.close()
    code, out = _run(python, conf, backbone, "--resume", *args, env=env)
    assert code == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    _check_run(exp, 1, start, step1)
    # every task once over the two attempts: each (step, task, repeat) trained by exactly one update, the killed
    # attempt's step-2 episodes (stored, not trained) abandoned (the trajectory store's ledger)
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        assert store.attempts() == [(0, 0), (1, 1)]          # (attempt, resumed from step): the second from step 1
    finally:
        store.close()
    live = live_episodes(exp)
    assert set(live.values()) == {1} and sorted(Counter(k[0] for k in live).items()) == [(1, 8), (2, 8)], live
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["policy_version"] == 2, metrics
    assert all(m["train/weight_sync_s"] > 0 for m in metrics), metrics
    _check_server_holds(url, AutoTokenizer.from_pretrained(model_path), _load(exp / "checkpoints" / "step_2"))
    return exp


def test_trinity_trains_through_vllm_syncs_every_update_and_resumes(model_path, request, tmp_path):  # noqa: F811
    """Trinity through the module's server, killed at step 2 and resumed (`_kill_then_resume`). verl's kill and
    resume: the two-node test below."""
    url = request.getfixturevalue("server")["url"]
    conf = _experiment(tmp_path, model_path, {"kind": "vllm", "urls": [url]})
    exp = _kill_then_resume(venv_python("trinity"), conf, "trinity", url, model_path, env=_env())
    shutil.rmtree(exp / "checkpoints")          # checked: GBs the suite's disk need not hold (kept on a failure)


def test_verl_on_two_ray_nodes_with_ray_workers_generates_through_vllm(model_path, request, tmp_path):  # noqa: F811
    """The scale-out shape on one machine: a Ray cluster of two raylets (2 logical CPUs each), joined with
    `--ray-address`; verl with `trainer.nnodes=2` (one FSDP rank, gloo, on each node), `--with-ray 2` episode workers
    spread over both nodes, generation through the module's vLLM server, two steps, killed at step 2 and resumed on
    the same cluster (`_kill_then_resume`: step 2's calls have step 1's checkpoint's logprobs, so the two ranks'
    update reached the server; the resumed run restores them). Each attempt's two ranks are on the two nodes. On
    the same cluster `trainer.nnodes=3` is refused in one line: the episode workers hold a CPU on each node, so
    three one-CPU groups cannot be placed (verl's placement groups would wait forever)."""
    python = venv_python("verl")
    url = request.getfixturevalue("server")["url"]
    conf = _experiment(tmp_path, model_path, {"kind": "vllm", "urls": [url]})
    env = {k: v for k, v in _env(**CLUSTER_ENV).items() if k != "RAY_ADDRESS"}
    with verl_cluster(tmp_path, cpus_per_node=2, object_store_mib=256) as cluster:
        args = ["--ray-address", cluster["address"], "--with-ray", "2", "workflow=wf.py:OneCallWhere"]
        refused = subprocess.run([python, "-m", "ajet", "--conf", conf.name, "--backbone", "verl", "--exp-dir",
                                  "exp3", *args, "verl.trainer.nnodes=3"], capture_output=True, text=True,
                                 timeout=300, cwd=tmp_path, env=env)
        errors = [x for x in refused.stderr.splitlines() if x.startswith("ajet: error:")]
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert len(errors) == 1 and "trainer.nnodes=3" in errors[0] and "(1, 1 held by placement groups)" in \
            errors[0], refused.stderr[-3000:]
        exp = _kill_then_resume(python, conf, "verl", url, model_path, *args, "verl.trainer.nnodes=2", env=env)
    assert all(m["rollout/ray_nodes"] == 2 for m in (json.loads(x) for x in
                                                      (exp / "metrics.jsonl").read_text().splitlines()))
    nodes = set(cluster["nodes"])
    assert len(nodes) == 2
    # the episodes ran on both nodes (what the workflow saw inside its Ray worker), 8 a step
    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 16 and all(e["error"] is None for e in episodes)
    assert {e["output"]["metadata"]["node_id"] for e in episodes} == nodes
    # verl's two ranks, one per node, in each attempt (a worker group each: "<group>AjetActorWorker_<rank>:0")
    groups: dict[str, dict[str, str]] = {}
    for a in cluster["actors"]:
        if a["cls"] == "AjetActorWorker":
            group, rank = a["name"].rsplit("AjetActorWorker_", 1)
            groups.setdefault(group, {})[rank] = a["node"]
    assert len(groups) == 2, groups
    assert all(sorted(g) == ["0:0", "1:0"] and set(g.values()) == nodes for g in groups.values()), groups
    # both ranks' shards in the run's checkpoint (they write from the cluster's working folder, not the run's)
    shards = sorted(p.name for p in (exp / "checkpoints" / "step_1" / "actor").glob("model_*.pt"))
    assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"], shards
    shutil.rmtree(exp / "checkpoints")
