"""A worker killed by Ray's memory monitor, said in ajet's terms.

Ray's raylet kills a worker when the node's memory use passes `RAY_memory_usage_threshold` (default 0.95 of the
node's memory) and the pending `ray.get` raises `ray.exceptions.OutOfMemoryError` ("N worker(s) were killed due
to the node running low on memory. ..."), or, for a call to an actor that died that way, an `ActorDiedError`
whose message carries the same sentence. Raw, that is a traceback through verl's worker-group dispatch that names
neither the step that ran out of memory nor the ajet setting that sizes it. `explain_ray_oom` turns it into
`BackboneOutOfMemory`, which the CLI prints as one message (no traceback, exit status 2).

Reference: Ray's out-of-memory prevention, https://docs.ray.io/en/latest/ray-core/scheduling/ray-oom-prevention.html
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ajet.errors import AjetError, exception_chain, first_line

OOM_SENTENCE = "killed due to the node running low on memory"   # the raylet's message, for tasks and actors


class BackboneOutOfMemory(AjetError, RuntimeError):
    """A backbone's Ray worker was killed by Ray's memory monitor; the message says where and what to change."""


def is_ray_oom(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is Ray's memory monitor killing a worker: Ray's
    `OutOfMemoryError` (matched by class name and module, so no Ray import is needed), or any Ray error whose
    message carries the raylet's OOM sentence (an actor that died that way). torch's `OutOfMemoryError` (an
    allocation that failed inside one process) is not."""
    for e in exception_chain(exc):
        ray_classes = [c for c in type(e).__mro__ if c.__module__.split(".")[0] == "ray"]
        if any(c.__name__ == "OutOfMemoryError" for c in ray_classes):
            return True
        if ray_classes and OOM_SENTENCE in str(e):
            return True
    return False


def oom_message(where: str, exc: BaseException, advice: str) -> str:
    """The user's message: what was killed (`where`), Ray's own first line (up to 400 characters), what to
    change (`advice`: the backbone's own settings), and Ray's kill threshold."""
    first = first_line(exc)
    if len(first) > 400:
        first = first[:400] + " ..."
    return (f"{where} was killed by Ray's memory monitor: the machine ran low on memory (Ray: {first}). "
            f"{advice} Ray kills a worker when the machine's memory use passes RAY_memory_usage_threshold "
            f"(default 0.95; set it, e.g. RAY_memory_usage_threshold=0.98, in the environment before ajet starts "
            f"Ray, at the risk of the kernel's own OOM killer). A run with checkpoints continues with --resume.")


@contextlib.contextmanager
def explain_ray_oom(where: str, advice: str) -> Iterator[None]:
    """Within the block, a worker killed by Ray's memory monitor (`is_ray_oom`) becomes `BackboneOutOfMemory`
    (chained to Ray's exception); every other exception passes unchanged.

    Args:
        where: what was running, e.g. "verl's actor update (step mini-batch 1 of 2)".
        advice: what to change, in the backbone's config keys.

    Raises:
        BackboneOutOfMemory: see above.
    """
    try:
        yield
    except Exception as exc:
        if is_ray_oom(exc):
            raise BackboneOutOfMemory(oom_message(where, exc, advice)) from exc
        raise
