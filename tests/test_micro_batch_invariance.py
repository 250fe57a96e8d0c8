"""`algorithm.micro_batch_tokens` trades memory (one micro-batch's activations) for nothing else: the loss weights
are computed over the whole mini-batch before it is split, so the summed gradient is the same whatever the
micro-batch size, up to float rounding. The main job's YAML relies on it (2,048-token micro-batches instead of the
4,096 default keep its update under 6 GB with the same update)."""

import pytest
import torch

from ajet.algorithm.loss import LOSS_AGG_MODES
from ajet.backbones.debug.backbone import DebugBackbone, _micro_batches
from ajet.config import AjetConfig
from tests.test_update_where_trained import _episodes, _grads_and_stats


@pytest.fixture(scope="module")
def backbone(tiny_model_dir):
    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": tiny_model_dir, "device": "cpu"})
    bb = DebugBackbone(cfg)
    yield bb
    bb.close()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_and_loss_do_not_depend_on_the_micro_batch_size(backbone, mode):
    samples = _episodes(backbone)                      # 9 samples in 3 GRPO groups
    alg = backbone.cfg.algorithm
    alg.loss_agg_mode = mode
    per_size = {}
    for tokens in (100_000, 100):
        alg.micro_batch_tokens = tokens
        items = [(s, 1.0) for s in samples]
        per_size[tokens] = (len(_micro_batches(items, tokens)), *_grads_and_stats(backbone, samples))
    (n_one, g_one, st_one), (n_four, g_four, st_four) = per_size.values()
    # 29-42 tokens a sample: one micro-batch, or 4 of 2, 2, 2 and 3 samples (each padded to its longest)
    assert (n_one, n_four) == (1, 4)
    assert st_one["clip_frac"] > 0 and float(sum(g.abs().sum() for g in g_one.values())) > 0
    assert g_four.keys() == g_one.keys()
    for name in g_one:
        torch.testing.assert_close(g_four[name], g_one[name], rtol=1e-4, atol=1e-7, msg=name)
    for key in ("loss", "pg_loss", "clip_frac", "ratio_mean", "weight_sum", "_tokens", "_entropy"):
        assert st_four[key] == pytest.approx(st_one[key], rel=1e-5, abs=1e-7), key
