"""What Trinity-RFT 0.6's trainer (on verl 0.8.0) needs to train on a machine without CUDA.

Trinity's `VERLTrainer` places its FSDP workers with verl's `RayWorkerGroup` on a resource pool of "GPUs"
and names the device "cuda" (trinity/trainer/verl/trainer.py: `self.device_name = "cuda"`). Nothing in the
update itself needs CUDA; seven places assume it, and `patch_verl_for_cpu` changes 1-6, in every
process that imports verl (the driver, and each Ray worker once it imports verl, through Ray's
`worker_process_setup_hook`: `loss.setup_worker`):

  1. verl/utils/device.py `get_nccl_backend()` returns "nccl" whatever the device, and the worker's process
     group (verl/utils/distributed.py `initialize_global_process_group_ray`, called by verl/workers/
     engine_workers.py) is "cpu:gloo,{device}:{that}" = "cpu:gloo,cpu:nccl" (torch: "Duplicate device type
     cpu"). -> "gloo" for both.
  2. verl/workers/engine/base.py `EngineRegistry` lists the FSDP engines for devices cuda and npu only
     (`AssertionError: Unknown device: cpu`). -> the same classes registered for "cpu".
  3. verl/utils/attention_utils.py imports flash-attn's padding helpers (`flash_attn.bert_padding`), which
     nothing installs on CPU. -> verl's own pure-torch copies of them (verl/utils/npu_flash_attn_utils.py).
  4. trinity/trainer/verl/monkey_patch.py `_build_module` (Trinity's replacement of verl's model loading) calls
     `torch.cuda.get_device_capability(0)` to decide on meta-device init for Hopper GPUs ("Torch not compiled
     with CUDA enabled"). -> capability (0, 0) in a process without CUDA: every rank loads the weights on
     CPU, as on a pre-Hopper GPU.
  5. verl/workers/engine/fsdp/transformer_impl.py shards a forward-only model (the reference policy) with
     `CPUOffloadPolicy(pin_memory=True)`; pinning needs an accelerator ("Cannot access accelerator device when
     none is available", torch/distributed/fsdp/_fully_shard/_fsdp_param.py). -> the same policy unpinned.
  6. verl calls its device module (`get_torch_device()`, here `torch.cpu`) for memory counters, cache and RNG
     (verl/utils/memory_utils.py `aggressive_empty_cache`: "module 'torch.cpu' has no attribute
     'memory_reserved'"; the checkpoint manager's `get_rng_state`). -> the missing ones added to `torch.cpu`:
     counters read 0, cache calls do nothing, the RNG state is torch's CPU generator.
  7. The resource pool asks Ray for one GPU per FSDP rank (`use_gpu=True` in verl's `ResourcePoolManager`).
     -> `ray_init_kwargs` starts a local Ray cluster that declares `world_size` logical "GPU" slots, which
     Ray only counts (a worker with one sees CUDA_VISIBLE_DEVICES set and `torch.cuda.is_available()` False).

The model side of the CPU settings (fsdp2, fp32 mixed precision, sdpa attention, no torch.compile) is plain
Trinity/verl config: see `cpu_trainer_config` (Trinity's `trainer.trainer_config` overrides).
"""

from __future__ import annotations

from ajet.ray_cluster import torch_threads_env


def patch_verl_for_cpu() -> None:
    """Apply the CPU changes 1-6 of the module docstring to the verl modules of this process (idempotent).

    A no-op when CUDA is available. Raises ImportError when verl is not installed.
    """
    import torch

    if torch.cuda.is_available():
        return
    import verl.utils.attention_utils as attention_utils
    import verl.utils.device as device
    import verl.utils.distributed as distributed
    import verl.workers.engine_workers as engine_workers
    from verl.utils import npu_flash_attn_utils  # noqa: F401  (change 3's helpers: fails here without einops)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl   # (importing it registers the FSDP engines)

    device.get_nccl_backend = distributed.get_nccl_backend = _gloo       # 1
    if not getattr(distributed.initialize_global_process_group_ray, "_ajet_gloo", False):
        engine_workers.initialize_global_process_group_ray = distributed.initialize_global_process_group_ray = \
            _with_gloo(distributed.initialize_global_process_group_ray)
    for backends in EngineRegistry._engines.values():                     # 2
        for devices in backends.values():
            if "cuda" in devices:
                devices.setdefault("cpu", devices["cuda"])
    attention_utils._get_attention_functions = _pure_torch_padding         # 3
    torch.cuda.get_device_capability = _no_capability                      # 4
    if transformer_impl.CPUOffloadPolicy is not None and transformer_impl.CPUOffloadPolicy.__name__ != "Unpinned":
        transformer_impl.CPUOffloadPolicy = _unpinned(transformer_impl.CPUOffloadPolicy)     # 5
    for name, fn in _CPU_DEVICE_FALLBACKS.items():                        # 6
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def _gloo() -> str:
    return "gloo"


