"""Two processes x 3 CPU devices with JAX's distributed runtime == one process with 6 devices."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jscenegen.sharding.mesh import make_mesh

from multihost_loss import sharded_loss


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_run_computes_the_single_process_loss(tiny_hf):
    expected = sharded_loss(tiny_hf["qwen3"], make_mesh(3, 2))
    port = _free_port()
    here = Path(__file__).parent
    procs = []
    for pid in range(2):
        env = dict(os.environ, JSCENEGEN_COORDINATOR=f"127.0.0.1:{port}",
                   JSCENEGEN_NUM_PROCESSES="2", JSCENEGEN_PROCESS_ID=str(pid),
                   PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
        env.pop("XLA_FLAGS", None)
        env.pop("JAX_NUM_CPU_DEVICES", None)  # an in-process CLI test may have set 6
        procs.append(subprocess.Popen([sys.executable, str(here / "multihost_worker.py"),
                                       str(tiny_hf["qwen3"])], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    assert result["processes"] == 2
    assert abs(result["loss"] - expected) <= 1e-5 * abs(expected)
