"""Serving while training for the debug backbone (docs/gateway.md, "Serving while training"): the engine keeps
answering with one copy of the weights while the update trains another, and a trained version is switched in only
when asked (`publish`), between two decode steps, after the rows in flight have finished.

    backbone.serve_while_training()      # once, before the engine serves (the gateway's gate does it)
    backbone.update(samples)             # trains the trainer's copy; the result waits as `candidate_version`
    with backbone.trainer_engine() as e: # evaluate it (or, before the update, the serving weights) beside serving
        ...
    backbone.publish()                   # serve it; or load_checkpoint(path, serve=False) to drop it

The in-process engine serves `served_model`, a second copy of the trained parameters (the whole model; with LoRA
or `agents:` only the adapters, the frozen base weights shared read-only by both copies). With the vLLM engine the
server holds its own weights, and `publish` is its weight sync.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch

from ajet.engines.in_process import HFEngine, engine_for


class ServeWhileTraining:
    """Mixed into `DebugBackbone` (backbones/debug/backbone.py); uses its `model`, `engine`, `optimizers`, `lora`,
    `tokenizer`, `cfg`, `adapter_for` and `_publish_weights`. Until `serve_while_training()` nothing changes:
    the engine serves the weights the update trains."""

    serves_while_training: bool             # set by the backbone's __init__: False, `served_model` its `model`,
    served_model: torch.nn.Module           # no candidate, no trainer engine
    candidate_version: int | None
    _trainer_engine: HFEngine | None

    def serve_while_training(self) -> None:
        """From now on the engine keeps serving while the update trains (the gateway, docs/gateway.md): the update
        trains `self.model`, the trainer's copy, and leaves the result as `candidate_version`; nothing is served
        until `publish()` (or dropped by `load_checkpoint(path, serve=False)`).

        In-process engine: the engine serves `served_model`, a second copy of the trained parameters made here
        (the whole model; with LoRA or `agents:` only the adapters, the frozen base weights are shared, read-only),
        and `publish` copies the trained weights into it between two decode steps (`HFEngine.switch_weights`: the
        rows in flight finish on the version they started with first). vLLM engine: the server already holds its
        own weights; `publish` syncs them (`sync_weights`/`sync_adapters`: new calls wait, calls in flight finish).
        Call it before the engine serves anything. Idempotent."""
        if self.serves_while_training:
            return
        if isinstance(self.engine, HFEngine):
            trained = {id(p) for p in self._optimized_parameters()}
            shared = {id(p): p for p in self.model.parameters() if id(p) not in trained} if self.lora else {}
            served = copy.deepcopy(self.model, memo=dict(shared)).eval()
            for p in served.parameters():
                if id(p) not in shared:
                    p.requires_grad_(False)
            with self.engine.weights_lock:
                self.engine.model = served
            self.served_model = served
        self.serves_while_training = True

    def publish(self) -> dict[str, float]:
        """Serve the candidate the last update trained (`candidate_version`), with serving while training; returns
        the switch's figures for the step's metrics (`weight_switch_s`, `weight_copy_s`; vLLM's sync figures), {}
        when there is no candidate."""
        version, self.candidate_version = self.candidate_version, None
        if version is None:
            return {}
        return self._serve(version)

    @contextmanager
    def trainer_engine(self):
        """An in-process engine over the trainer's copy of the weights (`self.model`), for evaluating the candidate,
        or before an update the serving weights, beside the served engine, which keeps answering. Its policy
        version is the candidate's (else the served one); its cached prefixes are dropped on entry and exit. Only
        with serving while training (the served engine's weights are another object), on the trainer thread,
        between updates."""
        if not self.serves_while_training:
            raise RuntimeError("trainer_engine() needs serve_while_training(): the engine serves the trained weights")
        if self._trainer_engine is None:
            self._trainer_engine = engine_for(self.model, self.tokenizer, self.cfg, self.adapter_for)
        engine = self._trainer_engine
        engine.policy_version = self.engine.policy_version if self.candidate_version is None else self.candidate_version
        with engine.weights_lock:
            engine.prefix_cache.clear()
        try:
            yield engine
        finally:
            with engine.weights_lock:
                engine.prefix_cache.clear()

    def _optimized_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter any of the optimizers steps (all adapters' with `agents:`)."""
        return [p for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]]

    def _weights_held(self):
        """The engine's `weights_lock` when it serves the weights the trainer changes; nothing when it serves its
        own copy (serving while training)."""
        return nullcontext() if self.serves_while_training else self.engine.weights_lock

    def _trained(self, version: int) -> dict[str, float]:
        """After an update: serve it as `version` at once, or with serving while training keep it as the candidate
        (`publish` serves it)."""
        if self.serves_while_training:
            self.candidate_version = version
            return {}
        return self._publish_weights(version)

    def _serve(self, version: int) -> dict[str, float]:
        """Serve the trainer's weights as `version`: copied into the served copy by a switch of the in-process
        engine, else `_publish_weights`."""
        if isinstance(self.engine, HFEngine) and self.served_model is not self.model:
            names = None
            if self.lora:     # only the adapters train: the base weights are shared with the served copy
                trained = {id(p) for p in self._optimized_parameters()}
                names = {n for n, p in self.model.named_parameters() if id(p) in trained}
            return self.engine.switch_weights(lambda: copy_parameters(self.served_model, self.model, names), version)
        return self._publish_weights(version)


@torch.no_grad()
def copy_parameters(dst, src, names: set[str] | None = None) -> None:
    """Copy `src`'s parameters into `dst`'s, in place, by name (`dst` a deep copy of `src`: same names and
    shapes); `names`: only these (None: all). Raises KeyError for a name `dst` lacks."""
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        if names is None or name in names:
            dst_params[name].copy_(p)
