"""--with-ray: episodes on a local Ray pool (2 actors) give exactly the calls and samples of the in-process
rollout, and a worker killed mid-step fails only the episodes it was running."""

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="--with-ray needs `ray` (pip install 'ajet[ray]')")

from ajet.workflow import Workflow, WorkflowOutput  # noqa: E402

TUTORIAL = Path(__file__).resolve().parent.parent / "tutorial" / "example_math_agent"


@pytest.fixture(scope="module")
def local_ray():
    # "local": a private Ray; a plain ray.init() joins a cluster another test started on this machine (the
    # two-node tests), where num_cpus is refused
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in __import__("sys").path if p)}})
    yield
    ray.shutdown()


def _train(tiny_model_dir, tmp_path, name, ray_workers):
    from ajet.config import load_config
    from ajet.trainer import run

    conf = tmp_path / f"{name}.yaml"
    conf.write_text(f"""
experiment_name: {name}
workflow: {TUTORIAL}/math_workflow.py:MathAgentWorkflow
judge: {TUTORIAL}/math_workflow.py:math_agent_reward
model: {{path: "{tiny_model_dir}", max_model_len: 1024, device: cpu}}
data: {{train_path: {TUTORIAL}/tasks/train.jsonl, max_tasks: 4}}
rollout: {{num_repeat: 2, max_tokens: 12, temperature: 1.0, max_concurrency: 1, ray_workers: {ray_workers}}}
algorithm: {{lr: 1.0e-3}}
trainer: {{total_steps: 2, tasks_per_step: 2, seed: 3, exp_dir: "{tmp_path}/{name}", tensorboard: false}}
""")
    exp = run(load_config(conf))
    return [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()], \
        [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]


def test_tutorial_on_two_ray_workers_records_what_the_in_process_run_records(tiny_model_dir, tmp_path, local_ray):
    # max_concurrency 1: the engine sees the calls in the same order, so the same seed samples the same tokens
    plain, m_plain = _train(tiny_model_dir, tmp_path, "plain", 0)
    on_ray, m_ray = _train(tiny_model_dir, tmp_path, "ray", 2)
    assert [m["step"] for m in m_ray] == [1, 2] and m_ray[-1]["policy_version"] == 2
    assert len(plain) == len(on_ray) == 8 and all(e["error"] is None for e in on_ray)
    keys = ("prompt_ids", "completion_ids", "completion_logprobs", "prompt_parent")
    for a, b in zip(plain, on_ray):
        assert a["episode_id"] == b["episode_id"] and a["reward"] == b["reward"]
        assert [[c[k] for k in keys] for c in a["calls"]] == [[c[k] for k in keys] for c in b["calls"]]
        strip = lambda s: {k: v for k, v in s.items() if k != "call_ids"}  # noqa: E731
        assert [strip(s) for s in a["samples"]] == [strip(s) for s in b["samples"]]
    # the workflow and its judge ran in the workers, every call through the proxy (the random tiny model never
    # completes the forced tool call in 12 tokens, so these episodes end after their first call)
    assert all(e["calls"] and e["reward"] is not None for e in on_ray)


class KillsItsWorker(Workflow):
    """One call; then the first episode of task `kill` kills the worker process it runs in (SIGKILL)."""

    async def execute(self, task, tuner):
        r = await tuner.client.chat.completions.create(model=tuner.model, max_tokens=4,
                                                       messages=[{"role": "user", "content": task.query}])
        if task.task_id == "kill" and tuner.episode_id.endswith("-r0"):
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.5)   # the other episodes of the killed worker are mid-flight when it dies
        return WorkflowOutput(reward=1.0, final_answer=r.choices[0].message.content)


def test_a_killed_worker_fails_only_its_own_episodes(tiny_model_dir, local_ray):
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig
    from ajet.llm_call import SamplingParams
    from ajet.proxy.server import ProxyServer
    from ajet.rollout.ray import RayRollout
    from ajet.task import Task

    cfg = AjetConfig.model_validate({"workflow": "x:y", "data": {"train_path": "x"},
                                     "model": {"path": tiny_model_dir, "max_model_len": 512, "device": "cpu"}})
    backbone = DebugBackbone(cfg)
    proxy = ProxyServer(backbone.engine, backbone.tokenizer, SamplingParams(max_tokens=4)).start()
    pool = RayRollout(2)
    try:
        # episode i runs on worker i % 2: episode 0 kills worker 0 while episodes 2 and 4 run there too
        tasks = [Task("kill", "What is 1 plus 1?"), Task("t1", "What is 2 plus 2?"), Task("t2", "What is 3?")]
        eps = asyncio.run(pool(KillsItsWorker(), tasks, 2, proxy, None, 1, 8, 60.0))
        failed = [i for i, e in enumerate(eps) if not e.ok]
        assert 0 in failed and all(i % 2 == 0 for i in failed)             # only worker 0's episodes
        assert all(eps[i].ok for i in range(len(eps)) if i % 2 == 1)        # worker 1 never noticed
        assert all("Ray worker running this episode failed" in eps[i].error for i in failed), eps[failed[0]].error
        assert len(eps[0].calls) == 1                                       # its call before dying is kept
        # the actor is restarted: the next step runs on both workers again
        again = asyncio.run(pool(KillsItsWorker(), [Task("t3", "What is 5?")], 2, proxy, None, 2, 8, 60.0))
        assert all(e.ok for e in again), [e.error for e in again]
    finally:
        pool.close()
        proxy.stop()
        backbone.close()
