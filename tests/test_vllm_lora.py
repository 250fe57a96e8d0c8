"""LoRA adapters through a real vLLM server (`engine: {kind: vllm}` with `model.lora` or `agents:`): each version's
adapters loaded under a name never used before, calls answered by the version they were admitted under, old
versions unloaded once drained, one adapter per agent role.

One server for the module, started with LoRA enabled (`VLLMServer(lora_rank=8)`, as `vllm_engine` starts it), from
the vLLM venv of tests/vllm_server.py, with its skip/fail rules (in CI a missing venv fails these tests). Which
version answered is never taken from the engine's record alone: every completion's greedy tokens are checked against
a transformers + peft forward of each version's adapter, computed here.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from ajet.backbones.debug.role_adapters import save_adapters
from ajet.engines.base import reset_calling_agent, set_calling_agent
from ajet.engines.vllm import SERVED_NAME, VLLMEngine, serving_folder
from ajet.engines.vllm_server import VLLMServer
from ajet.llm_call import SamplingParams
# importing `venv_python` marks this module as one that waits for a venv build (tests/ci_backbone_tests.py)
from tests.backbone_conformance.venvs import venv_python  # noqa: F401
from tests.vllm_server import START_LIMIT_S, model_path, vllm_python  # noqa: F401  (model_path: a fixture)

# the most this file's processes hold at once, all together (PSS, GB): the xdist workers share a memory
# budget (tests/memory_budget.py); measured 5.85 alone on 2026-12-06
PEAK_MEMORY_GB = 6.5

RANK = 8
PROMPTS = ["Once upon a time", "6 times 7 is"]


@pytest.fixture(scope="module")
def hf(model_path):
    """(tokenizer, the base model wrapped by peft with one LoRA adapter `default` on every linear layer, eval mode)."""
    from peft import LoraConfig, get_peft_model

    from ajet.model import load_model, load_tokenizer

    model = get_peft_model(load_model(model_path, "float32", "cpu"),
                           LoraConfig(r=RANK, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    return load_tokenizer(model_path), model.eval()


@pytest.fixture(scope="module")
def server(model_path, hf, tmp_path_factory):
    """The module's vLLM server with LoRA enabled (room for four adapters in a batch): its OpenAI base URL."""
    python = vllm_python()
    folder = tmp_path_factory.mktemp("vllm_lora")
    from ajet.backbones.debug.role_adapters import base_state_dict

    served = serving_folder(model_path, folder / "model", base_state_dict(hf[1]))
    srv = VLLMServer(str(served), folder / "vllm.log", python=python, kv_cache_gb=1, max_model_len=1024,
                     max_num_seqs=16, lora_rank=RANK, max_loras=4, start_timeout_s=START_LIMIT_S)
    yield srv.start()
    srv.stop()


@pytest.fixture(scope="module")
def prompts(hf) -> list[list[int]]:
    """Short plain-text prompts (few tokens: the checks' forwards stay cheap on a loaded CPU)."""
    return [hf[0].encode(q, add_special_tokens=False) for q in PROMPTS]


