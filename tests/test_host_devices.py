"""The CPU backend's device count and thread-pool size, set through the environment before JAX
starts (jscenegen/host_devices.py)."""
import os

import jax
import pytest

from jscenegen.cli import main
from jscenegen.host_devices import THREADS_PER_DEVICE, force_cpu_devices, size_cpu_thread_pool

from cli_errors import one_error_line

CORES = len(os.sched_getaffinity(0))
FLAG = "--xla_force_host_platform_device_count"


def pool(devices: int) -> str:
    return str(max(CORES, THREADS_PER_DEVICE * devices))


@pytest.mark.parametrize("environ, devices, written", [
    ({}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
    ({"JSCENEGEN_CPU_DEVICES": " 3 "}, 3, {"JAX_NUM_CPU_DEVICES": "3", "PJRT_NPROC": pool(3)}),
    # JAX's order: JAX_NUM_CPU_DEVICES before the flag, the flag before ours
    ({"JAX_NUM_CPU_DEVICES": "4", "JSCENEGEN_CPU_DEVICES": "3", "XLA_FLAGS": f"{FLAG}=2"}, 4,
     {"PJRT_NPROC": pool(4)}),
    ({"JAX_NUM_CPU_DEVICES": "-1", "XLA_FLAGS": f"{FLAG}=5"}, 5, {"PJRT_NPROC": pool(5)}),
    ({"XLA_FLAGS": f"--xla_dump_to=/tmp/x   {FLAG}=40", "JSCENEGEN_CPU_DEVICES": "3"}, 40,
     {"PJRT_NPROC": pool(40)}),
    ({"XLA_FLAGS": f"{FLAG}=2 {FLAG}=8"}, 8, {"PJRT_NPROC": pool(8)}),   # XLA takes the last
    ({"XLA_FLAGS": f"--not{FLAG}=9"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
    ({"PJRT_NPROC": "64"}, 6, {"JAX_NUM_CPU_DEVICES": "6"}),            # the user's, kept
    ({"PJRT_NPROC": "abc"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
    ({"PJRT_NPROC": "0"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
    ({"PJRT_NPROC": ""}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
    ({"NPROC": "2"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": pool(6)}),
])
def test_the_device_count_follows_jax_order_and_the_pool_is_sized_for_it(environ, devices, written):
    before = dict(environ)
    assert force_cpu_devices(environ) == devices
    assert environ == {**before, **written}


def test_a_small_pool_the_user_chose_is_kept_with_a_warning(caplog):
    environ = {"PJRT_NPROC": "4"}
    size_cpu_thread_pool(6, environ)
    assert environ == {"PJRT_NPROC": "4"}
    assert "PJRT_NPROC=4 gives XLA:CPU fewer than 12 threads for 6 devices" in caplog.text


@pytest.mark.parametrize("environ, name, value", [
    ({"JSCENEGEN_CPU_DEVICES": "abc"}, "JSCENEGEN_CPU_DEVICES", "abc"),
    ({"JSCENEGEN_CPU_DEVICES": "0"}, "JSCENEGEN_CPU_DEVICES", "0"),
    ({"JSCENEGEN_CPU_DEVICES": "\u00b2"}, "JSCENEGEN_CPU_DEVICES", "\u00b2"),
    ({"JSCENEGEN_CPU_DEVICES": "1000000000"}, "JSCENEGEN_CPU_DEVICES", "1000000000"),
    ({"JAX_NUM_CPU_DEVICES": "-2"}, "JAX_NUM_CPU_DEVICES", "-2"),
    ({"XLA_FLAGS": f"{FLAG}=4x"}, f"XLA_FLAGS {FLAG}", "4x"),
    ({"XLA_FLAGS": f"{FLAG}=0"}, f"XLA_FLAGS {FLAG}", "0"),
])
def test_a_bad_device_count_is_refused_naming_its_variable(environ, name, value):
    before = dict(environ)
    with pytest.raises(ValueError) as err:
        force_cpu_devices(environ)
    assert str(err.value) == f"{name}={value!r}: a CPU device count must be an integer in 1..1024"
    assert environ == before


def test_the_cli_refuses_a_bad_device_count_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JSCENEGEN_CPU_DEVICES", "six")
    assert main(["scene", "--help"]) == 2
    assert one_error_line(capsys) == ("error: JSCENEGEN_CPU_DEVICES='six': a CPU device count "
                                      "must be an integer in 1..1024")


def test_the_cli_sizes_the_pool_before_any_command(monkeypatch, capsys):
    for name in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "PJRT_NPROC", "NPROC"):
        monkeypatch.setenv(name, "")   # recorded, so what main writes is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("JSCENEGEN_CPU_DEVICES", "5")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["JAX_NUM_CPU_DEVICES"] == "5" and os.environ["PJRT_NPROC"] == pool(5)


def test_this_session_runs_its_six_devices_with_threads_per_device():
    """conftest sized the pools before JAX started: XLA:CPU's intra-op threads are counted
    (Linux names them tf_XLAEigen)."""
    assert jax.device_count() == 6
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:   # a thread that ended meanwhile
            pass
    assert names.count("tf_XLAEigen") == min(max(int(os.environ["PJRT_NPROC"]), 6), 256) >= 12
