"""The matrix's sample through the Lightning strategy (issue 45 §1): a LightningModule holding the
matrix's tiny Llama (`hf_models`, float32), fitted for 3 Adam steps by `lightning.pytorch.Trainer`
with `NnScalerStrategy` on N gloo processes (a DistributedSampler in order deals the data), and
compared with one process trained 3 steps on the same global batches (`matrix_run.reference`, the
bound of `matrix_run.compare`: float32 1e-5). The cases (`PLANS`) run in one launch, in sequence.
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, Sequence

import matrix_run  # noqa: E402  (puts tests/models and tests/runtime on sys.path)

import torch  # noqa: E402

# case -> (ComputeConfig keyword arguments, the matrix case it is compared as)
PLANS: Dict[str, tuple] = {
    "llama dp2 zero3 recompute": ({"plan_ngpus": 1, "use_zero": 3,
                                   "pas_config": {"recompute_modules": "LlamaDecoderLayer"}},
                                  {"plan": "dp", "zero": "3", "recompute": "layers"}),
    "llama tp2": ({"plan_ngpus": 2}, {"plan": "tp", "zero": "none", "recompute": "off"}),
}
POLICY = {"dp": "dp", "tp": "tp"}
WORLD = 2


def matrix_case(name: str) -> dict:
    return dict({"model": "llama", "precision": "fp32", "batch": "plain", "dropout": "off", "action": "none",
                 "zero_ngroups": "1", "id": f"lightning:{name}"}, **PLANS[name][1])


def _module(case, per_device: int, dp: int = 1, dp_rank: int = 0):
    import lightning.pytorch as pl

    rows = [{k: v[i] for k, v in matrix_run._batch(case, step).items()}
            for step in range(matrix_run.STEPS) for i in range(matrix_run.GLOBAL_BATCH)]

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = matrix_run.make_model(case)  # seeded: the reference's weights
            self.step_losses = []

        @property
        def dummy_forward_args(self):
            return {k: torch.stack([r[k] for r in rows[:per_device]]) for k in rows[0]}

        def forward(self, input_ids, labels, attention_mask):
            return self.lm(input_ids=input_ids, labels=labels, attention_mask=attention_mask)

        def training_step(self, batch, batch_idx):
            loss = self(**batch)
            self.step_losses.append(loss.detach().double().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=matrix_run.LR, eps=matrix_run.EPS[case["precision"]])

        def train_dataloader(self):  # the sampler given: in order (Lightning's own would shuffle)
            sampler = torch.utils.data.DistributedSampler(rows, num_replicas=dp, rank=dp_rank, shuffle=False)
            return torch.utils.data.DataLoader(rows, batch_size=per_device, sampler=sampler)
    return LitLlama()


def run_rank_lightning(rank: int, world: int, names: Sequence[str], root: str):
    """Each case of `names` in turn: this rank's {"state": "ok", losses, shards, reads}."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    out = []
    for i, name in enumerate(names):
        kwargs, _ = PLANS[name]
        case = matrix_case(name)
        dp = world // kwargs["plan_ngpus"]
        module = _module(case, matrix_run.GLOBAL_BATCH // dp, dp, rank // kwargs["plan_ngpus"])
        cfg = ComputeConfig(runtime_ngpus=world, trace_strategy="cpu", **kwargs)
        strategy = NnScalerStrategy(compute_config=cfg, pas_policy=POLICY[case["plan"]],
                                    gen_savedir=os.path.join(root, f"gen{i}"), instance_name=f"lit{i}")
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=matrix_run.STEPS,
                             max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=os.path.join(root, f"run{i}"),
                             num_sanity_val_steps=0)
        trainer.fit(module)
        losses = torch.stack(module.step_losses).reshape(-1)
        dist.all_reduce(losses)
        pm = module.nnscaler_pmodule
        with pm.unsharded():
            shards = [(e.full_name, tuple(e.full_shape), tuple(e.slices), getattr(pm, local).detach().clone())
                      for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
        out.append({"state": "ok", "losses": (losses / world).tolist(), "shards": shards, "reads": {}})
        dist.barrier()
    return out


def _strip(results, prefix="lm."):
    """The parallel module's names are the LightningModule's (``lm.`` + the reference's)."""
    return [dict(r, shards=[(n[len(prefix):] if n.startswith(prefix) else n, *rest) for n, *rest in r["shards"]])
            for r in results]


def run_lightning(names: Sequence[str] = tuple(PLANS)) -> Dict[str, dict]:
    """Run the cases `names` in one launch; {name: record} (parity / differs, or crash for every
    case when the launch failed)."""
    from launch import WorkerError, run_workers
    with tempfile.TemporaryDirectory(prefix="nnscaler-matrix-lightning-") as root:
        try:
            results = run_workers(run_rank_lightning, WORLD, list(names), root,
                                  timeout=matrix_run.DEADLINE[WORLD] * len(names))
        except WorkerError as exc:
            return {n: {"state": "crash", "error": matrix_run._first_error(str(exc))} for n in names}
    records = {}
    for i, name in enumerate(names):
        case = matrix_case(name)
        diff = matrix_run.compare(case, _strip([r[i] for r in results]), matrix_run.reference(case))
        records[name] = {"state": "differs", "error": diff} if diff else {"state": "parity"}
    return records
