"""The additive surrogate: a clock curve shared by all configurations plus drifting offsets."""

from __future__ import annotations

import numpy as np

from kareus.search.additive import AdditiveSettings, AdditiveSurrogate
from kareus.search.algorithms import PRESETS, MultiPassMBO
from kareus.search.problem import SearchSpace
from kareus.search.surrogates import Surrogate

CLOCKS_MHZ = tuple(range(1410, 899, -30))  # descending, as GPUs list them: order must not matter
SPACE = SearchSpace(CLOCKS_MHZ, tuple(range(3, 31, 3)), ("attn_0",))


def _truth(offset_of) -> tuple[np.ndarray, np.ndarray]:
    """Time and effective energy over SPACE: 1/f and linear curves scaled by 1 + `offset_of(config, clock_mhz)`."""
    clock_mhz = np.asarray(CLOCKS_MHZ, float)[SPACE.axes[0]]
    config = SPACE.configuration_index
    offset = np.array([offset_of(k, f) for k, f in zip(config, clock_mhz, strict=True)])
    time_s = 0.3 * 1410 / clock_mhz * (1 + offset)
    effective_j = (40 + 0.02 * clock_mhz) * (1 + offset)
    return time_s, effective_j


def _at(clock_mhz: int, config: int) -> int:
    return CLOCKS_MHZ.index(clock_mhz) * SPACE.configurations + config


def test_recovers_an_additive_grid_from_a_sweep_and_one_configuration_per_clock():
    time_s, effective_j = _truth(lambda k, f: 0.0)
    time_s, effective_j = time_s + 0.003 * SPACE.configuration_index, effective_j + 0.4 * SPACE.configuration_index
    sweep = [_at(1170, k) for k in range(10)]
    spine = [_at(f, 4) for f in CLOCKS_MHZ if f != 1170]
    measured = np.array(sweep + spine)
    model = AdditiveSurrogate(AdditiveSettings(), SPACE, measured, time_s[measured], effective_j[measured])
    everywhere = np.arange(SPACE.size)
    predicted = model.predict(everywhere)
    # 28 points predict the other 152 within 1 % (the penalties bias the fit a little).
    assert np.max(np.abs(predicted.time_s / time_s - 1)) < 0.01
    assert np.max(np.abs(predicted.effective_energy_j / effective_j - 1)) < 0.01
    # ... and every clock's ranking of the configurations is the true one.
    for clock in range(len(CLOCKS_MHZ)):
        at_clock = everywhere[SPACE.axes[0] == clock]
        assert list(np.argsort(predicted.time_s[at_clock])) == list(np.argsort(time_s[at_clock]))


def test_pools_measurements_over_clocks_to_rank_configurations_a_noise_level_apart():
    # Configuration 2 is 1 % worse than configuration 1 at every clock; measurements carry 1 %
    # noise and no clock has both measured, so no single clock can tell them apart.
    time_s, effective_j = _truth(lambda k, f: {1: 0.0, 2: 0.01}.get(k, 0.05))
    measured = np.array([_at(f, 1 + i % 2) for i, f in enumerate(CLOCKS_MHZ)] + [_at(1170, 5)])
    one, two = (np.array([_at(f, k) for f in CLOCKS_MHZ]) for k in (1, 2))
    right = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        noisy_time = time_s[measured] * (1 + 0.01 * rng.standard_normal(len(measured)))
        noisy_energy = effective_j[measured] * (1 + 0.01 * rng.standard_normal(len(measured)))
        model = AdditiveSurrogate(AdditiveSettings(), SPACE, measured, noisy_time, noisy_energy)
        prediction_one, prediction_two = model.predict(one), model.predict(two)
        right += int(np.sum(prediction_one.time_s < prediction_two.time_s))
        right += int(np.sum(prediction_one.effective_energy_j < prediction_two.effective_energy_j))
    # One clock's two measurements (if it had them) would rank them right 76 % of the time.
    assert right >= 0.95 * 2 * 10 * len(CLOCKS_MHZ)


def test_follows_a_configuration_switch_between_clocks():
    # Configuration 3 is 3 % faster at the high clocks, configuration 2 1 % faster below 1245 MHz
    # (where compute stops hiding the collective): the offsets must drift, not stay fixed.
    def offset(k: int, f: float) -> float:
        if k == 2:
            return 0.0 if f < 1245 else 0.0005 * (f - 1245)
        return 0.01 if k == 3 else 0.1

    time_s, _ = _truth(offset)
    rng = np.random.default_rng(0)
    measured = np.array([_at(f, k) for f in CLOCKS_MHZ for k in (2, 3)] + [_at(1170, k) for k in (0, 5, 9)])
    noisy = time_s[measured] * (1 + 0.005 * rng.standard_normal(len(measured)))
    model = AdditiveSurrogate(AdditiveSettings(), SPACE, measured, noisy, noisy)
    two, three = (np.array([_at(f, k) for f in CLOCKS_MHZ]) for k in (2, 3))
    predicted_two_wins = model.predict(two).time_s < model.predict(three).time_s
    true_two_wins = time_s[two] < time_s[three]
    near_switch = np.abs(np.asarray(CLOCKS_MHZ) - 1245) < 45
    assert (predicted_two_wins == true_two_wins)[~near_switch].all()
    assert true_two_wins.any() and not true_two_wins.all()


def test_a_configuration_never_measured_gets_the_shared_curve():
    time_s, effective_j = _truth(lambda k, f: 0.02 * k)
    measured = np.array([_at(f, k) for f in CLOCKS_MHZ[::3] for k in (0, 8)])
    model = AdditiveSurrogate(AdditiveSettings(), SPACE, measured, time_s[measured], effective_j[measured])
    unseen = model.predict(np.array([_at(1200, 4)])).time_s[0]
    seen = model.predict(np.array([_at(1200, 0), _at(1200, 8)])).time_s
    assert seen[0] < unseen < seen[1]


def test_default_preset_uses_it_only_where_configurations_fit_the_clocks():
    algorithm = MultiPassMBO(PRESETS["default"])
    wide = SearchSpace(CLOCKS_MHZ, SPACE.comm_sms, ("norm_0", "linear_0", "rope_0", "attn_0"))
    time_s, effective_j = np.linspace(1, 2, 20), np.linspace(3, 2, 20)
    for space, kind in ((SPACE, AdditiveSurrogate), (wide, Surrogate)):
        predict = algorithm._surrogate(space, np.arange(20), time_s, effective_j, seed=0)
        assert isinstance(predict(np.arange(3)).time_s, np.ndarray)
        if kind is AdditiveSurrogate:
            assert isinstance(predict.__self__, AdditiveSurrogate)
        else:
            assert not hasattr(predict, "__self__")
    assert MultiPassMBO(PRESETS["paper"])._surrogate(SPACE, np.arange(20), time_s, effective_j, 0).__name__ == "<lambda>"
