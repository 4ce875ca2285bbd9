"""hf_dp.accounting.group_privacy: the loose black-box group-privacy ε that ELS's tight accountant beats."""
from hf_dp import accounting


def test_mog_is_far_tighter_than_group_privacy():
    setting = dict(sample_rate=0.005, noise_multiplier=2.0, steps=500, delta=1e-5)
    mog = accounting.epsilon(**setting, group_size=32)
    group = accounting.group_privacy_epsilon(**setting, group_size=32)
    assert group > 4 * mog
    # group privacy of G=1 is the example-level guarantee itself
    assert accounting.group_privacy_epsilon(**setting, group_size=1) == accounting.epsilon(**setting)
    # the tight accountant never certifies more than group privacy does
    small = dict(sample_rate=0.01, noise_multiplier=2.0, steps=200, delta=1e-5)
    tight_lower = accounting.epsilon_bounds(**small, group_size=4)[0]
    assert tight_lower <= accounting.group_privacy_epsilon(**small, group_size=4)
