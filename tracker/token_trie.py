"""A token trie of one episode's calls (one trie per agent tag): each root-to-leaf path is a sample.

Every call inserts `prompt_ids + completion_ids`. A node is one token in one exact context (its path),
so "sampled" is a property of the node: the engine drew that token given exactly that prefix. Calls
that continue one another share a path; a call that rewrote history (an edited message, a compacted
context, a template that re-renders earlier turns) branches off where its tokens first differ, and
nothing is lost. When paths share a prefix, each sampled token is trained in exactly one sample (the
first path through it); in the others it is masked and counted in `flags["shared_prefix_tokens"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ajet.llm_call import LLMCall


@dataclass(eq=False)
class _Node:
    token: int
    children: dict[int, _Node] = field(default_factory=dict)
    sampled_by: str | None = None      # call id whose engine sampled this token here
    logprob: float = 0.0
    policy_version: int = -1
    ends_calls: list[str] = field(default_factory=list)   # calls whose completion ends at this node
    trained: bool = False              # claimed by a sample already (set while building samples)


@dataclass
class TriePath:
    """One root-to-leaf path: token ids `[seq]`, sampled mask `[seq]`, logprobs, versions, the call that
    sampled each token `[seq]` (None where not sampled in this path), and the calls ending on it."""

    ids: list[int]
    sampled: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    sampled_by: list[str | None]
    call_ids: list[str]
    shared_prefix_tokens: int


class TokenTrie:
    """Token trie of one (episode, agent tag). Insert calls in arrival order, then read `paths()`."""

    def __init__(self) -> None:
        self.root = _Node(-1)
        self.branches: list[tuple[str, str]] = []   # (call id, reason) for every call that opened a new branch

    def insert(self, call: LLMCall) -> None:
        """Add one call; records a branch when its tokens leave every existing path mid-way."""
        node, diverged = self.root, False
        for tok in call.prompt_ids:
            nxt = node.children.get(tok)
            if nxt is None:
                if node.children and not diverged:   # an existing path continues differently here
                    self.branches.append((call.call_id, call.prompt_render_reason or "prefix_mismatch"))
                diverged = True
                nxt = node.children[tok] = _Node(tok)
            node = nxt
        versions = call.token_versions or [call.policy_version] * len(call.completion_ids)
        for tok, lp, version in zip(call.completion_ids, call.completion_logprobs, versions):
            nxt = node.children.get(tok)
            if nxt is None:
                if node.children and not diverged:   # same context, another sample drawn (e.g. a retry)
                    self.branches.append((call.call_id, "resampled"))
                diverged = True
                nxt = node.children[tok] = _Node(tok)
            if nxt.sampled_by is None:
                nxt.sampled_by, nxt.logprob, nxt.policy_version = call.call_id, lp, version
            node = nxt
        node.ends_calls.append(call.call_id)

    def paths(self) -> list[TriePath]:
        """Root-to-leaf paths in insertion order (depth-first, children in the order they were added)."""
        out: list[TriePath] = []
        stack: list[tuple[_Node, list[_Node]]] = [(c, [c]) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, path = stack.pop()
            if node.children:
                for child in reversed(list(node.children.values())):
                    stack.append((child, path + [child]))
                continue
            out.append(self._claim(path))
        return out

    @staticmethod
    def _claim(path: list[_Node]) -> TriePath:
        sampled, shared = [], 0
        for n in path:
            is_sampled = n.sampled_by is not None and not n.trained
            shared += n.sampled_by is not None and n.trained
            n.trained = n.trained or n.sampled_by is not None
            sampled.append(int(is_sampled))
        return TriePath(ids=[n.token for n in path], sampled=sampled,
                        logprobs=[n.logprob if s else 0.0 for n, s in zip(path, sampled)],
                        policy_versions=[n.policy_version if s else -1 for n, s in zip(path, sampled)],
                        sampled_by=[n.sampled_by if s else None for n, s in zip(path, sampled)],
                        call_ids=[c for n in path for c in n.ends_calls], shared_prefix_tokens=shared)
