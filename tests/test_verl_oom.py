"""A verl worker killed by Ray's memory monitor during an update is `BackboneOutOfMemory`, a message that says
what happened and which settings to change, not a raw `ray.exceptions.OutOfMemoryError` traceback.

The kill is real and needs no verl: a Ray cluster started with `RAY_memory_usage_threshold=0.01` (any worker is
over it) kills the actor that stands in for verl's worker group while `VerlBackbone.update` (the real method, its
optimizer step replaced by a call to that actor) waits on it, so the exception and its text are Ray's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ajet.backbones.ray_oom import BackboneOutOfMemory, explain_ray_oom, is_ray_oom
from ajet.errors import AjetError
from tests.backbone_conformance.venvs import ROOT

ray_exceptions = pytest.importorskip("ray.exceptions")

UPDATE_KILLED = textwrap.dedent("""
    import json, threading, time, types
    import ray
    from ajet.backbones.verl.backbone import VerlBackbone
    from ajet.config import AjetConfig
    from ajet.tracker.sample import Sample

    ray.init(address="local", num_cpus=1, include_dashboard=False)   # private: not a cluster another test runs

    @ray.remote
    class Worker:            # stands in for verl's actor worker group: busy until the memory monitor kills it
        def update_actor(self):
            time.sleep(300)

    worker = Worker.remote()
    backbone = VerlBackbone.__new__(VerlBackbone)      # the real update(), without verl's worker group
    backbone.cfg = AjetConfig.model_validate({"data": {"train_path": "tasks.jsonl"},
                                              "algorithm": {"micro_batch_tokens": 1536}})
    backbone.rollout = "ajet"
    backbone._rng = __import__("random").Random(0)
    backbone.config = types.SimpleNamespace(trainer=types.SimpleNamespace(n_gpus_per_node=2, nnodes=1))
    backbone.engine = types.SimpleNamespace(weights_lock=threading.Lock(), policy_version=3)
    backbone._optimizer_step = lambda rows, n: ray.get(worker.update_actor.remote(), timeout=240)
    sample = Sample(episode_id="e0", group_id="g", agent_tag="a", call_ids=[], prompt_ids=[1, 2], response_ids=[3],
                    loss_mask=[1], old_logprobs=[-0.5], policy_versions=[3], temperatures=[1.0], top_ps=[1.0],
                    advantage=1.0)
    try:
        backbone.update([sample])
        out = {"raised": None}
    except BaseException as exc:
        out = {"raised": [f"{c.__module__}.{c.__name__}" for c in type(exc).__mro__], "message": str(exc),
               "cause": f"{type(exc.__cause__).__module__}.{type(exc.__cause__).__name__}",
               "lock_free": backbone.engine.weights_lock.acquire(blocking=False)}
    print("RESULT " + json.dumps(out), flush=True)
    ray.shutdown()
""")


def test_a_verl_update_killed_by_rays_memory_monitor_says_what_to_change(tmp_path):
    env = {**os.environ, "RAY_memory_usage_threshold": "0.01", "RAY_memory_monitor_refresh_ms": "100",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", UPDATE_KILLED], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(line[len("RESULT "):])
    assert out["raised"], "the update returned although its worker was killed"
    assert "ajet.backbones.ray_oom.BackboneOutOfMemory" in out["raised"]
    assert "ajet.errors.AjetError" in out["raised"]          # the CLI prints it without a traceback
    assert out["cause"] == "ray.exceptions.OutOfMemoryError"   # Ray's own exception, kept as the cause
    msg = out["message"]
    assert msg.startswith("verl's actor update (policy version 3, 1 samples) was killed by Ray's memory monitor")
    assert "worker(s) were killed due to the node running low on memory" in msg    # Ray's first line
    assert "algorithm.micro_batch_tokens (1536)" in msg and "2 data-parallel rank(s)" in msg
    assert "n_gpus_per_node" in msg and "RAY_memory_usage_threshold" in msg and "--resume" in msg
    assert len(msg) < 1500, "Ray's whole report (memory tables, process lists) does not belong in the message"
    assert out["lock_free"], "the engine's weights lock stayed held after the failed update"


def test_only_rays_memory_monitor_kills_are_explained():
    class ActorDiedOfOOM(ray_exceptions.ActorDiedError):   # an actor call after the monitor killed the actor
        def __str__(self):
            return "The actor is dead: 1 worker(s) were killed due to the node running low on memory. Memory ..."

    assert is_ray_oom(ray_exceptions.OutOfMemoryError("2 worker(s) were killed ..."))
    assert is_ray_oom(ActorDiedOfOOM())
    try:                                   # raised from Ray's exception inside a framework's own error
        try:
            raise ray_exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory.")
        except Exception as inner:
            raise RuntimeError("verl dispatch failed") from inner
    except RuntimeError as wrapped:
        assert is_ray_oom(wrapped)
    assert not is_ray_oom(ray_exceptions.ActorDiedError())                 # died of something else
    assert not is_ray_oom(RuntimeError("killed due to the node running low on memory"))   # not Ray's
    import torch

    assert not is_ray_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))

    with pytest.raises(ValueError, match="^a bad row$"):                    # anything else passes unchanged
        with explain_ray_oom("verl's actor update", "lower x."):
            raise ValueError("a bad row")
    with pytest.raises(BackboneOutOfMemory) as info:
        with explain_ray_oom("verl's actor update", "Lower algorithm.micro_batch_tokens."):
            raise ray_exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory."
                                                  + " x" * 1000 + "\nObject store memory usage: ...")
    assert isinstance(info.value, AjetError) and isinstance(info.value.__cause__, ray_exceptions.OutOfMemoryError)
    assert "Object store memory usage" not in str(info.value) and "Lower algorithm.micro_batch_tokens." in str(
        info.value)
