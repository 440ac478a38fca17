"""Process groups for tensor parallelism: who this rank is, which device it drives, how it talks.

:func:`init_tensor_parallel` joins (or creates) the default ``torch.distributed``
process group: NCCL on CUDA (one GPU per rank, ``cuda:LOCAL_RANK``, with
``device_id`` set so the communicator is made at once), gloo on the CPU. The
timeout is always finite, so a collective whose peer died raises instead of
waiting forever. :func:`check_world` refuses what cannot work before any process
starts; :func:`check_same_device` refuses mixed devices once the group exists.

Example (one process, gloo)::

    >>> tp = init_tensor_parallel(1, 0, init_method="tcp://127.0.0.1:29512")
    >>> tp.rank, tp.world_size, str(tp.device), tp.backend
    (0, 1, 'cpu', 'gloo')
    >>> destroy_tensor_parallel(tp)
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICE_TYPES = ("cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
#: seconds a collective may wait for its peers before it raises (a dead rank, a hung one)
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in a tensor-parallel group.

    ``device`` is the rank's device (``cuda:local_rank`` or ``cpu``); ``group`` the
    process group its collectives use (``None``: the default group).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float
    group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        """Rank 0: the rank that prints, schedules and reports."""
        return self.rank == 0


def check_world(world_size: int, device_type: str) -> None:
    """Refuse a world that cannot run: ``world_size < 1``, an unknown device type, or more
    ranks than visible GPUs (one GPU per rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor parallel size must be an int >= 1, got {world_size!r}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"tensor parallel runs on {' or '.join(DEVICE_TYPES)}, got device "
                         f"{device_type!r}; each rank takes cuda:LOCAL_RANK, so pass no index")
    if device_type == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > gpus:
            fewer = f"use --tensor-parallel {gpus} or fewer, or " if gpus else ""
            raise ValueError(f"tensor parallel size {world_size} needs one GPU per rank, but "
                             f"{gpus} GPU(s) are visible; {fewer}run on the CPU (--device cpu, "
                             "gloo)")


def check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e6:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}; "
                         "a collective without a timeout would wait forever for a dead rank")
    return float(timeout_s)


def init_tensor_parallel(
    world_size: int,
    rank: int,
    *,
    device_type: str = "cpu",
    local_rank: int | None = None,
    init_method: str = "env://",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: dist.Store | None = None,
) -> TensorParallel:
    """Join the default process group as ``rank`` of ``world_size``; returns this rank's place.

    ``device_type`` ``"cuda"`` uses NCCL on ``cuda:local_rank`` (``local_rank``
    defaults to ``rank``: one host), ``"cpu"`` uses gloo. ``init_method``: a
    ``tcp://host:port`` address, or ``env://`` (``MASTER_ADDR``/``MASTER_PORT``);
    ``store``, where given, wins over it: a ``torch.distributed`` store every rank
    reaches (the spawning launcher's, which already listens on its port).
    Collectives raise after ``timeout_s`` seconds.
    """
    check_world(world_size, device_type)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    local_rank = rank if local_rank is None else local_rank
    return _join(device_type, local_rank, init_method, timeout_s, store, world_size=world_size, rank=rank)


def init_from_torchrun(world_size: int, *, device_type: str = "cpu",
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallel:
    """Join the group ``torchrun`` set up for this process (rank, size and address from its
    environment, read by ``torch.distributed``); refuses a launch of another size."""
    check_world(world_size, device_type)
    tp = _join(device_type, dist.get_node_local_rank(fallback_rank=0), "env://", timeout_s, None)
    if tp.world_size != world_size:
        destroy_tensor_parallel(tp)
        raise ValueError(f"torchrun started {tp.world_size} processes but the tensor parallel "
                         f"size is {world_size}; pass --nproc-per-node {world_size} to torchrun")
    return tp


def _join(device_type: str, local_rank: int, init_method: str, timeout_s: float,
          store: dist.Store | None, **ranks: int) -> TensorParallel:
    timeout_s = check_timeout(timeout_s)
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group already exists in this process; "
                         "call destroy_tensor_parallel (or dist.destroy_process_group) first")
    device = torch.device("cpu")
    kwargs = {}
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # the NCCL communicator is made now, not at the first call
    # One backend string on every rank whatever its device, so that ranks on different
    # devices still meet and check_same_device can name the mismatch; object collectives
    # (plans, seeds, device kinds) go through gloo on the CPU, tensors through NCCL on CUDA.
    backends = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backends, timeout=datetime.timedelta(seconds=timeout_s), **ranks, **kwargs)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), local_rank, device,
                          BACKENDS[device_type], timeout_s)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the process group (after every rank's last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def shared_seed(tp: TensorParallel) -> int:
    """A seed drawn by rank 0 and broadcast: every rank gets the same int (a collective call)."""
    box = [secrets.randbits(62) if tp.is_first else None]
    dist.broadcast_object_list(box, src=0, group=tp.group)
    return box[0]


def check_same_device(tp: TensorParallel) -> None:
    """Refuse mixed devices: every rank must drive the same kind of device (all CUDA or all CPU).

    A collective call: every rank calls it; each raises the same ``ValueError``.
    """
    kinds: list[str | None] = [None] * tp.world_size
    dist.all_gather_object(kinds, tp.device.type, group=tp.group)
    if len(set(kinds)) != 1:
        raise ValueError(f"mixed devices across ranks: {kinds}; tensor parallel needs every rank "
                         "on CUDA (NCCL) or every rank on the CPU (gloo)")
