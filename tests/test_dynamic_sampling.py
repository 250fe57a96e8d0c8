"""Dynamic sampling (DAPO): groups whose rewards are all equal are dropped and replaced by extra tasks
within `max_oversample`; every episode stays in the ledger, trained once or left out with its reason. A task
drawn twice in one step is two groups with their own seeds; a group of one episode is kept (verl); under
`failed_episode_policy: drop_group` a group with a failure is refilled."""

import json
import textwrap

import pytest

from ajet.algorithm.sampling import groups_with_signal, no_success_groups, zero_std_groups
from ajet.config import AjetConfig, load_config
from ajet.episode import Episode
from ajet.task import Task
from ajet.trainer import run
from ajet.trajectory_store import TrajectoryStore

WORKFLOW = '''
import asyncio

from ajet.workflow import Workflow, WorkflowOutput

STARTED = set()   # the tasks whose episodes have started (the module is loaded once per file: per test)


class RepeatReward(Workflow):
    """One policy call; tasks "flat*" always score 1 (a group without signal), "win*" twice their repeat index,
    the others their repeat index (every group has signal); on tasks "fail*" the third repeat (index 2) raises.
    Tasks "wait*" first wait (at most 60 s) until an episode of a "var*" task has started, and answer whether one
    did."""

    async def execute(self, task, tuner):
        STARTED.add(task.task_id)
        seen = None
        if task.task_id.startswith("wait"):
            for _ in range(600):
                if seen := any(t.startswith("var") for t in STARTED):
                    break
                await asyncio.sleep(0.1)
        r = await tuner.client.chat.completions.create(model=tuner.model,
                                                       messages=[{"role": "user", "content": task.query}])
        repeat = int(tuner.episode_id.rsplit("-r", 1)[1])
        if task.task_id.startswith("fail") and repeat >= 2:
            raise RuntimeError("this repeat of a fail* task always fails")
        answer = r.choices[0].message.content or ""
        scale = 2.0 if task.task_id.startswith("win") else 1.0
        return WorkflowOutput(reward=1.0 if task.task_id.startswith("flat") else scale * repeat,
                              final_answer=answer if seen is None else f"var started: {seen}")
'''
TASKS = ["flat0", "flat1", "var0", "var1", "flat2", "var2", "flat3", "flat4", "flat5", "flat6", "var3", "var4"]


def _ep(group, reward, i=0):
    return Episode(episode_id=f"{group}-{i}", task=Task(task_id=group, query="q"), group_id=group, repeat_index=i,
                   reward=reward, error=None if reward is not None else "boom")


def test_zero_std_groups_are_those_whose_successful_episodes_agree():
    eps = [_ep("a", 1.0, 0), _ep("a", 1.0, 1), _ep("b", 0.0, 0), _ep("b", 1.0, 1), _ep("c", 2.0, 0),
           _ep("c", None, 1), _ep("d", None, 0), _ep("e", 0.5, 0), _ep("e", 0.5, 1), _ep("e", 0.25, 2)]
    # a: equal; c: one success (nothing to compare with); d: no success (nothing to drop); e: 0.5 vs 0.25
    assert zero_std_groups(eps) == ["a", "c"]
    assert groups_with_signal(eps) == ["b", "e"]


def test_with_a_success_reward_a_group_that_never_reached_it_has_no_signal():
    """success_reward 1.0 (the main job's right answer; its bonuses are 0.1 and 0.2): a group whose rewards differ
    only by bonuses is dropped; one that reached 1.0 exactly is kept; a group of one episode is kept (as verl)."""
    eps = [_ep("bonus", 0.1, 0), _ep("bonus", 0.2, 1), _ep("bonus", 0.0, 2),     # differences, no success
           _ep("right", 1.2, 0), _ep("right", 0.1, 1),                           # a success: its bonus counts
           _ep("exact", 1.0, 0), _ep("exact", 0.0, 1),                           # reached it exactly: kept
           _ep("flat", 1.1, 0), _ep("flat", 1.1, 1),                             # zero-std: dropped as before
           _ep("lone", 0.1, 0),                                                  # a group of one: kept
           _ep("failed", None, 0), _ep("failed", 0.1, 1), _ep("failed", 0.2, 2)]  # a failure, no success
    assert no_success_groups(eps, 1.0) == ["bonus", "failed"]
    assert no_success_groups(eps, None) == []
    assert groups_with_signal(eps, success_reward=1.0) == ["right", "exact", "lone"]
    assert groups_with_signal(eps) == ["bonus", "right", "exact", "lone", "failed"]


