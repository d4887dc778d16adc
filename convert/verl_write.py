"""Writing VERL FSDP2 rank files for any world size W, in one process, without a GPU.

For each rank r: torch's fake process group (`torch.testing._internal.distributed.fake_pg`)
at rank r of W, a 1-D DeviceMesh named "fsdp" (`init_device_mesh`, as VERL's
`create_device_mesh` builds it), and every tensor's rank-r slice (torch.chunk semantics, see
convert/sharding.py) wrapped as a DTensor with placement `(Shard(d),)`, then `torch.save` of
the three objects VERL's `FSDPCheckpointManager.save_checkpoint` saves
(verl/utils/checkpoint/fsdp_checkpoint_manager.py): `module.state_dict()`,
`optimizer.state_dict()` (torch.optim.AdamW layout) and `{"lr_scheduler", "rng"}`.

The mesh's device type defaults to "cuda", as a GPU VERL run pickles it; the local tensors are
CPU tensors (as VERL writes them under CPU offload). Use device_type="cpu" for a gloo run.
Memory: one rank's model slices (model size / W; twice that for the optimizer file) plus one
source tensor.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from convert.errors import ConvertError
from convert.sharding import chunk_bounds, shard_dim
from convert.tensors import cast, to_torch, warn_rounded_masters
from jscenegen.paths import naming_write_errors, storage_limit, write_limit_error

# (name, dim, start, stop) -> the slice [start, stop) of tensor `name` along `dim`
SliceReader = Callable[[str, int, int, int], np.ndarray]


def dict_reader(arrays: Mapping[str, np.ndarray]) -> SliceReader:
    """A SliceReader over in-memory full arrays."""

    def read(name: str, dim: int, start: int, stop: int) -> np.ndarray:
        a = arrays[name]
        return a[(slice(None),) * dim + (slice(start, stop),)]

    return read


@dataclasses.dataclass
class AdamSource:
    """Adam state to write: moments by HF name (SliceReaders, fp32), the step count, groups.

    `param_groups`: torch's list of group dicts (from `adamw_param_groups` or a VERL source);
    their `params` must cover 0..P-1 in parameter order. `names`: the parameters that have
    state (None = all); the others (a frozen vision tower) get an index in `param_groups` and
    no `state` entry, as torch AdamW saves parameters it never stepped.
    """

    exp_avg: SliceReader
    exp_avg_sq: SliceReader
    step: int
    param_groups: list[dict[str, Any]]
    names: Sequence[str] | None = None


def adamw_param_groups(n_params: int, *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                       eps: float = 1e-8, weight_decay: float = 0.01,
                       initial_lr: float | None = None) -> list[dict[str, Any]]:
    """The `param_groups` torch.optim.AdamW (installed torch) writes for one group of P params.

    The key set comes from a real AdamW, so it matches the torch version that will load it;
    `initial_lr` is what LambdaLR adds (defaults to lr).
    """
    import torch

    group = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay).state_dict()["param_groups"][0]
    group["initial_lr"] = lr if initial_lr is None else initial_lr
    group["params"] = list(range(n_params))
    return [group]


@contextlib.contextmanager
def _fake_rank(rank: int, world_size: int, device_type: str) -> Iterator[Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConvertError("a torch process group is already initialised in this process; "
                           "write VERL files from a process without one")
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]:"; undo that
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _dtensor(local: np.ndarray, mesh: Any, dim: int, shape: tuple[int, ...], device_type: str) -> Any:
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    t = to_torch(np.array(local, copy=True))  # own storage: torch.save writes whole storages
    stride = torch.empty(shape, dtype=t.dtype, device="meta").stride()
    if device_type == "cpu":
        return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                  stride=stride)
    # a "cuda" mesh with a CPU local tensor (what VERL writes under CPU offload); from_local
    # would move the tensor to the mesh's device, which needs a GPU
    spec = DTensorSpec(mesh, (Shard(dim),), TensorMeta(torch.Size(shape), stride, t.dtype))
    return DTensor(t, spec, requires_grad=False)


MAX_WORLD_SIZE = 8192  # 3 files a rank; a larger W is a typo, not a run (and takes O(W^2) to write)


def check_world_size(world_size: int) -> None:
    """Raise ConvertError unless 1 <= world_size <= MAX_WORLD_SIZE (VERL ranks to write)."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConvertError(f"world size {world_size}: must lie in [1, {MAX_WORLD_SIZE:,}] "
                           f"(VERL writes three files per rank)")


