"""The average of a run's late checkpoints (`learn.averaging`): which steps, and the mean."""

from __future__ import annotations

import numpy as np
import pytest

from macaron_local.learn.averaging import tail_average, tail_members
from macaron_local.learn.loop import Checkpoint, LearnConfig, TrainResult
from macaron_local.learn.run import _candidates


def lora(value: float) -> dict[str, np.ndarray]:
    return {
        "blk.0.attn_q.lora_A": np.full((2, 3), value, np.float32),
        "blk.0.attn_q.lora_B": np.full((3, 2), -value, np.float32),
    }


CHECKPOINTS = [Checkpoint(step, lora(float(step))) for step in (6, 12, 18, 24, 30, 36, 42, 48)]


def test_the_second_half_of_the_run_and_its_final_are_averaged():
    assert tail_members(CHECKPOINTS, 54, 0.5) == [30, 36, 42, 48, 54]
    assert tail_members(CHECKPOINTS, 54, 1.0) == [6, 12, 18, 24, 30, 36, 42, 48, 54]
    assert tail_members(CHECKPOINTS, 54, 0.0) == [54]  # off: the final alone
    assert tail_members([], 8, 0.5) == [8]  # no checkpoint: nothing to average with


def test_the_average_is_the_mean_of_each_tensor_in_its_own_dtype():
    averaged, steps = tail_average(CHECKPOINTS, 54, lora(54.0), 0.5)
    assert steps == [30, 36, 42, 48, 54]
    assert np.allclose(averaged["blk.0.attn_q.lora_A"], (30 + 36 + 42 + 48 + 54) / 5)
    assert np.allclose(averaged["blk.0.attn_q.lora_B"], -(30 + 36 + 42 + 48 + 54) / 5)
    assert all(a.dtype == np.float32 for a in averaged.values())


@pytest.mark.parametrize("share, checkpoints", [(0.0, CHECKPOINTS), (0.5, []), (0.05, CHECKPOINTS)])
def test_no_average_where_the_final_would_stand_alone(share, checkpoints):
    assert tail_average(checkpoints, 54, lora(54.0), share) is None


def test_the_average_is_judged_first_then_the_final_then_the_back_off_candidates():
    result = TrainResult(checkpoints=CHECKPOINTS[:2], start=lora(0.0))
    result.steps = [object()] * 18  # the run's length is what the candidates count
    names = [c.name for c in _candidates(result, lora(18.0), LearnConfig())]
    assert names == ["average", "final", "step-12", "step-6", "final-half"]
    average = _candidates(result, lora(18.0), LearnConfig())[0]
    assert average.step == 18 and average.averaged_steps == [12, 18] and average.summary()["averaged_steps"] == [12, 18]
    off = [c.name for c in _candidates(result, lora(18.0), LearnConfig(average_share=0.0))]
    assert off == ["final", "step-12", "step-6", "final-half"]


def test_the_share_is_a_learn_setting_from_0_to_1(home):
    from macaron_local.daemon.config import learn_config
    from macaron_local.errors import InvalidInputError

    assert learn_config(home).average_share == 0.5
    home.save(learn={"average_share": 0})
    assert learn_config(home).average_share == 0.0  # off: the final is judged first
    home.save(learn={"average_share": 1.5})
    with pytest.raises(InvalidInputError, match="average_share must be from 0 to 1"):
        learn_config(home)
