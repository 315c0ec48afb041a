"""A replacement takes a survivor's live model and optimizer tensor by tensor
(``trainer.checkpoint.handoff``): exact, into its own tensors, small ones packed; over a real
process group of three (here) and in the fast-recovery tests (bitwise-exact runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_fsdp import run_ranks

from support.jobs import assert_same, tiny_job, trained
from trainer.checkpoint.handoff import (
    BUCKET_MIN_BYTES,
    HandoffMismatch,
    adopt,
    live_tensors,
    messages,
    model_tensors,
    pack,
    signature,
    unpack,
)
from trainer.loop import build_model


def handed(src, dst, backend: str = "gloo") -> None:
    """What ``hand_over`` does on both sides, minus the wire: the signature, then every message."""
    adopt(signature(*src, backend), *dst)
    (large_src, groups_src), (large_dst, groups_dst) = (messages(live_tensors(*m, backend)) for m in (src, dst))
    for a, b in zip(large_src, large_dst, strict=True):
        b.copy_(a)
    for a, b in zip(groups_src, groups_dst, strict=True):
        unpack(pack(a), b)


def step(model, opt) -> torch.Tensor:
    torch.manual_seed(7)
    loss = model(torch.randint(0, 64, (2, 8))).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("replacement_steps", [0, 3], ids=["fresh spare (no optimizer state)", "stale state"])
def test_a_replacement_takes_the_survivors_state_exactly_and_trains_on_identically(tmp_path, replacement_steps):
    cfg = tiny_job(tmp_path)
    survivor = trained(cfg, steps=2)
    torch.manual_seed(99)  # another initialisation than the survivor's
    replacement = build_model(cfg, torch.device("cpu")) if not replacement_steps else trained(cfg, replacement_steps)
    survivor[1].param_groups[0]["lr"] = 0.0123  # set by the loop every step: travels with the signature anyway
    handed(survivor, replacement)
    assert_same(survivor[0].state_dict(), replacement[0].state_dict())
    assert_same(survivor[1].state_dict(), replacement[1].state_dict())
    # the tied embedding stays tied in the replacement: one tensor, taken once
    assert replacement[0].lm_head.weight is replacement[0].wte.weight
    assert len(model_tensors(replacement[0])) == len({id(t) for _, t in model_tensors(replacement[0])})
    assert torch.equal(step(*survivor), step(*replacement))
    assert_same(survivor[0].state_dict(), replacement[0].state_dict())


def test_small_tensors_travel_packed_large_ones_as_they_are(tmp_path):
    big = torch.zeros(BUCKET_MIN_BYTES // 4, dtype=torch.float32)
    small = [torch.arange(3.0), torch.ones(2, 2), torch.tensor(5.0), torch.arange(4, dtype=torch.int64)]
    large, groups = messages([small[0], big, *small[1:]])
    assert large == [big] and [len(g) for g in groups] == [3, 1]  # one message per dtype
    into = [torch.empty_like(t) for t in groups[0]]
    unpack(pack(groups[0]), into)
    for a, b in zip(groups[0], into):
        assert torch.equal(a, b)


def test_a_replacement_with_another_model_is_refused_naming_the_difference(tmp_path):
    survivor = trained(tiny_job(tmp_path))
    other = tiny_job(tmp_path)
    other = dataclasses.replace(other, model=dataclasses.replace(other.model, d_model=32))
    with pytest.raises(HandoffMismatch, match=r"differs from the survivor's .*wte\.weight"):
        adopt(signature(*survivor, "gloo"), *build_model(other, torch.device("cpu")))


def test_state_the_survivor_holds_as_plain_values_travels_with_the_signature(tmp_path):
    """Under NCCL the optimizer's step counters stay on the CPU: they cannot be NCCL messages,
    so they travel pickled with the signature (here: a CPU run told its backend is NCCL, where
    no tensor is a message at all)."""
    cfg = tiny_job(tmp_path)
    survivor, replacement = trained(cfg, steps=2), build_model(cfg, torch.device("cpu"))
    assert len(live_tensors(*survivor, "nccl")) == len(model_tensors(survivor[0]))  # no optimizer state
    adopt(signature(*survivor, "nccl"), *replacement)
    assert_same(survivor[1].state_dict(), replacement[1].state_dict())


def test_over_a_process_group_the_replacement_gets_the_survivors_state_and_a_bystander_keeps_its_own(tmp_path):
    survivor, replacement, bystander = run_ranks(
        "handoff", tmp_path, world=3, timeout=120, script=Path(__file__).parents[1] / "support" / "handoff_ranks.py"
    )
    assert replacement["before"] != survivor["before"]
    assert replacement["after"] == survivor["after"] == survivor["before"]
    assert bystander["after"] == bystander["before"] != survivor["before"]
