"""hf_dp.mechanism_table: contribution-bound heuristics and the budget plan of every registered mechanism."""
import json
import math

import numpy as np
import pytest

from hf_dp import accounting
from hf_dp import mechanisms, mechanism_table
from hf_dp.clipping.adaptive import effective_noise_multiplier, gradient_noise_multiplier
from hf_dp.vocabulary import DP_MECHANISMS, MECHANISMS

# A small population keeps every calibration fast: 200 users with 1..8 examples, 100 steps.
COUNTS = [1, 2, 3, 4, 5, 6, 7, 8] * 25
SETTING = dict(examples_per_step=40, steps=100, target_epsilon=4.0)


def test_els_bound_is_the_median():
    assert mechanism_table.recommend_contribution_bound_els([5]) == 5
    assert mechanism_table.recommend_contribution_bound_els([1, 3, 8, 20]) == 3  # lower median: an actual count
    assert mechanism_table.recommend_contribution_bound_els(np.array([1, 1, 1, 50])) == 1
    assert mechanism_table.recommend_contribution_bound_els([0, 0, 7]) == 7  # users without examples do not count
    for bad in ([], [-1, 3], [0, 0], ["a"], [1.5]):
        with pytest.raises(ValueError, match="examples_per_user|0 examples"):
            mechanism_table.recommend_contribution_bound_els(bad)


def _predicted_noise(counts, group, examples_per_step, steps, target_epsilon, delta):
    counts = np.asarray(counts)
    per_user = np.minimum(counts, group).mean()
    users_per_step = examples_per_step / per_user
    sigma = accounting.noise_multiplier(target_epsilon=target_epsilon, delta=delta,
                                        sample_rate=users_per_step / counts.size, steps=steps)
    return sigma / (users_per_step * math.sqrt(per_user))


def test_uls_bound_minimises_the_predicted_noise():
    delta = 1 / (10 * len(COUNTS))
    chosen = mechanism_table.recommend_contribution_bound_uls(COUNTS, **SETTING)
    noise = {g: _predicted_noise(COUNTS, g, delta=delta, **SETTING) for g in (1, 2, 4, 8)}
    assert chosen in noise
    assert noise[chosen] == min(noise.values())
    assert chosen > 1  # the prediction values each user's extra examples


def test_uls_bound_errors():
    with pytest.raises(ValueError, match="examples_per_step"):
        mechanism_table.recommend_contribution_bound_uls(COUNTS, examples_per_step=0)
    with pytest.raises(ValueError, match="examples_per_user"):
        mechanism_table.recommend_contribution_bound_uls([3, -2], examples_per_step=2)
    with pytest.raises(ValueError, match="target_delta"):
        mechanism_table.recommend_contribution_bound_uls(COUNTS, examples_per_step=40, target_delta=0.5)
    with pytest.raises(ValueError, match="No contribution bound"):  # more users per step than users at any G
        mechanism_table.recommend_contribution_bound_uls([1] * 10, examples_per_step=20)


