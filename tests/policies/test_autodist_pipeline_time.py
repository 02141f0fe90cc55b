"""The pipeline step time autodist estimates (nnscaler.policies.autodist.pipeline_time): the 1f1b
schedule played out with the stages' times, the messages' latency and shared CPU cores."""
from __future__ import annotations

import pytest

from nnscaler.policies.autodist.pipeline_time import PipelineTiming, step_seconds


@pytest.mark.parametrize("stages,micros", [(2, 1), (2, 4), (4, 4), (4, 8)])
def test_equal_stages_on_their_own_devices_take_the_textbook_time(stages, micros):
    f, b = 1.0, 2.0
    got = step_seconds([f] * stages, [b] * stages, micros)
    assert got == pytest.approx((micros + stages - 1) * (f + b))


def test_the_slowest_stage_sets_the_pace_and_the_fast_ones_do_not_add_up():
    even = step_seconds([1.0, 1.0], [2.0, 2.0], 8)
    uneven = step_seconds([0.5, 1.5], [1.0, 3.0], 8)  # same total work, one stage slower
    assert uneven > even
    assert uneven < (8 + 1) * 4.5  # below the textbook (m + s - 1) x slowest stage


def test_message_latency_lies_on_the_critical_path():
    f, b, lat = 1.0, 2.0, 0.25
    # one micro-batch through 2 stages: F0, message, F1, B1, message back, B0
    got = step_seconds([f, f], [b, b], 1, fwd_latency=[lat], bwd_latency=[lat])
    assert got == pytest.approx(2 * f + 2 * b + 2 * lat)
    assert step_seconds([f, f], [b, b], 4, fwd_latency=[lat], bwd_latency=[lat]) > step_seconds([f, f], [b, b], 4)


def test_shared_cores_slow_the_stages_that_run_together():
    f, b, m = 1.0, 2.0, 8
    alone = step_seconds([f, f], [b, b], m)
    one_core = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=1)
    work = 2 * m * (f + b)
    assert one_core == pytest.approx(work)  # one core: the step is all the work, one after the other
    assert alone < one_core
    assert step_seconds([f, f], [b, b], m, cores=1, contention=1.5) > one_core
    # the bubble is cheaper than a slot of the busy steady state: stages run alone there
    assert one_core < (m + 1) * 2 * (f + b)


def test_timing_divides_the_scale_out_of_the_stage_times():
    timing = PipelineTiming(fwd_share=1 / 3, scale=2.0, threads=4, cores=2)
    # 4 local processes on 2 cores, 2 stages of 2 processes: all busy = the priced stage times
    busy = timing.seconds([6.0, 6.0], [0.0], [0.0], 16)
    assert (16 + 1) * 6.0 * 0.85 < busy <= (16 + 1) * 6.0
    gpu = PipelineTiming(fwd_share=1 / 3)
    assert gpu.seconds([3.0, 3.0], [0.0], [0.0], 4) == pytest.approx(5 * 3.0)


def test_stages_running_together_slow_each_other_below_the_core_count():
    f, b, m = 1.0, 2.0, 8
    free = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=2)
    assert free == pytest.approx(step_seconds([f, f], [b, b], m))  # no contention measured: a device each
    slower = step_seconds([f, f], [b, b], m, threads_per_stage=1, cores=2, contention=1.2)
    # the steady state runs both stages (1.2x slower each); the bubble one alone, at its own speed
    assert free * 1.05 < slower < free * 1.2


def _gpt_graph(n_layer=2):
    import gpt
    from nnscaler.ir import trace
    cfg = gpt.GPTConfig(n_layer=n_layer, n_embd=32, n_head=2, block_size=8, vocab_size=64)
    return trace(gpt.GPT(cfg), gpt.random_batch(0, 2, cfg))


def test_a_tied_embedding_is_shared_by_the_stages_that_read_it():
    from nnscaler.policies.autodist.pipeline_solver import shared_across_stages
    from nnscaler.policies.pipeline import pivot_leads
    graph = _gpt_graph()
    leads = [c for c in pivot_leads(graph, "Block") if c > 0]
    assert shared_across_stages(graph, []) == []  # one stage: nothing to sync across stages
    # the GPT's head is tied to the token embedding: read in the first stage and the last
    wte = 64 * 32 * 4
    assert shared_across_stages(graph, leads[1:2]) == [(wte, 2)]
    assert shared_across_stages(graph, leads) == [(wte, 2)]  # the middle stage does not read it


def _stage_case():
    from nnscaler.ir import ComputeConfig
    from nnscaler.policies.autodist.comm_model import CommModel
    from nnscaler.policies.autodist.config import AutodistConfig
    from nnscaler.policies.autodist.policy import _Search
    from nnscaler.policies.pipeline import pivot_leads
    graph = _gpt_graph()
    cfg = AutodistConfig.from_compute_config(ComputeConfig(2, 2, use_end2end=True, pas_config={"update_freq": 4}))
    comm = CommModel({"backend": "given", "collectives": {
        c: {"2": [1e-5, 5e9]} for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}})
    s = _Search(graph, cfg)
    problem = s.problem(1, comm)
    return graph, problem, s.spmd(problem, None), pivot_leads(graph, "Block"), lambda b: comm.time("p2p", b, 2)


def test_the_step_adds_what_follows_the_schedule():
    from nnscaler.policies.autodist.pipeline_solver import cut_pipeline
    graph, problem, sol, leads, p2p = _stage_case()
    plain = cut_pipeline(graph, problem, sol, 2, leads, 4, None, p2p)
    seen = []
    tailed = cut_pipeline(graph, problem, sol, 2, leads, 4, None, p2p, tail=lambda ls: seen.append(ls) or 0.5)
    assert seen == [plain.leads]
    assert tailed.step_time == pytest.approx(plain.step_time + 0.5)


def test_a_stage_counts_its_transient_buffers_against_the_limit():
    from nnscaler.policies.autodist.pipeline_solver import cut_pipeline
    graph, problem, sol, leads, p2p = _stage_case()
    bare = cut_pipeline(graph, problem, sol, 2, leads, 4, None, p2p)
    with_buffers = cut_pipeline(graph, problem, sol, 2, leads, 4, None, p2p, transient_coef=1.0)
    assert bare.stage_transient == [0.0, 0.0]
    # each stage: its two largest outputs (the last stage holds the logits)
    assert all(t > 0 for t in with_buffers.stage_transient)
    assert with_buffers.stage_mem == pytest.approx([m + t for m, t in zip(bare.stage_mem, with_buffers.stage_transient)])
    # a limit the stages meet only without their buffers: no cut
    limit = max(bare.stage_mem) + 0.5 * min(with_buffers.stage_transient)
    assert cut_pipeline(graph, problem, sol, 2, leads, 4, limit, p2p) is not None
    assert cut_pipeline(graph, problem, sol, 2, leads, 4, limit, p2p, transient_coef=1.0) is None
