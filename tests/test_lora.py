"""LoRA in the debug backbone (tiny model): only the adapter trains, the engine serves the adapted policy
(engine logprobs = trainer logprobs), the KL reference is the base model (adapter disabled), and the
checkpoint loads with peft (adapter) and with transformers (merged)."""

import asyncio

import pytest
import torch

peft = pytest.importorskip("peft")

from ajet.backbones.debug.backbone import DebugBackbone  # noqa: E402
from ajet.config import AjetConfig  # noqa: E402
from ajet.llm_call import SamplingParams  # noqa: E402
from ajet.tracker.sample import Sample  # noqa: E402


def _backbone(model_dir):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"},
                     model={"path": model_dir, "device": "cpu", "max_model_len": 256,
                            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
                     algorithm={"lr": 5e-2, "kl_coef": 0.1})
    return DebugBackbone(cfg)


def _rollout(bb, prompts):
    """One engine completion per prompt -> samples with alternating advantages +1 / -1."""
    async def go():
        return await asyncio.gather(*(bb.engine.generate(p, SamplingParams(max_tokens=8)) for p in prompts))

    out = []
    for i, (p, c) in enumerate(zip(prompts, asyncio.run(go()))):
        n = len(c.token_ids)
        out.append(Sample(episode_id=f"e{i}", group_id="g", agent_tag="a", call_ids=["c"], prompt_ids=p,
                          response_ids=list(c.token_ids), loss_mask=[1] * n, old_logprobs=list(c.logprobs),
                          policy_versions=[c.policy_version] * n, advantage=1.0 if i % 2 == 0 else -1.0))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_lora_trains_serves_the_adapter_and_checkpoints(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    bb = _backbone(tiny_model_dir)
    try:
        assert isinstance(bb.model, peft.PeftModel) and bb.ref_model is None     # no second copy
        base_before = {k: v.clone() for k, v in bb.model.named_parameters() if not v.requires_grad}
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
        for step in range(3):
            samples = _rollout(bb, prompts)
            # the engine sampled from the adapted policy the trainer scores: same logprobs
            assert bb.measure(samples)["logprob_diff"] < 1e-5
            metrics = bb.update(samples)
            assert metrics["optimizer_steps"] == 1.0 and bb.engine.policy_version == step + 1
        # the adapter moved the policy away from the base model: the KL to the reference (adapter off) is > 0
        stats = bb.accumulate_gradients(_rollout(bb, prompts))
        bb.model.zero_grad(set_to_none=True)
        assert stats["kl"] > 1e-6
        assert all(torch.equal(v, base_before[k]) for k, v in bb.model.named_parameters() if not v.requires_grad)
        ids = prompts[0] + [20, 21, 22]
        adapted = _logits(bb.model, ids)
        with bb.model.disable_adapter():
            assert not torch.allclose(_logits(bb.model, ids), adapted, atol=1e-4)

        bb.save_checkpoint(tmp_path / "ckpt")
        with_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                                   tmp_path / "ckpt" / "adapter")
        torch.testing.assert_close(_logits(with_peft, ids), adapted, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")                 # plain transformers
        assert not any("lora" in k for k in merged.state_dict())
        torch.testing.assert_close(_logits(merged, ids), adapted, atol=1e-4, rtol=0)
    finally:
        bb.close()

    resumed = _backbone(tiny_model_dir)
    try:
        resumed.load_checkpoint(tmp_path / "ckpt")
        torch.testing.assert_close(_logits(resumed.model, ids), adapted, atol=0, rtol=0)
        assert resumed.engine.policy_version == 3
    finally:
        resumed.close()
