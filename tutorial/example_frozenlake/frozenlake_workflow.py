"""FrozenLake (gymnasium `FrozenLake-v1`, not slippery) as a multi-turn chat: one action per turn.

Each turn the agent sees the board (P = the player, F = frozen, H = hole, G = goal) and answers with one
move (Left, Down, Right or Up); the environment steps, and the next turn appends the new board to the same
conversation. Every call extends the previous one, so the context tracker merges the whole episode into
one training sample (loss mask 1 on the moves, 0 on the boards). The environment's reward (1 at the goal)
and the count of unparseable moves go to the metrics; `ajet.judges:frozenlake_judge` turns them into the
episode reward.
"""

from __future__ import annotations

import re

from ajet import Task, Tuner, Workflow, WorkflowOutput

MAX_TURNS = 6
ACTIONS = {"left": 0, "down": 1, "right": 2, "up": 3}
SYSTEM_PROMPT = ("You play FrozenLake on a grid. P is you, F is safe ice, H is a hole, G is the goal. "
                 "Reach G without stepping into H. Answer each turn with one word: Left, Down, Right or Up.")


def render(desc: list[str], state: int) -> str:
    """The board as text rows with the player's cell shown as P."""
    n = len(desc[0])
    rows = [list(r) for r in desc]
    rows[state // n][state % n] = "P"
    return "\n".join("".join(r) for r in rows)


def parse_action(text: str | None) -> int | None:
    """The first move word in `text` (any case), as a FrozenLake action id; None when there is none."""
    m = re.search(r"\b(left|down|right|up)\b", text or "", flags=re.I)
    return ACTIONS[m.group(1).lower()] if m else None


class FrozenLakeWorkflow(Workflow):
    """One episode on the map in `task.metadata["desc"]` (rows of S/F/H/G). Metrics: success (the
    environment's reward), invalid_actions, turns."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        import gymnasium as gym

        desc = list(task.metadata["desc"])
        env = gym.make("FrozenLake-v1", desc=desc, is_slippery=False)
        state, _ = env.reset(seed=0)
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"{render(desc, state)}\nYour move?"}]
        reward, invalid, moves, done = 0.0, 0, [], False
        turn = 0
        for turn in range(1, MAX_TURNS + 1):
            r = await tuner.client.chat.completions.create(model=tuner.model, messages=messages)
            text = r.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            action = parse_action(text)
            if action is None:
                invalid += 1
                feedback = "That is not a move. Answer Left, Down, Right or Up."
            else:
                state, reward, terminated, truncated, _ = env.step(action)
                moves.append(text.strip()[:10])
                done = terminated or truncated
                feedback = "You reached the goal!" if reward > 0 else ("You fell into a hole." if terminated else "")
            if done:
                break
            messages.append({"role": "user", "content": f"{feedback}\n{render(desc, state)}\nYour move?".strip()})
        env.close()
        return WorkflowOutput(final_answer=" ".join(moves), metadata={"moves": moves},
                              metrics={"success": float(reward), "invalid_actions": invalid, "turns": turn})
