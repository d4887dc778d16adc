"""Test session set-up: six forced CPU devices (a real 3 x 2 mesh) and a persistent compile cache
(shared by the pytest-xdist workers of `-n 2`).

The device count must be set before JAX's backend starts, so this runs at conftest import.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# threads enough for six devices (jscenegen/host_devices.py: XLA:CPU deadlocks without)
from jscenegen.host_devices import size_cpu_thread_pool  # noqa: E402

size_cpu_thread_pool(6)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 6)
_CACHE = os.environ.get(
    "JSCENEGEN_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jscenegen", "jax")
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# No size bound: a bound turns on JAX's LRU bookkeeping, whose writes fail on entries written
# without it. The two xdist workers share the cache unlocked: an entry read while the other
# writes it fails to load, which JAX warns about and compiles anew.


# Property tests draw the same examples on every run (a failure reproduces, CI never flakes).
# XLA:CPU flushes subnormal floats to zero (torch does not), so strategies exclude them.
from hypothesis import settings  # noqa: E402

settings.register_profile("jscenegen", derandomize=True, database=None)
settings.load_profile("jscenegen")


def pytest_configure(config):
    assert jax.device_count() == 6, f"expected 6 forced CPU devices, got {jax.devices()}"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Tiny random Qwen2 (biases, untied) and Qwen3 (q/k norms, tied) HF dirs written by transformers."""
    from hf_fixtures import make_hf_dir

    root = tmp_path_factory.mktemp("tiny_hf")
    return {arch: make_hf_dir(root / arch, arch) for arch in ("qwen2", "qwen3")}


@pytest.fixture(scope="session")
def qwen35_hf(tmp_path_factory):
    """Tiny random Qwen3.5 HF dirs written by transformers (tests/qwen35_fixtures.py): the
    composite `qwen3_5` (untied, vision tower, mtp), `qwen3_5_text` (tied, mtp) and the
    released storage (`release`: bf16 with fp32 A_log / gated norm, sharded file name + index)."""
    from qwen35_fixtures import make_qwen35_dir

    root = tmp_path_factory.mktemp("qwen35_hf")
    return {"qwen3_5": make_qwen35_dir(root, "qwen3_5"),
            "qwen3_5_text": make_qwen35_dir(root, "qwen3_5_text"),
            "release": make_qwen35_dir(root, "qwen3_5", seed=1, dtype="bfloat16",
                                       release_layout=True)}


@pytest.fixture
def train_command_calls(monkeypatch) -> dict:
    """`pipeline.train_command` replaced by a stub returning 0: the dict it returns gets the
    `cfg` and keyword arguments (resume, max_updates, config_source) of the last call."""
    import jscenegen.pipeline

    taken = {}
    monkeypatch.setattr(jscenegen.pipeline, "train_command",
                        lambda cfg, run_dir, **kw: taken.update(cfg=cfg, **kw) or 0)
    return taken
