"""benchmarks/engines.py's helpers: the trainer's recomputation of recorded completions, the agreement figures, and
the memory of a process tree."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks.engines import agreement, process_tree_memory, trainer_logprobs


def test_trainer_logprobs_score_each_completion_token_at_its_calls_temperature(tiny_model_dir):
    """Calls of different lengths and temperatures, batched (right padding) and cut per call, give the log-softmax
    of a plain forward's logits / T at the position before each completion token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for i, (p, c, t) in enumerate([(5, 3, 1.0), (9, 6, 0.7), (3, 1, 1.3), (12, 4, 0.5), (4, 7, 0.9)]):
        ids = torch.randint(3, model.config.vocab_size, (p + c,), generator=gen).tolist()
        calls.append(SimpleNamespace(prompt_ids=ids[:p], completion_ids=ids[p:],
                                     sampling=SimpleNamespace(temperature=t, top_p=1.0)))
    got = trainer_logprobs(model, calls, pad_id=0, batch_size=3)         # two forwards, padding in both
    assert [len(row) for row in got] == [len(c.completion_ids) for c in calls]
    for c, row in zip(calls, got):
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]                          # [S, V]
        p = len(c.prompt_ids)
        want = [torch.log_softmax(logits[p + j - 1] / c.sampling.temperature, -1)[tok].item()
                for j, tok in enumerate(c.completion_ids)]
        assert row == pytest.approx(want, abs=1e-5)


def test_agreement_is_the_max_and_mean_absolute_difference():
    assert agreement([0.0, -1.0, -2.0], [0.5, -1.25, -2.0]) == (0.5, pytest.approx(0.75 / 3), 3)
    worst, mean, count = agreement([], [])
    assert math.isnan(worst) and math.isnan(mean) and count == 0
    with pytest.raises(ValueError, match="2 engine logprobs but 1 trainer"):
        agreement([0.0, 0.0], [0.0])


def test_process_tree_memory_sums_a_process_and_its_descendants(tmp_path):
    """A parent with a child that holds 200 MB of its own: two processes, the child's memory counted."""
    import psutil

    ready = tmp_path / "ready"
    child = f"b = bytearray(200_000_000); open({str(ready)!r}, 'w').close(); import time; time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {child!r}])"])
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.1)
        assert ready.exists(), "the child did not start"
        rss, pss, count = process_tree_memory(parent.pid)
        assert count == 2
        assert rss > 200e6 and 0 < pss <= rss
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
