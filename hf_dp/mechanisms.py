"""The DP mechanisms as objects, one registry: what each one samples, weights, counts, accounts and says.

A mechanism is how each step samples and clips its units, and so what the accountant composes. Everything that
differs between ULS, ELS and example-level DP-SGD is a method or attribute here, looked up once by the key of
[`~hf_dp.vocabulary.MECHANISMS`] (`DPTrainingArguments.mechanism`); nothing else in the core compares the key.
A new mechanism is one subclass registered with [`register_mechanism`].

| | sampled unit | a unit's gradient | accountant's mixture size | G |
|---|---|---|---|---|
| ULS | a user | of the user's mean loss over ≤ G rows | 1 | optional |
| ELS | a row | of the row's loss | G (a user moves up to G rows) | required |
| example-level | a row | of the row's loss | 1 | none (every row kept) |

Pure: no torch, no transformers (the planner and `hf-dp plan` use it too).
"""

from __future__ import annotations

from .vocabulary import MECHANISMS, Mechanism as Presentation

__all__ = ["DPMechanism", "ULS", "ELS", "ExampleLevel", "register_mechanism", "get_mechanism", "DP_MECHANISMS"]

_REGISTRY: dict[str, "DPMechanism"] = {}


class DPMechanism:
    """One DP-SGD mechanism. Subclasses set `key` and override what differs from the defaults below."""

    key: str = ""
    # Whether a user's rows form one sampled unit whose loss weights are 1/n_u (ULS), or every row is a unit.
    samples_users: bool = False
    # Whether the guarantee protects users (the contribution bound G then applies) or single rows.
    protects_users: bool = True
    # Whether the accountant needs G (ELS: a user moves up to G sampled rows).
    requires_contribution_bound: bool = False
    # Whether a unit's rows may be drawn afresh each step (`redraw_rows`): the accounting does not rest on fixed rows.
    rows_may_be_redrawn: bool = False
    accountant_note: str = ""  # appended to the report's accountant name
    card_step: str = ""  # the privacy card's account of one step

    def card_accounting(self, epsilon_group_privacy: str | None) -> str | None:
        """The card's paragraph on how this mechanism is accounted, beyond the accountant's name (or `None`)."""
        return None

    @property
    def presentation(self) -> Presentation:
        """Labels, description, plot style (`hf_dp.vocabulary.MECHANISMS`)."""
        return MECHANISMS[self.key]

    # ---- the partition ----

    def num_units(self, partition) -> int:
        """Units each step Poisson-samples from `partition` (a [`~hf_dp.data.UserPartition`])."""
        return partition.num_users if self.samples_users else partition.num_examples

    def num_privacy_units(self, partition) -> int:
        """Units the guarantee protects: users, or rows."""
        return partition.num_users if self.protects_users else partition.num_examples

    def unit_rows(self, partition):
        """The rows of each sampled unit (users' rows), or `None` when every row is its own unit."""
        return partition.user_rows if self.samples_users else None

    def rows_per_unit(self, contribution_bound: int | None) -> int:
        """The most rows one sampled unit brings to a pass (sizes the passes)."""
        return (contribution_bound or 1) if self.samples_users else 1

    # ---- accounting ----

    def group_size(self, contribution_bound: int | None) -> int:
        """The accountant's mixture size: how many sampled units one protected unit can move (1 but for ELS)."""
        return 1

    def choose_contribution_bound(self, counts, *, epsilon: float, expected_batch_size: int, steps: int,
                                  target_epsilon: float, delta, rng) -> int | None:
        """G chosen with ε-DP from the rows per user (`contribution_bound="auto"`): a DP median on a public grid."""
        from .accounting import planner

        return planner.private_quantile(counts, epsilon=epsilon, rng=rng)

    def bound_rule(self) -> str:
        """How "auto" turns the DP median into G, for the report and the card."""
        return "the DP median"

    def group_privacy_epsilon(self, **accounting) -> float | None:
        """The loose group-privacy ε beside the tight one (ELS only), for the card; `None` otherwise."""
        return None


