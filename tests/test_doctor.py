"""`ajet doctor` verdicts on an append-only template and on a Qwen3-style think-stripping one."""

import subprocess
import sys

from ajet.commands.doctor import diagnose
from ajet.model import load_tokenizer
from tests.test_tracker_failure_modes import QWEN3_STYLE


def test_tool_template_is_append_only(tiny_model_dir):
    append_only, findings = diagnose(load_tokenizer(tiny_model_dir))
    by_check = {f.check: f for f in findings}
    assert append_only and by_check["append-only"].ok and by_check["end-of-turn token"].ok
    assert "'\\n'" in by_check["separator after end-of-turn"].detail
    assert by_check["parallel tool results"].detail == "rendered as one turn"


def test_qwen3_style_template_is_not_append_only(tiny_model_dir):
    append_only, findings = diagnose(load_tokenizer(tiny_model_dir, QWEN3_STYLE))
    bad = [f for f in findings if not f.ok and f.check.startswith("append-only")]
    assert not append_only and bad
    assert "earlier <think> blocks are stripped" in bad[0].detail
    assert "template_not_append_only" in bad[0].action


def test_doctor_cli_exit_codes(tiny_model_dir, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "ajet", "doctor", "--model", tiny_model_dir],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "verdict: append-only" in ok.stdout
    jinja = tmp_path / "qwen3.jinja"
    jinja.write_text(QWEN3_STYLE)
    bad = subprocess.run([sys.executable, "-m", "ajet", "doctor", "--model", tiny_model_dir, "--chat-template", str(jinja)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "not append-only" in bad.stdout
