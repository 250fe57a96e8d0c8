"""Deterministic task order: epochs of a seeded shuffle, consumed `tasks_per_step` at a time; several
datasets mixed by weight (`MultiTaskSampler`)."""

from __future__ import annotations

import random

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


class MultiTaskSampler:
    """Tasks from several named datasets ("cocktail" training): each draw without a named dataset picks
    one by weight (draw k uses `Random(f"{seed}:mix:{k}")`, so the mix is reproducible), then takes that
    dataset's next task in its own `TaskSampler` order. With one dataset it is exactly `TaskSampler`.

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

    def next_task(self, dataset: str | None = None) -> tuple[str, Task]:
        """(dataset name, its next task): from `dataset`, or from one drawn by weight.

        Raises:
            KeyError: `dataset` is not one of the datasets.
        """
        if dataset is None:
            names = list(self.samplers)
            dataset = names[0] if len(names) == 1 else random.Random(f"{self.seed}:mix:{self.draws}").choices(
                names, [self.weights[n] for n in names])[0]
            self.draws += 1
        (task,) = self.samplers[dataset].next_batch(1)
        return dataset, task

    def next_batch(self, n: int) -> list[Task]:
        """`n` tasks, each from a dataset drawn by weight."""
        return [self.next_task()[1] for _ in range(n)]

    def state(self) -> dict:
        """The position (for a checkpoint): draws so far and each dataset's (epoch, offset)."""
        return {"draws": self.draws, "positions": {n: (s.epoch, s.offset) for n, s in self.samplers.items()}}

    def set_state(self, state: dict) -> None:
        self.draws = state["draws"]
        for n, pos in state["positions"].items():
            if n in self.samplers:
                self.samplers[n].set_position(*pos)
