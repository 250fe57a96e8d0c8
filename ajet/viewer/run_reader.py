"""Read-only access to an experiment folder for `ajet view` and `ajet show`.

    run = RunReader(exp_dir)
    run.steps()                      # per-step episode counts and rewards, from trajectories.sqlite
    run.episodes(step=3, order="advantage_desc", limit=50)
    run.episode("s3-t1-r0")          # calls (token arrays left out), samples, reward, error
    run.sample_tokens("s3-t1-r0", 0) # the sample token by token: text, loss mask, logprob, call spans

The SQLite store is opened with `mode=ro` (a reader never takes a write lock and never blocks the
training run that appends to it in WAL mode); each thread gets its own connection. Every list is
filtered and paged inside SQLite with `json_extract`, so no view parses more than the records it shows.
Records are read as JSON and may carry more or fewer fields than this module knows (`Episode.to_dict()`,
`LLMCall.to_dict()`, `Sample.to_dict()`): a missing field reads as None, an extra one is passed through.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

from ajet.errors import AjetError

ORDERS = {  # episode list orders: SQL ORDER BY clauses over the columns of `_EPISODE_COLUMNS`
    "group": "group_id, repeat_index, episode_id",
    "advantage_desc": "advantage IS NULL, advantage DESC, episode_id",
    "advantage_asc": "advantage IS NULL, advantage ASC, episode_id",
    "reward_desc": "reward IS NULL, reward DESC, episode_id",
    "reward_asc": "reward IS NULL, reward ASC, episode_id",
    "duration_desc": "duration_s DESC, episode_id",
}

_EPISODE_COLUMNS = """
    e.episode_id AS episode_id, e.attempt AS attempt, e.step AS step, e.task_id AS task_id, e.reward AS reward,
    e.error AS error, json_extract(e.record, '$.group_id') AS group_id,
    json_extract(e.record, '$.repeat_index') AS repeat_index, json_extract(e.record, '$.duration_s') AS duration_s,
    json_array_length(e.record, '$.calls') AS calls,
    (SELECT group_concat(DISTINCT json_extract(c.value, '$.agent_tag')) FROM json_each(e.record, '$.calls') c)
        AS agent_tags"""
_SAMPLE_COLUMNS = """,
    (SELECT COUNT(*) FROM samples s WHERE s.episode_id = e.episode_id AND s.attempt = e.attempt) AS samples,
    (SELECT MAX(s.advantage) FROM samples s WHERE s.episode_id = e.episode_id AND s.attempt = e.attempt) AS advantage,
    (SELECT group_concat(json_extract(s.record, '$.flags.fork_reason')) FROM samples s
        WHERE s.episode_id = e.episode_id AND s.attempt = e.attempt AND json_valid(s.record)) AS fork_reasons"""
_NO_SAMPLE_COLUMNS = """,
    json_array_length(e.record, '$.samples') AS samples, NULL AS advantage, NULL AS fork_reasons"""
# what text search looks through: the task, the output, the error and every call's messages and answer
_SEARCH_TEXT = """lower(ifnull(json_extract(e.record, '$.task'), '') || ifnull(json_extract(e.record, '$.output'), '')
    || ifnull(e.error, '') || ifnull((SELECT group_concat(ifnull(json_extract(c.value, '$.messages'), '')
    || ifnull(json_extract(c.value, '$.response_message'), ''), ' ') FROM json_each(e.record, '$.calls') c), ''))"""
_TOKEN_ARRAYS = ("prompt_ids", "completion_ids", "completion_logprobs", "completion_top_logprobs")


class NotFound(AjetError):
    """An episode, attempt or sample that the store does not hold."""


class RunReader:
    """Read-only view of one experiment folder (`trajectories.sqlite`, `metrics.jsonl`, `config.json`).

    Args:
        exp_dir: the folder a run writes (`trainer.exp_dir`).

    Raises:
        AjetError: the folder has no `trajectories.sqlite` (the message names the folder).
    """

    def __init__(self, exp_dir: str | Path):
        self.exp_dir = Path(exp_dir).resolve()
        self.db_path = self.exp_dir / "trajectories.sqlite"
        if not self.db_path.is_file():
            raise AjetError(f"{self.exp_dir} holds no trajectories.sqlite: pass the folder a run wrote "
                            f"(its `trainer.exp_dir`, e.g. experiments/math_agent)")
        self._local = threading.local()
        self._tokenizer_lock = threading.Lock()

    # ---- SQLite ------------------------------------------------------------------------------------
    @property
    def db(self) -> sqlite3.Connection:
        """This thread's read-only connection (`mode=ro`: never writes, never blocks the writer)."""
        conn = getattr(self._local, "db", None)
        if conn is None:
            conn = sqlite3.connect(self.db_path.as_uri() + "?mode=ro", uri=True)
            conn.row_factory = sqlite3.Row
            self._local.db = conn
        return conn

    def has_samples_table(self) -> bool:
        """Whether the store has the `samples` table (runs before it only have the calls)."""
        return self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'samples'").fetchone() is not None

    # ---- run level ---------------------------------------------------------------------------------
    @cached_property
    def config(self) -> dict[str, Any]:
        """`config.json` of the run ({} when missing or unreadable)."""
        try:
            return json.loads((self.exp_dir / "config.json").read_text())
        except (OSError, ValueError):
            return {}

    def metrics(self) -> list[dict[str, Any]]:
        """`metrics.jsonl`, one dict per step (a torn last line, written while we read, is skipped)."""
        rows = []
        try:
            text = (self.exp_dir / "metrics.jsonl").read_text(encoding="utf-8")
        except OSError:
            return rows
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        return rows

    def steps(self) -> list[dict[str, Any]]:
        """Per (step, attempt): episodes, failed, reward mean/min/max of the successful ones, distinct tasks
        (plain columns only: no record is parsed, so the overview stays fast on long runs)."""
        rows = self.db.execute("""
            SELECT step, attempt, COUNT(*) AS episodes, SUM(error IS NOT NULL OR reward IS NULL) AS failed,
                   AVG(reward) AS reward_mean, MIN(reward) AS reward_min, MAX(reward) AS reward_max,
                   COUNT(DISTINCT task_id) AS tasks
            FROM episodes GROUP BY step, attempt ORDER BY step, attempt""").fetchall()
        return [dict(r) for r in rows]

    def groups(self, step: int, attempt: int | None = None) -> list[dict[str, Any]]:
        """The GRPO groups of one step: group id, task, episode count, failed, reward mean and spread."""
        attempt = self._attempt_of_step(step) if attempt is None else attempt
        rows = self.db.execute("""
            SELECT json_extract(record, '$.group_id') AS group_id, task_id, COUNT(*) AS episodes,
                   SUM(error IS NOT NULL OR reward IS NULL) AS failed, AVG(reward) AS reward_mean,
                   MIN(reward) AS reward_min, MAX(reward) AS reward_max
            FROM episodes WHERE step = ? AND attempt = ? AND json_valid(record) GROUP BY group_id ORDER BY group_id""",
            (step, attempt))
        return [dict(r) for r in rows]

    def bad_rows(self) -> list[str]:
        """The stored rows that are not valid JSON (e.g. a NaN written by an older ajet), as
        "episode <id> (attempt <a>)" / "sample <i> of episode <id> (attempt <a>)"; the episode lists, groups and
        `ajet sft` / `ajet export` leave them out."""
        out = [f"episode {eid} (attempt {att})" for eid, att in self.db.execute(
            "SELECT episode_id, attempt FROM episodes WHERE NOT json_valid(record) ORDER BY rowid")]
        if self.has_samples_table():
            out += [f"sample {i} of episode {eid} (attempt {att})" for eid, att, i in self.db.execute(
                "SELECT episode_id, attempt, idx FROM samples WHERE NOT json_valid(record) ORDER BY rowid")]
        return out

    def _attempt_of_step(self, step: int) -> int:
        """The newest attempt that has episodes of `step` (a resumed run re-runs a step under a new attempt)."""
        row = self.db.execute("SELECT MAX(attempt) FROM episodes WHERE step = ?", (step,)).fetchone()
        return row[0] if row[0] is not None else 0

    # ---- episode lists -------------------------------------------------------------------------------
    def episodes(self, step: int | None = None, attempt: int | None = None, *, failed: bool | None = None,
                 fork: str | None = None, agent: str | None = None, group: str | None = None, q: str | None = None,
                 order: str = "group", offset: int = 0, limit: int = 50) -> dict[str, Any]:
        """One page of the episode list.

        Args:
            step: only this step (its newest attempt unless `attempt` is given); None = every step.
            failed: True = only failed episodes, False = only successful ones.
            fork: only episodes with a sample forked for this reason ("any" = any fork).
            agent: only episodes where this agent tag called the policy.
            group: only this GRPO group.
            q: case-insensitive text in the task, output, error or any call's messages.
            order: a key of `ORDERS`.
            offset, limit: the page (limit <= 500).

        Returns:
            {"total": matching episodes, "offset", "limit", "episodes": [row, ...]} where a row holds
            episode_id, attempt, step, task_id, group_id, repeat_index, reward, advantage, duration_s, calls,
            samples, agent_tags [str], fork_reasons [str], failure (last line of the error) or None.

        Raises:
            ValueError: unknown `order` or a limit outside 1..500.
        """
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        if not 1 <= limit <= 500:
            raise ValueError(f"limit must be in 1..500, got {limit}")
        where, args = ["json_valid(e.record)"], []   # a row that is not valid JSON: left out (`bad_rows`)
        if step is not None:
            where.append("e.step = ? AND e.attempt = ?")
            args += [step, self._attempt_of_step(step) if attempt is None else attempt]
        elif attempt is not None:
            where.append("e.attempt = ?")
            args.append(attempt)
        if failed is not None:
            where.append("(e.error IS NOT NULL OR e.reward IS NULL)" if failed else "(e.error IS NULL AND e.reward IS NOT NULL)")
        if group:
            where.append("json_extract(e.record, '$.group_id') = ?")
            args.append(group)
        if q:   # a cheap scan of the raw JSON first; the exact fields are parsed only for records that pass it
            where.append(f"instr(lower(e.record), ?) > 0 AND instr({_SEARCH_TEXT}, ?) > 0")
            args += [json.dumps(q.lower())[1:-1], q.lower()]
        cols = _EPISODE_COLUMNS + (_SAMPLE_COLUMNS if self.has_samples_table() else _NO_SAMPLE_COLUMNS)
        having = []
        if agent:
            having.append("(',' || agent_tags || ',') LIKE ?")
            args.append(f"%,{agent},%")
        if fork:
            having.append("fork_reasons IS NOT NULL" if fork == "any" else "(',' || fork_reasons || ',') LIKE ?")
            if fork != "any":
                args.append(f"%,{fork},%")
        sql = f"SELECT {cols} FROM episodes e" + (" WHERE " + " AND ".join(where) if where else "")
        sql = f"SELECT * FROM ({sql})" + (" WHERE " + " AND ".join(having) if having else "")
        total = self.db.execute(f"SELECT COUNT(*) FROM ({sql})", args).fetchone()[0]
        rows = self.db.execute(f"{sql} ORDER BY {ORDERS[order]} LIMIT ? OFFSET ?", [*args, limit, offset]).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["agent_tags"] = d["agent_tags"].split(",") if d["agent_tags"] else []
            d["fork_reasons"] = d["fork_reasons"].split(",") if d["fork_reasons"] else []
            d["failure"] = _failure_line(d.pop("error"))
            out.append(d)
        return {"total": total, "offset": offset, "limit": limit, "episodes": out}

    # ---- one episode -----------------------------------------------------------------------------------
    def _record(self, episode_id: str, attempt: int | None) -> tuple[dict[str, Any], int, int]:
        sql = "SELECT record, attempt, step FROM episodes WHERE episode_id = ?"
        args: list[Any] = [episode_id]
        if attempt is not None:
            sql, args = sql + " AND attempt = ?", [episode_id, attempt]
        row = self.db.execute(sql + " ORDER BY attempt DESC LIMIT 1", args).fetchone()
        if row is None:
            raise NotFound(f"no episode {episode_id!r}" + (f" in attempt {attempt}" if attempt is not None else ""))
        return json.loads(row["record"]), row["attempt"], row["step"]

    def samples(self, episode_id: str, attempt: int | None = None) -> tuple[list[dict[str, Any]], str]:
        """The episode's training samples and where they come from: "store" (written after the advantages
        were set), "record" (inside the episode record) or "rebuilt" (merged again from the calls by the
        context tracker; advantage unknown, None) or "none" (a failed episode)."""
        record, attempt, _ = self._record(episode_id, attempt)
        return self._samples_of(record, attempt)

    def _samples_of(self, record: dict[str, Any], attempt: int) -> tuple[list[dict[str, Any]], str]:
        if self.has_samples_table():
            rows = self.db.execute("SELECT record FROM samples WHERE episode_id = ? AND attempt = ? ORDER BY idx",
                                   (record["episode_id"], attempt)).fetchall()
            if rows:
                return [json.loads(r[0]) for r in rows], "store"
        if record.get("samples"):
            return record["samples"], "record"
        if record.get("error") is None and record.get("calls"):
            return [{**s, "advantage": None} for s in rebuild_samples(record)], "rebuilt"
        return [], "none"

    def episode(self, episode_id: str, attempt: int | None = None) -> dict[str, Any]:
        """One episode for display: the record with each call's token arrays replaced by their lengths
        (`prompt_tokens`, `completion_tokens`), `samples` as summaries (index, tokens, loss tokens,
        advantage, trained, flags, call_ids), `trained_in`: [[step, attempt], ...] of the updates that
        used it (the store's trained-on ledger; [] when none or an older store) and `not_trained`: the reason
        an update left it out on purpose (e.g. "zero_std_group", "out_of_vocab_token"), else None.

        Raises:
            NotFound: no such episode (or attempt).
        """
        record, attempt, step = self._record(episode_id, attempt)
        calls = []
        for c in record.get("calls", []):
            view = {k: v for k, v in c.items() if k not in _TOKEN_ARRAYS}
            view["prompt_tokens"] = len(c.get("prompt_ids") or [])
            view["completion_tokens"] = len(c.get("completion_ids") or [])
            lps = c.get("completion_logprobs") or []
            view["mean_logprob"] = sum(lps) / len(lps) if lps else None
            calls.append(view)
        samples, source = self._samples_of(record, attempt)
        summaries = [{"index": i, "agent_tag": s.get("agent_tag"), "call_ids": s.get("call_ids", []),
                      "prompt_tokens": len(s.get("prompt_ids") or []), "response_tokens": len(s.get("response_ids") or []),
                      "loss_tokens": sum(s.get("loss_mask") or []), "advantage": s.get("advantage"),
                      "trained": s.get("trained"), "flags": s.get("flags", {})} for i, s in enumerate(samples)]
        trained_in = []   # the trainer's ledger: which updates (step, attempt that ran it) used this episode
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'trained'").fetchone():
            trained_in = [list(r) for r in self.db.execute(
                "SELECT step, trained_attempt FROM trained WHERE episode_id = ? AND attempt = ? ORDER BY rowid",
                (record["episode_id"], attempt))]
        not_trained = None   # why the update left it out on purpose (zero-std group, a guard), if it did
        if self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'not_trained'").fetchone():
            row = self.db.execute("SELECT reason FROM not_trained WHERE episode_id = ? AND attempt = ? "
                                  "ORDER BY rowid DESC LIMIT 1", (record["episode_id"], attempt)).fetchone()
            not_trained = row[0] if row else None
        return {**{k: v for k, v in record.items() if k not in ("calls", "samples")}, "attempt": attempt, "step": step,
                "calls": calls, "samples": summaries, "samples_source": source, "trained_in": trained_in,
                "not_trained": not_trained, "failure": _failure_line(record.get("error"))}

    def sample_tokens(self, episode_id: str, index: int, attempt: int | None = None) -> dict[str, Any]:
        """Sample `index` of an episode token by token.

        Returns:
            {"ids": [seq], "text": [seq] (each token decoded alone), "pieces": [seq] (the tokenizer's own
            token strings), "loss_mask": [seq] (0 over the prompt), "logprobs": [seq] (engine logprob where
            sampled, else None), "policy_versions": [seq] or None, "prompt_len": tokens before the response,
            "calls": [{"call_id", "index", "start", "completion_start", "completion_end", "exact"}] spans in
            sequence positions (`start`: first token the call added, `exact`: its completion sits at
            completion_start verbatim), "top_logprobs": {position: [[text, logprob], ...]} when recorded,
            "fork_at": position where this sample leaves an earlier one of the episode (None for the
            first), "advantage", "reward", "trained", "flags", "temperature", "agent_tag", "tokenizer"
            (None, or why token text is unavailable)}.

        Raises:
            NotFound: no such episode or sample index.
        """
        record, attempt, _ = self._record(episode_id, attempt)
        samples, source = self._samples_of(record, attempt)
        if not 0 <= index < len(samples):
            raise NotFound(f"episode {episode_id!r} has {len(samples)} sample(s); no sample {index}")
        s = samples[index]
        prompt, response = list(s.get("prompt_ids") or []), list(s.get("response_ids") or [])
        ids = prompt + response
        mask = [0] * len(prompt) + list(s.get("loss_mask") or [0] * len(response))
        old = s.get("old_logprobs") or [0.0] * len(response)
        logprobs = [None] * len(prompt) + [lp if m else None for lp, m in zip(old, mask[len(prompt):])]
        pv = s.get("policy_versions")
        calls_by_id = {c.get("call_id"): c for c in record.get("calls", [])}
        spans, top, start = [], {}, 0
        for cid in s.get("call_ids", []):
            c = calls_by_id.get(cid, {})
            comp = list(c.get("completion_ids") or [])
            cs = len(c.get("prompt_ids") or [])
            exact = ids[cs:cs + len(comp)] == comp
            spans.append({"call_id": cid, "index": c.get("index"), "start": min(start, cs), "completion_start": cs,
                          "completion_end": cs + len(comp), "exact": exact})
            # logprobs of sampled tokens the tracker masked (shared with an earlier sample) come from the call
            for k, lp in enumerate(c.get("completion_logprobs") or []):
                if exact and logprobs[cs + k] is None:
                    logprobs[cs + k] = lp
            for k, alts in enumerate(c.get("completion_top_logprobs") or []):
                if exact and alts:
                    top[cs + k] = [[a, b] for a, b in alts]
            start = cs + len(comp)
        fork_at = None
        for other in samples[:index]:
            o = list(other.get("prompt_ids") or []) + list(other.get("response_ids") or [])
            n = next((i for i, (a, b) in enumerate(zip(ids, o)) if a != b), min(len(ids), len(o)))
            fork_at = n if fork_at is None else max(fork_at, n)
        text, pieces, tok_error = self.token_text(ids)
        top_text = {p: [[self.token_text([a])[0][0], b] for a, b in alts] for p, alts in top.items()}
        return {"episode_id": record["episode_id"], "attempt": attempt, "index": index, "samples_source": source,
                "ids": ids, "text": text, "pieces": pieces, "loss_mask": mask, "logprobs": logprobs,
                "policy_versions": ([-1] * len(prompt) + list(pv)) if pv else None, "prompt_len": len(prompt),
                "calls": spans, "top_logprobs": top_text, "fork_at": fork_at, "advantage": s.get("advantage"),
                "reward": record.get("reward"), "trained": s.get("trained"), "flags": s.get("flags", {}),
                "temperature": s.get("temperature"), "agent_tag": s.get("agent_tag"), "tokenizer": tok_error}

    # ---- token text --------------------------------------------------------------------------------------
    def token_text(self, ids: list[int]) -> tuple[list[str], list[str], str | None]:
        """Each id decoded alone (`tokenizer.decode([id])`: readable text, "\\ufffd" for a partial UTF-8
        byte) and the tokenizer's own token string (`convert_ids_to_tokens`, e.g. "Ġthe"), with the
        experiment's tokenizer; when it cannot be loaded, "<id>" for both and the reason as third value."""
        tok = self._tokenizer()
        if isinstance(tok, str):
            return [f"<{i}>" for i in ids], [f"<{i}>" for i in ids], tok
        cache = self._text_cache
        missing = sorted({i for i in ids if i not in cache})
        if missing:
            decoded = tok.batch_decode([[i] for i in missing], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
            pieces = tok.convert_ids_to_tokens(missing)
            for i, t, p in zip(missing, decoded, pieces):
                cache[i] = (t, p if p is not None else f"<{i}>")
        return [cache[i][0] for i in ids], [cache[i][1] for i in ids], None

    def _tokenizer(self) -> Any:
        """The run's tokenizer (config.json `model.path`), loaded once; a str says why it could not be."""
        with self._tokenizer_lock:
            if not hasattr(self, "_tok"):
                self._text_cache: dict[int, tuple[str, str]] = {}
                path = (self.config.get("model") or {}).get("path")
                try:
                    if not path:
                        raise AjetError(f"{self.exp_dir / 'config.json'} names no model.path")
                    from ajet.model import load_tokenizer

                    self._tok = load_tokenizer(path)
                except Exception as exc:  # noqa: BLE001 - any loading problem only costs the token text
                    self._tok = f"tokenizer of {path!r} not loaded ({type(exc).__name__}: {exc}); showing token ids"
            return self._tok


def _failure_line(error: str | None) -> str | None:
    """The last non-empty line of a traceback (the exception and its message), or None."""
    if not error:
        return None
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else error[:300]


def rebuild_samples(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples (`Sample.to_dict()`) of a stored episode record (`Episode.to_dict()`), merged again from its calls
    by the context tracker (for stores written before the samples table); the calls read by `LLMCall.from_dict`
    (fields this version does not know are dropped, missing ones take defaults)."""
    from ajet.llm_call import LLMCall
    from ajet.tracker import merge_calls

    calls = [LLMCall.from_dict(c) for c in record.get("calls", [])]
    return [s.to_dict() for s in merge_calls(calls, record.get("group_id", ""))]