def _randomize(model, seed: int, adapter: str = "default") -> dict[str, torch.Tensor]:
    """Give adapter `adapter`'s B matrices seeded random values (large enough to change greedy answers); returns
    the adapter's LoRA weights as set (name -> copy)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{adapter}." in n}


def _set(model, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def _greedy_under(model, prompts: list[list[int]], completions: list, tol: float = 1e-3) -> list[bool]:
    """For each (prompt, completion): whether every completion token is the most likely next token (within `tol`
    nats) under `model` (transformers + peft, its active adapter) after the prompt and the tokens before it, i.e.
    a greedy completion of that model. One forward over all of them (right-padded rows)."""
    rows = [p + c.token_ids for p, c in zip(prompts, completions)]
    width = max(map(len, rows))
    x = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logprobs = model(input_ids=x, attention_mask=mask).logits.float().log_softmax(-1)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        lp = logprobs[i, len(p) - 1:len(p) - 1 + len(c.token_ids)]
        chosen = lp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        out.append(bool((chosen >= lp.max(-1).values - tol).all()))
    return out


def _listed(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/models", timeout=60) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def _wait_unlisted(url: str, name: str, limit_s: float = 120) -> bool:
    """Whether `name` leaves the server's /v1/models within `limit_s` seconds (the unload runs in a thread)."""
    deadline = time.monotonic() + limit_s
    while name in _listed(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _write(model, names=("default",)):
    return lambda folder: save_adapters(model, folder, list(names))


class _Loop:
    """An event loop on its own thread (a proxy's), which `block()` (called on it) blocks until `release()`: the
    calls running on it stay in flight (admitted, not finished) for as long as it is blocked."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._held, self._go = threading.Event(), threading.Event()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def block(self) -> None:
        """Block the loop (called on it) until `release`."""
        self._held.set()
        self._go.wait(600)

    def release(self) -> None:
        self._go.set()

    def close(self, engine: VLLMEngine) -> None:
        self.release()
        self.submit(engine.pool.aclose()).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _start_calls(engine: VLLMEngine, loop: _Loop, prompts, n_tokens: int, hold: bool = False):
    """One plain call and one stream per prompt, greedy, on `loop`; returns their futures once every stream has its
    first tokens. With `hold`, the stream whose first tokens come last blocks the loop right then (`_Loop.block`):
    that stream at least cannot finish until `loop.release()`."""
    firsts = [threading.Event() for _ in prompts]

    def first_tokens(delta, event):
        event.set()
        if hold and all(e.is_set() for e in firsts) and not loop._held.is_set():
            loop.block()

    futures = []
    for p, first in zip(prompts, firsts):
        futures.append(loop.submit(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=2 * n_tokens))))
        futures.append(loop.submit(engine.generate(p, SamplingParams(temperature=0.0, max_tokens=n_tokens),
                                                   on_tokens=lambda delta, e=first: first_tokens(delta, e))))
    assert loop._held.wait(600) if hold else all(e.wait(600) for e in firsts)
    return futures


def test_a_lora_swap_with_calls_and_streams_in_flight(server, hf, prompts, tmp_path):
    """Calls and streams admitted under version 0 stay in flight while version 1 is loaded: all finish, answered by
    version 0's adapter; the calls admitted after the load are answered by version 1's. Each records its version."""
    _, model = hf
    engine = VLLMEngine([server], SERVED_NAME, tmp_path / "w", adapters=["default"])
    old_loop, new_loop = _Loop(), _Loop()
    try:
        v0 = _randomize(model, 1)
        engine.sync_adapters(_write(model), 0)
        v1 = _randomize(model, 2)
        in_flight = _start_calls(engine, old_loop, prompts, n_tokens=12, hold=True)
        unfinished = sum(not f.done() for f in in_flight)   # these cannot finish before the load below
        figures = engine.sync_adapters(_write(model), 1)
        after = _start_calls(engine, new_loop, prompts, n_tokens=6)
        old_loop.release()
        old = [f.result(600) for f in in_flight]
        new = [f.result(600) for f in after]
    finally:
        old_loop.close(engine)
        new_loop.close(engine)
        engine.close()
    assert unfinished >= 1          # the stream holding the loop at least
    assert figures["weight_sync_s"] >= figures["weight_save_s"] + figures["weight_reload_s"] > 0
    ps = [p for p in prompts for _ in range(2)]           # each prompt: a plain call, then a stream
    assert [c.policy_version for c in old] == [0] * len(old) and [c.policy_version for c in new] == [1] * len(new)
    _set(model, v0)
    assert _greedy_under(model, ps + ps, old + new) == [True] * len(old) + [False] * len(new)
    _set(model, v1)
    assert _greedy_under(model, ps + ps, old + new) == [False] * len(old) + [True] * len(new)


def test_b_an_old_version_is_unloaded_once_its_calls_have_finished(server, hf, prompts, tmp_path):
    _, model = hf
    engine = VLLMEngine([server], SERVED_NAME, tmp_path / "w", adapters=["default"])
    loop = _Loop()
    try:
        _randomize(model, 3)
        engine.sync_adapters(_write(model), 0)
        name0, name1 = engine.served_name("default", 0), engine.served_name("default", 1)
        stream = loop.submit(engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=32),
                                             on_tokens=lambda delta: loop.block()))    # held at its first tokens
        assert loop._held.wait(600)
        engine.sync_adapters(_write(model), 1)
        engine._unloader.submit(lambda: None).result(60)   # any unload already asked for has run (one FIFO thread)
        while_held = _listed(server)
        loop.release()
        assert stream.result(600).policy_version == 0
        gone = _wait_unlisted(server, name0)
        engine._unloader.submit(lambda: None).result(60)   # the unload (unlisted first, folder removed last) is done
        after = _listed(server)
        folders = sorted(p.name for p in (tmp_path / "w").iterdir())
    finally:
        loop.close(engine)
        engine.close()
    assert {name0, name1} <= while_held          # still named by calls in flight: still loaded
    assert gone and name1 in after
    assert folders == [f"{engine.run_id}-v1"]    # the drained version's folder is gone too


def test_c_names_are_never_reused_by_a_resumed_run_or_a_version_served_again(server, hf, prompts, tmp_path):
    """A run that died with its adapters loaded, then its resume against the same server (which loads version 0,
    then the checkpoint's version 1, as the debug backbone does), then a checkpoint restored over a newer version:
    every load gets a name of its own, and each call is answered by the adapter loaded last."""
    _, model = hf
    first = VLLMEngine([server], SERVED_NAME, tmp_path / "w1", adapters=["default"])
    resumed = VLLMEngine([server], SERVED_NAME, tmp_path / "w2", adapters=["default"])
    names = []
    try:
        for version, seed in [(0, 4), (1, 5)]:
            _randomize(model, seed)
            first.sync_adapters(_write(model), version)      # never closed: its names stay loaded, as after a crash
            names.append(first.served_name("default", version))
        for version, seed in [(0, 6), (1, 7), (2, 8)]:
            weights = _randomize(model, seed)
            resumed.sync_adapters(_write(model), version)
            names.append(resumed.served_name("default", version))
        again = _randomize(model, 9)
        resumed.sync_adapters(_write(model), 1)              # version 1's checkpoint restored over version 2
        names.append(resumed.served_name("default", 1))
        answer = asyncio.run(resumed.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8)))
        asyncio.run(resumed.pool.aclose())
    finally:
        resumed.close()
        first.close()
    assert len(set(names)) == len(names) == 6, names
    assert resumed.served_names == [] and names[-1] not in _listed(server)     # closed: unloaded (a server of yours)
    assert answer.policy_version == 1
    _set(model, again)
    assert _greedy_under(model, prompts[:1], [answer]) == [True]
    _set(model, weights)
    assert _greedy_under(model, prompts[:1], [answer]) == [False]


def test_d_each_agent_role_is_answered_by_its_own_adapter(server, model_path, prompts, tmp_path):
    """`agents:` through the debug backbone with `engine.urls`: its adapters (`default` and `planner`) loaded as
    `<run>-<adapter>-v<N>` at start and after an update; a call is answered by its role's adapter (an unlisted role
    and a call without a role by `default`)."""
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    cfg = AjetConfig.model_validate({
        "data": {"train_path": "unused.jsonl"}, "model": {"path": model_path, "max_model_len": 1024},
        "trainer": {"exp_dir": str(tmp_path / "exp")}, "agents": {"planner": {"lora": {"r": RANK}}},
        "engine": {"kind": "vllm", "urls": [server]}})
    backbone = DebugBackbone(cfg)
    try:
        engine = backbone.engine
        at_start = set(engine.served_names)
        _randomize(backbone.model, 10, "planner")
        _randomize(backbone.model, 11, "default")
        backbone._publish_weights(1)
        listed = _listed(server)

        async def call(role: str | None, prompt: list[int]):
            token = set_calling_agent(role)
            try:
                return await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))
            finally:
                reset_calling_agent(token)

        async def calls():
            out = await asyncio.gather(*[call(role, p) for role in ("planner", "critic", None) for p in prompts])
            await engine.pool.aclose()
            return out

        answers = asyncio.run(calls())
        run = engine.run_id
    finally:
        backbone.close()
    assert at_start == {f"{run}-default-v0", f"{run}-planner-v0"}
    assert {f"{run}-default-v1", f"{run}-planner-v1"} <= listed
    assert all(a.policy_version == 1 for a in answers)
    model = backbone.model.eval()
    n = len(prompts)          # answers: planner's calls, then the unlisted role's and the role-less ones (`default`)
    model.set_adapter("planner")
    assert _greedy_under(model, prompts * 3, answers) == [True] * n + [False] * 2 * n
    model.set_adapter("default")
    assert _greedy_under(model, prompts * 3, answers) == [False] * n + [True] * 2 * n


def test_a_lora_rank_vllm_cannot_serve_is_a_config_error(tmp_path):
    """No server needed: refused before any start."""
    from ajet.config import AjetConfig
    from ajet.engines.vllm import vllm_engine
    from ajet.errors import ConfigError

    cfg = AjetConfig.model_validate({
        "data": {"train_path": "unused.jsonl"}, "model": {"path": "unused", "lora": {"r": 1024}},
        "trainer": {"exp_dir": str(tmp_path)},
        "engine": {"kind": "vllm", "python": str(tmp_path / "no-venv" / "python")}})
    with pytest.raises(ConfigError, match="model.lora.rank"):
        vllm_engine(cfg, "unused", {}, write_adapters=lambda folder: None)


def test_e_the_gateway_answers_through_vllm_while_it_trains(server, model_path, tmp_path):
    """`ajet gateway` over vLLM with `model.lora` (the debug backbone with `engine.urls`, the gateway's front on
    127.0.0.1, its gate): a request sent while the update is held inside its backward pass is answered at once, by
    version 0; once the update is published (its adapter loaded as `<run>-v1`), the next request is answered by
    version 1. Which version answered is checked against transformers + peft greedy forwards of the trainer's
    adapter before and after the update, not taken from the headers alone."""
    from ajet.config import AjetConfig
    from tests.test_gateway_serve_while_training import _chat, answered_while_update_in_backward, live_gateway

    cfg = AjetConfig.model_validate({
        "workflow": "x:y", "data": {"train_path": "unused.jsonl"}, "rollout": {"max_tokens": 8},
        "algorithm": {"micro_batch_tokens": 64, "lr": 0.05}, "trainer": {"exp_dir": str(tmp_path / "exp")},
        "gateway": {"gate": {"mode": "off"}}, "engine": {"kind": "vllm", "urls": [server]},
        "model": {"path": model_path, "max_model_len": 1024, "lora": {"rank": RANK}}})
    with live_gateway(cfg, tmp_path) as (url, bb, gate):
        trained = next(p for p in bb.model.parameters() if p.requires_grad)
        before = {n: p.detach().clone() for n, p in bb.model.named_parameters() if p.requires_grad}
        _, updated = answered_while_update_in_backward(url, gate, trained)
        assert bb.engine.policy_version == 1 and updated["value"]["weight_sync_s"] > 0
        after = _chat(url, "What is 2 plus 2?")
        assert after.status_code == 200 and after.headers["x-ajet-policy-version"] == "1", after.text
        run = bb.engine.run_id
        assert f"{run}-v1" in _listed(server)
    with sqlite3.connect(tmp_path / "gateway.sqlite") as db:
        calls = [json.loads(r[0]) for r in db.execute("SELECT record FROM calls")]
    assert [c["policy_version"] for c in calls] == [0, 1]
    prompt = calls[0]["prompt_ids"]
    assert calls[1]["prompt_ids"] == prompt
    answers = [SimpleNamespace(token_ids=c["completion_ids"]) for c in calls]
    model = bb.model.eval()
    assert _greedy_under(model, [prompt] * 2, answers)[1], "version 1's answer is not the trained adapter's greedy"
    _set(model, before)
    assert _greedy_under(model, [prompt] * 2, answers) == [True, False], "the update did not change the answer"