def test_plan_rows_meet_the_target_and_are_plain_data():
    rows = mechanism_table.compare(examples_per_user=COUNTS, noise_multiplier=1.0, **SETTING)
    json.dumps(rows)  # plain dicts: the Gradio app and the CLI print them
    assert [row["mechanism"] for row in rows] == list(DP_MECHANISMS) == ["uls", "els", "example"]
    for row in rows:  # one vocabulary: labels, units and privacy units from hf_dp.vocabulary
        entry = MECHANISMS[row["mechanism"]]
        assert (row["label"], row["sampled_unit"], row["privacy_unit"]) == (
            entry.label, entry.sampled_unit, entry.privacy_unit)
        assert "mode" not in row and "units_per_step" not in row
    users, examples = len(COUNTS), sum(COUNTS)
    uls, els, example = rows
    assert els["contribution_bound"] == mechanism_table.recommend_contribution_bound_els(COUNTS)
    assert example["contribution_bound"] is None
    assert uls["sampled_unit"] == "users" and els["sampled_unit"] == example["sampled_unit"] == "examples"
    # the same compute for every mechanism: 40 examples per step, as 40 / m(G) users for ULS
    per_user = np.minimum(COUNTS, uls["contribution_bound"]).mean()
    assert uls["expected_batch_size"] == pytest.approx(40 / per_user)
    assert els["expected_batch_size"] == example["expected_batch_size"] == 40
    assert uls["sample_rate"] == pytest.approx(40 / per_user / users)
    assert els["sample_rate"] == pytest.approx(40 / np.minimum(COUNTS, els["contribution_bound"]).sum())
    assert example["sample_rate"] == pytest.approx(40 / examples)
    assert uls["delta"] == els["delta"] == pytest.approx(1 / (10 * users))
    assert example["delta"] == pytest.approx(1 / (10 * examples))
    assert "not protected as a whole" in example["note"]
    for row, group in zip(rows, (1, els["contribution_bound"], 1)):
        assert row["steps"] == 100 and row["examples_per_step"] == 40
        spent = accounting.epsilon(sample_rate=row["sample_rate"], noise_multiplier=row["noise_multiplier"],
                                   steps=100, delta=row["delta"], group_size=group)
        assert spent <= 4.0
        assert row["noise_std"] == pytest.approx(row["noise_multiplier"] / row["expected_batch_size"])
        assert row["epsilon_at_fixed_noise"] == accounting.epsilon(
            sample_rate=row["sample_rate"], noise_multiplier=1.0, steps=100, delta=row["delta"], group_size=group)


def test_the_uls_batch_is_what_dptrainer_needs_for_the_same_compute():
    """ULS's expected_batch_size (users) at its G processes examples_per_step examples, as ELS's does."""
    rows = mechanism_table.compare(users=1000, examples_per_user=20, examples_per_step=64, steps=300,
                                   target_epsilon=4.0, contribution_bound=4)
    uls, els, _ = rows
    assert (uls["expected_batch_size"], uls["sampled_unit"]) == (16, "users")  # 16 users x 4 examples = 64
    assert (els["expected_batch_size"], els["sampled_unit"]) == (64, "examples")
    assert uls["contribution_bound"] == els["contribution_bound"] == 4  # one G for both user-level mechanisms


def test_plan_from_users_and_a_count_and_defaults():
    rows = mechanism_table.compare(users=300, examples_per_user=4, examples_per_step=30, target_epsilon=6.0,
                                   contribution_bound=2)
    assert rows[0]["contribution_bound"] == rows[1]["contribution_bound"] == 2
    default = mechanism_table.compare(users=300, examples_per_user=4, examples_per_step=30, target_epsilon=6.0)
    assert default[1]["contribution_bound"] == 4  # ELS: the median
    assert rows[0]["steps"] == math.ceil(1200 / 30)  # default: one expected pass over the examples
    assert all(row["epsilon_at_fixed_noise"] is None for row in rows)


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=-2.0), "target_epsilon"),
    (dict(target_delta=1 / 200), "target_delta"),   # = 1/users
    (dict(target_delta=0.5), "target_delta"),
    (dict(examples_per_step=10_000), "examples_per_step"),  # sample rate > 1
    (dict(examples_per_step=-1), "examples_per_step"),
    (dict(examples_per_user=[3, -1]), "negative"),
    (dict(users=5), "users"),  # disagrees with the list
    (dict(steps=0), "steps"),
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(contribution_bound=0), "contribution_bound"),
    (dict(examples_per_user=[7], users=None), "users=1: DPTrainer refuses"),
    (dict(examples_per_user=7, users=1), "users=1: DPTrainer refuses"),
    (dict(noise_multiplier=1e-9), "noise_multiplier=1e-09: so little noise"),
    (dict(clipping_count_noise=2.0), "only used with adaptive clipping"),
    (dict(adaptive_clipping=True, clipping_count_noise=0.0), "clipping_count_noise"),
])
def test_plan_bad_input_says_what_to_change(kwargs, match):
    arguments = dict(examples_per_user=COUNTS, **SETTING)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match) as info:
        mechanism_table.compare(**arguments)
    assert "\n" not in str(info.value)


