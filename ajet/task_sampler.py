"""Deterministic task order: epochs of a seeded shuffle, consumed `tasks_per_step` at a time."""

from __future__ import annotations

import random

from ajet.task import Task


class TaskSampler:
    """Yields batches of tasks; each epoch is a fresh permutation drawn from `seed` and the epoch number.

    The position (epoch, offset) is all the state, so a run can be resumed exactly.
    """

    def __init__(self, tasks: list[Task], shuffle: bool = True, seed: int = 0):
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
