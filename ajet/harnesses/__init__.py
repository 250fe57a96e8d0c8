"""Coding-agent harnesses (Codex CLI, Claude Code, Gemini CLI, opencode, Qwen Code, aider, mini-swe-agent) run
unmodified on repository tasks: the registry (registry.py, entries in builtin.yaml) and the workflow that runs
one per episode (workflow.py). docs/harnesses.md lists each harness, its API and what is known to fork or fail.
"""
