"""RNG states: torch, NumPy and Python random continue where they were captured."""
import random

import numpy as np
import torch

from nnscaler.ckpt.rng import capture_rng, restore_rng, rng_keys


class Stream:
    def __init__(self):
        self.state = {"seed": torch.tensor(5), "cpu": torch.arange(3, dtype=torch.uint8)}
        self.loaded = None

    def rng_state(self):
        return self.state

    def load_rng_state(self, state):
        self.loaded = state


def test_capture_and_restore():
    stream = Stream()
    tensors, info = capture_rng({"": stream})
    assert sorted(tensors) == sorted(rng_keys(info))
    expected = (torch.rand(2), np.random.rand(2), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore_rng(info, tensors.__getitem__, {"": stream})
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
    assert torch.equal(stream.loaded["cpu"], stream.state["cpu"])


def test_snapshot_sets_the_states_again():
    from nnscaler.ckpt import restore_rng_snapshot, rng_snapshot
    snapshot = rng_snapshot(None)
    expected = (torch.rand(2), np.random.rand(2), random.random())
    torch.rand(5), np.random.rand(5), random.random()
    restore_rng_snapshot(snapshot, None)
    got = (torch.rand(2), np.random.rand(2), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