def write_rank_files(shard_dir: str | Path, *, shapes: Mapping[str, tuple[int, ...]],
                     params: SliceReader, world_size: int, placement: str = "dim0",
                     tied_alias: str | None = None, adam: AdamSource | None = None,
                     extra_states: list[dict[str, Any]] | None = None, dtype: str | None = None,
                     device_type: str = "cuda", shown_as: str | Path | None = None) -> dict[str, int]:
    """Write `{model,optim,extra_state}_world_size_W_rank_R.pt` for R in 0..W-1 and fsdp_config.json.

    shapes: ordered {hf_name: global shape} in parameter order (`tensor_sets.verl_shapes`);
    `tied_alias`: the embedding's name when the head is tied: `lm_head.weight` is added as a
    second DTensor over its shard (sharing its storage, as torch's state_dict does). `dtype`
    casts every model tensor (VERL's actor holds all of them, vision tower included, as fp32
    parameters); Adam moments stay fp32. Adam `state` is keyed by the index in `shapes` and
    written for `adam.names` only; `param_groups` are written as given. `extra_states`: one
    dict per rank, or one for all ranks. A `dtype` narrower than a parameter's stored one is
    warned (ConversionWarning naming `shown_as`, default `shard_dir`) when Adam state is
    written for it. Returns {hf_name: shard dim}. Raises ConvertError
    on a W outside [1, MAX_WORLD_SIZE], a wrong extra_states count, or Adam names outside `shapes`.
    """
    import torch

    shard_dir = Path(shard_dir)
    check_world_size(world_size)
    if extra_states is not None and len(extra_states) not in (1, world_size):
        raise ConvertError(f"{len(extra_states)} extra states for world size {world_size} "
                           "(give one per rank, or one for all)")
    dims = {n: shard_dim(s, world_size, placement) for n, s in shapes.items()}
    with_state = set(shapes) if adam is None or adam.names is None else set(adam.names)
    if with_state - set(shapes):
        raise ConvertError(f"Adam state for {sorted(with_state - set(shapes))[:3]}, which are not "
                           "parameters of the model")
    shard_dir.mkdir(parents=True, exist_ok=True)
    W = world_size
    for r in range(W):
        with _fake_rank(r, W, device_type) as mesh:

            def local(reader: SliceReader, name: str) -> np.ndarray:
                lo, hi = chunk_bounds(shapes[name][dims[name]], W, r)
                return reader(name, dims[name], lo, hi)

            model, stored = {}, {}
            for name, shape in shapes.items():
                shard = local(params, name)
                stored[name] = shard.dtype
                model[name] = _dtensor(cast(shard, dtype), mesh, dims[name], tuple(shape),
                                       device_type)
            if r == 0 and adam is not None:
                warn_rounded_masters(str(shown_as or shard_dir),
                                     {n: stored[n] for n in shapes if n in with_state}, dtype)
            if r == 0:   # about the bytes of all 3W files (for a full disk's message)
                all_bytes = sum(int(np.prod(shapes[n], dtype=np.int64)) * model[n].element_size()
                                for n in shapes)
                if adam is not None:
                    all_bytes += sum(2 * 4 * int(np.prod(shapes[n], dtype=np.int64)) for n in with_state)
            if tied_alias:
                # state_dict order: lm_head comes last
                model["lm_head.weight"] = _tied_view(model[tied_alias])
            _save(model, shard_dir / f"model_world_size_{W}_rank_{r}.pt", all_bytes)
            del model
            if adam is not None:
                state = {}
                step = torch.tensor(float(adam.step), dtype=torch.float32)
                for i, (name, shape) in enumerate(shapes.items()):
                    if name not in with_state:
                        continue
                    state[i] = {
                        "step": step.clone(),
                        "exp_avg": _dtensor(cast(local(adam.exp_avg, name), "float32"), mesh,
                                            dims[name], tuple(shape), device_type),
                        "exp_avg_sq": _dtensor(cast(local(adam.exp_avg_sq, name), "float32"), mesh,
                                               dims[name], tuple(shape), device_type),
                    }
                _save({"state": state, "param_groups": adam.param_groups},
                      shard_dir / f"optim_world_size_{W}_rank_{r}.pt", all_bytes)
                del state
            if extra_states is not None:
                extra = extra_states[r if len(extra_states) == W else 0]
                _save(extra, shard_dir / f"extra_state_world_size_{W}_rank_{r}.pt", all_bytes)
    (shard_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": W},
                                                           indent=4))
    return dims


