"""The pipeline executor's pieces: p2p message headers, the in-memory (same-rank) mailbox, and,
on 2 real gloo ranks, a pipelined module's errors (plain forward call, wrong number of samples,
train_step on an inference-only module), its per-action timeline and its activation accounting
(gpipe keeps more micro-batches' activations alive on stage 0 than 1f1b)."""
from __future__ import annotations

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from launch import error_of, run_workers
from nnscaler.runtime.pipeline.p2p import HEADER_LEN, MAX_DIMS, Mailbox, empty_from_header, tensor_header

CPU = torch.device("cpu")
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128]
OTHERS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


# -- headers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS + OTHERS)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 5), (4, 1, 3), (1,) * MAX_DIMS])
def test_header_round_trip(dtype, shape):
    x = torch.zeros(shape, dtype=dtype)
    header = tensor_header(x)
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    y = empty_from_header(header, CPU)
    assert y.dtype == dtype and y.shape == x.shape and y.device == CPU
    assert not y.requires_grad and y.is_leaf


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_header_carries_requires_grad(dtype, requires_grad):
    x = torch.randn(2, 3, dtype=dtype).requires_grad_(requires_grad)
    y = empty_from_header(tensor_header(x * 2 if requires_grad else x), CPU)  # non-leaves too
    assert y.requires_grad == requires_grad and y.is_leaf and y.shape == (2, 3) and y.dtype == dtype


def test_header_survives_a_wire_copy():
    """The receiver builds from its own buffer (as dist.recv fills it), not the sender's tensor."""
    x = torch.randn(5, 7, 2, dtype=torch.bfloat16, requires_grad=True)
    buf = torch.empty(HEADER_LEN, dtype=torch.int64)
    buf.copy_(tensor_header(x))
    y = empty_from_header(buf, CPU)
    assert (y.shape, y.dtype, y.requires_grad) == (x.shape, x.dtype, True)


def test_header_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match=f"at most {MAX_DIMS} dims"):
        tensor_header(torch.zeros((1,) * (MAX_DIMS + 1)))
    with pytest.raises(TypeError, match="dtype"):
        tensor_header(torch.zeros(2, dtype=torch.uint16))


# -- same-rank mailbox (no torch.distributed) ----------------------------------------------------
def test_mailbox_local_tensor_round_trip():
    box = Mailbox(3, CPU)
    w = torch.randn(4, 2, requires_grad=True)
    sent = w * 3  # a non-leaf: the receiver must get a fresh leaf that needs a gradient
    box.send_tensor(sent, 3, tag=7)
    box.send_tensor(torch.arange(5), 3, tag=8)
    got = box.recv_tensor(3, tag=7)
    assert got.is_leaf and got.requires_grad and got.grad_fn is None
    assert torch.equal(got, sent.detach())
    got.sum().backward()  # the receiver's graph does not reach the sender's
    assert w.grad is None and got.grad is not None
    ints = box.recv_tensor(3, tag=8)
    assert torch.equal(ints, torch.arange(5)) and not ints.requires_grad
    box.send_int(42, 3, tag=9)
    assert box.recv_int(3, tag=9) == 42
    assert box.messages == 0 and box.bytes_sent == 0  # nothing went over the wire
    box.wait_sends()  # nothing pending, nothing left over


def test_mailbox_reports_unreceived_local_messages():
    box = Mailbox(0, CPU)
    box.send_tensor(torch.ones(2), 0, tag=1)
    box.send_int(5, 0, tag=2)
    with pytest.raises(RuntimeError, match="never received"):
        box.wait_sends()
    box.wait_sends()  # cleared: the next step starts clean


def test_mailbox_local_receive_without_a_send_fails():
    with pytest.raises(KeyError):
        Mailbox(0, CPU).recv_tensor(0, tag=11)


# -- on 2 ranks ----------------------------------------------------------------------------------
GPT_CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
NMICROS = 4


def _samples(n=NMICROS):
    batch = random_batch(0, 2 * n, GPTConfig(**GPT_CFG))
    return [{k: v[2 * i:2 * i + 2] for k, v in batch.items()} for i in range(n)]


def _build(gen_dir, name, scheduler, inference_only=False):
    from nnscaler import ComputeConfig, parallelize
    torch.manual_seed(0)
    pas = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": scheduler}
    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True, inference_only=inference_only,
                        pas_config=pas)
    return parallelize(GPT(GPTConfig(**GPT_CFG)), _samples()[0], "pp", cfg, gen_savedir=gen_dir, instance_name=name)


