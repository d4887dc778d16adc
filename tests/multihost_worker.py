"""One process of a 2-process x 3-CPU-device run (launched by test_multihost.py)."""
import json
import os
import sys

os.environ.pop("XLA_FLAGS", None)
os.environ["JAX_NUM_CPU_DEVICES"] = "3"  # this process's share of the 6-device mesh
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from jscenegen.sharding.mesh import initialize_distributed, make_mesh  # noqa: E402


def main(hf_dir: str) -> None:
    assert initialize_distributed()  # from JSCENEGEN_* environment variables
    assert jax.device_count() == 6 and jax.local_device_count() == 3
    from multihost_loss import sharded_loss

    loss = sharded_loss(hf_dir, make_mesh(3, 2))
    if jax.process_index() == 0:
        print(json.dumps({"loss": loss, "processes": jax.process_count()}))


if __name__ == "__main__":
    main(sys.argv[1])
