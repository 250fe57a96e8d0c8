"""The keys of `ajet serve` (ajet/serve/keys.py): bad `serve.keys` and a bad job server `--keys FILE` are one-line
errors (exit 2) that never show a key; a job server hands its secret and keys to each job's server in the
environment, where `ajet serve --conf` finds them beside its own `serve.keys`. (The keys at work, on real servers:
tests/test_serve_api.py and tests/test_serve_jobs.py.)"""

from __future__ import annotations

import pytest

from ajet.cli import main as ajet_main
from ajet.config.serving import GatewayKey
from ajet.errors import ConfigError
from ajet.serve.jobs import JobQueue
from ajet.serve.keys import KEYS_ENV, server_keys

ALICE = "alice-client-key-0123456789"
OPS = "ops-admin-key-0123456789abcdef"


def _one_line_error(capsys, argv: list[str], expected: str) -> None:
    assert ajet_main(argv) == 2, argv
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert ALICE not in err and OPS not in err                     # no message shows a key


def test_bad_serve_keys_are_one_line_config_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("AJET_TEST_UNSET_KEY", raising=False)
    monkeypatch.delenv("AJET_SECRET", raising=False)
    for serve, expected in (
            ("{keys: [{name: a, key_env: AJET_TEST_UNSET_KEY}]}", "serve.keys: key 'a': the environment variable "
                                                                  "AJET_TEST_UNSET_KEY is unset"),
            (f"{{keys: [{{name: a, key: {ALICE}}}, {{name: a, key: {OPS}}}]}}", "two keys are named 'a'"),
            (f"{{secret: {ALICE}, keys: [{{name: a, key: {ALICE}}}]}}", "one key is given twice"),
            (f"{{keys: [{{name: secret, key: {ALICE}}}]}}", "the name `secret` is the secret's")):
        conf = tmp_path / "conf.yaml"
        conf.write_text(f'model: {{path: "{tmp_path}"}}\ndata: {{train_path: x.jsonl}}\nserve: {serve}\n')
        _one_line_error(capsys, ["serve", "--conf", str(conf), "--port", "0", "--exp-dir", str(tmp_path / "e")],
                        expected)
    _one_line_error(capsys, ["serve", "--conf", str(conf), "--keys", "k.yaml"], "with --conf put the keys in "
                                                                               "serve.keys")

    keys = tmp_path / "keys.yaml"
    root = ["serve", "--exp-root", str(tmp_path / "root"), "--port", "0", "--keys", str(keys)]
    _one_line_error(capsys, root, "cannot read it")                 # no such file
    for text, expected in ((f"keys: [{{name: a, key: {ALICE}}}]", "serve: {keys: [{name, key | key_env, scope}"),
                           (f"serve: {{keys: [{{name: a, key: {ALICE}, scope: root}}]}}", "serve.keys.0.scope"),
                           ("serve: {keys: [{name: a, key_env: AJET_TEST_UNSET_KEY}]}", "AJET_TEST_UNSET_KEY is unset"),
                           (f"serve: {{keys: [{{name: a, key: {ALICE}}}, {{name: b, key: {ALICE}}}]}}",
                            "one key is given twice")):
        keys.write_text(text + "\n")
        _one_line_error(capsys, root, f"--keys {keys}: ")
        _one_line_error(capsys, root, expected)
    assert not (tmp_path / "root").exists()                         # refused before the queue's folder is made


def test_a_job_server_hands_its_keys_to_each_jobs_server(tmp_path, monkeypatch):
    """`JobQueue`'s environment for a job: the server's keys in KEYS_ENV and its secret in AJET_SECRET (none
    without one, whatever the server's own environment holds); `server_keys` there finds them beside the job's
    serve.keys and, with an admin key among them and no secret, generates none."""
    monkeypatch.setenv(KEYS_ENV, "stale")
    monkeypatch.setenv("AJET_SECRET", "stale-secret-0123456789")
    handed = [("alice", ALICE, "client"), ("ops", OPS, "admin")]
    env = JobQueue(tmp_path, None, keys=handed)._env()
    assert "AJET_SECRET" not in env and KEYS_ENV in env and ALICE in env[KEYS_ENV]
    monkeypatch.delenv("AJET_SECRET")
    monkeypatch.setenv(KEYS_ENV, env[KEYS_ENV])
    own = [GatewayKey(name="bob", key="bob-client-key-0123456789")]
    assert server_keys(own, None) == ([("bob", "bob-client-key-0123456789", "client"), *handed], None, False)

    env = JobQueue(tmp_path / "b", "the-secret-0123456789abc")._env()   # no keys: the secret only, as before
    assert env["AJET_SECRET"] == "the-secret-0123456789abc" and KEYS_ENV not in env
    monkeypatch.setenv(KEYS_ENV, '[["a", "b"]]')
    with pytest.raises(ConfigError, match=f"{KEYS_ENV} is set but is not the JSON"):
        server_keys([], None)
    monkeypatch.delenv(KEYS_ENV)
    keys, secret, generated = server_keys(own, None)                 # no admin key: a secret is generated
    assert keys == [("bob", "bob-client-key-0123456789", "client")] and generated and len(secret) >= 32
