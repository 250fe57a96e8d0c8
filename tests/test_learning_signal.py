"""The learning signal end to end on the real tiny model: per-token sampling distributions (engine == trainer
logprobs on an episode at two temperatures), greedy calls, the GRPO baseline, and the update's accounting
(every episode trained, logprob_diff measured before any weight moves)."""

import copy

import openai
import pytest
import torch

from ajet.backbones.debug.backbone import DebugBackbone, _collate, token_logprobs
from ajet.config import AjetConfig
from ajet.algorithm.advantage import assign_advantages, grpo_advantages
from ajet.llm_call import LLMCall, SamplingParams
from ajet.proxy.server import ProxyServer
from ajet.tracker import merge_calls
from ajet.tracker.sample import Sample


def _backbone(model_dir, **algorithm):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": model_dir, "device": "cpu"},
                     algorithm={"micro_batch_tokens": 256, **algorithm})
    return DebugBackbone(cfg)


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    bb = _backbone(tiny_model_dir)
    yield bb
    bb.close()


def _trainer_logprobs(bb, samples):
    """`[num_samples][response_len]` the trainer's logprob of every response token (no grad)."""
    batch = _collate(samples, [1.0] * len(samples), bb.tokenizer.pad_token_id, bb.device)
    with torch.no_grad():
        lp, _ = token_logprobs(bb.model, batch["input_ids"], batch["attention_mask"], batch["temperatures"],
                               batch["top_ps"])
    return [lp[i, len(s.prompt_ids):len(s.input_ids)].tolist() for i, s in enumerate(samples)]


def _on_policy(bb, samples):
    """Set each sample's old logprobs to the current policy's (as a fresh rollout would record them)."""
    for s, lp in zip(samples, _trainer_logprobs(bb, samples)):
        s.old_logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]
    return samples


# ---- item 1: each token is scored under the distribution of the call that sampled it ----------------------
def test_engine_and_trainer_logprobs_agree_on_an_episode_at_two_temperatures_and_a_nucleus(backbone):
    proxy = ProxyServer(backbone.engine, backbone.tokenizer, SamplingParams(temperature=1.0, max_tokens=10),
                        sampling_policy="client", max_model_len=1024).start()
    try:
        ep = proxy.open_episode("ep-temps")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Say something."}]
        for temperature, top_p in ((0.3, 1.0), (1.0, 1.0), (0.8, 0.7)):
            r = client.chat.completions.create(model="policy", messages=messages, temperature=temperature,
                                               top_p=top_p, max_tokens=10)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    assert [(c.sampling.temperature, c.sampling.top_p) for c in calls] == [(0.3, 1.0), (1.0, 1.0), (0.8, 0.7)]
    (sample,) = merge_calls(calls, "g")   # token-in-token-out: the three calls chain into one sample
    n0, n1, n2 = (len(c.completion_ids) for c in calls)
    sampled = [i for i, m in enumerate(sample.loss_mask) if m]
    assert len(sampled) == n0 + n1 + n2
    assert [sample.temperatures[i] for i in sampled] == [0.3] * n0 + [1.0] * n1 + [0.8] * n2
    assert [sample.top_ps[i] for i in sampled] == [1.0] * (n0 + n1) + [0.7] * n2
    (trainer,) = _trainer_logprobs(backbone, [sample])
    engine = torch.tensor([sample.old_logprobs[i] for i in sampled])
    torch.testing.assert_close(torch.tensor([trainer[i] for i in sampled]), engine, rtol=0, atol=1e-4)
    # and the update's own measurement agrees: ratio 1 on fresh data
    sample.advantage = 1.0
    assert backbone.measure([sample])["logprob_diff"] < 1e-4


def _call(i, prompt, completion, temperature=1.0, top_p=1.0, tag="default"):
    return LLMCall(call_id=f"c{i}", episode_id="ep", agent_tag=tag, index=i, messages=[], tools=None,
                   prompt_ids=prompt, completion_ids=completion, completion_logprobs=[-0.5] * len(completion),
                   finish_reason="stop", response_message={"role": "assistant", "content": ""},
                   sampling=SamplingParams(temperature=temperature, top_p=top_p), policy_version=0)