def _checks(rank, world, gen_dir):
    out = {}
    samples = _samples()
    pm = _build(gen_dir, "pp_1f1b", "1f1b")
    ex = pm._executor()
    out["forward"] = error_of(lambda: pm(**samples[0]))
    out["too_few"] = error_of(lambda: pm.train_step(samples[:3]))
    out["not_a_list"] = error_of(lambda: pm.train_step(samples[0]))
    out["infer_too_many"] = error_of(lambda: pm.infer_step(samples + samples[:1]))
    # a sample the forward cannot take fails on every rank before any message is sent
    out["unknown_arg"] = error_of(lambda: pm.train_step(samples[:3] + [{**samples[3], "mask": samples[3]["idx"]}]))
    out["missing_arg"] = error_of(lambda: pm.infer_step([{"targets": s["targets"]} for s in samples]))

    # the errors above left nothing behind: a full step still runs, and the timeline follows it
    ex.track_activations = True
    pm.train_step(samples)
    mine = [str(a) for a in ex.schedule.actions(ex.group_index)]
    out["train_timeline"] = ([name for name, _, _ in ex.last_timeline], mine,
                             all(t0 <= t1 for _, t0, t1 in ex.last_timeline))
    out["peak_1f1b"], out["live_after_1f1b"] = ex.peak_activation_bytes, ex.live_activation_bytes
    pm.zero_grad()
    pm.infer_step(samples)
    out["infer_timeline"] = ([name for name, _, _ in ex.last_timeline], [a for a in mine if a.startswith("F")])

    gp = _build(gen_dir, "pp_gpipe", "gpipe")
    gp._executor().track_activations = True
    gp.train_step(samples)
    out["peak_gpipe"], out["live_after_gpipe"] = gp._executor().peak_activation_bytes, gp._executor().live_activation_bytes

    inf = _build(gen_dir, "pp_infer", "infer_pipe", inference_only=True)
    out["infer_only_train"] = error_of(lambda: inf.train_step(samples))
    out["infer_only_infer"] = len(inf.infer_step(samples))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(_checks, 2, str(tmp_path_factory.mktemp("gen")), timeout=300)


@pytest.mark.multiprocess
def test_plain_call_of_a_pipelined_module_fails(two_ranks):
    for rank, out in enumerate(two_ranks):
        is_ours, kind, msg = out["forward"]
        assert is_ours, f"rank {rank}: {kind}: {msg}"
        assert "train_step" in msg and "infer_step" in msg and "pipelined" in msg


@pytest.mark.multiprocess
def test_wrong_number_of_samples_fails(two_ranks):
    for rank, out in enumerate(two_ranks):
        for key, got in [("too_few", "got 3"), ("not_a_list", "got dict"), ("infer_too_many", "got 5")]:
            is_ours, kind, msg = out[key]
            assert is_ours, f"rank {rank} {key}: {kind}: {msg}"
            assert f"pipeline_nmicros={NMICROS}" in msg and got in msg, f"rank {rank} {key}: {msg}"
        assert "train_step" in out["too_few"][2] and "infer_step" in out["infer_too_many"][2]


@pytest.mark.multiprocess
def test_samples_the_forward_cannot_take_fail_on_every_rank(two_ranks):
    for rank, out in enumerate(two_ranks):
        _, kind, msg = out["unknown_arg"]
        assert kind == "TypeError" and "train_step: sample 3" in msg and "'mask'" in msg, f"rank {rank}: {msg}"
        _, kind, msg = out["missing_arg"]
        assert kind == "TypeError" and "infer_step: sample 0" in msg and "'idx'" in msg, f"rank {rank}: {msg}"
        assert "forward()" in msg and "_check_sample" not in msg


@pytest.mark.multiprocess
def test_inference_only_module_refuses_train_step(two_ranks):
    for rank, out in enumerate(two_ranks):
        is_ours, kind, msg = out["infer_only_train"]
        assert is_ours, f"rank {rank}: {kind}: {msg}"
        assert "train_step" in msg and "inference_only" in msg and "infer_step" in msg
        assert out["infer_only_infer"] == NMICROS


@pytest.mark.multiprocess
def test_timeline_has_one_entry_per_action(two_ranks):
    for rank, out in enumerate(two_ranks):
        names, actions, ordered = out["train_timeline"]
        assert names == actions and ordered, f"rank {rank}: {names} vs {actions}"
        assert len(actions) == 2 * NMICROS  # one stage per rank: every micro-batch forward and backward
        names, forwards = out["infer_timeline"]
        assert names == forwards and len(forwards) == NMICROS, f"rank {rank}: {names}"


@pytest.mark.multiprocess
def test_activation_accounting(two_ranks):
    for rank, out in enumerate(two_ranks):
        assert out["peak_1f1b"] > 0 and out["peak_gpipe"] > 0, f"rank {rank}: {out['peak_1f1b']}, {out['peak_gpipe']}"
        assert out["live_after_1f1b"] == 0 and out["live_after_gpipe"] == 0  # every backward released its forward
    stage0 = two_ranks[0]
    # gpipe keeps all 4 micro-batches' activations on stage 0; 1f1b at most 2 (the pipeline depth)
    assert stage0["peak_gpipe"] > stage0["peak_1f1b"], (stage0["peak_gpipe"], stage0["peak_1f1b"])