def _save(obj: Any, file: Path, all_bytes: int) -> None:
    """torch.save, a failed write naming `file`: torch's zip writer reports one as a
    RuntimeError ("[enforce fail at inline_container.cc] . unexpected pos ...") that drops the
    errno. A storage limit (full disk, quota, `ulimit -f`) is DiskFullError (`write_limit_error`:
    the file's bytes, or `all_bytes` for the whole set of rank files)."""
    import torch

    with naming_write_errors(file):
        try:
            torch.save(obj, file)
        except RuntimeError as err:
            first = (str(err).splitlines() or [""])[0][:200]
            code = _storage_limit_of_save(obj, file)
            if code is not None:
                raise write_limit_error(code, file, _saved_bytes(obj), all_bytes,
                                        "writing the VERL rank files") from None
            raise OSError(errno.EIO, f"torch.save could not write the file ({first})", str(file)) from None


def _storage_limit_of_save(obj: Any, file: Path) -> int | None:
    """After torch.save(obj, file) failed: the STORAGE_LIMITS errno that stopped it, else None.
    torch's C++ writer keeps no errno, so the save is tried again through a Python file, whose
    write() raises the OSError that torch then chains to its RuntimeError. The file is removed
    either way (a partial file holds the space the message reports as free)."""
    import torch

    try:
        with open(file, "wb") as f:
            torch.save(obj, f)
    except (RuntimeError, OSError) as err:
        return storage_limit(err)
    finally:
        file.unlink(missing_ok=True)
    return None


class _ByteCounter:
    """A file-like sink that only counts what torch.save writes to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.n += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:   # torch skips metadata-only records
        self.n = offset if whence == 0 else self.n + offset
        return self.n

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        pass


def _saved_bytes(obj: Any) -> int:
    """The bytes torch.save writes for `obj` (serialised, nothing stored)."""
    import torch

    sink = _ByteCounter()
    torch.save(obj, sink)
    return sink.n


def _tied_view(emb: Any) -> Any:
    """A second DTensor over the same local storage (torch's tied lm_head entry)."""
    from torch.distributed.tensor import DTensor

    return DTensor(emb._local_tensor.view(emb._local_tensor.shape), emb._spec, requires_grad=False)


def lambda_lr_state(base_lr: float, last_epoch: int, last_lr: float) -> dict[str, Any]:
    """A torch LambdaLR `state_dict()` (installed torch's keys) at `last_epoch` steps taken,
    `last_lr` = base_lr x the multiplier at `last_epoch` (what the optimizer's group lr is then).

    VERL builds LambdaLR (verl/utils/torch_functional.py); its lambda is rebuilt from config on
    load, so `lr_lambdas` is `[None]`.
    """
    import torch

    opt = torch.optim.AdamW([torch.zeros(1)], lr=base_lr)
    sd = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0).state_dict()
    sd.update(base_lrs=[base_lr], last_epoch=int(last_epoch), _step_count=int(last_epoch) + 1,
              _last_lr=[float(last_lr)], lr_lambdas=[None])
    return sd   # _is_initial: as torch leaves it after construction and after every step