def test_sample_temperature_and_top_p_come_from_the_call_that_sampled_each_token():
    c0 = _call(0, [1, 2, 3], [10, 11], temperature=0.3, top_p=0.9)
    c1 = _call(1, [1, 2, 3, 10, 11, 50, 51], [12, 13, 14], temperature=1.2, top_p=1.0)
    c2 = _call(2, [1, 2, 3], [10, 20], temperature=0.7, top_p=0.5)   # resampled after [10]: forks
    c3 = _call(3, [1, 2, 3, 10, 20, 60], [21], temperature=0.5)        # continues the fork
    main, fork = merge_calls([c0, c1, c2, c3], "g")
    assert main.temperatures == [0.3, 0.3, 1.0, 1.0, 1.2, 1.2, 1.2]
    assert main.top_ps == [0.9, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert fork.response_ids == [20, 60, 21] and fork.loss_mask == [1, 0, 1]
    assert fork.temperatures == [0.7, 1.0, 0.5] and fork.top_ps == [0.5, 1.0, 1.0]


def test_greedy_calls_are_recorded_but_not_trained_unless_configured(backbone):
    c0 = _call(0, [5, 6, 7], [10, 11], temperature=0.0)
    c1 = _call(1, [5, 6, 7, 10, 11, 40], [12, 13], temperature=1.0)
    (s,) = merge_calls([c0, c1], "g")
    assert s.response_ids == [10, 11, 40, 12, 13] and s.loss_mask == [0, 0, 0, 1, 1]
    assert s.flags["greedy_tokens"] == 2 and s.temperatures[:2] == [0.0, 0.0]
    (t,) = merge_calls([c0, c1], "g", train_greedy_calls=True)
    assert t.loss_mask == [1, 1, 0, 1, 1]
    # trained greedy tokens are scored at T = 1 (temperature 0 is not a distribution)
    at_one = copy.deepcopy(t)
    at_one.temperatures = [1.0] * len(t.response_ids)
    assert _trainer_logprobs(backbone, [t]) == _trainer_logprobs(backbone, [at_one])


def test_a_trained_greedy_call_with_a_nucleus_is_scored_as_the_engine_recorded_it(backbone):
    """train_greedy_calls with temperature 0 and top_p < 1: the engine records the argmax token's logprob
    under T = 1 without truncation; the trainer must score that same distribution, not the nucleus."""
    proxy = ProxyServer(backbone.engine, backbone.tokenizer, SamplingParams(temperature=1.0, max_tokens=8),
                        sampling_policy="client", max_model_len=1024).start()
    try:
        ep = proxy.open_episode("ep-greedy-top-p")
        client = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi."}],
                                       temperature=0.0, top_p=0.3, max_tokens=8)
        calls = proxy.close_episode(ep)
    finally:
        proxy.stop()
    (s,) = merge_calls(calls, "g", train_greedy_calls=True)
    sampled = [i for i, m in enumerate(s.loss_mask) if m]
    assert sampled and all(s.top_ps[i] == 0.3 and s.temperatures[i] == 0.0 for i in sampled)
    (trainer,) = _trainer_logprobs(backbone, [s])
    torch.testing.assert_close(torch.tensor([trainer[i] for i in sampled]),
                               torch.tensor([s.old_logprobs[i] for i in sampled]), rtol=0, atol=1e-4)


# ---- item 2: the GRPO baseline counts every trainable episode --------------------------------------------
def _s(ep, group="g", tag="default"):
    return Sample(episode_id=ep, group_id=group, agent_tag=tag, call_ids=["c"], prompt_ids=[1], response_ids=[2],
                  loss_mask=[1], old_logprobs=[-1.0], policy_versions=[0])


def test_baseline_counts_episodes_that_produced_no_trained_sample():
    rewards = {"e1": 1.0, "e2": 0.0, "e3": 0.0, "e4": 1.0}
    groups = {"e1": "g", "e2": "g", "e3": "g", "e4": "g"}   # e3, e4: no trained sample (e.g. a non-target agent)
    samples = [_s("e1"), _s("e2")]
    assign_advantages(samples, rewards, groups, eps=1e-6)
    want = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ["g"] * 4)
    assert [s.advantage for s in samples] == pytest.approx(want[:2].tolist())
    # per-agent-tag groups: every episode of the task joins each tag's group
    samples = [_s("e1", "g:a", "a"), _s("e2", "g:a", "a"), _s("e1", "g:b", "b")]
    assign_advantages(samples, rewards, groups, eps=1e-6)
    assert [s.advantage for s in samples] == pytest.approx([want[0].item(), want[1].item(), want[0].item()])


