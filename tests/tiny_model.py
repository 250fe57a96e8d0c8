"""A tiny random Llama model and a locally trained byte-level BPE tokenizer (no downloads, ~2 s).

Used by tests and benchmarks wherever a real-but-small model is enough.
"""

from __future__ import annotations

from pathlib import Path

_CORPUS = [
    "Tom has 3 apples and buys 4 more. How many apples does Tom have now? The answer is 7.",
    "A box holds 12 pens. How many pens are in 3 boxes? 12 * 3 = 36. The answer is 36.",
    "You are a helpful assistant. You may call one or more functions to assist with the user query.",
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 + 4"}}\n</tool_call>',
    "<tool_response>\n7\n</tool_response> <tools> </tools> system user assistant tool",
    '{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}',
    "What is 0 1 2 3 4 5 6 7 8 9 10 plus minus times divided by equals? Answer briefly. TOOL RESULT 42",
    "The quick brown fox jumps over the lazy dog. Sara had 20 stickers and gave away 7.",
]


def build_tiny_model(out_dir: str) -> str:
    """Write a tiny `LlamaForCausalLM` (2 layers, hidden 64) and its tokenizer to `out_dir`; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from ajet.chat_template import TOOL_CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = TOOL_CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
