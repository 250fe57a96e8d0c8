"""Each tutorial (countdown, frozenlake, guessing game, learn-to-ask) trains one step with the tiny model
through the real proxy, its real workflow, data and judge; only the model and the sizes are shrunk."""

import json
from pathlib import Path

import pytest
import yaml

from ajet.config import load_config
from ajet.trainer import run

ROOT = Path(__file__).resolve().parent.parent / "tutorial"
TUTORIALS = {   # folder -> (config, client library the workflow needs)
    "example_countdown": ("countdown.yaml", "agentscope"),
    "example_frozenlake": ("frozenlake.yaml", "gymnasium"),
    "example_guessing_game": ("guessing_game.yaml", None),
    "example_learn_to_ask": ("learn_to_ask.yaml", None),
}


def _one_step_config(folder: str, tiny_model_dir: str, tmp_path: Path) -> Path:
    src = ROOT / folder
    conf = yaml.safe_load((src / TUTORIALS[folder][0]).read_text())
    file, _, name = conf["workflow"].partition(":")
    conf["workflow"] = f"{src / file}:{name}"
    for key in ("train_path", "val_path"):
        if key in conf["data"]:
            conf["data"][key] = str(src / conf["data"][key])
    if "generator_args" in conf["data"]:
        conf["data"]["generator_args"]["size"] = 4
    if "llm_judge" in conf:
        conf["llm_judge"]["rubric"] = str(src / conf["llm_judge"]["rubric"])
    conf["model"] = {"path": tiny_model_dir, "max_model_len": 1024}
    conf["rollout"].update(num_repeat=2, max_tokens=6)
    conf["trainer"].update(total_steps=1, tasks_per_step=2, tensorboard=False, exp_dir=str(tmp_path / "exp"),
                           val_freq=0)      # one step: the held-out evaluations are the README's runs
    path = tmp_path / "conf.yaml"
    path.write_text(yaml.safe_dump(conf))
    return path


@pytest.mark.parametrize("folder", list(TUTORIALS))
def test_tutorial_trains_one_step(folder, tiny_model_dir, tmp_path):
    if TUTORIALS[folder][1]:
        pytest.importorskip(TUTORIALS[folder][1])
    assert (ROOT / folder / "README.md").is_file()
    exp = run(load_config(_one_step_config(folder, tiny_model_dir, tmp_path)))
    m = json.loads((exp / "metrics.jsonl").read_text().splitlines()[0])
    assert m["rollout/episodes"] == 4 and m["rollout/failed"] == 0, m.get("rollout/first_error")
    assert m["policy_version"] == 1 and m["tracker/samples"] >= 4
    episodes = [json.loads(line) for line in (exp / "trajectories.jsonl").read_text().splitlines()]
    if folder == "example_frozenlake":      # many turns, one merged sample per episode
        assert all(len(e["samples"]) == 1 for e in episodes)
        assert any(len(e["calls"]) > 1 for e in episodes)
    if folder == "example_guessing_game":   # two agents; only the guesser's samples train
        assert m["tracker/samples"] == 8 and m["tracker/trained_samples"] == 4
    if folder == "example_learn_to_ask":    # the tiny model's judgements are unparseable: recorded, reward 0
        assert all(e["output"]["metadata"]["llm_judge"]["parse_error"] for e in episodes)
