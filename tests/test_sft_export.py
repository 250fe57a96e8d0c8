"""Fine-tuning on recorded traces (`ajet sft`) and their export (`ajet export --format hf`), on a real recorded run.

The recorded run is `tiny_experiment` (tests/tiny_experiment.py: a real 2-step `ajet` run of the tiny model, rewards
0, 1 and 2, one task whose episodes fail). Every expected value is read from its trajectories.sqlite with plain SQL,
never through ajet's readers.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import Counter

import pytest

from ajet.cli import main
from ajet.errors import AjetError, ConfigError


def _store_rows(exp_dir, min_reward=None):
    """(episode_id, attempt, reward, sample record) of every sample of a successful episode with reward >= min_reward,
    straight from the store's tables."""
    db = sqlite3.connect(exp_dir / "trajectories.sqlite")
    rows = db.execute("SELECT e.episode_id, e.attempt, e.reward, s.record FROM samples s JOIN episodes e "
                      "ON s.episode_id = e.episode_id AND s.attempt = e.attempt "
                      "WHERE e.error IS NULL AND e.reward IS NOT NULL ORDER BY e.rowid, s.idx").fetchall()
    db.close()
    return [(eid, att, r, json.loads(rec)) for eid, att, r, rec in rows if min_reward is None or r >= min_reward]


def _tokens(prompt, response, mask):
    return (tuple(prompt), tuple(response), tuple(mask))


@pytest.fixture(scope="module")
def sft_run(tiny_experiment, tmp_path_factory, monkeypatch_module):
    """`ajet sft --from <recorded run> --min-reward 1 --steps 3` in this process, capturing what each update got."""
    from ajet.backbones.debug.backbone import DebugBackbone

    fed: list[list] = []
    original = DebugBackbone.update

    def spy(self, samples):
        fed.append([(s.episode_id, _tokens(s.prompt_ids, s.response_ids, s.loss_mask)) for s in samples])
        return original(self, samples)

    monkeypatch_module.setattr(DebugBackbone, "update", spy)
    out = tmp_path_factory.mktemp("sft") / "sft_exp"
    monkeypatch_module.chdir(tiny_experiment.parent)
    rc = main(["sft", "--from", str(tiny_experiment), "--min-reward", "1", "--conf", "conf.yaml", "--backbone=debug",
               "--exp-dir", str(out), "--steps", "3"])
    assert rc == 0
    return out, fed


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_sft_trains_the_recorded_tokens_and_masks_of_the_kept_episodes(tiny_experiment, sft_run):
    out, fed = sft_run
    kept = _store_rows(tiny_experiment, min_reward=1.0)
    everything = _store_rows(tiny_experiment)
    assert 0 < len({(e, a) for e, a, _, _ in kept}) < len({(e, a) for e, a, _, _ in everything})   # the filter bites
    expected = Counter(_tokens(s["prompt_ids"], s["response_ids"], s["loss_mask"]) for _, _, _, s in kept)
    assert len(fed) == 3                                   # one update per step, no generation in between
    for step in fed:   # every step is one pass over the kept samples: exactly the stored tokens and loss masks
        assert Counter(tokens for _, tokens in step) == expected
        assert len({eid for eid, _ in step}) == len({(e, a) for e, a, _, _ in kept})   # --min-reward: the count
    # the SFT run's own store holds the replayed episodes, each naming the recorded one it replays
    db = sqlite3.connect(out / "trajectories.sqlite")
    sources = [json.loads(r)["task"]["metadata"]["sft_source"]["episode_id"]
               for (r,) in db.execute("SELECT record FROM episodes WHERE step = 1")]
    assert sorted(sources) == sorted(e for e, _, _, _ in kept)