# ---- items 5 and 9: the update trains every episode and measures drift before weights move ----------------
def _episodes(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 200, (6,), generator=g).tolist()
        resp = torch.randint(3, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(episode_id=f"e{i}", group_id="g", agent_tag="default", call_ids=["c"], prompt_ids=prompt,
                          response_ids=resp, loss_mask=[1] * len(resp), old_logprobs=[0.0] * len(resp),
                          policy_versions=[0] * len(resp), temperatures=[0.6 + 0.1 * (i % 3)] * len(resp),
                          advantage=1.0 if i % 2 else -1.0))
    return out


def test_update_trains_every_episode_and_measures_logprob_diff_before_weights_move(tiny_model_dir):
    bb = _backbone(tiny_model_dir, mini_batches=3, ppo_epochs=2, lr=1e-2)
    try:
        samples = _on_policy(bb, _episodes(6, seed=0))
        entropy_before = bb.measure(samples)["entropy"]
        seen = []
        real = bb.accumulate_gradients
        bb.accumulate_gradients = lambda mb: seen.append(sorted(s.episode_id for s in mb)) or real(mb)
        stats = bb.update(samples)
    finally:
        bb.close()
    assert stats["optimizer_steps"] == 6.0 and len(seen) == 6
    # each epoch covers every episode exactly once, spread over the 3 mini-batches
    for epoch in (seen[:3], seen[3:]):
        assert sorted(e for mb in epoch for e in mb) == [f"e{i}" for i in range(6)]
    # fresh on-policy data: later mini-batches' drift (lr 1e-2) is not reported as rollout/trainer disagreement
    assert stats["logprob_diff"] < 1e-5
    assert stats["entropy"] == pytest.approx(entropy_before, rel=1e-5)


def test_each_episode_of_a_mini_batch_contributes_its_share(backbone):
    samples = _on_policy(backbone, _episodes(3, seed=1))

    def grads(ss):
        backbone.model.zero_grad(set_to_none=True)
        backbone.accumulate_gradients(ss)
        g = torch.cat([p.grad.flatten() for p in backbone.model.parameters() if p.grad is not None]).clone()
        backbone.model.zero_grad(set_to_none=True)
        return g

    each = [grads([s]) for s in samples]
    assert all(g.abs().sum() > 0 for g in each)   # on-policy: no token is clipped away
    torch.testing.assert_close(grads(samples), sum(each) / 3, rtol=1e-4, atol=1e-7)


def test_episode_weight_counts_a_forked_episode_once_or_each_sample(backbone):
    # e0 forked into two samples, e1 is one: seq-mean-token-sum weighs every token 1/S
    samples = _on_policy(backbone, _episodes(3, seed=2))
    samples[1].episode_id = "e0"
    tokens = sum(s.num_loss_tokens for s in samples)
    alg = backbone.cfg.algorithm
    alg.loss_agg_mode = "seq-mean-token-sum"
    try:
        by_episode = backbone.accumulate_gradients(samples)["weight_sum"]
        alg.episode_weight = "sample"
        by_sample = backbone.accumulate_gradients(samples)["weight_sum"]
    finally:
        alg.loss_agg_mode, alg.episode_weight = "seq-mean-token-mean", "episode"
        backbone.model.zero_grad(set_to_none=True)
    assert by_episode == pytest.approx(tokens / 2)    # S = 2 episodes
    assert by_sample == pytest.approx(tokens / 3)     # S = 3 samples (verl's per-row semantics)


def test_algorithm_config_names_the_loss_choices():
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": "m"},
                     algorithm={"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm",
                                "loss_scale_factor": 96})            # Dr. GRPO: both changes
    assert cfg.algorithm.clip_ratio_c == 3.0 and cfg.algorithm.train_greedy_calls is False
    assert AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": "m"}).algorithm.loss_agg_mode \
        == "seq-mean-token-mean"
    for bad in ({"loss_agg_mode": "seq-mean"}, {"clip_ratio_c": 1.0}, {"loss_scale_factor": 0}):
        with pytest.raises(Exception, match=next(iter(bad))):
            AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": "m"}, algorithm=bad)


