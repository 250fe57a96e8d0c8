"""What only a CPU run of verl needs: a CPU platform, its environment, and the settings verl's FSDP engine needs
without CUDA.

verl 0.9.1 ships platforms for CUDA, ROCm and NPU only and falls back to CUDA. On a machine without a GPU the
verl backbone therefore registers `PlatformCPU` ("cpu", gloo, Ray resource "CPU") in EVERY process that imports
verl, by verl's own plugin mechanism: `VERL_USE_EXTERNAL_MODULES=ajet.backbones.verl.cpu` makes `import verl`
import this module (in the driver and in each Ray worker, whose environment comes from `worker_env()`), and
`VERL_PLATFORM=cpu` makes verl's platform manager pick it. `VERL_ENGINE_DEVICE=cuda` selects verl's FSDP engine
class, which verl registers for the cuda/npu devices only (its code is device-agnostic: the device comes from the
platform).

The settings (`cpu_overrides`) are the ones the FSDP2 engine needs on CPU: `strategy: fsdp2` (FSDP1 refuses CPU
parameters), no torch.compile, and no parameter/optimizer offload; the precision comes from `model.dtype` (fp32 by
default; verl's bf16 default moves the loss by ~4%). The components replaced on CPU are named in docs/backbones.md.
"""

from __future__ import annotations

import os
import types
from contextlib import nullcontext
from typing import Any

import torch

MODULE = __name__     # "ajet.backbones.verl.cpu": what verl's VERL_USE_EXTERNAL_MODULES imports


def worker_env() -> dict[str, str]:
    """Environment variables of every process of a CPU verl run (driver and Ray workers): verl imports this
    module (registering `PlatformCPU`), picks it, and selects its FSDP engine class."""
    return {"VERL_USE_EXTERNAL_MODULES": MODULE, "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda",
            "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}


def cpu_overrides() -> dict[str, Any]:
    """verl config keys (dotted) a CPU actor needs; applied before the YAML's `verl:` block (which may change
    them). Every key exists in verl 0.9.1's `ppo_trainer.yaml`."""
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    out: dict[str, Any] = {"trainer.device": "cpu", "trainer.n_gpus_per_node": 1, "trainer.nnodes": 1}
    for role in ("actor", "ref"):
        p = f"actor_rollout_ref.{role}"
        out.update({f"{p}.strategy": "fsdp2", f"{p}.fsdp_config.use_torch_compile": False,
                    f"{p}.fsdp_config.mixed_precision": fp32, f"{p}.fsdp_config.param_offload": False})
    out.update({"actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
                "actor_rollout_ref.actor.use_torch_compile": False, "actor_rollout_ref.ref.use_torch_compile": False})
    return out


def apply_env() -> None:
    """Set `worker_env()` in this process (before verl is imported or its platform asked for)."""
    os.environ.update(worker_env())


def replace_pinned_offload() -> None:
    """The one verl component replaced on CPU: verl's FSDP engine wraps a forward-only engine (the reference
    policy) in `CPUOffloadPolicy(pin_memory=True)` (verl/workers/engine/fsdp/transformer_impl.py,
    `_build_fsdp_module`), and pinning needs an accelerator: "RuntimeError: Cannot access accelerator device
    when none is available". On CPU the same policy without pinning (the parameters already live in CPU memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.fsdp import transformer_impl

    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True: CPUOffloadPolicy(pin_memory=False)


def init_process_group() -> None:
    """This worker's torch.distributed group on gloo alone (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come
    from verl's RayWorkerGroup). verl's own `initialize_global_process_group_ray` asks for
    "cpu:gloo,<device>:<backend>", which torch refuses when the device is cpu too ("Duplicate device type cpu");
    verl skips it when a group exists."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


class _CpuDeviceModule(types.SimpleNamespace):
    """What verl calls on `get_torch_device()` (`torch.cuda` on GPUs): torch.cpu's functions, memory counters
    that read 0 (verl only logs them) and no-op cache / stream controls."""

    @staticmethod
    def get_device_name(*args) -> str:
        return "CPU"            # verl's flops counter looks the device's peak FLOPS up by this name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith(("memory_", "max_memory_")) or name in ("mem_get_info",):
            return lambda *a, **k: (0, 0) if name == "mem_get_info" else 0
        return lambda *a, **k: None


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """verl's platform interface on CPU: device "cpu", gloo collectives, Ray resource "CPU"."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = _CpuDeviceModule()

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return not torch.cuda.is_available()

        def current_device(self):
            return "cpu"       # verl passes it to `.to(...)`; on CUDA it is an index

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str):
            return nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


PlatformCPU = _platform_class()   # registered as "cpu" in verl's PlatformRegistry at import