def test_groups_without_a_success_are_replaced_and_recorded_with_their_reason(tiny_model_dir, tmp_path):
    """success_reward 1.5: "var*" groups (rewards 0, 1: a signal, no success) are dropped like the zero-std
    "flat*" ones and replaced; "win*" groups (0, 2) train."""
    tasks = ["var0", "win0", "flat0", "win1", "var1"]
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=tasks,
                    algorithm=", dynamic_sampling: {enabled: true, max_oversample: 3, success_reward: 1.5}"))
    (m,) = _metrics(exp)
    assert (m["rollout/no_success_groups"], m["rollout/zero_std_groups"], m["rollout/oversampled_tasks"]) == (1, 1, 2)
    assert m["rollout/trained_episodes"] == 4 and m["rollout/not_trained/no_success_group"] == 2
    store = TrajectoryStore(exp / "trajectories.sqlite")
    ledger, records = store.ledger(), store.episodes()
    store.close()
    task_of = {r["episode_id"]: r["task"]["task_id"] for r in records}
    reasons = {task_of[e["episode_id"]]: e["not_trained"] for e in ledger}
    assert reasons == {"var0": "no_success_group", "win0": None, "flat0": "zero_std_group", "win1": None}


def _conf(tmp_path, tiny_model_dir, steps, enabled=True, exp="exp", resume=False, tasks=TASKS, num_repeat=2,
          rollout="", algorithm=""):
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"task_id": t, "query": f"Say {t}."}) + "\n"
                                                  for t in tasks))
    (tmp_path / "conf.yaml").write_text(textwrap.dedent(f"""
        workflow: wf.py:RepeatReward
        model: {{path: "{tiny_model_dir}", max_model_len: 256}}
        data: {{train_path: tasks.jsonl, shuffle: false}}
        rollout: {{num_repeat: {num_repeat}, max_tokens: 4, temperature: 1.0{rollout}}}
        algorithm: {{lr: 1.0e-3, dynamic_sampling: {{enabled: {str(enabled).lower()}, max_oversample: 3}}{algorithm}}}
        trainer: {{total_steps: {steps}, tasks_per_step: 2, tensorboard: false, exp_dir: "{tmp_path / exp}",
                   resume: {str(resume).lower()}}}
    """))
    return load_config(tmp_path / "conf.yaml")


def _metrics(exp):
    return [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines() if '"val/' not in line]


def test_zero_std_groups_are_replaced_within_the_bound_and_every_episode_is_accounted_for(tiny_model_dir, tmp_path):
    exp = run(_conf(tmp_path, tiny_model_dir, steps=2))
    m1, m2 = _metrics(exp)
    # step 1: flat0, flat1 have no signal -> 2 extra tasks (var0, var1) fill the step
    assert (m1["rollout/zero_std_groups"], m1["rollout/oversampled_tasks"], m1["rollout/trained_episodes"]) == (2, 2, 4)
    assert m1["rollout/episodes"] == 8 and m1["rollout/not_trained/zero_std_group"] == 4
    # step 2: flat2, var2, then flat3, flat4, flat5 (the bound, 3) and still one group short: train on var2 alone
    assert (m2["rollout/zero_std_groups"], m2["rollout/oversampled_tasks"], m2["rollout/trained_episodes"]) == (4, 3, 2)
    store = TrajectoryStore(exp / "trajectories.sqlite")
    ledger, records = store.ledger(), store.episodes()
    store.close()
    assert len(ledger) == 18 and len({e["episode_id"] for e in ledger}) == 18
    task_of = {r["episode_id"]: r["task"]["task_id"] for r in records}
    for e in ledger:   # each episode trained exactly once, or left out with its reason; never both, never neither
        flat = task_of[e["episode_id"]].startswith("flat")
        assert e["ok"] and not e["abandoned"]
        assert (e["trained_in"], e["not_trained"]) == (([], "zero_std_group") if flat else ([(e["step"], 0)], None))
    assert sorted(task_of.values()) == sorted(t for t in TASKS[:9] for _ in range(2))
    from ajet.viewer.run_reader import RunReader   # `ajet view` shows the reason on the episode

    flat_id = next(e for e, t in task_of.items() if t.startswith("flat"))
    assert RunReader(exp).episode(flat_id)["not_trained"] == "zero_std_group"


def test_resume_after_an_oversampled_step_continues_with_the_next_task(tiny_model_dir, tmp_path):
    run(_conf(tmp_path, tiny_model_dir, steps=1))
    exp = run(_conf(tmp_path, tiny_model_dir, steps=2, resume=True))
    store = TrajectoryStore(exp / "trajectories.sqlite")
    step2 = [r["task"]["task_id"] for r in store.episodes(step=2)]
    store.close()
    # the sampler position after var1: flat2, var2, then the extra tasks flat3, flat4, flat5 (two repeats each);
    # episodes are stored as they finish, so compare as a multiset
    assert sorted(step2) == sorted(t for t in ["flat2", "var2", "flat3", "flat4", "flat5"] for _ in range(2))