def test_sft_loss_decreases_and_the_checkpoint_loads(sft_run, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = sft_run
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/sft_loss"] for m in metrics if "train/sft_loss" in m]
    assert len(losses) == 3
    assert all(b < a for a, b in zip(losses, losses[1:])), losses   # the same samples each step: the loss falls
    # a checkpoint like any run's: model.path (or `ajet eval --checkpoint`) can start from it
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_3")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), base.state_dict().values()))


def test_without_min_reward_every_successful_episode_is_kept(tiny_experiment):
    from ajet.commands.sft import read_recorded

    recorded = read_recorded(tiny_experiment)
    assert sorted((e.episode_id, e.attempt) for e in recorded) == \
        sorted({(e, a) for e, a, _, _ in _store_rows(tiny_experiment)})
    assert read_recorded(tiny_experiment, agent="no-such-agent") == []


def test_backbones_that_do_not_declare_sft_refuse_it(tiny_experiment, tmp_path, capsys, monkeypatch):
    from ajet.backbones.capabilities import check_supported
    from ajet.config import load_config

    cfg = load_config(tiny_experiment.parent / "conf.yaml", {"sft.from_dir": str(tiny_experiment)})
    check_supported(cfg, "debug")
    for backbone in ("verl", "trinity"):
        with pytest.raises(ConfigError, match=r"(?m)^sft=.*the " + backbone + " backbone .*--backbone=debug"):
            check_supported(cfg, backbone)
    monkeypatch.chdir(tiny_experiment.parent)
    assert main(["sft", "--from", str(tiny_experiment), "--conf", "conf.yaml", "--backbone=verl",
                 "--exp-dir", str(tmp_path / "x")]) == 2
    assert "sft=" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_filter_that_keeps_nothing_is_a_config_error(tiny_experiment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tiny_experiment.parent)
    assert main(["sft", "--from", str(tiny_experiment), "--agent", "no-such-agent", "--conf", "conf.yaml",
                 "--exp-dir", str(tmp_path / "x")]) == 2
    assert "sft.agent=no-such-agent" in capsys.readouterr().err


def test_export_reads_back_with_datasets_as_recorded(tiny_experiment, tmp_path):
    import datasets

    out = tmp_path / "hf"
    assert main(["export", "--format", "hf", str(tiny_experiment), str(out), "--min-reward", "1"]) == 0
    ds = datasets.load_from_disk(str(out))
    kept = _store_rows(tiny_experiment, min_reward=1.0)
    assert len(ds) == len(kept)
    db = sqlite3.connect(tiny_experiment / "trajectories.sqlite")
    for row, (eid, att, reward, s) in zip(ds, kept):
        assert (row["episode_id"], row["attempt"], row["reward"], row["agent"]) == (eid, att, reward, s["agent_tag"])
        assert row["prompt_ids"] == s["prompt_ids"] and row["completion_ids"] == s["response_ids"]
        assert row["loss_mask"] == s["loss_mask"]
        assert row["input_ids"] == s["prompt_ids"] + s["response_ids"]
        assert row["completion_mask"] == [0] * len(s["prompt_ids"]) + s["loss_mask"] == row["assistant_masks"]
        # the conversation of the sample's last call: its request messages, then the answer it returned
        record = json.loads(db.execute("SELECT record FROM episodes WHERE episode_id = ? AND attempt = ?",
                                       (eid, att)).fetchone()[0])
        call = next(c for c in record["calls"] if c["call_id"] == s["call_ids"][-1])
        assert [m["role"] for m in row["messages"]] == [m["role"] for m in call["messages"]] + ["assistant"]
        assert row["messages"][-1]["content"] == call["response_message"]["content"]
        assert row["messages"][1]["content"] == call["messages"][1]["content"]
        assert json.loads(row["tools"]) == call["tools"]


def test_export_without_datasets_names_the_extra(tiny_experiment, tmp_path, monkeypatch):
    from ajet.commands.export import export_hf

    monkeypatch.setitem(sys.modules, "datasets", None)   # `import datasets` raises ImportError
    with pytest.raises(AjetError, match=r"ajet\[datasets\]"):
        export_hf(tiny_experiment, tmp_path / "hf")
