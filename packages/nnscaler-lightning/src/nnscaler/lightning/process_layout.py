"""The process layout both strategies (Lightning's Trainer and Fabric) share: one process per
device, `plan_ngpus` consecutive ranks per data-parallel unit, one data shard per unit; and the
collectives over all of them (barrier, broadcast)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from .internals import default_process_group_backend, distributed_is_initialized, init_dist_connection

__all__ = ["ProcessLayout"]


class ProcessLayout:
    """Mixed in before Lightning's ParallelStrategy; the strategy sets ``self._num_nodes``,
    ``self.compute_config`` (None: data parallel over every process), ``self._start_method``,
    ``self._timeout``, ``self._process_group_backend`` and `_LAUNCHERS`, the (script, spawn)
    launcher classes of its Lightning flavour (Fabric's or the Trainer's)."""

    _LAUNCHERS: Tuple[type, type]

    def _configure_launcher(self) -> None:
        script, spawn = self._LAUNCHERS
        if self._start_method == "popen":
            self._launcher = script(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = spawn(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _init_process_group(self, **kwargs: Any) -> None:
        """The default process group over every process (the strategy's backend, or the device's)."""
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, **kwargs)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def plan_ngpus(self) -> int:
        return self.compute_config.plan_ngpus if self.compute_config is not None else 1

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        """One shard of the data per data-parallel unit; the ranks of a unit see the same batch."""
        return {"num_replicas": self.num_nodes * self.num_processes // self.plan_ngpus,
                "rank": self.global_rank // self.plan_ngpus}

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
