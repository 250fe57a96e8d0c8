"""Deterministic task order: epochs of a seeded shuffle, consumed `tasks_per_step` at a time; several
datasets mixed by weight (`MultiTaskSampler`).

The trainer takes a step's tasks as numbered draws (`MultiTaskSampler.draw`): draw k is the k-th task of the
run's sequence, and the sampler remembers which step holds which draws until that step is trained. A checkpoint
after step t (`state(after_step=t)`) keeps the draws of the later steps already handed out (asynchronous
training draws ahead; dynamic sampling's extra tasks come after them), and a resumed run hands exactly those
draws to the same steps again, in the same order: every draw is trained by one step, none twice, none skipped.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

from ajet.task import Task


class TaskSampler:
    """Yields batches of tasks; each epoch is a fresh permutation drawn from `seed` and the epoch number.

    The position (epoch, offset) is all the state, so a run can be resumed exactly.
    """

    def __init__(self, tasks: list[Task], shuffle: bool = True, seed: int | str = 0):
        if not tasks:
            raise ValueError("no tasks to sample from")
        self.tasks, self.shuffle, self.seed = tasks, shuffle, seed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def set_position(self, epoch: int, offset: int) -> None:
        """Continue from a saved (epoch, offset), as read from `(sampler.epoch, sampler.offset)`."""
        self.epoch, self.offset = epoch, offset
        self._order = self._permutation(epoch)

    def task_at(self, epoch: int, offset: int) -> Task:
        """The task at place `offset` of epoch `epoch`'s order (what `next_batch` handed out there).

        Raises:
            IndexError: `offset` is not in 0..len(tasks)-1.
        """
        order = self._order if epoch == self.epoch else self._permutation(epoch)
        return self.tasks[order[offset]]

    def next_batch(self, n: int) -> list[Task]:
        """The next `n` tasks, wrapping into a new epoch when the current one runs out."""
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.tasks[self._order[self.offset]])
            self.offset += 1
        return out


@dataclass(frozen=True)
class Draw:
    """One task handed out by `MultiTaskSampler.draw`.

    Attributes:
        index: its place in the run's sequence of draws (0, 1, 2, ...; a draw keeps its index when a resumed
            run hands it out again).
        dataset: the dataset it came from.
        epoch, offset: its place in that dataset's order (`TaskSampler.task_at`).
        task: the task.
    """

    index: int
    dataset: str
    epoch: int
    offset: int
    task: Task

    def to_state(self) -> list[Any]:
        return [self.index, self.dataset, self.epoch, self.offset]


class MultiTaskSampler:
    """Tasks from several named datasets ("cocktail" training): each draw without a named dataset picks
    one by weight (draw k uses `Random(f"{seed}:mix:{k}")`, so the mix is reproducible), then takes that
    dataset's next task in its own `TaskSampler` order. With one dataset it is exactly `TaskSampler`.

    Thread-safe: asynchronous training draws the next steps' tasks in its producer thread while the trainer's
    thread draws dynamic sampling's extra tasks; one lock orders every draw.

    Args:
        datasets: name -> its tasks (non-empty).
        weights: name -> relative weight (> 0); missing names weigh 1.
        shuffle, seed: as for `TaskSampler` (each dataset is shuffled with its own seed `f"{seed}:{name}"`,
            except a lone dataset, which keeps `seed`).
    """

    def __init__(self, datasets: dict[str, list[Task]], weights: dict[str, float] | None = None,
                 shuffle: bool = True, seed: int = 0):
        if not datasets:
            raise ValueError("no datasets to sample from")
        lone = len(datasets) == 1
        self.samplers = {n: TaskSampler(t, shuffle, seed if lone else f"{seed}:{n}") for n, t in datasets.items()}
        self.weights = {n: (weights or {}).get(n, 1.0) for n in datasets}
        self.seed, self.draws = seed, 0
        self.index = 0                                # the next new draw's index
        self._owned: dict[int, list[Draw]] = {}       # step -> the draws handed to it, until it is trained
        self._reserved: dict[int, list[Draw]] = {}    # step -> draws it held when the checkpoint was written
        self._free: list[Draw] = []                   # draws of a checkpoint that no step holds (lowest first)
        self._lock = threading.RLock()

    def next_task(self, dataset: str | None = None) -> tuple[str, Task]:
        """(dataset name, its next task): from `dataset`, or from one drawn by weight. A new draw of the
        sequence (never one that `draw` holds for a step).

        Raises:
            KeyError: `dataset` is not one of the datasets.
        """
        draw = self._new_draw(dataset)
        return draw.dataset, draw.task

    def next_batch(self, n: int) -> list[Task]:
        """`n` tasks, each from a dataset drawn by weight."""
        return [self.next_task()[1] for _ in range(n)]

    def draw(self, step: int, n: int) -> list[Draw]:
        """`n` more draws for `step`: first the ones the checkpoint says `step` held (in their order), then the
        lowest free ones, then new ones. The sampler holds them for `step` until `retire(step)`.

        Returns:
            `[n]` draws, in the order handed out.
        """
        with self._lock:
            out = []
            for _ in range(n):
                mine = self._reserved.get(step)
                if mine:
                    out.append(mine.pop(0))
                elif self._free:
                    out.append(self._free.pop(0))
                else:
                    out.append(self._new_draw())
            self._owned.setdefault(step, []).extend(out)
            return out

    def drawn(self, step: int) -> list[Draw]:
        """Every draw handed to `step` so far (until it is retired), in order."""
        with self._lock:
            return list(self._owned.get(step, []))

    def retire(self, step: int) -> None:
        """`step` (and every earlier one) is trained: forget their draws; a draw the checkpoint held for such a
        step that it did not take again is free for the next `draw`."""
        with self._lock:
            for s in [s for s in self._owned if s <= step]:
                del self._owned[s]
            for s in [s for s in self._reserved if s <= step]:
                self._free.extend(self._reserved.pop(s))
            self._free.sort(key=lambda d: d.index)

    def state(self, after_step: int | None = None) -> dict[str, Any]:
        """The position, for a checkpoint written after `after_step` is trained: draws so far, each dataset's
        (epoch, offset), the next draw index, and (with `after_step`) the draws of the later steps handed out
        already (`reserved`, by step) and the draws no step holds (`free`), as [index, dataset, epoch, offset].
        """
        with self._lock:
            out: dict[str, Any] = {"draws": self.draws, "index": self.index,
                                   "positions": {n: (s.epoch, s.offset) for n, s in self.samplers.items()}}
            if after_step is None:
                return out
            free = list(self._free)
            reserved: dict[int, list[Draw]] = {}
            for s in sorted(set(self._owned) | set(self._reserved)):
                held = self._owned.get(s, []) + self._reserved.get(s, [])
                if s > after_step:
                    reserved[s] = held
                else:                                   # trained: what it took is used, the rest is free
                    free += self._reserved.get(s, [])
            out["reserved"] = {s: [d.to_state() for d in ds] for s, ds in reserved.items() if ds}
            out["free"] = [d.to_state() for d in sorted(free, key=lambda d: d.index)]
            return out

    def set_state(self, state: dict) -> None:
        """Continue from `state()` (also from a checkpoint written before draws were numbered)."""
        with self._lock:
            self.draws = state["draws"]
            self.index = state.get("index", state["draws"])
            for n, pos in state["positions"].items():
                if n in self.samplers:
                    self.samplers[n].set_position(*pos)
            self._owned = {}
            self._reserved = {int(s): [d for d in map(self._restore, ds) if d is not None]
                              for s, ds in state.get("reserved", {}).items()}
            self._free = [d for d in map(self._restore, state.get("free", [])) if d is not None]

    def _restore(self, rec: list[Any]) -> Draw | None:
        index, dataset, epoch, offset = rec
        if dataset not in self.samplers:             # the config no longer has that dataset
            return None
        return Draw(index, dataset, epoch, offset, self.samplers[dataset].task_at(epoch, offset))

    def _new_draw(self, dataset: str | None = None) -> Draw:
        with self._lock:
            if dataset is None:
                names = list(self.samplers)
                dataset = names[0] if len(names) == 1 else random.Random(f"{self.seed}:mix:{self.draws}").choices(
                    names, [self.weights[n] for n in names])[0]
                self.draws += 1
            sampler = self.samplers[dataset]
            (task,) = sampler.next_batch(1)
            draw = Draw(self.index, dataset, sampler.epoch, sampler.offset - 1, task)
            self.index += 1
            return draw
