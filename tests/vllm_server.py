"""The one real vLLM server a test module shares, and the helpers its tests use: the vLLM venv (.venvs/vllm,
built by `.ci/make_vllm_env.sh`; skip/fail rules in `vllm_python`), the SmolLM2-135M folder ajet converts, and the
module-scoped `server` fixture (started by an owner process: `vllm_engine(cfg, ...)`, the debug backbone's own
call). Used by tests/test_vllm_engine.py (whose module also runs tests/vllm_faults.py's tests on the same server),
tests/test_backbone_vllm.py and tests/test_vllm_lora.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ajet.engines.vllm import SERVED_NAME
from tests.backbone_conformance.venvs import wait_for_build

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venvs" / "vllm"
START_LIMIT_S = 900          # the server's start on a loaded 2-core machine (about 100 s idle)


def vllm_python() -> str:
    """The vLLM venv's python, once its build (if one runs) has finished. A missing venv FAILS the test in CI
    (`CI=true`: .ci/run builds it in the background), unless `AJET_CI_VLLM_ENV=0` turned the build off on purpose;
    elsewhere it skips, naming the build command."""
    wait_for_build(VENV)
    if not (VENV / ".complete").exists():
        msg = "the vLLM venv is absent: build it with `.ci/make_vllm_env.sh`"
        if os.environ.get("CI", "").lower() in ("true", "1") and os.environ.get("AJET_CI_VLLM_ENV", "1") != "0":
            pytest.fail(f"{msg} (in CI these tests may not skip; set AJET_CI_VLLM_ENV=0 to skip on purpose)")
        pytest.skip(msg)
    return str(VENV / "bin" / "python")


OWNER = '''
import json, sys, time
from ajet.config import AjetConfig
from ajet.engines.vllm import vllm_engine
from ajet.model import load_model, resolve_model_path

cfg = AjetConfig.model_validate(json.loads(sys.argv[1]))
path = resolve_model_path(cfg.model.path)
engine = vllm_engine(cfg, path, load_model(path, "float32", "cpu").state_dict())
print(json.dumps({"url": engine.base_urls[0], "pgid": engine.server.pgid}), flush=True)
while True:
    time.sleep(60)
'''


# the test servers run eager: vLLM's torch.compile warm-up took 56 s of the idle 2-core CPU per start (minutes under
# load); what it changes is speed, not tokens or logprobs. The compiled default that users run is what
# benchmarks/main_job_engines.py measures.
EAGER = ["--enforce-eager"]


@pytest.fixture(scope="module")
def model_path() -> str:
    from ajet.model import resolve_model_path

    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """{"url", "pgid", "owner" (the owner's Popen), "exp" (its run folder)}: the module's one vLLM server."""
    python = vllm_python()
    exp = tmp_path_factory.mktemp("vllm_owner")
    cfg = {"data": {"train_path": "unused.jsonl"}, "model": {"path": model_path, "max_model_len": 2048},
           "trainer": {"exp_dir": str(exp)}, "rollout": {"max_batch_size": 16},
           "engine": {"kind": "vllm", "python": python, "kv_cache_gb": 1, "start_timeout_s": START_LIMIT_S,
                      "extra_args": EAGER}}
    out = exp / "owner.out"
    with open(out, "w") as f:
        owner = subprocess.Popen([sys.executable, "-c", OWNER, json.dumps(cfg)], stdout=f, stderr=subprocess.STDOUT,
                                 cwd=exp)
    deadline = time.monotonic() + START_LIMIT_S + 60
    while not (reports := [ln for ln in out.read_text().splitlines() if ln.startswith("{")]):
        if owner.poll() is not None or time.monotonic() > deadline:
            owner.kill()
            pytest.fail(f"the vLLM server's owner did not report a server: {out.read_text()[-3000:]}")
        time.sleep(1)
    info = json.loads(reports[0])
    yield {**info, "owner": owner, "exp": exp}
    if owner.poll() is None:
        owner.kill()
    owner.wait()
    _wait_group_gone(info["pgid"])


def _wait_group_gone(pgid: int, limit_s: float = 120) -> bool:
    """Whether process group `pgid` is empty within `limit_s` seconds (polled every 0.5 s)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def _post(url: str, body: dict) -> dict:
    """A plain HTTP client (not ajet's) POSTing JSON to the server."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _vllm_direct(url: str, prompt_ids: list[int], **params) -> tuple[list[int], list[float]]:
    """vLLM's own answer for `prompt_ids` (its /v1/completions, token ids back): (sampled ids, their logprobs)."""
    body = _post(url + "/completions", {"model": SERVED_NAME, "prompt": prompt_ids, "logprobs": 1,
                                        "return_tokens_as_token_ids": True, "top_k": -1, "min_p": 0.0,
                                        "repetition_penalty": 1.0, "skip_special_tokens": False, **params})
    lp = body["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]
