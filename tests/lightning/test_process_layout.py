"""ProcessLayout: the launcher and process-group set-up both strategies share."""
from __future__ import annotations

import lightning.fabric.strategies.launchers as fabric_launchers
import lightning.pytorch.strategies.launchers as trainer_launchers

from nnscaler.lightning import NnScalerStrategy
from nnscaler.lightning.fabric import NnScalerStrategy as NnScalerFabricStrategy
from nnscaler.lightning.process_layout import ProcessLayout


def test_both_strategies_take_launch_and_process_group_setup_from_the_layout():
    for cls in (NnScalerStrategy, NnScalerFabricStrategy):
        for name in ("_configure_launcher", "set_world_ranks", "_init_process_group"):
            assert name not in vars(cls), (cls.__name__, name)
            assert getattr(cls, name) is getattr(ProcessLayout, name), (cls.__name__, name)
    assert NnScalerStrategy._LAUNCHERS == (trainer_launchers._SubprocessScriptLauncher,
                                           trainer_launchers._MultiProcessingLauncher)
    assert NnScalerFabricStrategy._LAUNCHERS == (fabric_launchers._SubprocessScriptLauncher,
                                                 fabric_launchers._MultiProcessingLauncher)


def test_the_launcher_follows_the_start_method():
    for cls in (NnScalerStrategy, NnScalerFabricStrategy):
        for method, kind in (("popen", 0), ("spawn", 1)):
            strategy = cls.__new__(cls)
            strategy._start_method = method
            calls = []
            strategy._LAUNCHERS = tuple((lambda *a, i=i, **k: calls.append((i, a, k))) for i in range(2))
            strategy.cluster_environment = "env"
            strategy.parallel_devices = [None, None]
            strategy._num_nodes = 1
            strategy._configure_launcher()
            assert calls[0][0] == kind, (cls.__name__, method)
            if kind == 0:
                assert calls[0][1] == ("env", 2, 1)
            else:
                assert calls[0][1] == (strategy,) and calls[0][2] == {"start_method": "spawn"}
