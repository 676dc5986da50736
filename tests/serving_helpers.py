"""Chapter 12's test helpers: a tiny float64 Llama that carries SmolLM2's tokenizer and chat template (so
the server's text, chat and token counting are real while a step costs milliseconds), a `python -m minivllm
serve` child process, and its `/metrics` read with prometheus-client's parser."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

MODEL_NAME = "tiny-chat"
MAX_MODEL_LEN = 1024
SERVER_FLAGS = ["--dtype", "float64", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", MODEL_NAME,
                "--uvicorn-log-level", "warning"]
STARTUP_TIMEOUT_S = 180
ABORT_TIMEOUT_S = 15  # an aborted request must leave the scheduler within this
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def make_tiny_chat_model(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random float64 Llama (`course.testing.make_tiny_model`) with SmolLM2-135M-Instruct's
    vocabulary size, tokenizer, chat template and end-of-sequence ids, saved in `folder`."""
    from minivllm.course.testing import make_tiny_model
    from minivllm.transformers_utils.model_files import resolve_model

    folder, source = Path(folder), resolve_model(None)
    config = json.loads((source / "config.json").read_text())
    make_tiny_model(folder, "llama", tie=False, seed=seed, vocab_size=config["vocab_size"],
                    bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


class Server:
    """A `python -m minivllm serve` child process: its URL, the processes it started, and a clean stop."""

    def __init__(self, model: Path, log: Path, extra: list[str] = (), env: dict | None = None):
        import os

        import psutil

        cmd = [sys.executable, "-m", "minivllm", "serve", "--model", str(model), "--port", "0", *SERVER_FLAGS, *extra]
        self.log = open(log, "w")
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        cwd=Path(__file__).resolve().parents[1],
                                        env=None if env is None else {**os.environ, **env})
        self.url = self._read_url()
        self.children = psutil.Process(self.process.pid).children(recursive=True)

    def _read_url(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if line.startswith("minivllm serve: listening on "):
                return line.split()[-1]
            if not line and self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"the server did not start: {Path(self.log.name).read_text()[-3000:]}")

    def engine_core(self):
        return next(p for p in self.children if "run_engine_core" in " ".join(p.cmdline()))

    def stop(self) -> int | None:
        """SIGTERM, then wait; returns the exit code (SIGKILL after 30 s, then fails the caller's check)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        return self.process.returncode

    def orphans(self) -> list:
        import psutil

        _, alive = psutil.wait_procs(getattr(self, "children", []), timeout=10)
        return alive


def metrics(server) -> dict[str, float]:
    """`/metrics` parsed with prometheus-client's own parser: sample name (labels in braces) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(server, timeout: float = ABORT_TIMEOUT_S) -> dict[str, float]:
    """Poll `/metrics` until no request runs or waits; returns the metrics then. Fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"requests still running {timeout} s after their clients left: {metrics(server)}")
