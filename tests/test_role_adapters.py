"""A LoRA adapter per agent role (`agents:`), on the tiny model: the debug engine serves a batch that mixes adapters
exactly as each request alone; an update of one role leaves the other adapters bit-identical; a checkpoint holds
one peft folder per adapter (loadable by peft) and resume restores every adapter and its optimizer; the proxy
routes each agent's calls to its adapter (debug engine and RemoteEngine's `model`); a two-agent run logs
per-role figures; bad `agents:` config and the verl/trinity backbones are refused with the key named."""

import asyncio
import json
import textwrap

import pytest
import torch

peft = pytest.importorskip("peft")

from ajet.agent_adapters import adapter_router  # noqa: E402
from ajet.backbones.capabilities import check_supported  # noqa: E402
from ajet.backbones.debug.backbone import DebugBackbone  # noqa: E402
from ajet.config import AjetConfig, load_config  # noqa: E402
from ajet.engines.base import reset_calling_agent, set_calling_agent  # noqa: E402
from ajet.errors import ConfigError  # noqa: E402
from ajet.llm_call import SamplingParams  # noqa: E402
from ajet.tracker.sample import Sample  # noqa: E402
from tests.test_trainable_targets import WORKFLOW  # noqa: E402  (planner/solver: two agents, one sample each)

AGENTS = {"planner": {"lora": {"r": 4, "alpha": 8}}, "solver": {"lora": {"r": 2, "target_modules": ["q_proj"]}}}


def _backbone(model_dir, **algorithm):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, agents=AGENTS,
                     model={"path": model_dir, "device": "cpu", "max_model_len": 256},
                     algorithm={"lr": 5e-2, **algorithm})
    return DebugBackbone(cfg)


def _distinct_adapters(bb, seed=0):
    """Give every adapter its own random B (LoRA starts with B = 0, i.e. every adapter = the base model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bb.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _lora(bb, adapter):
    """{parameter name: a copy} of one adapter's LoRA weights."""
    return {n: p.detach().clone() for n, p in bb.model.named_parameters() if f".{adapter}." in n and "lora_" in n}


async def _generate(bb, tag, prompt, seed):
    token = set_calling_agent(tag)
    try:
        return await bb.engine.generate(prompt, SamplingParams(max_tokens=6, seed=seed))
    finally:
        reset_calling_agent(token)


def _samples(bb, tag, prompts, first=0):
    """One completion per prompt from `tag`'s adapter -> samples with advantages +1 / -1 alternating."""
    async def go():
        return await asyncio.gather(*(_generate(bb, tag, p, 100 + i) for i, p in enumerate(prompts)))

    out = []
    for i, (p, c) in enumerate(zip(prompts, asyncio.run(go()))):
        n = len(c.token_ids)
        out.append(Sample(episode_id=f"{tag}-e{first + i}", group_id=f"g:{tag}", agent_tag=tag, call_ids=["c"],
                          prompt_ids=p, response_ids=list(c.token_ids), loss_mask=[1] * n,
                          old_logprobs=list(c.logprobs), policy_versions=[c.policy_version] * n,
                          advantage=1.0 if i % 2 == 0 else -1.0))
    return out


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


