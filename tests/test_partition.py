"""Sequence partitioning (train/partition.py): a sequence trained in partitions of its anchors gives the loss, the
gradients and the stats of one unpartitioned step, for both algorithms, 1- and 2-layer drafters, packed documents,
and a partition smaller than the deepest element's reach."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import random_slots, tiny_drafter
from paradraft.train.partition import partition_bounds, partitioned

ARGS = {"peagle": {"num_depths": 6, "cod_ratio": 0.7, "cod_ratio_min": 0.2, "loss_decay": 0.5},
        "eagle3": {"ttt_steps": 3, "loss_decay": 0.8}}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, b, algo, size, seed=3):
    model.zero_grad(set_to_none=True)
    args = dict(ARGS[algo])
    span = args.get("num_depths", args.get("ttt_steps"))
    g = torch.Generator().manual_seed(seed)
    if size is None:
        loss, stats = model(b, generator=g, **args)
        (loss * 0.5).backward()
    else:
        loss, stats = partitioned(lambda sub, **kw: model(sub, **kw), model, b, size, span, span, args,
                                  generator=g, scale=0.5)
    return float(loss.detach()), stats, _grads(model)


@pytest.mark.parametrize("algo", ["peagle", "eagle3"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("size", [16, 5])
def test_partitioned_step_equals_one_step(algo, layers, size):
    model, _ = tiny_drafter(algo, layers=layers)
    model.train()
    b = random_slots(45, model, doc_lengths=[20, 9, 16], seed=1)
    loss0, stats0, grads0 = _run(model, b, algo, None)
    loss1, stats1, grads1 = _run(model, b, algo, size)
    assert abs(loss0 - loss1) < 1e-5 * max(1.0, abs(loss0))
    assert grads0.keys() == grads1.keys() and "fc.weight" in grads0
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-6, msg=n)
    assert stats1["count"] == stats0["count"] and stats1["num_elements"] == stats0["num_elements"]
    for a, c in zip(stats0["acc"], stats1["acc"]):
        assert a == pytest.approx(c, nan_ok=True)
    # the same elements, each judged the same
    key0 = sorted(zip(*(t.tolist() for t in stats0["elements"])))
    key1 = sorted(zip(*(t.tolist() for t in stats1["elements"])))
    assert key0 == key1


@pytest.mark.parametrize("algo", ["peagle", "eagle3"])
def test_partitioned_evaluation_equals_one_pass(algo):
    model, _ = tiny_drafter(algo, layers=2)
    b = random_slots(40, model, doc_lengths=[25, 15], seed=2)
    args = dict(ARGS[algo])
    span = args.get("num_depths", args.get("ttt_steps"))
    with torch.no_grad():
        loss0, stats0 = model(b, generator=torch.Generator().manual_seed(0), **args)
        loss1, stats1 = partitioned(lambda sub, **kw: model(sub, **kw), model, b, 7, span, span, args,
                                    generator=torch.Generator().manual_seed(0))
    assert float(loss1) == pytest.approx(float(loss0), rel=1e-5)
    assert stats1["count"] == stats0["count"]


def test_sync_wraps_every_partition_and_only_the_last_syncs():
    model, _ = tiny_drafter("peagle", layers=1)
    model.train()
    b = random_slots(30, model, seed=4)
    seen = []

    def sync(last):
        seen.append(last)
        return contextlib.nullcontext()

    partitioned(lambda sub, **kw: model(sub, **kw), model, b, 8, 6, 6, ARGS["peagle"],
                generator=torch.Generator().manual_seed(0), scale=1.0, sync=sync)
    assert seen == [False, False, False, True] and len(partition_bounds(30, 8)) == 4
