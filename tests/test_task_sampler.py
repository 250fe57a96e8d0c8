"""The task sampler's numbered draws: a checkpoint after step t keeps the draws of later steps handed out
already (asynchronous training draws ahead; dynamic sampling's extra tasks for step t come after them), and a
resumed sampler hands each step exactly its draws again; a draw a resumed step no longer needs goes to the next."""

import sys
import threading

from ajet.task import Task
from ajet.task_sampler import MultiTaskSampler

TASKS = [Task(f"t{i}", f"q{i}") for i in range(5)]
PER_THREAD = 10000


def _sampler():
    return MultiTaskSampler({"train": TASKS}, None, False, 0)   # not shuffled: draw k is t<k mod 5>


def _ids(draws):
    return [(d.index, d.task.task_id) for d in draws]


def test_a_checkpoint_keeps_the_later_steps_draws_and_a_resume_hands_them_out_again():
    s = _sampler()
    assert _ids(s.draw(1, 2)) == [(0, "t0"), (1, "t1")]
    assert _ids(s.draw(2, 2)) == [(2, "t2"), (3, "t3")]      # the producer draws step 2 ahead
    assert _ids(s.draw(1, 1)) == [(4, "t4")]                 # then step 1's extra task
    s.retire(1)
    state = s.state(after_step=1)                           # the checkpoint after step 1
    assert state["reserved"] == {2: [[2, "train", 0, 2], [3, "train", 0, 3]]} and state["free"] == []
    assert _ids(s.draw(3, 2)) == [(5, "t0"), (6, "t1")]      # drawn after the checkpoint (epoch 1)

    r = _sampler()
    r.set_state(state)
    assert _ids(r.draw(2, 2)) == [(2, "t2"), (3, "t3")]      # step 2's own draws, not t0 / t1 of the next epoch
    assert _ids(r.draw(3, 2)) == [(5, "t0"), (6, "t1")]
    assert _ids(r.draw(2, 1)) == [(7, "t2")]
    assert _ids(r.drawn(2)) == [(2, "t2"), (3, "t3"), (7, "t2")]


def test_a_draw_the_resumed_step_does_not_take_goes_to_the_next_draw():
    s = _sampler()
    s.draw(1, 1)
    s.draw(2, 3)
    state = s.state(after_step=1)
    r = _sampler()
    r.set_state(state)
    assert _ids(r.draw(2, 2)) == [(1, "t1"), (2, "t2")]
    r.retire(2)                                              # step 2 trained without its third draw
    assert _ids(r.draw(3, 2)) == [(3, "t3"), (4, "t4")]      # draw 3 first, then a new one: none skipped
    assert r.state(after_step=3)["free"] == [] and r.index == 5


def test_a_checkpoint_written_before_draws_were_numbered_continues_from_its_position():
    r = _sampler()
    r.set_state({"draws": 3, "positions": {"train": (0, 3)}})
    assert _ids(r.draw(2, 3)) == [(3, "t3"), (4, "t4"), (5, "t0")]


def test_two_threads_drawing_at_once_hand_out_each_draw_once():
    """The producer thread (asynchronous training) and the trainer's thread (dynamic sampling) draw at once:
    every index once, and the tasks are the sequence's, in order."""
    s = MultiTaskSampler({"train": [Task(f"t{i}", "q") for i in range(7)]}, None, True, 3)
    got: dict[int, list] = {1: [], 2: []}
    start = threading.Barrier(2)

    def worker(step):
        start.wait()
        for _ in range(PER_THREAD):
            got[step] += s.draw(step, 1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in (1, 2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                  # switch threads as often as the interpreter can: races show
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    draws = sorted(got[1] + got[2], key=lambda d: d.index)
    assert [d.index for d in draws] == list(range(2 * PER_THREAD))
    seq = MultiTaskSampler({"train": [Task(f"t{i}", "q") for i in range(7)]}, None, True, 3)
    assert [d.task.task_id for d in draws] == [t.task_id for t in seq.next_batch(2 * PER_THREAD)]
