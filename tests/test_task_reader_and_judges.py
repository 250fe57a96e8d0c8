"""JSONL task reading (ajet and GSM8K rows, the real GSM8K split) and the math judge."""

import json
from pathlib import Path

import pytest

from ajet.errors import ConfigError
from ajet.judges import extract_final_number, math_answer_judge
from ajet.task import Task
from ajet.tasks.jsonl import read_jsonl_tasks
from ajet.workflow import WorkflowOutput

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def test_ajet_and_gsm8k_rows(tmp_path):
    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join([
        json.dumps({"task_id": "a", "query": "1+1?", "answer": 2, "level": "easy"}),
        "",
        json.dumps({"question": "How many?", "answer": "He has 1,000 + 234.\n#### 1,234"}),
    ]) + "\n")
    a, b = read_jsonl_tasks(p)
    assert (a.task_id, a.query, a.answer, a.metadata) == ("a", "1+1?", "2", {"level": "easy"})
    assert (b.task_id, b.query, b.answer) == ("mixed-2", "How many?", "1234")
    assert b.metadata["solution"].endswith("#### 1,234")
    assert len(read_jsonl_tasks(p, max_tasks=1)) == 1


def test_reader_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"query": "ok"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl_tasks(p)
    p.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: a task row needs `query`"):
        read_jsonl_tasks(p)
    p.write_text("\n")
    with pytest.raises(ConfigError, match="no tasks"):
        read_jsonl_tasks(p)
    with pytest.raises(ConfigError, match="task file not found"):
        read_jsonl_tasks(tmp_path / "missing.jsonl")
    p.write_bytes(b'{"query": "\xff"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl: not UTF-8"):
        read_jsonl_tasks(p)


def test_default_ids_count_lines_from_zero_and_keep_unicode(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"query": "a\u2028b"}\n\n{"query": "c", "answer": 3.0}\n', encoding="utf-8")  # raw U+2028
    a, b = read_jsonl_tasks(p)
    assert (a.task_id, a.query, b.task_id, b.answer) == ("t-0", "a\u2028b", "t-2", "3.0")
    assert math_answer_judge(b, WorkflowOutput(final_answer="The answer is 3.")) == 1.0


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"GSM8K split not found at {GSM8K} (shared data is absent)")
def test_real_gsm8k_split():
    tasks = read_jsonl_tasks(GSM8K)
    assert len(tasks) == 7473
    assert all(t.answer is not None and extract_final_number(t.answer) is not None for t in tasks)
    # the judge accepts the reference solution text itself
    assert sum(math_answer_judge(t, WorkflowOutput(final_answer=t.metadata["solution"])) for t in tasks) == 7473


@pytest.mark.parametrize("text,number", [
    ("The answer is 7.", "7"), ("#### 1,234.50", "1234.5"), (r"so \boxed{42}", "42"), ("3 then 5", "5"),
    ("-3.0", "-3"), ("The answer is 12 apples, not 3", "12"), ("costs $1,000", "1000"), (None, None), ("none", None),
    ("pick one of 1,2,3", "3"), ("I got 14, so", "14"), ("-0", "0"), ("1" * 40, "1" * 40), ("it is 5.", "5"),
])
def test_extract_final_number(text, number):
    assert extract_final_number(text) == number


def test_math_judge():
    task = Task("t", "q", "14")
    assert math_answer_judge(task, WorkflowOutput(final_answer="7 + 7 = 14. The answer is 14.")) == 1.0
    assert math_answer_judge(task, WorkflowOutput(final_answer="The answer is 15.")) == 0.0
    assert math_answer_judge(task, WorkflowOutput(final_answer=None)) == 0.0
    assert math_answer_judge(Task("t", "q"), WorkflowOutput(final_answer="14")) == 0.0