def test_a_fixed_noise_too_small_for_one_mechanism_is_a_note_not_an_error():
    """σ = 0.05 is accountable for ULS and example-level but beyond range for ELS (G = 20): a per-row note."""
    rows = mechanism_table.compare(users=100, examples_per_user=20, noise_multiplier=0.05)
    by_key = {row["mechanism"]: row for row in rows}
    assert by_key["uls"]["epsilon_at_fixed_noise"] is not None
    assert by_key["els"]["epsilon_at_fixed_noise"] is None and "ε at σ=0.05" in by_key["els"]["note"]
    assert "Cannot compute" not in " ".join(row["note"] for row in rows)


def test_huge_populations_allocate_nothing_per_user():
    """10⁹ and 10¹² users: the planner keeps (count, users holding it), never an array of users
    (a billion-user plan once took 19 GB)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = mechanism_table.compare(users=10**12, examples_per_user=20, examples_per_step=64, steps=1000,
                                   target_epsilon=8.0)
    assert rows[1]["sample_rate"] == pytest.approx(64 / (20 * 10**12))  # ELS: examples
    assert rows[0]["noise_multiplier"] is not None and rows[1]["noise_multiplier"] is not None
    # example level: δ = 1/(20·10¹²) is below what the composition's round-off can certify: no σ, and the note says why
    assert rows[2]["noise_multiplier"] is None and "exceeds δ's error budget" in rows[2]["note"]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2_000_000  # KiB: far below 10¹² of anything


@pytest.mark.parametrize("kwargs, match", [
    (dict(users=10**9, examples_per_user=20), "steps=312500000 is above 10,000,000"),   # default: one pass
    (dict(users=10**6, examples_per_user=20, steps=10**9), "steps=1000000000 is above"),
    (dict(users=1000, examples_per_user=20, contribution_bound=10**6), "group_size=1000000 is above 256"),
])
def test_out_of_range_plans_answer_with_one_line_per_mechanism(kwargs, match):
    rows = mechanism_table.compare(examples_per_step=64, target_epsilon=8.0, **kwargs)
    refused = [row for row in rows if match in row["note"]]
    assert refused and all(row["noise_multiplier"] is None for row in refused)


def test_rdp_noise_multiplier_is_conservative_and_close():
    setting = dict(target_epsilon=4.0, delta=1e-6, sample_rate=1e-4, steps=30_000)
    exact = accounting.noise_multiplier(**setting)
    rough = accounting.rdp_noise_multiplier(**setting)
    assert exact <= rough <= 1.3 * exact


# 64 users with one row each, 16 users per step, 4 steps: the ULS row is the run DPTrainer makes of these settings.
ADAPTIVE_RUN = dict(users=64, examples_per_user=1, examples_per_step=16, steps=4, target_epsilon=8.0,
                    contribution_bound=1)


def test_adaptive_clipping_plans_the_gradient_noise_dptrainer_calibrates(tmp_path):
    """With adaptive clipping the ledger's σ_eff also covers the count: the plan's σ is the (larger) gradient σ."""
    from trainer_fixtures import make_trainer, user_dataset

    fixed = mechanism_table.compare(**ADAPTIVE_RUN)[0]
    uls = mechanism_table.compare(adaptive_clipping=True, **ADAPTIVE_RUN)[0]
    assert (uls["mechanism"], uls["expected_batch_size"]) == ("uls", 16)
    assert uls["count_noise"] == pytest.approx(16 / 20) and fixed["count_noise"] is None  # the default σ_b = m/20
    trainer = make_trainer(tmp_path, dataset=user_dataset(num_users=64, max_rows=1), adaptive_clipping=True,
                           expected_batch_size=16, max_steps=4, target_epsilon=8.0, contribution_bound=1,
                           private_logging=False)  # the plan leaves out private logging, at a fixed C too
    plan = trainer.privacy_plan
    assert (plan.mechanism, plan.steps, plan.count_noise) == ("uls", 4, pytest.approx(uls["count_noise"]))
    assert (plan.sample_rate, plan.delta) == (pytest.approx(uls["sample_rate"]), pytest.approx(uls["delta"]))
    assert uls["noise_multiplier"] == pytest.approx(plan.noise_multiplier, rel=1e-9)
    assert uls["effective_noise_multiplier"] == pytest.approx(plan.effective_noise_multiplier, rel=1e-9)
    assert uls["effective_noise_multiplier"] == fixed["noise_multiplier"] == fixed["effective_noise_multiplier"]
    assert uls["noise_multiplier"] > fixed["noise_multiplier"]
    assert uls["noise_std"] == pytest.approx(uls["noise_multiplier"] / 16)


def test_adaptive_clipping_accounts_a_fixed_sigma_and_a_given_count_noise():
    rows = mechanism_table.compare(adaptive_clipping=True, clipping_count_noise=2.0, noise_multiplier=1.0,
                                   **ADAPTIVE_RUN)
    fixed = mechanism_table.compare(noise_multiplier=1.0, **ADAPTIVE_RUN)
    for row, plain in zip(rows, fixed):
        assert row["count_noise"] == 2.0
        assert row["noise_multiplier"] == pytest.approx(
            gradient_noise_multiplier(row["effective_noise_multiplier"], 2.0), rel=1e-12)
        # a fixed gradient σ = 1 is accounted at its σ_eff, so it spends more than without the count
        assert row["epsilon_at_fixed_noise"] == pytest.approx(accounting.epsilon(
            sample_rate=row["sample_rate"], noise_multiplier=effective_noise_multiplier(1.0, 2.0),
            steps=row["steps"], delta=row["delta"], group_size=row["contribution_bound"] if row["mechanism"] == "els"
            else 1))
        assert row["epsilon_at_fixed_noise"] > plain["epsilon_at_fixed_noise"]
        assert "σ_eff" in row["note"] and "σ_eff" not in plain["note"]


def test_adaptive_clipping_with_too_little_count_noise_is_a_note():
    """σ_b ≤ σ_eff/2: the count alone would spend the budget, so no gradient σ exists (DPTrainer refuses)."""
    rows = mechanism_table.compare(adaptive_clipping=True, clipping_count_noise=0.1,
                                   **{**ADAPTIVE_RUN, "target_epsilon": 1.0})
    for row in rows:
        assert row["noise_multiplier"] is None and row["effective_noise_multiplier"] is not None
        assert "not above σ_eff/2" in row["note"] and "raise clipping_count_noise" in row["note"]


def test_cli_plan_adaptive_clipping_flags(capsys):
    from hf_dp import cli

    argv = ["plan", "--users", "64", "--examples_per_user", "1", "--examples_per_step", "16", "--steps", "4",
            "--target_epsilon", "8", "--contribution_bound", "1"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main([*argv, "--adaptive-clipping"]) == 0
    adaptive = capsys.readouterr().out
    assert cli.main([*argv, "--adaptive_clipping", "--clipping-count-noise", "0.8"]) == 0  # m/20: the default
    assert capsys.readouterr().out == adaptive

    def uls_cells(out):
        line = next(line for line in out.splitlines() if line.startswith(MECHANISMS["uls"].label))
        return line.split()

    expected = mechanism_table.compare(adaptive_clipping=True, **ADAPTIVE_RUN)[0]["noise_multiplier"]
    assert f"{expected:.4g}" in uls_cells(adaptive) and f"{expected:.4g}" not in uls_cells(plain)
    assert "adaptive clipping" in adaptive and "adaptive clipping" not in plain
    assert cli.main([*argv, "--clipping_count_noise", "0.8"]) == 2  # without --adaptive_clipping: refused
    assert "only used with adaptive clipping" in capsys.readouterr().err


# ---- the ε-DP contribution bound: an exponential-mechanism quantile on a public grid ------------------------------


GRID = mechanism_table.CONTRIBUTION_BOUND_GRID
# 500 users with 1-29 rows, and one more user with 77 rows.
USERS = np.random.default_rng(0).integers(1, 30, size=500).tolist()
OUTLIER = 77


def _max_log_ratio(p, q) -> float:
    return float(np.max(np.abs(np.log(p) - np.log(q))))


@pytest.mark.parametrize("epsilon", [0.1, 1.0])
@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9])
def test_quantile_release_is_epsilon_dp_for_neighbouring_counts(epsilon, quantile):
    """Exact probabilities of every released G: removing/adding one user changes each by at most e^ε."""
    rng = np.random.default_rng(1)
    cases = [(USERS, USERS + [OUTLIER]), (USERS, USERS + [1]), ([5] * 40, [5] * 40 + [300])]
    for _ in range(20):
        counts = rng.integers(1, 400, size=int(rng.integers(2, 60))).tolist()
        cases.append((counts, counts + [int(rng.integers(1, 600))]))
    for smaller, larger in cases:
        p = mechanism_table.quantile_probabilities(smaller, epsilon=epsilon, quantile=quantile)
        q = mechanism_table.quantile_probabilities(larger, epsilon=epsilon, quantile=quantile)
        assert p.sum() == pytest.approx(1) and q.sum() == pytest.approx(1)
        assert _max_log_ratio(p, q) <= epsilon * (1 + 1e-9)


def test_the_outlier_does_not_set_g():
    """Old behaviour: G = 77 with the outlier, 29 without. Now G comes from the public grid, whatever the draw."""
    for sampling in ("uls", "els"):
        for seed in range(30):
            bound = mechanism_table.private_contribution_bound(
                USERS + [OUTLIER], sampling=sampling, epsilon=0.1, expected_batch_size=64, steps=100,
                target_epsilon=7.9, rng=np.random.default_rng(seed))
            assert bound in GRID and bound != OUTLIER
    # A quantile that no grid value equals (every user has 5 rows) is never released as such.
    draws = {mechanism_table.private_quantile([5] * 2000, epsilon=0.1, rng=np.random.default_rng(s)) for s in range(50)}
    assert draws <= set(GRID) and 5 not in draws and 6 in draws
    # With many users the DP median is accurate: the median of 1..29 rounds up to the grid value 16.
    p = mechanism_table.quantile_probabilities(USERS * 20, epsilon=0.1)
    assert GRID[int(p.argmax())] == 16 and p.max() > 0.9


def test_uls_bound_reads_only_the_dp_median_and_the_number_of_users(monkeypatch):
    monkeypatch.setattr(mechanisms, "private_quantile", lambda counts, **kwargs: 12)  # the DP median ULS reads
    choose = dict(sampling="uls", epsilon=0.1, expected_batch_size=64, steps=100, target_epsilon=7.9)
    other = [200] * 250 + [1] * 251  # as many users, very different counts
    assert mechanism_table.private_contribution_bound(USERS + [OUTLIER], **choose) == \
        mechanism_table.private_contribution_bound(other, **choose)


def test_quantile_rejects_bad_input():
    for kwargs, match in [(dict(epsilon=0.0), "epsilon"), (dict(epsilon=0.1, quantile=1.5), "quantile"),
                          (dict(epsilon=0.1, grid=[4, 2]), "grid")]:
        with pytest.raises(ValueError, match=match):
            mechanism_table.quantile_probabilities([1, 2, 3], **kwargs)
