"""What runs one episode and judges it: command and harness workflows, the LLM and reward-model judges."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ajet.config.base import _Section


class LLMJudgeConfig(_Section):
    """The LLM judge (`judge: ajet.judges.llm:LLMJudge`; see ajet/judges/llm.py).

    rubric: the prompt (text or a file path); {query}, {answer}, {reference}, {max_score} are filled in.
    base_url/api_key/model: any OpenAI-compatible endpoint; base_url None = a frozen copy of the initial
    policy (or `frozen_model_path`) served by ajet, never trained. temperature 0 = greedy.
    """

    rubric: str | None = Field(None, description="the judge's prompt, text or a file path; {query}, {answer}, "
                                                 "{reference}, {max_score} are filled in (None: the built-in rubric, "
                                                 "ajet.judges.llm.DEFAULT_RUBRIC)")
    base_url: str | None = Field(None, description="an OpenAI-compatible endpoint serving the judge; None: a frozen "
                                                   "copy of the initial policy (or frozen_model_path) served by ajet,"
                                                   " never trained")
    api_key: str | None = Field(None, description="the API key sent to base_url")
    model: str = Field("ajet-judge", description="the model name sent to the judge's endpoint")
    frozen_model_path: str | None = Field(None, description="with base_url None: the model ajet serves as the judge "
                                                            "instead of a copy of the initial policy")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature; 0 = greedy")
    max_tokens: int = Field(64, gt=0, description="limit of the judge's reply, tokens")
    max_score: float = Field(10.0, gt=0, description="top of the rubric's scale: the reward is score / max_score, "
                                                     "clipped to [0, 1]")
    parse_failure_reward: float = Field(0.0, description="the reward of an episode whose judge reply holds no score "
                                                         "(the reply is recorded in the episode)")


class RewardModelConfig(_Section):
    """A reward model behind an HTTP endpoint as the judge (`judge: ajet.judges.reward_model:RewardModelJudge`;
    see ajet/judges/reward_model.py): each answer is scored by `POST {base_url}/pooling` (vLLM's pooling API)
    with the conversation and the answer; e.g. the gateway's best-of-N pick."""

    base_url: str | None = Field(None, description="the server of the reward model (e.g. vLLM's http://host:8000); "
                                                   "required by RewardModelJudge")
    model: str = Field("reward-model", min_length=1, description="the model name sent to the endpoint")
    api_key: str | None = Field(None, description="sent as a bearer token; None: no Authorization header")
    timeout_s: float = Field(60.0, gt=0, description="how long one scoring request may take, seconds")


class CommandWorkflowConfig(_Section):
    """A workflow that is the user's own program, started once per episode (see ajet/rollout/command.py).

    command: argv, e.g. [python, agent.py] (run in the config file's folder, or `cwd` relative to it).
    env: extra environment variables. timeout_s: kill its process group after this many seconds, not counting
    the time its calls wait in the engine's queue (None: only `rollout.episode_timeout_s` applies).
    """

    command: list[str] = Field(min_length=1, description="argv of the program run once per episode, e.g. [python, "
                                                         "agent.py]; it reads OPENAI_BASE_URL, OPENAI_API_KEY, "
                                                         "AJET_MODEL and the task (AJET_TASK, stdin)")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the program")
    timeout_s: float | None = Field(None, gt=0, description="kill the program's process group after this many seconds,"
                                                            " not counting the time its calls wait in the engine's "
                                                            "queue (None: only rollout.episode_timeout_s applies)")
    cwd: str | None = Field(None, description="the program's working folder, relative to the config file's folder "
                                              "(None: that folder)")


class HarnessSpec(_Section):
    """One coding-agent harness as data (the built-in ones are in ajet/harnesses/builtin.yaml; a config adds its
    own under `harnesses:` with the same keys). The placeholders are listed below.

    package: `npm:NAME` or `pip:NAME` (None: the executable must already be on PATH). version: the pinned
    version installed into the cache. executable: the program's name in the install's bin folder (or on PATH).
    api: what it speaks to the proxy: chat | responses | messages | gemini. argv: the command line of one
    non-interactive task, after the executable. env: variables pointing it at the episode's endpoint.
    files: files written into its fresh HOME before it starts ({path relative to HOME: text}).
    model: the model name it sends when the workflow names none (some check it, e.g. Claude Code's
    `--model` must be a Claude name; the proxy serves the policy under any name).
    timeout_s: wall-clock limit of one episode, seconds. needs: what it needs that ajet may not have yet
    (shown by `ajet harnesses`; its test skips with this reason). notes: known forks or failures.
    Placeholders in argv, env and files: see the head of ajet/harnesses/builtin.yaml.
    """

    package: str | None = Field(None, description="`npm:NAME` or `pip:NAME`, installed into ajet's cache (None: the "
                                                  "executable must already be on PATH)")
    version: str | None = Field(None, description="the pinned version of the package")
    executable: str = Field(description="the program's name in the install's bin folder (or on PATH)")
    api: Literal["chat", "responses", "messages", "gemini"] = Field(
        description="the API it speaks to the proxy: chat (Chat Completions), responses, messages (Anthropic) or "
                    "gemini")
    argv: list[str] = Field(default_factory=list, description="the command line of one non-interactive task, after "
                                                              "the executable (placeholders: "
                                                              "ajet/harnesses/builtin.yaml)")
    env: dict[str, str] = Field(
        default_factory=dict, description="variables pointing it at the episode's endpoint (placeholders as in argv)")
    files: dict[str, str] = Field(
        default_factory=dict, description="files written into its fresh HOME before it starts: {path relative to "
                                          "HOME: text}")
    model: str | None = Field(None, description="the model name it sends when the workflow names none (the proxy "
                                                "serves the policy under any name)")
    timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one episode, seconds")
    needs: str = Field("", description="what it needs that ajet may not have (shown by `ajet harnesses`; its test "
                                       "skips with this reason)")
    notes: str = Field("", description="known forks or failures, shown by `ajet harnesses`")

    @field_validator("package")
    @classmethod
    def _package_kind(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("npm:", "pip:")):
            raise ValueError(f"package must be `npm:NAME` or `pip:NAME`, got {v!r}")
        return v


class HarnessSandboxConfig(_Section):
    """Limits of one harness episode's sandbox (ajet/tools/workdir_sandbox.py).

    memory_mb: address-space limit per process, MiB (RLIMIT_AS; Node's fetch, through undici's WebAssembly,
    reserves more than 16 GiB of address space it never touches, hence the large default; a real memory limit
    needs cgroups, not set up here). max_processes: RLIMIT_NPROC of the sandbox
    uid. max_file_mb: largest file written. isolation: auto (bubblewrap when it works), bwrap (required),
    none (limits only: the harness then shares the host's network and files).
    """

    memory_mb: int = Field(262144, gt=0, description="address-space limit per process (RLIMIT_AS), MiB; large because"
                                                     " Node's fetch reserves more than 16 GiB it never touches")
    max_processes: int = Field(256, gt=0, description="RLIMIT_NPROC of the sandbox's uid: processes it may run at "
                                                      "once")
    max_file_mb: int = Field(256, gt=0, description="largest file the sandbox may write, MiB (RLIMIT_FSIZE)")
    isolation: Literal["auto", "bwrap", "none"] = Field(
        "auto", description="auto: bubblewrap when it works; bwrap: required; none: limits only (the harness then "
                            "shares the host's network and files)")


class HarnessWorkflowConfig(_Section):
    """`workflow: {harness: NAME}`: a registered coding-agent CLI run unmodified per episode on a repository
    task, in the sandbox, then judged by the task's tests (ajet/harnesses/workflow.py).

    harness: a built-in name (`ajet harnesses` lists them) or one defined under the config's `harnesses:`.
    model: the model name the harness sends (any string: the proxy serves the policy under every name).
    timeout_s: overrides the harness's own timeout. env: extra variables for the harness.
    test_timeout_s: limit of the judge's test run. sandbox: the limits of both.
    """

    harness: str = Field(description="a built-in harness name (`ajet harnesses` lists them) or one defined under the "
                                     "config's `harnesses:`")
    model: str | None = Field(None, description="the model name the harness sends (any string: the proxy serves the "
                                                "policy under every name)")
    timeout_s: float | None = Field(None, gt=0, description="overrides the harness's own timeout_s, seconds")
    env: dict[str, str] = Field(
        default_factory=dict, description="extra environment variables for the harness")
    test_timeout_s: float = Field(120.0, gt=0, description="limit of the judge's test run after the episode, seconds")
    sandbox: HarnessSandboxConfig = Field(
        default_factory=HarnessSandboxConfig, description="the sandbox limits of both the harness and the test run")
