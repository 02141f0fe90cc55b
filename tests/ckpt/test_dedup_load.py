"""A deduped checkpoint loaded into the plan that saved it, in a plain process (one rank: no
piece comes from another rank, so no process group is needed)."""
from __future__ import annotations

import torch

from fake_modules import trained
from nnscaler.ckpt import load, save


def test_deduped_checkpoint_loads_in_a_plain_process(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt, kind="deduped", extra={"step": 3})
    pm2, opt2 = trained(seed=9, steps=1)
    assert load(tmp_path / "ck", pm2, opt2) == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(pm.state_dict().values(), pm2.state_dict().values()))