def _with_gloo(init_process_group):
    def init_gloo(timeout_second=None, backend=None):
        return init_process_group(timeout_second=timeout_second, backend="gloo")

    init_gloo._ajet_gloo = True
    return init_gloo


def _zero(*args, **kwargs) -> int:
    return 0


def _nothing(*args, **kwargs) -> None:
    return None


_CPU_DEVICE_FALLBACKS = {
    "memory_reserved": _zero, "memory_allocated": _zero, "max_memory_allocated": _zero,
    "max_memory_reserved": _zero, "reset_peak_memory_stats": _nothing, "empty_cache": _nothing,
    "ipc_collect": _nothing, "mem_get_info": lambda *a, **k: (0, 0),
    "get_rng_state": lambda *a, **k: __import__("torch").get_rng_state(),
    "set_rng_state": lambda state, *a, **k: __import__("torch").set_rng_state(state),
}


def _unpinned(policy_cls):
    """`policy_cls` (torch's FSDP2 `CPUOffloadPolicy`) with `pin_memory` always False."""
    class Unpinned(policy_cls):
        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    return Unpinned


def _no_capability(device=None) -> tuple[int, int]:
    return (0, 0)


def _pure_torch_padding():
    from verl.utils.npu_flash_attn_utils import index_first_axis, pad_input, rearrange, unpad_input

    return index_first_axis, pad_input, rearrange, unpad_input


WORKER_SETUP_HOOK = "ajet.backbones.trinity.loss.setup_worker"


def ray_init_kwargs(world_size: int) -> dict:
    """`ray.init` arguments for a local CPU cluster that can hold `world_size` FSDP ranks (change 7), with
    `patch_verl_for_cpu` (and the micro-batch loss of `backbones/trinity/loss.py`) applied in every Ray worker
    process that imports verl (and Trinity's worker module), as it imports them (`loss.setup_worker`)."""
    return {
        # logical counts, not cores: verl's placement group asks 3 CPUs per rank (max_colocate_count), and
        # Trinity's Synchronizer / CheckpointMonitor and ajet's explorer handle are actors too
        "num_cpus": 3 * world_size + 4,
        "num_gpus": world_size,                    # logical slots for verl's placement groups, no CUDA behind
        "include_dashboard": False,
        "runtime_env": {"worker_process_setup_hook": WORKER_SETUP_HOOK,
                        # each rank's share of the cores as torch threads (Ray's default: 1 thread per worker)
                        "env_vars": {"TOKENIZERS_PARALLELISM": "false", **torch_threads_env(world_size)}},
    }


def cpu_trainer_config() -> dict:
    """Trinity `trainer.trainer_config` overrides (verl 0.8 worker config) for training on CPU: FSDP2 (FSDP1
    cannot wrap CPU parameters), fp32 compute and reduction (verl's default bf16 autocast moves the loss by
    ~4%), sdpa attention (verl's default asks for flash-attn; eager materialises a [heads, tokens, tokens] matrix per
    layer over a packed micro-batch: 10.7 GB vs 6.1 GB for 4 rows of 550 tokens), no torch.compile, and gradient
    checkpointing unless `model.gradient_checkpointing` is false (the same gradients; it recomputes each layer in the
    backward instead of keeping SmolLM2's 30 layers of activations for a 4,096-token micro-batch, which with the
    step's fp32 logits filled a 24 GB machine)."""
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    return {
        "model": {"override_config": {"attn_implementation": "sdpa"}, "enable_gradient_checkpointing": True},
        "actor": {"use_torch_compile": False, "fsdp_config": {"mixed_precision": fp32, "model_dtype": "fp32"}},
        "ref": {"use_torch_compile": False, "fsdp_config": {"mixed_precision": fp32, "model_dtype": "fp32"}},
    }
