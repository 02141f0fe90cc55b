"""The compile driver: `parallelize()` and what it needs before a rank runs its generated code:
reuse decisions and the gen_savedir manifest (`gen_dir.py`), sending the files to other nodes
(`broadcast.py`), checking that every rank loaded the same program (`load_check.py`), the
model's source files (`model_sources.py`), the plan report (`plan_report.py`), errors about the
gen_savedir (`savedir.py`) and how errors are shown (`error_display.py`). Generated code never
imports this folder: it needs `nnscaler.runtime`'s module, comm, guards and random only."""
