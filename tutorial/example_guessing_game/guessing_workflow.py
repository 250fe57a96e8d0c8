"""A two-agent game small enough for a 135M model: a describer gives a clue, a guesser names the animal.

Both agents call the same policy through their own endpoints (`tuner.agent("describer")`,
`tuner.agent("guesser")`), so the context tracker keeps their calls apart. guessing_game.yaml sets
`algorithm.trainable_targets: [guesser]`: only the guesser trains; the describer plays with the policy's
weights, and its calls are recorded but never trained on (AgentJet's werewolves tutorial trains one role
the same way). Reward: 1 when the guesser names the secret animal, shared by the episode.
"""

from __future__ import annotations

import re

from ajet import Task, Tuner, Workflow, WorkflowOutput

DESCRIBER_PROMPT = ("You are playing a guessing game. Describe the animal {secret} in one short sentence "
                    "without saying its name.")
GUESSER_PROMPT = "Clue: {clue}\nWhich animal is it: {candidates}? Answer with one word."


def guessed(text: str | None, candidates: list[str]) -> str | None:
    """The first candidate named in `text` (whole word, any case), or None."""
    hits = [(m.start(), c) for c in candidates for m in re.finditer(rf"\b{re.escape(c)}s?\b", text or "", re.I)]
    return min(hits)[1] if hits else None


class GuessingGameWorkflow(Workflow):
    """One round: task.metadata = {"secret": str, "candidates": [str]}. Metrics: correct, clue_leaks
    (the describer said the name), guessed_a_candidate."""

    async def execute(self, task: Task, tuner: Tuner) -> WorkflowOutput:
        secret, candidates = task.metadata["secret"], list(task.metadata["candidates"])
        describer, guesser = tuner.agent("describer"), tuner.agent("guesser")
        r = await describer.client.chat.completions.create(
            model=tuner.model, messages=[{"role": "user", "content": DESCRIBER_PROMPT.format(secret=secret)}])
        clue = r.choices[0].message.content or ""
        r = await guesser.client.chat.completions.create(model=tuner.model, messages=[
            {"role": "user", "content": GUESSER_PROMPT.format(clue=clue, candidates=", ".join(candidates))}])
        answer = r.choices[0].message.content or ""
        guess = guessed(answer, candidates)
        correct = float(guess == secret)
        return WorkflowOutput(reward=correct, final_answer=answer, metadata={"clue": clue, "guess": guess},
                              metrics={"correct": correct, "clue_leaks": float(guessed(clue, [secret]) is not None),
                                       "guessed_a_candidate": float(guess is not None)})