def test_a_batch_mixing_adapters_gives_each_row_what_it_gets_alone(tiny_model_dir):
    bb = _backbone(tiny_model_dir)
    seen: list[list[str]] = []
    real = bb.engine._adapters
    bb.engine._adapters = lambda reqs: (seen.append(list(real(reqs)["adapter_names"])), real(reqs))[1]
    bb.engine.batch_wait_s = 2.0                       # the requests below are admitted together, even under load
    try:
        _distinct_adapters(bb)
        calls = [(tag, p, 7 + i) for i, p in enumerate(PROMPTS[:2]) for tag in ("planner", "solver", "critic")]

        async def together():
            return await asyncio.gather(*(_generate(bb, *c) for c in calls))

        mixed = asyncio.run(together())
        alone = []
        for c in calls:                                  # each alone: an empty prefix cache, a batch of one
            bb.engine.prefix_cache.clear()
            alone.append(asyncio.run(_generate(bb, *c)))
        for (tag, _, _), m, a in zip(calls, mixed, alone):
            assert m.token_ids == a.token_ids, tag
            torch.testing.assert_close(torch.tensor(m.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
        assert any(len(set(names)) == 3 for names in seen)      # one decode step served all three adapters
        assert {n for names in seen for n in names} == {"planner", "solver", "default"}   # critic: not listed
        # the adapters really differ: the same prompt and seed score differently under each
        by_tag = {tag: m for (tag, p, _), m in zip(calls, mixed) if p == PROMPTS[0]}
        assert abs(by_tag["planner"].logprobs[0] - by_tag["solver"].logprobs[0]) > 1e-3
        assert abs(by_tag["planner"].logprobs[0] - by_tag["critic"].logprobs[0]) > 1e-3
    finally:
        bb.close()


def test_an_update_of_one_role_leaves_the_other_adapters_bit_identical(tiny_model_dir):
    bb = _backbone(tiny_model_dir)
    try:
        base = {n: p.detach().clone() for n, p in bb.model.named_parameters() if "lora_" not in n}
        before = {a: _lora(bb, a) for a in ("default", "planner", "solver")}
        metrics = bb.update(_samples(bb, "planner", PROMPTS))
        after = {a: _lora(bb, a) for a in ("default", "planner", "solver")}
        assert any(not torch.equal(after["planner"][k], v) for k, v in before["planner"].items())
        for other in ("default", "solver"):
            assert all(torch.equal(after[other][k], v) for k, v in before[other].items()), other
            assert bb.optimizers[other].state == {}                     # its optimizer never stepped
        assert all(torch.equal(p, base[n]) for n, p in bb.model.named_parameters() if "lora_" not in n)
        assert metrics["train/planner/optimizer_steps"] == 1.0 and "train/solver/loss" not in metrics
        assert bb.engine.policy_version == 1

        # one update with both roles (and an unlisted one, trained into `default`) moves every adapter once
        mixed = _samples(bb, "solver", PROMPTS, 10) + _samples(bb, "planner", PROMPTS, 20) + \
            _samples(bb, "critic", PROMPTS[:2], 30)
        metrics = bb.update(mixed)
        moved = {a: _lora(bb, a) for a in ("default", "planner", "solver")}
        for a in ("default", "planner", "solver"):
            assert any(not torch.equal(moved[a][k], v) for k, v in after[a].items()), a
            assert f"train/{a}/loss" in metrics and f"train/{a}/grad_norm" in metrics
        assert metrics["optimizer_steps"] == 3.0 and bb.engine.policy_version == 2
    finally:
        bb.close()


def test_resume_restores_every_adapter_and_its_optimizer_and_peft_loads_each(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    bb = _backbone(tiny_model_dir)
    try:
        bb.update(_samples(bb, "planner", PROMPTS) + _samples(bb, "solver", PROMPTS, 10))
        bb.save_checkpoint(tmp_path / "ckpt")
        saved = {a: _lora(bb, a) for a in ("default", "planner", "solver")}
        moments = {a: [s["exp_avg"].clone() for s in bb.optimizers[a].state.values()] for a in ("planner", "solver")}
        nxt = _samples(bb, "planner", PROMPTS, 40) + _samples(bb, "solver", PROMPTS, 50)
        bb.update(nxt)
        continued = {a: _lora(bb, a) for a in ("planner", "solver")}
        ids = PROMPTS[0] + [20, 21, 22]
        bb.model.eval()
        with torch.no_grad():
            served = {a: bb.model(input_ids=torch.tensor([ids]), adapter_names=[a]).logits[0]
                      for a in ("planner", "solver")}
    finally:
        bb.close()

    for a in ("default", "planner", "solver"):   # one peft folder per adapter, as vLLM --lora-modules reads it
        folder = tmp_path / "ckpt" / "adapters" / a
        assert (folder / "adapter_model.safetensors").is_file()
        assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert json.loads((tmp_path / "ckpt" / "adapters" / "planner" / "adapter_config.json").read_text())["r"] == 4

    resumed = _backbone(tiny_model_dir)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        for a in ("default", "planner", "solver"):
            got = _lora(resumed, a)
            assert got.keys() == saved[a].keys() and all(torch.equal(got[k], v) for k, v in saved[a].items()), a
        for a in ("planner", "solver"):
            restored = [s["exp_avg"] for s in resumed.optimizers[a].state.values()]
            assert len(restored) == len(moments[a]) and all(torch.equal(x, y) for x, y in zip(restored, moments[a]))
        assert resumed.engine.policy_version == 1
        resumed.update(nxt)        # the same next update as the run that went on: the same weights
        for a in ("planner", "solver"):
            got = _lora(resumed, a)
            assert all(torch.equal(got[k], v) for k, v in continued[a].items()), a
    finally:
        resumed.close()

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")      # the base model, unmerged
    for a in ("planner", "solver"):
        # each adapter as saved before the last update: compare with the checkpoint's own weights, served by peft
        with_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt"),
                                                   tmp_path / "ckpt" / "adapters" / a).eval()
        with torch.no_grad():
            logits = with_peft(input_ids=torch.tensor([ids])).logits[0]
            plain = base(input_ids=torch.tensor([ids])).logits[0]
        assert not torch.allclose(logits, plain, atol=1e-4)               # the adapter is there
        assert not torch.allclose(logits, served[a], atol=1e-6)           # (served[a] is one update later)
        checker = _backbone(str(tmp_path / "ckpt"))     # model.path = the checkpoint: its adapters are loaded
        try:
            checker.model.eval()
            with torch.no_grad():
                mine = checker.model(input_ids=torch.tensor([ids]), adapter_names=[a]).logits[0]
            torch.testing.assert_close(logits, mine, atol=1e-5, rtol=0)
        finally:
            checker.close()


def test_the_proxy_routes_each_agent_to_its_adapter_in_the_remote_engine_model(tokenizer):
    import openai

    from ajet.proxy.server import ProxyServer
    from ajet.engines.remote import RemoteEngine
    from benchmarks.instant_engine_server import InstantServer

    reply = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
    server = InstantServer.start(reply, [tokenizer.decode([t]) for t in reply[:-1]] + [""], max_model_len=512)
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, agents=AGENTS)
    engine = RemoteEngine(server.url + "/v1", "base-model", adapter_for=adapter_router(cfg))
    proxy = ProxyServer(engine, tokenizer, SamplingParams(max_tokens=8)).start()
    try:
        ep = proxy.open_episode("ep-roles")
        root = ep.base_url[: -len("/v1")]
        for tag, want in (("planner", "planner"), ("solver", "solver"), ("critic", "default"), (None, "default")):
            url = f"{root}/agent/{tag}/v1" if tag else ep.base_url
            client = openai.OpenAI(base_url=url, api_key=ep.api_key, max_retries=0)
            client.chat.completions.create(model="anything", messages=[{"role": "user", "content": "hi"}])
            assert server.stats()["last_request"]["model"] == want, tag
        proxy.close_episode(ep)
        asyncio.run(engine.aclose())
    finally:
        proxy.stop()
        server.stop()


def test_a_two_agent_run_trains_an_adapter_per_role_and_logs_per_role_figures(tiny_model_dir, tmp_path):
    from ajet.trainer import run

    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"{i} + {i}?"}) + "\n"
                                                  for i in range(4)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:PlannerSolver
        model: {{path: "{tiny_model_dir}", max_model_len: 512}}
        agents: {{planner: {{lora: {{r: 4, alpha: 8}}}}, solver: {{lora: {{r: 2}}}}}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 4, max_tokens: 8, temperature: 1.0}}
        algorithm: {{lr: 1.0e-2}}
        trainer: {{total_steps: 1, tasks_per_step: 2, tensorboard: false, exp_dir: "{tmp_path / 'exp'}"}}
    """))
    exp = run(load_config(tmp_path / "conf.yaml"))
    m = json.loads((exp / "metrics.jsonl").read_text().splitlines()[0])
    assert m["rollout/planner/calls"] == m["rollout/solver/calls"] == 8
    assert m["tracker/planner/trained_samples"] == m["tracker/solver/trained_samples"] == 8
    assert m["reward/planner"] == m["reward/solver"] == pytest.approx(m["reward/mean"])   # one reward per episode
    assert "train/planner/loss" in m and "train/solver/loss" in m and "train/default/loss" not in m
    assert m["policy_version"] == 1
    ckpt = next((exp / "checkpoints").glob("step_*"))
    assert sorted(p.name for p in (ckpt / "adapters").iterdir()) == ["default", "planner", "solver"]
    samples = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    groups = {s["group_id"] for e in samples for s in e["samples"]}
    assert all(g.endswith((":planner", ":solver")) for g in groups)             # GRPO groups per role


@pytest.mark.parametrize("agents, key", [
    ({"plan/ner": {}}, "agents.plan/ner"),
    ({"planner": {"lora": {"rank": 0}}}, "agents.planner.lora.rank"),
    ({"planner": {"lora": {"r": 4, "rank": 4}}}, "agents.planner.lora"),
    ({"planner": {"lroa": {}}}, "agents.planner.lroa"),
    ({"mean": {}}, "agents.mean"),
])
def test_bad_agents_config_is_a_config_error_naming_the_key(tmp_path, agents, key):
    (tmp_path / "c.yaml").write_text(json.dumps({"workflow": "x:y", "data": {"train_path": "x"}, "agents": agents}))
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "c.yaml")
    assert key in str(err.value)


@pytest.mark.parametrize("backbone", ["verl", "trinity"])
def test_verl_and_trinity_refuse_agents(backbone):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, agents=AGENTS)
    with pytest.raises(ConfigError, match=r"agents=.*the \w+ backbone .*debug"):
        check_supported(cfg, backbone)
    check_supported(cfg, "debug")
    check_supported(AjetConfig(workflow="x:y", data={"train_path": "x"}), backbone)   # no agents: fine


def test_the_tutorial_comparison_differs_only_in_the_adapters():
    """guessing_game_adapters.yaml (an adapter per role) and guessing_game_shared.yaml (one adapter for both) run
    the same steps, seed, sampling and learning rate, per-role GRPO groups in both."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "tutorial" / "example_guessing_game"
    roles, shared = (load_config(folder / f"guessing_game_{v}.yaml") for v in ("adapters", "shared"))
    assert sorted(roles.agents) == ["describer", "guesser"] and roles.model.lora is None
    assert not shared.agents and shared.model.lora == roles.agents["guesser"].lora == roles.agents["describer"].lora
    assert shared.algorithm.group_by_agent_tag                    # agents: implies it
    for section in ("rollout", "trainer", "data", "eval"):
        a, b = getattr(roles, section).model_dump(), getattr(shared, section).model_dump()
        assert a == b, section
    assert roles.algorithm.model_dump(exclude={"group_by_agent_tag"}) == \
        shared.algorithm.model_dump(exclude={"group_by_agent_tag"})
    check_supported(roles, "debug")
