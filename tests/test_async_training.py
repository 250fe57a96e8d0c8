"""Issue 21 item 4, asynchronous training: weights swap between decode steps of a completion in flight,
each token records the version that sampled it; stale samples are dropped and counted; the truncated
importance-sampling weight of the loss; the trainer's rollouts run ahead of the update by at most
`trainer.async.max_staleness` steps."""

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.backbones.debug.backbone import token_logprobs
from ajet.engines.in_process import HFEngine
from ajet.llm_call import SamplingParams


def test_an_update_lands_between_decode_steps_of_a_completion_in_flight(tiny_model_dir):
    """The update takes the weights while a 60-token completion is at its 10th token (it does not wait for the
    engine to run out of work); the completion finishes whole; each token records the version that sampled
    it (0 before the update, 1 after); the tokens before the swap have the old weights' logprobs, the ones
    after do not (the new weights sampled them)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    old_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = HFEngine(model, [], tok.pad_token_id, max_batch_size=4, max_model_len=256)   # no end-of-turn: 60 tokens
    prompt = tok.encode("tell me a long story", add_special_tokens=False)
    seen, swapped_at = [], []
    tenth = threading.Event()

    def on_tokens(delta):
        seen.extend(delta.token_ids)
        if len(seen) >= 10:
            tenth.set()

    def update():
        tenth.wait(timeout=60)
        with eng.weights_lock:                       # what DebugBackbone.update takes
            swapped_at.append(len(seen))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            eng.policy_version += 1

    try:
        updater = threading.Thread(target=update)
        updater.start()
        out = asyncio.run(eng.generate(prompt, SamplingParams(temperature=1.0, max_tokens=60, seed=5), on_tokens))
        updater.join(timeout=60)
    finally:
        eng.close()
    assert out.finish_reason == "length" and len(out.token_ids) == 60 and len(out.logprobs) == 60
    k = swapped_at[0]
    assert 10 <= k < 60                              # the update came while the completion was in flight
    assert out.policy_version == 0
    assert out.token_versions is not None
    n_old = out.token_versions.count(0)
    assert out.token_versions == [0] * n_old + [1] * (60 - n_old) and 10 <= n_old < 60
    ids = torch.tensor([prompt + out.token_ids])
    lp_old, _ = token_logprobs(old_model, ids, torch.ones_like(ids), torch.tensor([[1.0]]))
    lp_old = lp_old[0, len(prompt):].tolist()
    assert lp_old[:n_old] == pytest.approx(out.logprobs[:n_old], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(lp_old[n_old:], out.logprobs[n_old:])) > 1e-2


# ---- the loss: truncated importance sampling ---------------------------------------------------------
def test_truncated_is_weights_by_hand():
    from ajet.algorithm.loss import truncated_is_weights

    prox = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    behaviour = torch.tensor([[-1.0, -1.0, -2.0, float("nan")]])       # the last one is masked out
    mask = torch.tensor([[1, 1, 1, 0]])
    w = truncated_is_weights(prox, behaviour, 2.0, mask)
    # exp(0) = 1; exp(-1) = 0.3679; exp(1.5) = 4.48 -> the cap 2; masked: 0
    assert w.tolist()[0] == pytest.approx([1.0, 0.36787944, 2.0, 0.0])
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(prox, behaviour, 0.0, mask)


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    from ajet.backbones.debug.backbone import DebugBackbone
    from ajet.config import AjetConfig

    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"},
                     trainer={"async": {"max_staleness": 2, "is_cap": 2.0}})
    bb = DebugBackbone(cfg)
    yield bb
    bb.close()


def _stale_samples(bb, shift):
    """Two samples whose behaviour logprobs are the current policy's minus `shift` (the engine that sampled
    them gave each token exp(-shift) times the probability the policy gives it now)."""
    from ajet.backbones.debug.backbone import _collate
    from ajet.tracker.sample import Sample

    g = torch.Generator().manual_seed(0)
    samples = [Sample(episode_id=f"e{i}", group_id="g", agent_tag="default", call_ids=["c"],
                      prompt_ids=torch.randint(3, 200, (8,), generator=g).tolist(),
                      response_ids=torch.randint(3, 200, (6,), generator=g).tolist(), loss_mask=[1] * 6,
                      old_logprobs=[0.0] * 6, policy_versions=[0] * 6, advantage=adv)
               for i, adv in enumerate((1.0, -0.5))]
    batch = _collate(samples, [1.0, 1.0], bb.tokenizer.pad_token_id, bb.device)
    with torch.no_grad():
        lp, _ = token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"],
                               score_mask=batch["loss_mask"])
    for i, s in enumerate(samples):
        s.old_logprobs = [x - shift for x in lp[i, 8:14].tolist()]
    return samples


def _grad(bb, samples, cap):
    bb.is_cap = cap
    bb.model.zero_grad(set_to_none=True)
    bb.accumulate_gradients(samples)
    g = torch.cat([p.grad.flatten() for p in bb.model.parameters() if p.grad is not None]).clone()
    bb.model.zero_grad(set_to_none=True)
    return g


def test_stale_tokens_are_weighted_by_the_truncated_importance_ratio(backbone):
    """On-policy samples give gradient G. The same tokens sampled by an older policy that gave them 1/1.5 of
    today's probability: the ratio is taken against today's policy (1: unclipped) and the loss weighted by
    1.5, so the gradient is 1.5 G; at 1/3 of today's probability the weight 3 is truncated to the cap, 2 G.
    Without the correction the PPO ratio against the stale logprobs (1.5) clips the positive-advantage sample
    away: another gradient."""
    bb = backbone
    on_policy = _grad(bb, _stale_samples(bb, 0.0), cap=None)
    assert on_policy.abs().sum() > 0
    stale = _stale_samples(bb, torch.log(torch.tensor(1.5)).item())
    torch.testing.assert_close(_grad(bb, stale, cap=2.0), 1.5 * on_policy, rtol=1e-3, atol=1e-6)
    very_stale = _stale_samples(bb, torch.log(torch.tensor(3.0)).item())
    torch.testing.assert_close(_grad(bb, very_stale, cap=2.0), 2.0 * on_policy, rtol=1e-3, atol=1e-6)
    # several optimizer steps per update: pi_prox from a no-grad pass before the first step, same gradient
    bb._prox = bb._proximal_logprobs(stale)
    try:
        torch.testing.assert_close(_grad(bb, stale, cap=2.0), 1.5 * on_policy, rtol=1e-3, atol=1e-6)
    finally:
        bb._prox = None
    uncorrected = _grad(bb, stale, cap=None)
    assert (uncorrected - 1.5 * on_policy).abs().max() > 0.1 * on_policy.abs().max()
    bb.is_cap = 2.0


# ---- the trainer: staleness bound -------------------------------------------------------------------
def _versions_sample(versions):
    from ajet.tracker.sample import Sample

    n = len(versions)
    return Sample(episode_id="e", group_id="g", agent_tag="default", call_ids=["c"], prompt_ids=[1],
                  response_ids=[2] * n, loss_mask=[int(v >= 0) for v in versions], old_logprobs=[0.0] * n,
                  policy_versions=versions)


def test_a_sample_with_a_token_older_than_max_staleness_is_dropped_and_counted():
    from ajet.trainer import _drop_stale

    fresh = _versions_sample([5, -1, 5])
    one_behind = _versions_sample([4, 4, -1, 5])            # its first call was served one version ago
    three_behind = _versions_sample([2, -1, 5, 5])          # an old first call, later calls fresh: still stale
    samples = [fresh, one_behind, three_behind]
    kept, m = _drop_stale(samples, 5, 1)
    assert kept == [fresh, one_behind]
    assert m == {"async/stale_samples": 1, "async/staleness_max": 1, "async/staleness_mean": 0.5}
    assert _drop_stale(samples, 5, 0)[0] == [fresh]
    assert _drop_stale(samples, 5, 3)[0] == samples
    assert _drop_stale(samples, 5, None)[0] == samples       # synchronous: nothing dropped


# ---- the trainer: rollouts run ahead of the update ----------------------------------------------------
LONG_TAIL = '''
import asyncio

from ajet.workflow import Workflow, WorkflowOutput


class LongTail(Workflow):
    """A call, a tool that sleeps 1 s on the tasks named slow*, a second call."""

    async def execute(self, task, tuner):
        messages = [{"role": "user", "content": task.query}]
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        await asyncio.sleep(1.0 if task.task_id.startswith("slow") else 0.0)
        messages.append({"role": "user", "content": "tool says 42"})
        r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
        text = r.choices[0].message.content or ""
        return WorkflowOutput(reward=float(len(text) % 3), final_answer=text)
'''


LONG_TAIL_COMMAND = '''
import json, sys, time
from openai import OpenAI

task = json.loads(sys.stdin.read())
client = OpenAI()                                    # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": task["query"]}]
r = client.chat.completions.create(model="ajet-policy", messages=messages)
time.sleep(1.0 if task["task_id"].startswith("slow") else 0.0)
messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "tool says 42"}]
r = client.chat.completions.create(model="ajet-policy", messages=messages)
text = r.choices[0].message.content or ""
print(json.dumps({"reward": len(text) % 3, "final_answer": text}))
'''


def _train_async(root, model_dir, k, steps=3, command=False):
    import json
    import sys
    import textwrap

    from ajet.config import load_config
    from ajet.trainer import run

    root.mkdir(parents=True, exist_ok=True)
    (root / "wf.py").write_text(LONG_TAIL)
    (root / "agent.py").write_text(LONG_TAIL_COMMAND)
    workflow = (f"{{command: [{json.dumps(sys.executable)}, agent.py], timeout_s: 120}}" if command
                else "wf.py:LongTail")
    (root / "tasks.jsonl").write_text("".join(json.dumps({"task_id": t, "query": f"q {t}"}) + "\n"
                                             for t in ("slow0", "fast1", "fast2", "slow3", "fast4", "fast5")))
    (root / "c.yaml").write_text(textwrap.dedent(f"""
        workflow: {workflow}
        model: {{path: "{model_dir}", max_model_len: 512}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: 2, max_tokens: 6}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, tensorboard: false, loggers: [jsonl], exp_dir: "{root / 'exp'}",
                   async: {{max_staleness: {k}}}}}
    """))
    exp = run(load_config(root / "c.yaml"))
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    calls = {}   # step -> policy versions of its calls
    for line in (exp / "trajectories.jsonl").read_text().splitlines():
        e = json.loads(line)
        calls.setdefault(e["step"], []).extend(c["policy_version"] for c in e["calls"])
    return metrics, calls


def test_with_max_staleness_1_the_next_steps_episodes_run_during_the_update(tiny_model_dir, tmp_path):
    """K = 1: step 2's episodes start with step 1's (before its update: version 0) and finish across it; step 3's
    start once step 1 is trained. Every step trains all its samples (none older than 1 version), with the
    importance-sampling weight in the loss. K = 0: each step's calls are all served by the previous step's
    weights (the synchronous loop)."""
    metrics, calls = _train_async(tmp_path / "k1", tiny_model_dir, 1)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert set(calls[1]) == {0}
    assert 0 in calls[2]                                   # served before step 1's update: ran during it
    assert min(calls[3]) >= 1
    assert all(m["async/stale_samples"] == 0 and m["async/staleness_max"] <= 1 for m in metrics)
    assert metrics[1]["async/staleness_max"] == 1
    assert all("train/is_weight_mean" in m for m in metrics)
    assert metrics[-1]["policy_version"] == 3

    metrics, calls = _train_async(tmp_path / "k0", tiny_model_dir, 0)
    assert {s: set(v) for s, v in calls.items()} == {1: {0}, 2: {1}, 3: {2}}
    assert all(m["async/staleness_max"] == 0 and "train/is_weight_mean" not in m for m in metrics)


def test_the_command_source_runs_ahead_too(tiny_model_dir, tmp_path):
    """The user's program per episode (`workflow: {command: ...}`), K = 1: step 2's programs run during step 1's
    update, as with a `Workflow` class."""
    metrics, calls = _train_async(tmp_path, tiny_model_dir, 1, steps=2, command=True)
    assert set(calls[1]) == {0} and 0 in calls[2]
    assert [m["async/staleness_max"] for m in metrics] == [0, 1] and metrics[-1]["rollout/failed"] == 0


def test_ajet_serve_drops_and_counts_a_sample_older_than_max_staleness(tiny_model_dir, tmp_path):
    """`ajet serve` with `trainer.async.max_staleness: 0`: an episode whose first call was served before step 1's
    update and that finishes after it is stored and counted in its group's baseline, but the sample of that
    first call is not trained (async/stale_samples); every trained sample is on-policy."""
    import json
    import textwrap
    import time

    from ajet.client import AjetClient, RunFinished
    from ajet.trajectory_store import TrajectoryStore
    from tests.test_serve import SECRET, Server

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "query": f"q {i}"}) + "\n"
                                                  for i in range(8)))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl}}
        rollout: {{num_repeat: 2, max_tokens: 4}}
        algorithm: {{lr: 1.0e-3}}
        trainer: {{total_steps: 2, tasks_per_step: 2, tensorboard: false, async: {{max_staleness: 0}}}}
    """))
    exp = tmp_path / "exp"
    server = Server(tmp_path / "conf.yaml", exp)
    client = AjetClient(server.url, secret=SECRET, retry_for_s=60)

    def one_call(ep):
        ep.openai().chat.completions.create(model=ep.model, messages=[{"role": "user", "content": ep.task["query"]}])

    try:
        held = client.begin()
        one_call(held)                                      # served by version 0
        deadline = time.monotonic() + 120
        while client.status()["policy_version"] < 1:        # other episodes complete step 1
            assert time.monotonic() < deadline and server.proc.poll() is None, server.output()
            ep = client.begin()
            one_call(ep)
            ep.finish(reward=float(len(ep.episode_id) % 2))
        one_call(held)                                      # served by version 1
        held.finish(reward=1.0)
        while True:                                         # the rest of step 2
            try:
                ep = client.begin()
            except RunFinished:
                break
            one_call(ep)
            ep.finish(reward=0.0)
        assert server.proc.wait(timeout=120) == 0, server.output()
    finally:
        client.close()
        if server.proc.poll() is None:
            server.proc.kill()
    metrics = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["async/stale_samples"] for m in metrics) >= 1
    assert all(m["async/staleness_max"] == 0 for m in metrics)
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        ledger = {e["episode_id"]: e for e in store.ledger()}
        assert ledger[held.episode_id]["trained_in"]         # its reward counted in its group ...
        (record,) = [r for r in store.episodes() if r["episode_id"] == held.episode_id]
        samples = [json.loads(r[0]) for r in store._db.execute("SELECT record FROM samples WHERE episode_id = ?",
                                                               (held.episode_id,))]
    finally:
        store.close()
    assert [c["policy_version"] for c in record["calls"]] == [0, 1]
    # ... the sample of its first call (the same prompt twice: two samples) is too old to train, the other trains
    assert sorted((min(v for v in s["policy_versions"] if v >= 0), s["trained"]) for s in samples) == \
        [(0, False), (1, True)]


def test_a_caller_whose_event_loop_is_gone_does_not_stop_the_engine(tiny_model_dir):
    """A request whose caller gave up and closed its event loop (a stopped proxy) while the request decodes:
    answering it must not kill the engine's worker; the next request is served."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = HFEngine(model, [], tok.pad_token_id, max_batch_size=4, max_model_len=256)
    prompt = tok.encode("hello", add_special_tokens=False)
    try:
        loop = asyncio.new_event_loop()

        async def submit() -> asyncio.Task:
            task = asyncio.ensure_future(eng.generate(prompt, SamplingParams(max_tokens=30)))
            await asyncio.sleep(0)       # the task runs up to its `await`: the request is in the engine's queue
            return task

        # the caller's loop closes with the request still pending, not cancelled (a cancelled request leaves its
        # row at once, see test_abandoned_calls.py): it still decodes, and its answer has nowhere to go
        loop.run_until_complete(submit())
        loop.close()
        deadline = time.monotonic() + 60
        while eng.generated_tokens < 30 or eng._rows:   # until it is answered (into the closed loop)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out = asyncio.run(asyncio.wait_for(eng.generate(prompt, SamplingParams(max_tokens=3)), 120))
        assert len(out.token_ids) == 3
    finally:
        eng.close()