def test_a_source_that_cannot_roll_out_more_tasks_is_refused_by_name():
    from ajet.errors import ConfigError
    from ajet.rollout.dynamic_sampling import DynamicSampling

    class Fixed:
        def collect(self, step):
            return []

    cfg = AjetConfig(workflow="x:y", data={"train_path": "x"}, model={"path": "m"},
                     algorithm={"dynamic_sampling": {"enabled": True}})
    with pytest.raises(ConfigError, match="Fixed cannot: set algorithm.dynamic_sampling.enabled: false"):
        DynamicSampling(Fixed(), cfg)


def test_an_episode_left_out_on_purpose_is_not_adopted_again_unless_its_step_was_rolled_back(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    a0 = store.begin_attempt(0)
    for eid in ("x", "y", "z"):
        store.add_episode(1, a0, _ep(eid, 1.0).to_dict())
    store.mark_trained(1, a0, [("x-0", a0)], [("y-0", a0, "zero_std_group")])
    assert [r["episode_id"] for r in store.untrained()] == ["z-0"]        # y is not a leftover to adopt
    assert {e["episode_id"]: e["not_trained"] for e in store.ledger()} == {"x-0": None, "y-0": "zero_std_group",
                                                                            "z-0": None}
    store.begin_attempt(0)                                                 # a resume from before step 1
    fates = {e["episode_id"]: e for e in store.ledger()}
    assert fates["y-0"]["not_trained"] is None and fates["y-0"]["abandoned"]   # that decision was rolled back too
    store.close()


def _store(exp):
    store = TrajectoryStore(exp / "trajectories.sqlite")
    try:
        return store.ledger(), store.episodes()
    finally:
        store.close()


def test_a_task_drawn_twice_in_a_step_is_two_groups_with_their_own_seeds(tiny_model_dir, tmp_path):
    """Three tasks, two per step, up to three extra: step 1 draws flat0, var0, then flat1, and wraps into the
    next epoch for flat0 and var0 again. Each draw is its own group (five), and the two var0 groups sampled
    different tokens: they are not one group of four episodes holding two byte-identical pairs."""
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=["flat0", "var0", "flat1"]))
    (m,) = _metrics(exp)
    assert (m["rollout/episodes"], m["rollout/oversampled_tasks"], m["rollout/trained_episodes"]) == (10, 3, 4)
    ledger, records = _store(exp)
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["group_id"], []).append(r)
    assert len(groups) == 5 and all(len(g) == 2 for g in groups.values())
    assert sorted(g[0]["task"]["task_id"] for g in groups.values()) == ["flat0", "flat0", "flat1", "var0", "var0"]
    var = [g for g in groups.values() if g[0]["task"]["task_id"] == "var0"]
    tokens = [{r["repeat_index"]: r["calls"][0]["completion_ids"] for r in g} for g in var]
    assert tokens[0][0] != tokens[1][0] and tokens[0][1] != tokens[1][1]     # their own seeds
    trained = {r["episode_id"] for r in records if r["task"]["task_id"] == "var0"}
    assert {e["episode_id"] for e in ledger if e["trained_in"]} == trained and len(trained) == 4


def test_a_refill_asks_for_no_more_than_the_remaining_budget(tiny_model_dir, tmp_path):
    """Two tasks per step, three extra at most: flat0 and flat1 miss two groups, flat2 and flat3 still miss two,
    and the budget has one left: one more task (var0), not two."""
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=["flat0", "flat1", "flat2", "flat3", "var0", "var1"]))
    (m,) = _metrics(exp)
    assert (m["rollout/episodes"], m["rollout/oversampled_tasks"], m["rollout/trained_episodes"]) == (10, 3, 2)
    _, records = _store(exp)
    assert sorted({r["task"]["task_id"] for r in records}) == ["flat0", "flat1", "flat2", "flat3", "var0"]


