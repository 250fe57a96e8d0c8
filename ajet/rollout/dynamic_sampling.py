"""Dynamic sampling as a rollout-source wrapper: the trainer's one loop asks it for a step's episodes as
it asks any source; it drops the groups without signal (ajet/algorithm/sampling.py) and asks the source
for more tasks until the step has `trainer.tasks_per_step` groups with signal, or `max_oversample` extra
tasks were rolled out (DAPO, Yu et al. 2025, sec. 3.2). The in-process source starts each extra task as soon
as the group it replaces has finished, beside the groups still running (`collect_refilling`). Under
`rollout.failed_episode_policy: drop_group` a group with a failed episode is not counted: the trainer leaves it
out whole, so it is refilled too.

Nothing is lost: every episode it was handed is returned (and was committed to the store by the source);
the dropped groups' episodes carry `not_trained = "zero_std_group"` (or `"no_success_group"`, with
`success_reward`), which the trainer records in the ledger instead of training them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ajet.algorithm.sampling import (NO_SUCCESS_REASON, ZERO_STD_REASON, groups_with_signal, no_success_groups,
                                     zero_std_groups)
from ajet.errors import ConfigError
from ajet.progress import active
from ajet.rollout import RefillableSource

if TYPE_CHECKING:
    from ajet.config import AjetConfig
    from ajet.episode import Episode
    from ajet.proxy.server import ProxyServer
    from ajet.rollout import RefillingSource, RolloutSource


class DynamicSampling:
    """A `RolloutSource` over a `RefillableSource` (one that rolls out extra tasks: `collect_more`); `bind`,
    `step_done`, `state_dict`, `load_state_dict` and `close` are the wrapped source's.

    Args:
        source: the rollout source.
        cfg: the experiment config (`trainer.tasks_per_step`, `algorithm.dynamic_sampling.max_oversample`,
            `rollout.failed_episode_policy`).

    Raises:
        ConfigError: the source is no `RefillableSource` (it cannot roll out extra tasks).
    """

    def __init__(self, source: RefillableSource, cfg: AjetConfig):
        if not isinstance(source, RefillableSource):
            raise ConfigError(f"algorithm.dynamic_sampling needs a rollout source that can roll out extra tasks; "
                              f"{type(source).__name__} cannot: set algorithm.dynamic_sampling.enabled: false")
        self.source, self.tasks_per_step = source, cfg.trainer.tasks_per_step
        self.max_oversample = cfg.algorithm.dynamic_sampling.max_oversample
        self.success_reward = cfg.algorithm.dynamic_sampling.success_reward
        self.failed_episode_policy = cfg.rollout.failed_episode_policy
        self.num_repeat = cfg.rollout.num_repeat
        self.oversampled = self.no_success = 0

    def collect(self, step: int) -> list[Episode]:
        """The source's episodes of `step` plus those of up to `max_oversample` extra tasks, grouped; the
        episodes of every group without signal get `not_trained = "zero_std_group"` (`"no_success_group"`: no
        episode reached `success_reward`).

        One extra task replaces each group found without signal, within `max_oversample` (`_refill`). A source
        that `refills_while_running` starts it as soon as that group has finished (`collect_refilling`), beside
        the groups still running; any other is asked for the groups still missing once all it rolled out has
        finished (`collect_more`), again until none is missing or the budget is spent. Both draw the same tasks:
        the first of the sampler's that give `tasks_per_step` groups with signal, or `tasks_per_step +
        max_oversample` tasks."""
        self.oversampled = 0
        if self.source.refills_while_running:
            refilling: RefillingSource = self.source   # (declared by refills_while_running)
            episodes = refilling.collect_refilling(step, self._refill)
        else:
            episodes = self.source.collect(step)
            while (n := self._refill(episodes)) > 0:
                episodes += self.source.collect_more(step, n)
        flat = set(zero_std_groups(episodes))
        unsolved = set(no_success_groups(episodes, self.success_reward)) - flat
        self.no_success = len(unsolved)
        for e in episodes:
            if e.ok and e.not_trained is None and e.group_id in flat | unsolved:
                e.not_trained = ZERO_STD_REASON if e.group_id in flat else NO_SUCCESS_REASON
        return episodes

    def _refill(self, finished: list[Episode]) -> int:
        """How many extra tasks to draw now, given the episodes of the step's finished groups (the step's tasks
        and the extra ones drawn so far, or some of them): one for each finished group without signal that no
        extra task replaces yet, within what is left of `max_oversample`. Counted into `oversampled`."""
        signal = groups_with_signal(finished, self.failed_episode_policy, self.success_reward)
        without_signal = len({e.group_id for e in finished}) - len(signal)
        n = min(without_signal - self.oversampled, self.max_oversample - self.oversampled)
        if n <= 0:
            return 0
        if (bar := active("step")) is not None and bar.total is not None:   # the rollout display waits for more
            bar.set(total=bar.total + n * self.num_repeat, extra_tasks=self.oversampled + n)
        self.oversampled += n
        return n

    def metrics(self) -> dict[str, Any]:
        extra = {"rollout/no_success_groups": self.no_success} if self.success_reward is not None else {}
        return {**self.source.metrics(), "rollout/oversampled_tasks": self.oversampled, **extra}

    def bind(self, proxy: ProxyServer) -> None:
        self.source.bind(proxy)

    def step_done(self, step: int) -> None:
        self.source.step_done(step)

    def state_dict(self, step: int) -> dict[str, Any]:
        return self.source.state_dict(step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def close(self) -> None:
        self.source.close()


def with_dynamic_sampling(source: RefillableSource, cfg: AjetConfig) -> RolloutSource:
    """`source` wrapped by `DynamicSampling` when `algorithm.dynamic_sampling.enabled`, else `source` itself.

    Raises:
        ConfigError: dynamic sampling is on and `source` cannot roll out extra tasks.
    """
    return DynamicSampling(source, cfg) if cfg.algorithm.dynamic_sampling.enabled else source
