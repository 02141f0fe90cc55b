"""Guards and both-branch decisions in generated code (codegen/guards.py, codegen/branches.py)."""
from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.codegen import generate
from nnscaler.codegen.emit import emit_rank
from nnscaler.codegen.stages import stage_io
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy

from guard_models import HFMaskAttention, MaskBranch, PipeMask, mask_batch


class MaskOrCausal(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        if attention_mask.sum() == attention_mask.numel():
            mask = None
        else:
            mask = attention_mask.bool()[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).sum()


def _code(model, args, policy="dp", plan=1, world=1, both_branches=True, rank=0, **cfg):
    config = ComputeConfig(plan, world, trace_strategy="cpu", **cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(model, args, both_branches=both_branches)
    graph = apply_policy(graph, config, policy)
    return emit_rank(graph, config.to_dict(), rank, policy, graph.fingerprint())


def _line_of(text):
    lines, start = inspect.getsourcelines(MaskBranch.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_guard_is_a_check_call_with_the_users_line():
    text = _code(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}, world=2, both_branches=False)
    (call,) = [line.strip() for line in text.splitlines() if "nr.guards.check(" in line]
    assert re.match(r"nr\.guards\.check\(all_\d+, 'bool', True, at='.*guard_models\.py:"
                    f"{_line_of('guarded line')} in MaskBranch.forward: if \\(mask == 1\\).all\\(\\):", call), call
    # data-parallel only: ranks agree in a training forward; eval under no_grad may run on one rank alone
    assert "cause=\"forward's argument `mask`\"" in call and call.endswith("agree=torch.is_grad_enabled())")
    assert "import nnscaler.runtime.guards" not in text  # reached through `nr`
    compile(text, "gencode0.py", "exec")
    tp = _code(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}, policy="tp", plan=2, world=2,
               both_branches=False)
    (call,) = [line.strip() for line in tp.splitlines() if "nr.guards.check(" in line]
    assert call.endswith("agree=True)")  # a tensor-parallel forward runs collectives anyway


def test_both_branches_become_if_blocks_and_conditional_arguments():
    text = _code(MaskBranch(4), {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)})
    assert "nr.guards.check(" not in text
    (decision,) = re.findall(r"(_branch_\d+) = bool\(all_\d+\)", text)
    body = [line.strip() for line in text.split("def _forward_impl")[1].splitlines()]
    traced = body.index(f"if {decision}:")
    other = body.index(f"if not {decision}:")
    assert re.match(r"mul_\d+ = \(linear_\d+ \* 2\)", body[traced + 1])
    assert re.match(r"mul_\d+ = \(linear_\d+ \* mask\)", body[other + 1])
    assert re.search(rf"\(mul_\d+ if {decision} else mul_\d+\)", text)
    compile(text, "gencode0.py", "exec")


def test_tensor_parallel_conversions_of_a_branch_value_stay_inside_its_branch():
    args = {"x": torch.randn(2, 4, 8), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    text = _code(MaskOrCausal(), args, policy="tp", plan=2, world=2)
    compile(text, "gencode0.py", "exec")
    (decision,) = re.findall(r"(_branch_\d+) = bool\(", text)
    lines = text.split("def _forward_impl")[1].splitlines()
    # every statement that touches a value computed in one branch runs under that branch's `if`
    branch_vars, header = set(), None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith(("if _branch", "if not _branch")):
            header, indent = stripped, len(line) - len(line.lstrip())
            continue
        if header is not None and len(line) - len(line.lstrip()) > indent:
            assign = re.match(r"\s*\(?([A-Za-z_0-9, ]+?)\)? = ", line)
            if assign:
                branch_vars |= {v.strip() for v in assign.group(1).split(",")}
            continue
        header = None
        used = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", stripped.split("#")[0]))
        outside = used & branch_vars
        if outside and not stripped.startswith("del "):
            assert " if _branch" in stripped, stripped  # only as one side of a conditional argument
    assert any("nr.comm." in line and line.startswith(" " * 12) for line in lines), "no conversion inside a branch"
    assert "attn_mask=" in text and f"if {decision} else" in text


@pytest.mark.parametrize("recompute", [False, True])
def test_a_pipelined_plan_generates_both_branches_and_sends_the_decision(tmp_path, recompute):
    """The decision is taken in stage 0 (inside a recompute group too) and sent to stage 1 as an int;
    the mask only the padded branch makes crosses as a placeholder when the branch was not taken."""
    pas = {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}
    if recompute:
        pas["recompute_modules"] = "MaskPrep"
    config = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True, pas_config=pas)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(PipeMask(), {"x": torch.randn(2, 8), "mask": torch.ones(2, 8)})
    graph = apply_policy(graph, config, "pp")
    io = stage_io(graph)
    ((vid, gid),) = io.decisions.items()
    assert io.producer[vid] == 0 and io.consumers[vid] == [1] and io.kinds[vid] == "int"
    assert vid in io.outputs[0] and vid in io.inputs[1] and vid not in graph.values
    stages = [p.read_text() for p in generate(graph, config, tmp_path, policy="pp")]
    decision = f"_branch_{gid}"
    first = stages[0][stages[0].index("def _stage_0"):]
    ret = [line.strip() for line in first.splitlines() if line.startswith(" " * 8 + "return (")][-1]
    assert ret.endswith(f", {decision})") and f"if not {decision} else torch.empty(0, device=self.device))" in ret
    if recompute:
        assert re.search(rf"\(.*\b{decision}\) = torch.utils.checkpoint.checkpoint", first), first
    second = stages[1][stages[1].index("def _stage_1"):]
    unpack = second.splitlines()[1].strip()
    assert unpack.endswith(f", {decision}) = _acts"), unpack
    assert f"if not {decision}:" in second and "nr.guards.check(" not in second
    assert "nr.guards.check(" not in first and f"{decision} = bool(" in first


def test_a_guard_inside_a_branch_is_checked_on_every_rank_outside_its_if():
    """The padded branch's own guard: a rank whose data took the other branch checks None, so every
    data-parallel rank joins the guard's agreement whichever branch its data took."""
    text = _code(HFMaskAttention(right_padded=True), mask_batch(0, 2, True), world=2)
    lines = text.splitlines()
    (i,) = [k for k, line in enumerate(lines) if "nr.guards.check(" in line]
    call = lines[i]
    assert re.search(r"nr\.guards\.check\(\((\w+) if not _branch_\d+ else None\), 'bool', True, ", call), call
    assert call.endswith("agree=torch.is_grad_enabled())")
    indent = len(call) - len(call.lstrip())
    body = next(k for k, line in enumerate(lines) if "def _forward_impl" in line)
    assert indent == len(lines[body + 1]) - len(lines[body + 1].lstrip()), "the check sits inside an if block"
    compile(text, "gencode0.py", "exec")
