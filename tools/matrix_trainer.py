"""The matrix's sample through `nnscaler train` (issue 45 §1): a YAML config (a tiny Llama,
`nnscaler.trainer.hf.CausalLM` from examples/trainer/hf_llama, on `TokenizedText` blocks; AdamW
with weight decay and gradient clipping; 3 steps of a global batch of 8) run by the command's
worker entry point, `nnscaler.trainer.cli.main.main(["-f", cfg.yaml, ...])`, on each of N gloo
processes carrying torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): what
every process `nnscaler train --nproc N` starts through torchrun runs (torchrun's agent itself is
run by tests/trainer/test_example.py). The cases (`PLANS`) run in one launch, in sequence.

Each case ends in parity with one process: the same model built from the same seed, the same
blocks in the sampler's order, AdamW, `clip_grad_norm_`, 3 steps by hand (`reference`): the
losses the trainer logs (`LossFile`, a logger named in the YAML) and the weights of its last
checkpoint (merged with `nnscaler.ckpt.merge(..., hf=True)`) within float32's bound, 1e-5.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Dict, List, Sequence

import matrix_run  # noqa: E402  (puts tests/models and tests/runtime on sys.path)

import torch  # noqa: E402

ROOT = matrix_run._ROOT
MODEL_DIR = os.path.join(ROOT, "examples", "trainer", "hf_llama")  # config.json + tokenizer
STEPS, MICRO, GLOBAL, BLOCK, LR, WD, CLIP = 3, 4, 8, 16, 3e-3, 0.01, 1.0
TOL = 1e-5
# case -> (world, dotted overrides); recompute: every decoder layer
PLANS: Dict[str, tuple] = {
    "llama dp2 zero3 recompute": (2, {"pas_policy": "dp", "compute_config.use_zero": 3,
                                      "compute_config.pas_config": {"recompute_modules": "LlamaDecoderLayer"}}),
    "llama tp2": (2, {"pas_policy": "tp", "compute_config.plan_ngpus": 2}),
    "llama pp2": (2, {"pas_policy": "pp", "compute_config.plan_ngpus": 2,
                      "compute_config.pas_config": {"pipeline_nmicros": 2}}),
}


class LossFile:
    """A trainer logger (``log: [{type: matrix_trainer.LossFile, args: {path: ...}}]``): one JSON
    line per training step, {step, loss}."""

    def __init__(self, path: str):
        self.path = path

    def setup(self, config) -> None:
        open(self.path, "w").close()

    def log_metrics(self, metrics, step: int, tag: str) -> None:
        if tag == "train":
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(metrics["loss"])}) + "\n")

    def finalize(self) -> None:
        pass


def config(run_dir: str, text: str, world: int, overrides: dict) -> dict:
    """The YAML's content of a case (plain data)."""
    data = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": world, "use_end2end": True, "trace_strategy": "cpu"},
        "pas_policy": "dp", "gen_savedir": f"{run_dir}/gen", "seed": 0,
        "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "max_train_steps": STEPS, "enable_progress_bar": False,
        "model": {"type": "nnscaler.trainer.hf.CausalLM", "args": {"config": MODEL_DIR, "dtype": "float32"}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": LR, "weight_decay": WD}, "clip_gnorm": CLIP},
        "dataset": {"type": "nnscaler.trainer.hf.TokenizedText",
                    "train_args": {"files": text, "tokenizer": MODEL_DIR, "block_size": BLOCK, "split": "all",
                                   "cache_dir": f"{run_dir}/datasets"}},
        "dataset_sampler": {"train_args": {"shuffle": False}},
        "checkpoint": {"save_dir": f"{run_dir}/checkpoints", "every_n_train_steps": STEPS},
        "log": [{"type": "matrix_trainer.LossFile", "args": {"path": f"{run_dir}/losses.jsonl"}}],
    }
    for key, value in overrides.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return data


def run_rank_trainer(rank: int, world: int, argvs: Sequence[List[str]]) -> List[int]:
    """`nnscaler train`'s worker entry point on each argv in turn; the exit codes."""
    import torch.distributed as dist
    from nnscaler.trainer.cli.main import main
    codes = []
    for argv in argvs:
        codes.append(main(list(argv)))
        dist.barrier()
    return codes


