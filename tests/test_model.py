"""Model resolution: the embedded SmolLM2 alias, local folders, and the chat-template rules."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from ajet.chat_template import TOOL_CHAT_TEMPLATE
from ajet.model import load_model, load_tokenizer, resolve_model_path


def test_tokenizer_template_rules(tiny_model_dir, tmp_path):
    assert load_tokenizer(tiny_model_dir).chat_template == TOOL_CHAT_TEMPLATE       # already tool-capable: kept
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_tokenizer(tiny_model_dir, str(jinja)).chat_template == jinja.read_text()
    assert load_tokenizer(tiny_model_dir, "{{ 'x' }}").chat_template == "{{ 'x' }}"
    assert load_tokenizer(tiny_model_dir, "tools").chat_template == TOOL_CHAT_TEMPLATE
    assert resolve_model_path("org/some-hub-id") == "org/some-hub-id"
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir
    model = load_model(tiny_model_dir, device="cpu")
    assert model.dtype.is_floating_point and next(model.parameters()).device.type == "cpu"


@pytest.mark.slow
def test_embedded_smollm2_converts_once_and_renders_tools(tmp_path):
    path = resolve_model_path("smollm2-135m-instruct", cache=str(tmp_path))
    weights = Path(path) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert resolve_model_path("SmolLM2-135M-Instruct", cache=str(tmp_path)) == path   # reused, not reconverted
    assert weights.stat().st_mtime_ns == written
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    tok = load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
        "name": "calculate", "parameters": {"type": "object"}}}], tokenize=False, add_generation_prompt=True)
    assert '"name": "calculate"' in text and text.endswith("<|im_start|>assistant\n")