# ---- models that scale their logits after the LM head ------------------------------------------------------
def _scaled_model(kind):
    import transformers

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "granite":   # logits / logits_scaling
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(logits_scaling=0.125, **common)).eval()
    return transformers.CohereForCausalLM(transformers.CohereConfig(logit_scale=8.0, **common)).eval()   # logits * scale


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_models_that_scale_logits_after_the_head_get_ratio_one_on_fresh_data(kind):
    """The engine samples from the model's own forward (`model(...).logits`, scaling included); the update's
    head must give the same logprobs, or the PPO ratio is off on fresh data."""
    from ajet.sampling_dist import processed_logprobs

    model = _scaled_model(kind)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    temps, tops = torch.full((2, 12), 0.7), torch.ones((2, 12))   # random ids: a nucleus would drop most of them
    with torch.no_grad():
        engine = processed_logprobs(model(input_ids=ids).logits[:, :-1], temps[:, 1:], tops[:, 1:])   # [2, 11, V]
        engine = engine.gather(-1, ids[:, 1:, None]).squeeze(-1)
        trainer, _ = token_logprobs(model, ids, torch.ones_like(ids), temps, tops)
    assert engine.std() > 0.5                    # the scaling matters: a sharp distribution, far from uniform
    torch.testing.assert_close(trainer[:, 1:], engine, rtol=0, atol=1e-5)


# ---- the trainer's own call of the baseline --------------------------------------------------------------
NO_CALL_WORKFLOW = '''
from ajet.workflow import Workflow, WorkflowOutput


class FirstRepeatAnswersAlone(Workflow):
    """Repeat 0 answers without calling the policy (reward 1, no sample); the others call it (reward 0)."""

    async def execute(self, task, tuner):
        if tuner.episode_id.endswith("-r0"):
            return WorkflowOutput(reward=1.0, final_answer="known")
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        return WorkflowOutput(reward=0.0, final_answer=r.choices[0].message.content or "")
'''


def test_the_trainers_baseline_counts_an_episode_that_made_no_call(tiny_model_dir, tmp_path):
    import json

    from ajet.trainer import run

    (tmp_path / "wf.py").write_text(NO_CALL_WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text('{"task_id": "t0", "query": "Say hi."}\n')
    cfg = AjetConfig(workflow="wf.py:FirstRepeatAnswersAlone", config_dir=str(tmp_path),
                     data={"train_path": str(tmp_path / "tasks.jsonl")},
                     model={"path": tiny_model_dir, "max_model_len": 256},
                     rollout={"num_repeat": 3, "max_tokens": 4}, algorithm={"lr": 1e-3},
                     trainer={"total_steps": 1, "tasks_per_step": 1, "tensorboard": False,
                              "exp_dir": str(tmp_path / "exp")})
    exp = run(cfg)
    rows = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    advantages = {r["episode_id"][-2:]: [s["advantage"] for s in r["samples"]] for r in rows}
    # rewards 1, 0, 0: mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3); A = (0 - 1/3) sqrt(3)
    # (with only the episodes that have samples, the group would be 0, 0 and every advantage 0)
    assert advantages["r0"] == []
    assert advantages["r1"] == pytest.approx([-1 / 3 ** 0.5], abs=1e-5)
    assert advantages["r2"] == pytest.approx([-1 / 3 ** 0.5], abs=1e-5)


# ---- an update while a completion decodes -----------------------------------------------------------------
# ---- on-policy distillation -------------------------------------------------------------------------------
def test_distillation_moves_the_student_towards_the_teacher_on_its_own_tokens(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    teacher.save_pretrained(tmp_path / "teacher")
    bb = _backbone(tiny_model_dir, lr=3e-3, distill={"teacher": str(tmp_path / "teacher"), "mode": "replace"})
    try:
        samples = _episodes(4, seed=4)
        for s in samples:
            s.advantage = 0.0                      # no RL signal: only the teacher moves the student
        kls = []
        for _ in range(4):
            kls.append(bb.update(_on_policy(bb, samples))["distill/kl"])
    finally:
        bb.close()
    assert kls[0] > 0.05                           # the perturbed teacher disagrees ...
    assert kls[-1] < 0.7 * kls[0], kls             # ... less and less after each update
    same = _backbone(tiny_model_dir, distill={"teacher": tiny_model_dir})
    try:
        assert abs(same.update(_on_policy(same, _episodes(2, seed=5)))["distill/kl"]) < 1e-4   # teacher = student
    finally:
        same.close()
