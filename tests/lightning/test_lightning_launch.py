"""`Trainer(strategy="nnscaler", devices=2, accelerator="cpu")` in a plain script: Lightning's own
launcher starts the second process (popen, like strategy="ddp"), and the strategy trains data
parallel over both with every default."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import nnscaler.lightning  # registers "nnscaler"
    import lightning.pytorch as pl
    from lit_models import Classifier

    if __name__ == "__main__":
        model = Classifier()
        t = pl.Trainer(strategy="nnscaler", devices=2, accelerator="cpu", max_epochs=1, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        t.fit(model)
        cfg = t.strategy.compute_config
        print(f"RESULT rank={{t.global_rank}} world={{t.world_size}} plan={{cfg.plan_ngpus}}x{{cfg.runtime_ngpus}} "
              f"steps={{t.global_step}} net={{model.net}}", flush=True)
""")


@pytest.mark.multiprocess
def test_registered_strategy_in_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the launched child's stdout is the parent's: both ranks report (their lines may interleave
    # on the shared pipe, so the reports are found by pattern, not by line)
    lines = sorted(re.findall(r"RESULT rank=\d+ world=\d+ plan=\d+x\d+ steps=\d+ net=\w+?(?=RESULT|\s|$)", proc.stdout))
    assert lines == ["RESULT rank=0 world=2 plan=1x2 steps=4 net=None",
                     "RESULT rank=1 world=2 plan=1x2 steps=4 net=None"], proc.stdout[-2000:]
    assert (tmp_path / ".nnscaler").is_dir()  # the default gen_savedir, in the working directory
