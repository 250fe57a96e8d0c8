"""The main job's math agent with TRL's turn structure, for benchmarks/vs_trl.py's equal-work comparison.

TRL's `GRPOTrainer` cannot force a tool call (no `tool_choice`), and with `max_tool_calling_iterations=1` it makes at
most two generations per episode: the first turn, free; after a tool call, one more. This workflow does the same
through ajet's proxy: the first turn's `tool_choice` is "auto" (the main job names the function) and an episode
makes at most two model calls (the main job: three). Prompt, tool, reward and 48 tokens per turn are the main job's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tutorial" / "example_math_agent"))

from math_workflow import MathAgentWorkflow


class TRLTurnsMathAgentWorkflow(MathAgentWorkflow):
    """The main job's agent, first turn free and at most two model calls per episode (as TRL's tool loop)."""

    max_turns = 2
    first_turn_tool_choice = "auto"
