"""Fine-tuning on recorded traces: the samples a finished run recorded, replayed as a rollout source.

Rejection-sampling fine-tuning (RFT; Yuan et al. 2023, "Scaling Relationship on Learning Mathematical Reasoning
with Large Language Models"): keep the episodes whose reward is at least `sft.min_reward` and train on their
samples with the supervised objective (token-level cross-entropy on the loss-mask-1 tokens,
`ajet.algorithm.loss.sft_loss`). The tokens are the recorded ones, exactly: each sample's `prompt_ids`,
`response_ids` and `loss_mask` as the run stored them in `trajectories.sqlite` (read through
`ajet.viewer.run_reader.RunReader`), or inside the records of `trajectories.jsonl` for a run without the
SQLite store. Nothing is re-tokenized or re-rendered; no call is generated.

    recorded = read_recorded(exp_dir, min_reward=1.0, agent=None)   # [RecordedEpisode], oldest first
    source = RecordedSource.from_context(ctx)                        # what `ajet sft` trains from

The one training loop (`ajet.trainer.run`) runs SFT in `sft_mode()`: this source instead of the workflow (no
datasets read, no generation), the backbone's update with the SFT objective (the config's `sft:` section).
`ajet export` (ajet/commands/export.py) writes the same samples as a Hugging Face `datasets` folder.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet.errors import ConfigError

if TYPE_CHECKING:
    from ajet.config import AjetConfig
    from ajet.episode import Episode
    from ajet.rollout import RolloutContext, RunMode
    from ajet.tracker.sample import Sample

_PAGE = 500   # RunReader's largest page


def sft_mode() -> RunMode:
    """`ajet sft`'s run mode (`ajet.trainer.run(cfg, sft_mode())`, cfg with an `sft:` section): the recorded episodes
    of `sft.from_dir` (`RecordedSource`), no datasets, their samples trained as stored (no staleness bound: they
    carry another run's policy versions)."""
    from ajet.rollout import Rollout, RunMode

    return RunMode(lambda ctx: Rollout(RecordedSource.from_context(ctx), staleness_bound=False))


def sft(cfg: AjetConfig) -> Path:
    """`ajet sft`: fine-tune on the recorded samples of `cfg.sft.from_dir` (`sft_mode`); returns the experiment folder.

    Raises:
        ConfigError: the filters keep no recorded episode, or `sft.from_dir` holds no recorded run; AjetError
            subclasses: what `ajet.trainer.run` raises.
    """
    from ajet.trainer import run

    return run(cfg, sft_mode())


@dataclass
class RecordedEpisode:
    """One successful episode of a recorded run and its samples, as stored.

    Attributes:
        record: the episode's stored record (`Episode.to_dict()`: task, calls, reward, ...).
        attempt: the trainer attempt that stored it; step: the step it was collected for.
        reward: its reward (finite: failed episodes are never read).
        samples: its samples as stored (`Sample.to_dict()` plus `trained`, `advantage`), filtered by agent.
        samples_source: where they come from: "store" (the samples table), "record" (inside the record),
            "rebuilt" (merged again from the calls by the context tracker: a store written before samples were
            kept) or "gateway" (a gateway's rated session no update took, merged from its calls in gateway.sqlite).
    """

    record: dict[str, Any]
    attempt: int
    step: int
    reward: float
    samples: list[dict[str, Any]]
    samples_source: str

    @property
    def episode_id(self) -> str:
        return self.record["episode_id"]


def read_recorded(exp_dir: str | Path, min_reward: float | None = None,
                  agent: str | None = None) -> list[RecordedEpisode]:
    """The successful episodes of a finished run with reward >= `min_reward`, each with its samples of agent
    `agent`, in the order the run stored them (every attempt: an episode a resumed run re-collected is a
    second, different episode).

    A gateway's folder (`ajet gateway`) also holds `gateway.sqlite`: its closed, rated sessions that are not in
    the trajectory store (rated after the gateway's last update, or not taken by one) come after the stored
    episodes, in the order their rewards arrived (`_from_gateway`).

    Args:
        exp_dir: the run's folder, holding `trajectories.sqlite` (preferred) or `trajectories.jsonl`, and/or a
            gateway's `gateway.sqlite`.
        min_reward: keep episodes whose reward is at least this (None: every successful episode).
        agent: keep only the samples of this agent tag (None: every agent); an episode left with no sample is dropped.

    Returns:
        [RecordedEpisode], possibly empty.

    Raises:
        ConfigError: `exp_dir` holds none of the three files.
    """
    exp_dir = Path(exp_dir)
    gateway = (exp_dir / "gateway.sqlite").is_file()
    if (exp_dir / "trajectories.sqlite").is_file():
        episodes = _from_store(exp_dir)
    elif (exp_dir / "trajectories.jsonl").is_file():
        episodes = _from_jsonl(exp_dir / "trajectories.jsonl")
    elif gateway:
        episodes = []
    else:
        raise ConfigError(f"sft.from_dir: {exp_dir} holds neither trajectories.sqlite nor trajectories.jsonl: pass the "
                          f"folder a finished run wrote (its trainer.exp_dir)")
    if gateway:
        episodes = _one_per_session(exp_dir, episodes)
        episodes += _from_gateway(exp_dir, {e.episode_id for e in episodes})
    out = []
    for e in episodes:
        if min_reward is not None and e.reward < min_reward:
            continue
        if agent is not None:
            e.samples = [s for s in e.samples if s.get("agent_tag") == agent]
        if e.samples:
            out.append(e)
    return out


def _one_per_session(exp_dir: Path, episodes: list[RecordedEpisode]) -> list[RecordedEpisode]:
    """A gateway's stored episodes with one row per session: an episode id is a session (or a best-of-N candidate),
    so a session stored by several attempts (a gateway stopped before its update was recorded takes it again after
    `--resume`) is the same conversation each time. Kept: the attempt a live update trained it in (the trajectory
    store's ledger), else the newest one; in the order of the rows kept."""
    if not (exp_dir / "trajectories.sqlite").is_file():
        return episodes
    from ajet.trajectory_store import TrajectoryStore

    store = TrajectoryStore(exp_dir / "trajectories.sqlite")
    try:
        trained = {(e["episode_id"], e["attempt"]) for e in store.ledger() if e["trained_in"]}
    finally:
        store.close()
    best: dict[str, RecordedEpisode] = {}
    for e in episodes:                             # storage order: a later attempt wins unless the earlier trained
        kept = best.get(e.episode_id)
        if kept is None or (e.episode_id, e.attempt) in trained or (kept.episode_id, kept.attempt) not in trained:
            best[e.episode_id] = e
    chosen = {id(e) for e in best.values()}
    return [e for e in episodes if id(e) in chosen]


def _from_store(exp_dir: Path) -> list[RecordedEpisode]:
    """Every successful episode of `exp_dir/trajectories.sqlite`, in storage order, with its stored samples."""
    from ajet.viewer.run_reader import RunReader

    reader = RunReader(exp_dir)
    bad = reader.bad_rows()
    if bad:   # one bad row never fails the folder: said, and left out
        print(f"ajet: skipped {len(bad)} stored row(s) of {exp_dir / 'trajectories.sqlite'} that are not valid JSON "
              f"(a NaN or infinity written by an older ajet): {', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else ""),
              file=sys.stderr, flush=True)
    order = {(eid, att): i for i, (eid, att) in enumerate(reader.db.execute(
        "SELECT episode_id, attempt FROM episodes ORDER BY rowid"))}
    rows: list[dict[str, Any]] = []
    while True:
        page = reader.episodes(failed=False, offset=len(rows), limit=_PAGE)["episodes"]
        rows += page
        if len(page) < _PAGE:
            break
    rows.sort(key=lambda r: order[(r["episode_id"], r["attempt"])])
    out = []
    for r in rows:
        if r["reward"] is None or not math.isfinite(r["reward"]):
            continue
        samples, source = reader.samples(r["episode_id"], r["attempt"])
        if any(s is None or not isinstance(s, dict) for s in samples) or any(
                f"sample {i} of episode {r['episode_id']} (attempt {r['attempt']})" in bad for i in range(len(samples))):
            continue
        record = json.loads(reader.db.execute("SELECT record FROM episodes WHERE episode_id = ? AND attempt = ?",
                                              (r["episode_id"], r["attempt"])).fetchone()[0])
        out.append(RecordedEpisode(record, r["attempt"], r["step"], float(r["reward"]), samples, source))
    return out


def _from_jsonl(path: Path) -> list[RecordedEpisode]:
    """Every successful episode of a `trajectories.jsonl` (one `{"step", **Episode.to_dict()}` per line; a torn
    last line is skipped), with the samples inside its record, else rebuilt from its calls."""
    from ajet.viewer.run_reader import rebuild_samples

    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        reward = record.get("reward")
        if record.get("error") is not None or reward is None or not math.isfinite(reward):
            continue
        samples, source = record.get("samples") or [], "record"
        if not samples and record.get("calls"):
            samples, source = rebuild_samples(record), "rebuilt"
        out.append(RecordedEpisode(record, record.get("attempt", 0), record.get("step", 0), float(reward), samples,
                                   source))
    return out


def _from_gateway(exp_dir: Path, stored: set[str]) -> list[RecordedEpisode]:
    """The closed, rated sessions of `exp_dir/gateway.sqlite` whose id is not in `stored` (the episodes of the
    trajectory store), in the order their latest rewards arrived: each an episode of its recorded calls (the exact
    prompt and sampled ids the engine saw), reward its latest feedback (client or judge), samples merged from the
    calls by the context tracker (`ajet.tracker.merge_calls`: loss mask 1 exactly on sampled tokens), as the
    gateway's own update would have merged them; step 0 and attempt 0 (never trained by the gateway), source
    "gateway". Best-of-N's unchosen candidates are not included."""
    from ajet.episode import Episode
    from ajet.gateway.store import GatewayStore
    from ajet.llm_call import LLMCall
    from ajet.task import Task
    from ajet.tracker import merge_calls
    from ajet.workflow import WorkflowOutput

    store = GatewayStore(exp_dir / "gateway.sqlite")
    try:
        sessions = store.sessions()
    finally:
        store.close()
    rated = sorted((s for s in sessions.values() if s.feedback and s.calls and s.closed_at is not None
                    and s.dropped is None and s.session_id not in stored),
                   key=lambda s: s.feedback[-1]["received_at"])
    out = []
    for s in rated:
        last = s.feedback[-1]
        calls = [LLMCall.from_dict(c) for c in s.calls]
        group_id = f"gateway-{s.session_id}"
        ep = Episode(s.session_id, Task(task_id=s.session_id, query=s.query,
                                        metadata={"session": s.session_id, "found_by": s.found_by}),
                     group_id, 0, calls=calls, reward=last["reward"],
                     output=WorkflowOutput(reward=last["reward"], final_answer=_answer(s.calls[-1]),
                                           metadata={"reward_source": last["source"], "comment": last["comment"]}))
        samples = [{**x.to_dict(), "trained": False} for x in merge_calls(calls, group_id)]
        out.append(RecordedEpisode(ep.to_dict(), 0, 0, float(last["reward"]), samples, "gateway"))
    return out


def _answer(call: dict[str, Any]) -> str:
    content = (call.get("response_message") or {}).get("content")
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def to_sample(d: dict[str, Any], episode_id: str) -> Sample:
    """A `Sample` with a stored sample's tokens, loss mask, logprobs and sampling settings unchanged
    (fields this version does not know are dropped), belonging to `episode_id`."""
    from ajet.tracker.sample import Sample

    known = {f.name for f in fields(Sample)}
    return Sample(**{**{k: v for k, v in d.items() if k in known}, "episode_id": episode_id, "advantage": 0.0})


class RecordedSource:
    """A `RolloutSource` (ajet/rollout/__init__.py) that replays a finished run's recorded samples: no generation.

    Each step hands out `sft.episodes_per_step` of the kept episodes (None: all of them, so each step is one
    pass), in the order the run stored them, continuing where the last step stopped and starting over after
    the last. A replayed episode gets the id `sft<step>-<its id>` (unique within this run's store), keeps its
    reward, calls and samples (the samples' tokens and loss masks exactly as stored), and names where it came
    from in its task's metadata (`sft_source`: exp_dir, episode_id, attempt). Each is committed to this run's
    store through `ctx.record`, like any finished episode.

    Raises:
        ConfigError: (from `from_context`) `sft.from_dir` is this run's own folder, or the filters keep nothing.
    """

    def __init__(self, ctx: RolloutContext, recorded: list[RecordedEpisode], from_dir: Path):
        self.ctx, self.recorded, self.from_dir = ctx, recorded, from_dir
        n = ctx.cfg.sft.episodes_per_step
        self.per_step = len(recorded) if n is None else n
        self.next = 0   # index into `recorded` of the next episode to hand out
        self._metrics: dict[str, Any] = {}

    @classmethod
    def from_context(cls, ctx: RolloutContext) -> RecordedSource:
        """The source of `ctx.cfg.sft` (relative `from_dir` resolves against the working directory)."""
        sft = ctx.cfg.sft
        from_dir = Path(sft.from_dir).expanduser().resolve()   # not the run's own folder: the config's check
        recorded = read_recorded(from_dir, sft.min_reward, sft.agent)
        if not recorded:
            raise ConfigError(f"sft: no recorded sample of {from_dir} passes the filters (sft.min_reward="
                              f"{sft.min_reward}, sft.agent={sft.agent}): lower --min-reward or check --agent "
                              f"(`ajet show {from_dir}` lists the episodes with their rewards and agents)")
        return cls(ctx, recorded, from_dir)

    def bind(self, proxy) -> None:
        """Nothing to serve: the episodes are recorded already."""

    def collect(self, step: int) -> list[Episode]:
        """The step's recorded episodes (see the class docstring), each committed through `ctx.record`, with their
        samples set (the trainer keeps them: it merges calls only for episodes without samples)."""
        out = []
        for _ in range(self.per_step):
            r = self.recorded[self.next % len(self.recorded)]
            self.next += 1
            ep = self._episode(step, r)
            self.ctx.record(step, ep)
            out.append(ep)
        rewards = [e.reward for e in out]
        self._metrics = {"sft/kept_episodes": len(self.recorded), "sft/epoch": self.next / len(self.recorded),
                         "sft/reward_mean": sum(rewards) / len(rewards)}
        return out

    def _episode(self, step: int, r: RecordedEpisode) -> Episode:
        from dataclasses import replace

        from ajet.episode import Episode

        prefix = f"sft{step}-"   # ids unique within this run's store (an episode may be replayed every step)
        eid = prefix + r.episode_id

        def renamed(c: dict[str, Any]) -> dict[str, Any]:
            parent = c.get("prompt_parent")
            return {**c, "call_id": prefix + c["call_id"], "episode_id": eid,
                    "prompt_parent": None if parent is None else prefix + parent}

        ep = Episode.from_dict({**r.record, "episode_id": eid, "attempt": self.ctx.attempt,
                                "calls": [renamed(c) for c in r.record.get("calls", [])]})
        ep.task = replace(ep.task, metadata={**ep.task.metadata, "sft_source": {
            "exp_dir": str(self.from_dir), "episode_id": r.episode_id, "attempt": r.attempt}})
        ep.group_id = f"sft{step}-{ep.group_id}"
        ep.samples = [to_sample({**s, "group_id": ep.group_id, "call_ids": [prefix + c for c in s.get("call_ids", [])]},
                                eid) for s in r.samples]
        return ep

    def step_done(self, step: int) -> None:
        pass

    def state_dict(self, step: int) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state.get("next", 0)

    def metrics(self) -> dict[str, Any]:
        return dict(self._metrics)

    def close(self) -> None:
        pass
