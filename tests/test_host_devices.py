"""The CPU backend's device count and thread-pool size, set through the environment before JAX
starts (jscenegen/host_devices.py)."""
import os

import pytest

from jscenegen.cli import main
from jscenegen.host_devices import THREADS_PER_DEVICE, force_cpu_devices, size_cpu_thread_pool

from cli_errors import one_error_line

CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("environ, devices, expected", [
    ({}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": str(max(CORES, 12))}),
    ({"JSCENEGEN_CPU_DEVICES": "3"}, 3,
     {"JSCENEGEN_CPU_DEVICES": "3", "JAX_NUM_CPU_DEVICES": "3", "PJRT_NPROC": str(max(CORES, 6))}),
    ({"JAX_NUM_CPU_DEVICES": "4", "JSCENEGEN_CPU_DEVICES": "3"}, 4,
     {"JAX_NUM_CPU_DEVICES": "4", "JSCENEGEN_CPU_DEVICES": "3", "PJRT_NPROC": str(max(CORES, 8))}),
    ({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=40"}, 40,
     {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=40",
      "PJRT_NPROC": "80"}),
    ({"PJRT_NPROC": "5"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "PJRT_NPROC": "5"}),
    ({"NPROC": "7"}, 6, {"JAX_NUM_CPU_DEVICES": "6", "NPROC": "7"}),
])
def test_the_device_count_is_kept_or_chosen_and_the_pool_sized_for_it(environ, devices, expected):
    assert force_cpu_devices(environ) == devices
    assert environ == expected


def test_the_pool_holds_threads_per_device_beyond_the_cores():
    environ = {}
    size_cpu_thread_pool(CORES, environ)
    assert int(environ["PJRT_NPROC"]) == THREADS_PER_DEVICE * CORES > CORES


@pytest.mark.parametrize("name, value", [("JSCENEGEN_CPU_DEVICES", "abc"),
                                         ("JSCENEGEN_CPU_DEVICES", "0"),
                                         ("JAX_NUM_CPU_DEVICES", "-2")])
def test_a_bad_device_count_is_refused_naming_its_variable(name, value):
    environ = {name: value}
    with pytest.raises(ValueError, match=f"{name}='{value}': a CPU device count must be a positive"):
        force_cpu_devices(environ)
    assert environ == {name: value}


def test_the_cli_refuses_a_bad_device_count_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JSCENEGEN_CPU_DEVICES", "six")
    assert main(["scene", "--help"]) == 2
    assert one_error_line(capsys) == ("error: JSCENEGEN_CPU_DEVICES='six': a CPU device count "
                                      "must be a positive integer")

