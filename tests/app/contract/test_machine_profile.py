"""The machine profile's format and shape, as the worker writes it and the web app reads it."""

from __future__ import annotations

import copy

import pytest

from app.contract.machine_profile import FORMAT, checked_profile, is_current

from ..test_planner import PROFILE


def test_the_profile_the_planner_reads_has_the_shape():
    assert checked_profile(PROFILE) == PROFILE and PROFILE["format"] == FORMAT
    assert is_current(PROFILE, "embedded") and not is_current(PROFILE, "some/other-model")
    offload_extra = copy.deepcopy(PROFILE)
    offload_extra["methods"]["lora"]["swap_bytes"] = 0  # offload.plan's other figures ride along
    assert is_current(offload_extra, "embedded")


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.update(format=FORMAT + 1),
        lambda p: p.pop("reference"),
        lambda p: p["methods"]["full"].pop("fits"),
        lambda p: p.update(cpu={"matmul_flops": "fast"}),
        lambda p: p.update(gpu={}),
    ],
)
def test_another_format_or_shape_is_not_current(change):
    profile = copy.deepcopy(PROFILE)
    change(profile)
    assert not is_current(profile, "embedded")
    with pytest.raises(ValueError):
        checked_profile(profile)
    assert not is_current("not a profile", "embedded")
