"""verl beside `--with-ray` without a cluster: the Ray the episode pool starts holds verl's rank too. verl on a
cluster of two Ray nodes, generating through vLLM: tests/test_backbone_vllm.py."""

import json
import os
import subprocess

from tests.backbone_conformance.venvs import venv_python
from tests.two_nodes import CLUSTER_ENV, write_run

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 3.32 alone on 2026-12-06 (with the two-node test now in
# tests/test_backbone_vllm.py)
PEAK_MEMORY_GB = 4.0


def test_verl_with_ray_workers_on_the_ray_ajet_starts(tiny_model_dir, tmp_path):
    """No cluster: the episode pool starts the local Ray (before verl's backbone loads, which joins it) with room
    for verl's rank beside the workers' CPUs, whatever the machine's core count."""
    py = venv_python("verl")
    write_run(tmp_path, tiny_model_dir)
    run = subprocess.run([py, "-m", "ajet", "--conf", "conf.yaml", "--backbone", "verl", "--exp-dir", "exp",
                          "--with-ray", "2"], capture_output=True, text=True, timeout=480, cwd=tmp_path,
                         env={**os.environ, **CLUSTER_ENV})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 Ray episode workers on 1 node(s)" in run.stderr
    metrics = [json.loads(x) for x in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["train/optimizer_steps"] == 1.0 and metrics[0]["rollout/ray_nodes"] == 1