def test_groups_of_one_episode_are_kept_as_verl_keeps_them(tiny_model_dir, tmp_path):
    """`num_repeat: 1` (REINFORCE++, no group baseline): every group has one episode; dynamic sampling keeps
    them all (verl's DAPO filter keeps a prompt with one trajectory) instead of dropping every group."""
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=["flat0", "var0", "flat1", "var1"], num_repeat=1,
                    algorithm=", adv_estimator: reinforce_plus_plus"))
    (m,) = _metrics(exp)
    assert (m["rollout/zero_std_groups"], m["rollout/oversampled_tasks"], m["rollout/trained_episodes"]) == (0, 0, 2)
    assert m["tracker/trained_samples"] == 2 and "rollout/not_trained/zero_std_group" not in m
    ledger, _ = _store(exp)
    assert len(ledger) == 2 and all(e["trained_in"] == [(1, 0)] for e in ledger)
    one = [_ep("a", 1.0), _ep("b", 1.0, 0), _ep("b", 1.0, 1)]
    assert zero_std_groups(one) == ["b"] and groups_with_signal(one) == ["a"]


def test_drop_group_refills_a_group_with_a_failed_episode(tiny_model_dir, tmp_path):
    """`failed_episode_policy: drop_group`, three repeats: fail0's rewards differ (0, 1) but its third episode
    fails, so the trainer leaves the group out whole; dynamic sampling counts it as missing and rolls out
    var1, so the step trains two groups, as asked. fail0's successful episodes are left out as "failed_group"."""
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=["fail0", "var0", "var1", "var2"], num_repeat=3,
                    rollout=", failed_episode_policy: drop_group"))
    (m,) = _metrics(exp)
    assert (m["rollout/episodes"], m["rollout/failed"], m["rollout/oversampled_tasks"]) == (9, 1, 1)
    assert m["rollout/trained_episodes"] == 6 and m["rollout/not_trained/failed_group"] == 2
    ledger, records = _store(exp)
    task_of = {r["episode_id"]: r["task"]["task_id"] for r in records}
    assert sorted(task_of[e["episode_id"]] for e in ledger if e["trained_in"]) == ["var0"] * 3 + ["var1"] * 3
    fail0 = [e for e in ledger if task_of[e["episode_id"]] == "fail0"]
    assert sorted((e["ok"], e["not_trained"]) for e in fail0) == [(False, None), (True, "failed_group"),
                                                                    (True, "failed_group")]
    eps = [_ep("f", 0.0, 0), _ep("f", 1.0, 1), _ep("f", None, 2), _ep("v", 0.0, 0), _ep("v", 1.0, 1)]
    assert groups_with_signal(eps) == ["f", "v"] and groups_with_signal(eps, "drop_group") == ["v"]


def test_an_extra_task_starts_as_soon_as_the_group_it_replaces_has_finished(tiny_model_dir, tmp_path):
    """flat0 finishes at once without signal; wait0's episodes wait for an extra task's episode to start. The
    extra task (var0) starts beside them: refilled only once the step's tasks had all finished, wait0 would wait
    its whole 60 s and answer that none started."""
    exp = run(_conf(tmp_path, tiny_model_dir, steps=1, tasks=["flat0", "wait0", "var0", "var1"]))
    (m,) = _metrics(exp)
    assert (m["rollout/episodes"], m["rollout/oversampled_tasks"], m["rollout/trained_episodes"]) == (6, 1, 4)
    _, records = _store(exp)
    assert sorted(r["output"]["final_answer"] for r in records if r["task"]["task_id"] == "wait0") == \
        ["var started: True"] * 2


def test_refilling_while_the_step_runs_draws_and_samples_what_refilling_after_it_does(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """The same config run twice, extra tasks started early (the in-process source) and only once all the
    step's episodes have finished (the other sources' way, forced here): the same draws, episode ids, sampled
    tokens and rewards, the same ledger, and the same update (loss equal up to float rounding)."""
    from ajet.rollout.in_process import InProcessRollout

    def runs(exp):
        out = run(_conf(tmp_path, tiny_model_dir, steps=2, exp=exp))
        ledger, records = _store(out)
        tokens = {r["episode_id"]: (r["task"]["task_id"], r["reward"], [c["completion_ids"] for c in r["calls"]])
                  for r in records}
        return _metrics(out), sorted((e["episode_id"], e["trained_in"], e["not_trained"]) for e in ledger), tokens

    early = runs("early")
    monkeypatch.setattr(InProcessRollout, "refills_while_running", property(lambda self: False))
    late = runs("late")
    assert early[1] == late[1] and early[2] == late[2] and len(early[2]) == 18
    for m_early, m_late in zip(early[0], late[0]):
        for key in ("rollout/episodes", "rollout/oversampled_tasks", "rollout/trained_episodes",
                    "rollout/zero_std_groups", "tracker/trained_samples"):
            assert m_early[key] == m_late[key], key
        assert m_early["train/loss"] == pytest.approx(m_late["train/loss"], rel=1e-4, abs=1e-6)
