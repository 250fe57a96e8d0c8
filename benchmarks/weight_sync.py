"""Seconds per weight sync to a vLLM server: the LoRA adapter alone against the full weights, on the same model.

    python benchmarks/weight_sync.py [--rounds 8] [--rank 8] [--kv-cache-gb 1]

One vLLM server (ajet's `VLLMServer`, from `.venvs/vllm`, LoRA enabled) serves SmolLM2-135M-Instruct (fp32). The
policy is that model with a peft LoRA adapter of rank `--rank` on every linear layer (`model.lora`'s default
targets). Each round moves the adapter's weights (as an update would) and syncs them both ways, alternating which
goes first, as the debug backbone does after an update:
- `adapter`: `VLLMEngine.sync_adapters`: peft's `save_pretrained` of the adapter, then `/v1/load_lora_adapter` under
  a new name (the old version unloaded in the background);
- `full`: `VLLMEngine.sync_weights` of the merged weights (`merged_lora_state_dict`): one safetensors file, then
  `/collective_rpc reload_weights` and `/reset_prefix_cache`.
Prints, per way, the median / min / max over the rounds of the whole sync, the save and the load (seconds), the
file sizes, and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8, help="the adapter's rank (one of vLLM's: 8, 16, 32, ...)")
    ap.add_argument("--kv-cache-gb", type=int, default=1)
    args = ap.parse_args(argv)

    from peft import LoraConfig, get_peft_model

    from ajet.backbones.debug.backbone import merged_lora_state_dict
    from ajet.backbones.debug.role_adapters import base_state_dict, save_adapters
    from ajet.engines.vllm import SERVED_NAME, VLLMEngine, serving_folder
    from ajet.engines.vllm_server import VLLMServer
    from ajet.model import load_model, resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    model = get_peft_model(load_model(path, "float32", "cpu"),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear",
                                      task_type="CAUSAL_LM")).eval()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs; SmolLM2-135M fp32, LoRA rank {args.rank} on every linear layer", flush=True)
    with tempfile.TemporaryDirectory(prefix="ajet-weight-sync-") as tmp:
        tmp = Path(tmp)
        folder = serving_folder(path, tmp / "model", base_state_dict(model))
        server = VLLMServer(str(folder), tmp / "vllm.log", kv_cache_gb=args.kv_cache_gb, max_model_len=1024,
                            max_num_seqs=8, lora_rank=args.rank, max_loras=2)
        url = server.start()
        full = VLLMEngine([url], SERVED_NAME, tmp / "full")
        lora = VLLMEngine([url], SERVED_NAME, tmp / "lora", adapters=["default"])
        write = lambda folder: save_adapters(model, folder, ["default"])   # noqa: E731  (the backbone's writer)
        try:
            lora.sync_adapters(write, 0)
            figures: dict[str, list[dict[str, float]]] = {"adapter": [], "full": []}
            sizes = {}
            for version in range(1, args.rounds + 1):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "lora_" in name:
                            p.add_(1e-3 * torch.randn_like(p))
                ways = [("adapter", lambda v=version: lora.sync_adapters(write, v)),
                        ("full", lambda v=version: full.sync_weights(merged_lora_state_dict(model), v))]
                for way, sync in ways if version % 2 else ways[::-1]:
                    figures[way].append(sync())
                sizes["adapter"] = sum(f.stat().st_size for f in (tmp / "lora").rglob("*.safetensors"))
                sizes["full"] = sum(f.stat().st_size for f in (tmp / "full").rglob("*.safetensors"))
        finally:
            full.close()
            lora.close()
            server.stop()
    print(f"{'way':8} {'file MB':>8} {'sync s (median min-max)':>26} {'save s':>8} {'load s':>8}")
    for way, rows in figures.items():
        sync = [r["weight_sync_s"] for r in rows]
        print(f"{way:8} {sizes[way] / 1e6:8.1f} {statistics.median(sync):10.3f} ({min(sync):.3f}-{max(sync):.3f})"
              f"{statistics.median(r['weight_save_s'] for r in rows):10.3f}"
              f"{statistics.median(r['weight_reload_s'] for r in rows):9.3f}")
    print(f"load after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
