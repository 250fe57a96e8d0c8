"""Issue 21 item 4, asynchronous training: weights swap between decode steps of a completion in flight,
each token records the version that sampled it; stale samples are dropped and counted; the truncated
importance-sampling weight of the loss; the trainer's rollouts run ahead of the update by at most
`trainer.async.max_staleness` steps."""

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet.backbones.debug.backbone import token_logprobs
from ajet.backbones.debug.engine import HFEngine
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
