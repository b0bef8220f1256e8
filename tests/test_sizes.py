"""owned_sizeof and Snapshot.nbytes: the memory a snapshot keeps to itself."""

import gc
import sys
import tracemalloc

import gymnasium as gym
import numpy as np
import pytest

import branchgym
from branchgym.sizes import owned_sizeof


class Shared:
    __branchgym_shared__ = True

    def __init__(self):
        self.big = list(range(10_000))


def test_owned_objects_count_and_shared_ones_do_not():
    mine = [[str(i) * 50 for i in range(100)] for _ in range(3)]
    inner = sys.getsizeof(mine[0]) + sum(sys.getsizeof(x) for x in mine[0])
    whole = owned_sizeof(mine)
    assert whole == sys.getsizeof(mine) + 3 * inner
    outside = [mine[1]]  # a second holder: mine[1] and what hangs below it are shared now
    assert owned_sizeof(mine) == whole - inner
    assert outside
    marked = {"state": [1, 2], "static": Shared()}
    assert owned_sizeof(marked) < 2000  # the shared object's 10,000-int list is left out
    assert owned_sizeof({"a": np.zeros(100_000)}) >= 800_000  # a buffer only it holds


def _closure_over_a_buffer():
    payload = bytearray(50_000)
    return lambda: len(payload)


def test_a_closure_made_for_the_state_counts_and_a_module_function_does_not():
    assert owned_sizeof({"f": _closure_over_a_buffer()}) > 50_000
    assert owned_sizeof({"f": _closure_over_a_buffer}) < 1000


@pytest.mark.parametrize("env_id", ["branchgym/TreeMDP-v0", "branchgym/TextTreeMDP-v0"])
def test_snapshot_nbytes_is_close_to_the_memory_it_holds(env_id):
    env = gym.make(env_id)
    env.reset(seed=0)
    env.step(env.action_space.sample())
    gc.collect()
    tracemalloc.start()
    snaps = [branchgym.snapshot(env) for _ in range(100)]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per = held / len(snaps)
    # pickled size (the old figure) was 5-20x below; now within the allocator's overhead
    assert 0.6 * per <= snaps[0].nbytes <= 1.2 * per, (snaps[0].nbytes, per)
    assert snaps[0].wire_nbytes < snaps[0].nbytes
    for s in snaps:
        s.release()
    assert snaps[0].nbytes == 0