def register_mechanism(cls: type[DPMechanism]) -> type[DPMechanism]:
    """Class decorator: register a mechanism by its `key` (a key of `hf_dp.vocabulary.MECHANISMS`)."""
    if cls.key not in MECHANISMS or not MECHANISMS[cls.key].is_private:
        raise ValueError(f"mechanism key {cls.key!r}: add it to hf_dp.vocabulary.MECHANISMS (its labels) first.")
    _REGISTRY[cls.key] = cls()
    return cls


def get_mechanism(key: str) -> DPMechanism:
    """The registered mechanism for `key`, or one line naming the keys that exist."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"mechanism={key!r}: use one of {tuple(_REGISTRY)}.") from None


@register_mechanism
class ULS(DPMechanism):
    """User-level sampling: Poisson-sampled users, each user's mean loss over at most G rows clipped as one."""

    key = "uls"
    samples_users = True
    rows_may_be_redrawn = True
    card_step = ("Each step Poisson-samples users, each independently with probability q; a sampled user's gradient "
                 "is\nthe gradient of the mean loss over their (at most G) examples, clipped to norm C; Gaussian noise"
                 "\nN(0, σ²C²I) is added once to the sum, which is divided by the expected number of users per step"
                 "\n(`expected_batch_size`; Charles et al. 2024).")

    def choose_contribution_bound(self, counts, *, epsilon, expected_batch_size, steps, target_epsilon, delta, rng):
        """The noise-prediction heuristic (Charles et al. 2024) run on the DP median, for this compute budget."""
        from .accounting import planner

        median = super().choose_contribution_bound(counts, epsilon=epsilon, expected_batch_size=expected_batch_size,
                                                   steps=steps, target_epsilon=target_epsilon, delta=delta, rng=rng)
        return planner.uls_bound_from_median(len(counts), median, expected_batch_size=expected_batch_size,
                                             steps=steps, target_epsilon=target_epsilon, delta=delta)

    def bound_rule(self) -> str:
        return "the ULS noise-prediction heuristic on that median"


@register_mechanism
class ELS(DPMechanism):
    """Example-level sampling, user-level accounting: rows sampled and clipped alone, at most G per user."""

    key = "els"
    requires_contribution_bound = True
    accountant_note = "; mixture-of-Gaussians for ELS"
    card_step = ("Each user keeps at most G examples. Each step Poisson-samples examples, each independently with"
                 "\nprobability q; every sampled example's gradient is clipped to norm C; Gaussian noise N(0, σ²C²I) is"
                 "\nadded once to the sum, which is divided by the expected number of examples per step"
                 "\n(`expected_batch_size`; Charles et al. 2024).")

    def card_accounting(self, epsilon_group_privacy: str | None) -> str | None:
        text = ("ELS is accounted at the user level with the tight mixture-of-Gaussians accountant: per step,\n"
                "a user's G examples are each sampled with probability q, so the privacy loss is that of\n"
                "N(0, σ²) against Σₖ Binom(k; G, q)·N(k, σ²).\n")
        if epsilon_group_privacy is None:
            return text + "The loose group-privacy ε (`epsilon_group_privacy`) was not reported."
        return text + ("The black-box route — the example-level guarantee converted to users by group privacy\n"
                       f"over G examples — gives only **ε = {epsilon_group_privacy}** (`epsilon_group_privacy`). The "
                       "tight\naccountant is what makes ELS usable.")

    def group_size(self, contribution_bound: int | None) -> int:
        return contribution_bound

    def bound_rule(self) -> str:
        return "the ELS median"

    def group_privacy_epsilon(self, **accounting) -> float | None:
        from .accounting import group_privacy_epsilon

        return group_privacy_epsilon(**accounting)


@register_mechanism
class ExampleLevel(DPMechanism):
    """Plain DP-SGD: rows sampled and clipped alone, each row protected (not each user)."""

    key = "example"
    protects_users = False
    card_step = ("Each step Poisson-samples examples, each independently with probability q; every sampled example's"
                 "\ngradient is clipped to norm C; Gaussian noise N(0, σ²C²I) is added once to the sum, which is "
                 "divided\nby the expected number of examples per step (`expected_batch_size`).")

    def choose_contribution_bound(self, counts, **kwargs) -> int | None:
        return None  # every row is kept: a bound would drop rows the guarantee counts


DP_MECHANISMS: tuple[str, ...] = tuple(_REGISTRY)