def reference(run_dir: str, text: str, world: int, plan_ngpus: int):
    """(losses, {hf name: weight}) of one process: the trainer's data order, by hand."""
    from nnscaler.trainer.hf import CausalLM, TokenizedText
    from nnscaler.trainer.setup import seed_everything
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = TokenizedText(text, MODEL_DIR, block_size=BLOCK, split="all", cache_dir=os.path.join(run_dir, "ref-ds"))
        seed_everything(0)
        model = CausalLM(config=MODEL_DIR, dtype="float32")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        dp = world // plan_ngpus
        samplers = [list(torch.utils.data.DistributedSampler(data, num_replicas=dp, rank=r, shuffle=False))
                    for r in range(dp)]
        per_step = GLOBAL // dp  # samples a data-parallel rank takes per step
        losses = []
        for step in range(STEPS):
            ids = [i for s in samplers for i in s[step * per_step:(step + 1) * per_step]]
            batch = {"input_ids": torch.stack([data[i]["input_ids"] for i in ids])}
            opt.zero_grad()
            loss = model(batch)  # equally many tokens per sample: the mean of the micro-batches' means
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.model.named_parameters()}  # a tied weight once
    finally:
        torch.set_num_threads(threads)


def compare(losses, weights, ref_losses, ref_weights) -> str:
    """'' when within float32's bound, else the first difference."""
    if len(losses) != len(ref_losses):
        return f"{len(losses)} losses logged, {len(ref_losses)} steps expected"
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if not abs(got - want) <= TOL * max(1.0, abs(want)):
            return f"loss of step {step}: {got!r} vs {want!r} (bound {TOL})"
    missing = sorted(set(ref_weights) - set(weights))
    if missing:
        return f"weights missing from the checkpoint: {missing[:4]}"
    for name, want in ref_weights.items():
        diff = ((weights[name].double() - want.double()).norm() / want.double().norm().clamp_min(1.0)).item()
        if not diff <= TOL:
            return f"{name} differs by {diff:.3g} (bound {TOL})"
    return ""


def run_trainer(names: Sequence[str] = tuple(PLANS)) -> Dict[str, dict]:
    """Run the cases `names` (one launch per world size); {name: record} with state parity,
    differs, or crash (a non-zero exit code, or the launch's error)."""
    import yaml
    from launch import WorkerError, run_workers
    from nnscaler.ckpt import merge
    from safetensors.torch import load_file
    records: Dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nnscaler-matrix-trainer-") as root:
        text = os.path.join(root, "text.txt")
        with open(os.path.join(ROOT, "docs", "trainer.md")) as f:
            open(text, "w").write(f.read()[:6000])
        for world in sorted({PLANS[n][0] for n in names}):
            mine = [n for n in names if PLANS[n][0] == world]
            argvs = []
            for i, name in enumerate(mine):
                run_dir = os.path.join(root, f"run{i}-w{world}")
                os.makedirs(run_dir)
                path = os.path.join(run_dir, "cfg.yaml")
                with open(path, "w") as f:
                    yaml.safe_dump(config(run_dir, text, world, PLANS[name][1]), f)
                argvs.append(["-f", path])
            try:
                codes = run_workers(run_rank_trainer, world, argvs, timeout=matrix_run.DEADLINE[world] * len(mine))[0]
            except WorkerError as exc:
                for name in mine:
                    records[name] = {"state": "crash", "error": matrix_run._first_error(str(exc))}
                continue
            for i, (name, code) in enumerate(zip(mine, codes)):
                run_dir = os.path.join(root, f"run{i}-w{world}")
                if code != 0:
                    records[name] = {"state": "crash", "error": f"nnscaler train exited with {code}"}
                    continue
                with open(os.path.join(run_dir, "losses.jsonl")) as f:
                    losses = [json.loads(line)["loss"] for line in f if line.strip()]
                out = merge(os.path.join(run_dir, "checkpoints", "last"), os.path.join(run_dir, "hf"), hf=True)
                weights = load_file(os.path.join(out, "model.safetensors"))
                plan_ngpus = PLANS[name][1].get("compute_config.plan_ngpus", 1)
                diff = compare(losses, weights, *reference(run_dir, text, world, plan_ngpus))
                records[name] = {"state": "differs", "error": diff} if diff else {"state": "parity"}
    return records
