"""The multi-process halves of the FSDP-style argument tests: activation checkpointing (parity
and recomputation observed), `configure_model` (also on the meta device, and a Hugging Face Llama
built there on meta and loaded with nnscaler.ckpt.load in on_fit_start) and `cpu_offload`."""
from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from lit_models import Base, Classifier, FEATURES, HIDDEN, CLASSES, SAMPLES, full_weights, global_losses, trainer

VOCAB, SEQ = 64, 8


class CountsSaved(Classifier):
    """Counts the tensors autograd saves during forward (saved-tensor hooks): recomputed
    segments save only their inputs."""

    def training_step(self, batch, batch_idx):
        count = [0]

        def pack(t):
            count[0] += 1
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self(batch[0])
        self.saved_counts = getattr(self, "saved_counts", []) + [count[0]]
        loss = F.cross_entropy(out, batch[1])
        self.step_losses.append(loss.detach().clone())
        return loss


class BuiltInHook(Base):
    """The network is built in configure_model (on the meta device when `meta`)."""

    def __init__(self, meta: bool, batch_size: int = 8):
        super().__init__(batch_size=batch_size)
        self.net, self.meta = None, meta

    @property
    def dummy_forward_args(self):
        return {"x": torch.randn(self.batch_size, FEATURES)}

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        with torch.device("meta") if self.meta else torch.device("cpu"):
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                           torch.nn.Linear(HIDDEN, CLASSES))
        self.built_on = str(next(self.net.parameters()).device)


class MetaLlama(pl.LightningModule):
    """A Hugging Face Llama built in configure_model: on the meta device and filled from the
    save_pretrained directory `hf_dir` by ``nnscaler.ckpt.load(hf_dir, self)`` in on_fit_start
    (each rank reads its shards), or (`meta` False, the DDP reference) by from_pretrained."""

    def __init__(self, hf_dir: str, meta: bool, batch_size: int):
        super().__init__()
        self.hf_dir, self.meta, self.batch_size = hf_dir, meta, batch_size
        self.llama, self.step_losses = None, []

    def configure_model(self):
        if self.llama is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM
        if self.meta:
            with torch.device("meta"):
                self.llama = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hf_dir))
        else:
            self.llama = AutoModelForCausalLM.from_pretrained(self.hf_dir)
        self.built_on = str(next(self.llama.parameters()).device)

    def on_fit_start(self):
        if self.meta:
            import nnscaler.ckpt
            nnscaler.ckpt.load(self.hf_dir, self)

    def forward(self, input_ids, labels):
        logits = self.llama(input_ids=input_ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    @property
    def dummy_forward_args(self):
        ids = torch.randint(0, VOCAB, (self.batch_size, SEQ))
        return {"input_ids": ids, "labels": ids}

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.step_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
        return DataLoader(TensorDataset(ids, torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)),
                          batch_size=self.batch_size, shuffle=False)


def _write_llama(root):
    """A tiny Llama's save_pretrained directory (rank 0 writes it)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = os.path.join(root, "llama-hf")
    if dist.get_rank() == 0:
        torch.manual_seed(11)
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                     use_cache=False)).save_pretrained(path)
    dist.barrier()
    return path


def _strategy(root, name, plan_ngpus=1, policy="dp", **kwargs):
    from nnscaler.ir import ComputeConfig
    from nnscaler.lightning import NnScalerStrategy
    return NnScalerStrategy(compute_config=ComputeConfig(plan_ngpus, dist.get_world_size()), pas_policy=policy,
                            gen_savedir=os.path.join(root, "gen"), instance_name=name, **kwargs)


def _fit(model, strategy, root, name):
    t = trainer(strategy, os.path.join(root, name))
    t.fit(model)
    return t


def checkpointing(rank, world, root):
    """The same training with and without activation_checkpointing_policy={Linear}, dp2 and tp2."""
    out = {}
    for name, plan, policy in (("dp2", 1, "dp"), ("tp2", 2, "tp")):
        for recompute in (False, True):
            label = f"{name}-{'ckpt' if recompute else 'plain'}"
            model = CountsSaved(batch_size=8 * plan)
            types = {torch.nn.Linear} if recompute else None
            _fit(model, _strategy(root, label, plan, policy, activation_checkpointing_policy=types), root, label)
            files = glob.glob(os.path.join(root, "gen", "**", label, "**", "gencode*.py"), recursive=True)
            codes = [open(f).read() for f in files]
            out[label] = dict(losses=global_losses(model.step_losses), weights=full_weights(model),
                              saved=model.saved_counts[0], code_files=len(codes),
                              checkpoint_calls={c.count("torch.utils.checkpoint.checkpoint(") for c in codes})
    return out if rank == 0 else None


def configure_model(rank, world, root):
    """DDP with the network built in configure_model, against nnscaler with it built there on
    the CPU and on the meta device; and with cpu_offload=True."""
    from lightning.pytorch.strategies import DDPStrategy
    out = {}
    model = BuiltInHook(meta=False)
    trainer(DDPStrategy(), os.path.join(root, "ddp")).fit(model)
    out["ddp"] = (global_losses(model.step_losses), {k: v.detach().clone() for k, v in model.state_dict().items()})
    for label, meta, offload in (("cpu", False, False), ("meta", True, False), ("offload", False, True)):
        model = BuiltInHook(meta=meta)
        t = _fit(model, _strategy(root, label, cpu_offload=offload), root, label)
        state = t.strategy.optimizers[0].state
        devices = {v.device.type for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)}
        out[label] = (global_losses(model.step_losses), full_weights(model), model.built_on, model.net, devices)
    hf_dir = _write_llama(root)
    model = MetaLlama(hf_dir, meta=False, batch_size=8)
    trainer(DDPStrategy(), os.path.join(root, "llama-ddp")).fit(model)
    out["llama-ddp"] = (global_losses(model.step_losses),
                        {f"llama.{k}": v.detach().clone() for k, v in model.llama.named_parameters()})
    from torch.distributed.fsdp import MixedPrecision
    bf16 = {"sharding_strategy": "FULL_SHARD",  # FSDPStrategy's mixed_precision: bf16 gathers from fp32 shards
            "mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for label, plan, policy, kwargs in (("llama-tp2", 2, "tp", {}), ("llama-zero3", 1, "dp",
                                                                     {"sharding_strategy": "FULL_SHARD"}),
                                        ("llama-cpu-dp2", 1, "dp", {}), ("llama-zero3-bf16", 1, "dp", bf16)):
        # llama-cpu-dp2: built by from_pretrained on the CPU, as the reference (its example input is
        # one tensor for input_ids and labels: traced as two inputs, ir/tracer/trace.py)
        model = MetaLlama(hf_dir, meta=label != "llama-cpu-dp2", batch_size=8 * plan)
        _fit(model, _strategy(root, label, plan, policy, **kwargs), root, label)
        out[label] = (global_losses(model.step_losses), full_weights(model), model.built_on, model.llama,
                      {str(loss.dtype) for loss in model.step_losses})
    # activation checkpointing of the decoder layers (issue 43 §1), under dp2
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model = MetaLlama(hf_dir, meta=True, batch_size=8)
    label = "llama-dp2-ckpt"
    _fit(model, _strategy(root, label, activation_checkpointing_policy={LlamaDecoderLayer}), root, label)
    files = glob.glob(os.path.join(root, "gen", "**", label, "**", "gencode*.py"), recursive=True)
    out[label] = (global_losses(model.step_losses), full_weights(model), model.built_on, model.llama,
                  [open(f).read().count("torch.utils.checkpoint.checkpoint(") for f in files])
    return out if rank == 0 else None
