"""Tokens/s, MFU and peak memory of a ~1 B-parameter Llama on one GPU: nnscaler against eager PyTorch.

    python bench/gpu.py [--smoke] [--out FILE.json] [--steps 10] [--warmup 3] [--batch 8]

The model is bench/_llama.py's Llama-style decoder (RMSNorm, rotary embeddings, SDPA causal
attention, SwiGLU, untied head): dim 2048, 16 layers, 16 heads (no GQA by default: --kv-heads),
SwiGLU 5632, vocab 32000, 953 M parameters (888 M without the token embedding), bf16 parameters,
gradients and AdamW states (pure bf16, no fp32 master weights; fused AdamW on CUDA), sequence 2048,
micro-batch 8 (16,384 tokens a step), no activation recomputation. All variants start from the
same initial weights (seed 0) and train on the same batches (`_llama.RandomTokens`, seed 0), so
their losses agree (`max_abs_loss_diff_vs_eager`); in this order, in one run:

* ``eager``                : the model, `torch.optim.AdamW`, a plain loop (zero_grad, forward,
                             backward, step)
* ``nnscaler_parallelize`` : `parallelize(model, ..., 'dp', ComputeConfig(1, 1, use_end2end=True,
                             trace_strategy='cuda'))` on a one-rank process group (HashStore, no
                             port) + `build_optimizer(AdamW)`; the loop calls `train_step([batch])`
* ``nnscaler_train``       : `python -m nnscaler.trainer -f CFG.yaml --nproc 1` (= `nnscaler train`,
                             without needing the console script), a YAML generated into a
                             temporary directory: policy dp, precision bf16 (applied after the
                             fp32 trace), the same model, data (no shuffling), batch and optimizer;
                             a hook (bench/_step_timer.py) records each step's end time
* ``torch_compile``        : the eager loop with every decoder block under `torch.compile`
                             (`--compile-scope blocks`, as torchtitan does: one compilation reused by
                             all layers; `model` compiles the whole model, slower to compile),
                             backend `--compile-backend` (inductor). Last: the slowest to set up.

The results file is rewritten after every variant (`"complete": false` until the end), so a run
cut short still leaves the figures it has.

**Timing.** Every step ends with `torch.cuda.synchronize()` and a `perf_counter` reading (the
Trainer's hook does the same in `on_step_end`). After `--warmup` steps (compilation, autotuning,
allocator warm-up), tokens/s = batch x seq x `--steps` / (end of the last step - end of the last
warm-up step): wall time over the timed steps, for all four variants alike (the Trainer's own
logged step times are kept beside it, `logged_step_ms`). Setup (tracing, code generation,
compilation) is timed separately and not counted.

**MFU** = tokens/s x FLOPs per token / the chip's dense bf16 peak. FLOPs per token follow PaLM
(Chowdhery et al. 2022, appendix B) as torchtitan computes them (`get_num_flop_per_token`):
6 N + 12 L H Q T, with N the parameters without the token embedding (the output head counted),
L layers, H heads of size Q, sequence T, the causal mask's sparsity not discounted, and no
recomputation counted. The peak comes from the device name (`PEAK_BF16_TFLOPS`: H100 SXM 989,
H100 PCIe 756, H100 NVL 835, H200 989, A100 312, ...); an unknown device, or the CPU, gives MFU
null with the reason. Beside it, torchtitan's published Llama 3.1 8B figures on H100 (`REFERENCE`).

**Peak memory**: `torch.cuda.max_memory_allocated()` from the first warm-up step to the end
(model, gradients, optimizer states and activations; reset between variants; null on the CPU).

Target: both nnscaler variants >= 0.98 x the eager loop's tokens/s (`target_met`). Budget: about
4 minutes on one H100 / H200 with the defaults, compilation and tracing included.

Without CUDA the script refuses (exit 2, one line) unless `--smoke`: a 2.5 M-parameter model
(dim 256, 2 layers, GQA 4/2 heads), sequence 64, batch 2, 2 steps after 1 warm-up, bf16 (the CPU
runs it), `torch.compile` with the `aot_eager` backend (no C++ toolchain needed): every variant on
the CPU in about 30 s; results to `--out` or a temporary directory. Writes bench/results/gpu.json
by default. A failed variant is reported (`errors`, its traceback on stderr) and the others still
run; the exit status is then 1.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

TARGET_RATIO = 0.98
VARIANTS = ("eager", "nnscaler_parallelize", "nnscaler_train", "torch_compile")  # the order they run in

# dense bf16 tensor-core peak, TFLOP/s (no sparsity), matched on torch.cuda.get_device_name();
# the first matching key wins, so the more specific names come first
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),  # H100 SXM5 / "H100 80GB HBM3"
    ("GH200", 989.0), ("H200", 989.0), ("H800", 989.0), ("H20", 148.0),
    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("A10G", 70.0), ("L40S", 362.0), ("L4", 121.0),
)

REFERENCE = {
    "source": "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
    "what": "torchtitan team, end of 2024: Llama 3.1 8B, 1D parallelism (FSDP), 8 H100 (SXM, HBM2e, 500 W), "
            "local batch 2, global batch 16, selective activation checkpointing, bf16 (the rows without Float8); "
            "the page does not state the sequence length",
    "tokens_per_s_per_gpu": {"FSDP": 5762, "FSDP + torch.compile": 6667, "FSDP + torch.compile + Float8": 8532},
    "peak_memory_gib": {"FSDP": 82.4, "FSDP + torch.compile": 77.0, "FSDP + torch.compile + Float8": 76.8},
    "mfu": "33% to 39% without Float8, with or without torch.compile (8 or 128 GPUs), computed against the "
           "H100 SXM peak (989 TFLOP/s), which their 500 W HBM2e H100s do not reach (their footnote)",
    "comparability": "an 8B model on 8 GPUs with FSDP and recomputation against a 1B model on one GPU without: "
                     "the MFU is the comparable figure, tokens/s is not",
}


def peak_tflops(device_name):
    """(dense bf16 peak TFLOP/s or None, reason when None) for a CUDA device name (None: the CPU)."""
    if device_name is None:
        return None, "no CUDA device: MFU is defined against a GPU's bf16 peak"
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops, None
    return None, f"unknown device {device_name!r}: add its dense bf16 peak to PEAK_BF16_TFLOPS in bench/gpu.py"


# -- in-process variants --------------------------------------------------------------------------

def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_loop(step, batches, args, device):
    """Run warm-up + timed steps; returns (per-step end times, losses, peak memory or None)."""
    import torch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    ends, losses = [time.perf_counter()], []
    for i in range(args.warmup + args.steps):
        loss = step(batches[i % len(batches)])
        _sync(device)
        ends.append(time.perf_counter())
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ends, losses, peak


def _optimizer(params, args, device):
    import torch
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, **extra)


def _plain(base, batches, args, device, dtype, compiled):
    import torch
    t0 = time.perf_counter()
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    opt = _optimizer(model.parameters(), args, device)
    fwd = model
    if compiled and args.compile_scope == "blocks":  # as torchtitan: one compiled block, reused by every layer
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=args.compile_backend)
    elif compiled:
        fwd = torch.compile(model, backend=args.compile_backend)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = fwd(batch)
        loss.backward()
        opt.step()
        return loss.detach()
    setup = time.perf_counter() - t0  # torch.compile compiles lazily: in the first warm-up step
    result = _timed_loop(step, batches, args, device) + (setup,)
    opt.zero_grad(set_to_none=True)
    if compiled:
        torch._dynamo.reset()  # its caches hold the compiled model: free its memory for the next variants
    return result


def _nnscaler(base, batches, args, device, dtype, workdir):
    import torch
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime.device import default_backend
    from nnscaler.runtime.grid import RankGrid
    t0 = time.perf_counter()
    dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1)
    try:
        cc = ComputeConfig(1, 1, trace_strategy=args.trace_strategy, use_end2end=True)
        model = copy.deepcopy(base).to(device=device, dtype=dtype)
        pm = parallelize(model, {"tokens": batches[0]}, "dp", cc, gen_savedir=os.path.join(workdir, "gen"),
                         instance_name="parallelize", reuse="override")
        del model
        opt = build_optimizer(pm, torch.optim.AdamW, lr=args.lr, weight_decay=0.1,
                              **({"fused": True} if device.type == "cuda" else {}))
        dtypes = sorted({str(p.dtype) for p in pm.parameters()})
        setup = time.perf_counter() - t0

        def step(batch):
            opt.zero_grad(set_to_none=True)
            loss = pm.train_step([batch])[0]
            opt.step()
            return loss
        result = _timed_loop(step, batches, args, device) + (setup,)
        del pm, opt
        return result + (dtypes,)
    finally:
        RankGrid.destroy_all()
        dist.destroy_process_group()


# -- the Trainer, in its own process ---------------------------------------------------------------

def _trainer_yaml(args, cfg, device, path, timer_out, workdir):
    config = {
        "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 1, "use_end2end": True,
                           "trace_strategy": args.trace_strategy},
        "pas_policy": "dp", "gen_savedir": os.path.join(workdir, "gen"), "gen_reuse": "override",
        "instance_name": "train", "seed": 0, "precision": args.dtype,
        "micro_batch_size": args.batch, "global_batch_size": args.batch,
        "max_train_steps": args.warmup + args.steps, "enable_progress_bar": False,
        "model": {"type": "_llama.Llama", "args": cfg.as_dict()},
        "optimizer": {"type": "torch.optim.AdamW",
                      "args": {"lr": args.lr, "weight_decay": 0.1, **({"fused": True} if device.type == "cuda" else {})}},
        "dataset": {"type": "_llama.RandomTokens",
                    "train_args": {"rows": args.batch * (args.warmup + args.steps), "seq": args.seq,
                                   "vocab": cfg.vocab, "seed": 0}},
        "dataloader": {"train_args": {"drop_last": True}},
        "dataset_sampler": {"train_args": {"shuffle": False}},
        "checkpoint": {"no_save": True, "save_dir": os.path.join(workdir, "checkpoints")},
        "hook": {"type": "_step_timer.StepTimer", "args": {"out": timer_out}},
    }
    with open(path, "w") as f:  # JSON is YAML: no yaml writer needed
        json.dump(config, f, indent=1)


def _trainer(args, cfg, device, workdir):
    os.makedirs(workdir, exist_ok=True)
    path, timer_out = os.path.join(workdir, "train.yaml"), os.path.join(workdir, "timer.json")
    _trainer_yaml(args, cfg, device, path, timer_out, workdir)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_common.BENCH_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, "-m", "nnscaler.trainer", "-f", path, "--nproc", "1"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=args.trainer_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(timer_out):
        raise RuntimeError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    with open(timer_out) as f:
        data = json.load(f)
    ends = [data["start"]] + data["ends"]
    setup = wall - (ends[-1] - ends[0])  # process start, tracing, code generation: all but the steps
    return ends, data["losses"], data["peak_memory_bytes"], setup, data["logged_step_s"]


# -- report ---------------------------------------------------------------------------------------

def _summary(ends, losses, peak, setup, args, tokens_per_step, flops_tok, peak_tf):
    timed = ends[args.warmup:]  # the end of the last warm-up step, then every timed step's end
    step_s = [b - a for a, b in zip(timed, timed[1:])]
    seconds = timed[-1] - timed[0]
    tps = tokens_per_step * args.steps / seconds
    return {"tokens_per_s": tps, "ms_per_step_median": _common.median(step_s) * 1e3,
            "step_ms": [s * 1e3 for s in step_s], "timed_seconds": seconds,
            "warmup_ms": [(b - a) * 1e3 for a, b in zip(ends[:args.warmup], ends[1:args.warmup + 1])],
            "mfu": tps * flops_tok / (peak_tf * 1e12) if peak_tf else None,
            "model_tflops_per_s": tps * flops_tok / 1e12,
            "peak_memory_bytes": peak, "peak_memory_gib": peak / 2**30 if peak is not None else None,
            "setup_seconds": setup, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant (default 3)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads, no GQA)")
    p.add_argument("--ffn", type=int, default=5632, help="SwiGLU hidden size (default 5632)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="parameter dtype (default bf16)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                   help="torch.compile each decoder block (default; compiles once, as torchtitan) or the whole model")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--trainer-timeout", type=int, default=300, help="seconds for the nnscaler train process")
    p.add_argument("--out", default=str(_common.RESULTS_DIR / "gpu.json"))
    args = _common.parse_args(p, {"steps": 2, "warmup": 1, "batch": 2, "seq": 64, "dim": 256, "layers": 2,
                                  "heads": 4, "kv_heads": 2, "ffn": 688, "vocab": 2048, "dtype": "bf16",
                                  "compile_backend": "aot_eager"}, "gpu.json")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    import torch
    if not torch.cuda.is_available() and not args.smoke:
        print("bench/gpu.py needs a CUDA device and torch.cuda.is_available() is False: run it on a GPU "
              "machine (or pass --smoke for the tiny CPU configuration)", file=sys.stderr)
        raise SystemExit(2)
    from _llama import Llama, LlamaConfig, RandomTokens, flops_per_token, param_counts

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    args.trace_strategy = "cuda" if device.type == "cuda" else "cpu"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak_tf, mfu_reason = peak_tflops(device_name)

    cfg = LlamaConfig(vocab=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn=args.ffn, seq=args.seq)
    torch.manual_seed(0)  # as the Trainer's `seed: 0` before it builds the model
    base = Llama(cfg)
    n_params, n_flop = param_counts(base)
    flops_tok = flops_per_token(base, args.seq)
    rows = RandomTokens(args.batch * (args.warmup + args.steps), args.seq, cfg.vocab, seed=0)
    batches = [torch.stack([rows[i * args.batch + j] for j in range(args.batch)]).to(device)
               for i in range(args.warmup + args.steps)]
    tokens_per_step = args.batch * args.seq
    print(f"gpu bench: Llama {n_params / 1e6:.1f} M params ({n_flop / 1e6:.1f} M for FLOPs), {args.dtype}, "
          f"batch {args.batch} x seq {args.seq}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"device {device_name or 'cpu'}", flush=True)

    ctx = {"args": args, "cfg": cfg, "device_name": device_name, "peak_tf": peak_tf, "mfu_reason": mfu_reason,
           "n_params": n_params, "n_flop": n_flop, "flops_tok": flops_tok, "tokens_per_step": tokens_per_step,
           "cuda": device.type == "cuda", "cuda_version": torch.version.cuda}
    results, errors = {}, {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nnscaler_bench_gpu_") as tmp:
        for name in [v for v in VARIANTS if v in args.variants]:
            t0 = time.perf_counter()
            extra = {}
            try:
                if name in ("eager", "torch_compile"):
                    out = _plain(base, batches, args, device, dtype, compiled=name == "torch_compile")
                elif name == "nnscaler_parallelize":
                    *out, dtypes = _nnscaler(base, batches, args, device, dtype, os.path.join(tmp, name))
                    extra["param_dtypes"] = dtypes
                else:
                    *out, logged = _trainer(args, cfg, device, os.path.join(tmp, name))
                    extra["logged_step_ms"] = [s * 1e3 if s is not None else None for s in logged]
                results[name] = {**_summary(*out, args, tokens_per_step, flops_tok, peak_tf), **extra,
                                 "variant_seconds": time.perf_counter() - t0}
                r = results[name]
                print(f"{name:21s} {r['tokens_per_s']:12,.0f} tokens/s  {r['ms_per_step_median']:9.1f} ms/step  "
                      f"MFU {'-' if r['mfu'] is None else format(r['mfu'], '.1%')}  peak "
                      f"{'-' if r['peak_memory_gib'] is None else format(r['peak_memory_gib'], '.1f') + ' GiB'}  "
                      f"(setup {r['setup_seconds']:.1f} s, {r['variant_seconds']:.1f} s in all)", flush=True)
            except Exception as exc:  # noqa: BLE001 - one failed variant must not lose the others' figures
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name}: FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            finally:
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            # after every variant: a run cut short by a timeout still leaves what it measured
            data = _report(ctx, results, errors, time.perf_counter() - t_start, complete=False)
            _common.save_results(args.out, data)
    data = _report(ctx, results, errors, time.perf_counter() - t_start, complete=True)
    _common.save_results(args.out, data)
    _print(data)
    if errors:
        raise SystemExit(1)


def _report(ctx, results, errors, wall, complete):
    """The results file's content."""
    args, cfg = ctx["args"], ctx["cfg"]
    eager = results.get("eager")
    ratios = {n: r["tokens_per_s"] / eager["tokens_per_s"] for n, r in results.items() if eager and n != "eager"}
    needed = [n for n in ("nnscaler_parallelize", "nnscaler_train") if n in args.variants]
    # same initial weights, same batches: every variant's losses should track the eager loop's
    loss_diff = {n: max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
                 for n, r in results.items() if eager and n != "eager"}
    return {
        **_common.run_header(),
        "complete": complete,
        "device": {"name": ctx["device_name"] or "cpu", "peak_bf16_tflops": ctx["peak_tf"],
                   "cuda": ctx["cuda_version"], "mfu_reason": ctx["mfu_reason"]},
        "config": {"model": {**cfg.as_dict(), "params": ctx["n_params"], "params_for_flops": ctx["n_flop"],
                             "layout": "bench/_llama.py: RMSNorm, RoPE, SDPA causal (GQA when n_kv_heads < n_heads), "
                                       "SwiGLU, untied head, no biases"},
                   "dtype": args.dtype, "batch": args.batch, "seq": args.seq, "tokens_per_step": ctx["tokens_per_step"],
                   "optimizer": f"AdamW(lr={args.lr}, weight_decay=0.1{', fused' if ctx['cuda'] else ''}), "
                                f"states in the parameter dtype",
                   "activation_recomputation": False, "warmup_steps": args.warmup, "timed_steps": args.steps,
                   "compile_backend": args.compile_backend, "compile_scope": args.compile_scope,
                   "trace_strategy": args.trace_strategy, "variants": [v for v in VARIANTS if v in args.variants],
                   "timing": "wall time from the end of the last warm-up step to the end of the last step, "
                             "torch.cuda.synchronize() at every step's end (the Trainer: in its on_step_end hook)"},
        "flops_per_token": ctx["flops_tok"],
        "flops_formula": "6*N + 12*L*H*Q*T (PaLM appendix B, as torchtitan's get_num_flop_per_token): N params "
                         "without the token embedding, causal sparsity not discounted, no recomputation",
        "variants": results,
        "errors": errors,
        "ratio_vs_eager": ratios,
        "target": {"ratio": TARGET_RATIO, "of": "nnscaler_parallelize and nnscaler_train tokens/s vs eager"},
        "target_met": bool(needed) and all(n in ratios and ratios[n] >= TARGET_RATIO for n in needed),
        "step0_loss": {n: r["losses"][0] for n, r in results.items()},
        "max_abs_loss_diff_vs_eager": loss_diff,
        "reference": REFERENCE,
        "wall_seconds": wall,
        "smoke": bool(args.smoke),
    }


def _print(data):
    results, ratios = data["variants"], data["ratio_vs_eager"]
    rows = [[n, f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step_median']:.1f}",
             "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
             "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.1f}",
             f"{ratios[n]:.3f}" if n in ratios else "1.000" if n == "eager" else "-"] for n, r in results.items()]
    print(_common.table(["variant", "tokens/s", "ms/step", "MFU", "peak GiB", "vs eager"], rows))
    print("step-0 loss: " + ", ".join(f"{n} {v:.6f}" for n, v in data["step0_loss"].items())
          + "; max |loss - eager loss|: "
          + ", ".join(f"{n} {v:.2e}" for n, v in data["max_abs_loss_diff_vs_eager"].items()))
    peak, reason = data["device"]["peak_bf16_tflops"], data["device"]["mfu_reason"]
    print(f"target nnscaler >= {TARGET_RATIO} x eager: {'met' if data['target_met'] else 'NOT met'}; "
          f"MFU {'vs ' + str(peak) + ' TFLOP/s' if peak else 'n/a: ' + reason}; "
          f"torchtitan Llama 3.1 8B on 8 H100 (FSDP, bf16): 33-39% MFU ({REFERENCE['source']}); "
          f"wall {data['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
