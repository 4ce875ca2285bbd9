"""The DP mechanisms as objects, one registry: what each one samples, plans, accounts, and says.

A mechanism is how each step samples and clips its units, and so what the accountant composes. Everything that
differs between ULS, ELS and example-level DP-SGD is an attribute or method of its object here: the units it
samples and protects, the G it plans with and chooses with ε-DP, the group size the accountant composes, its names
in tables and plots, its sentences in the report and the card. Code outside this module looks a mechanism up by
its key (`DPTrainingArguments.mechanism`, from `privacy_unit` and `sampling`: [`mechanism_of`]) and asks it; it
never compares the key. A new mechanism is one subclass of [`DPMechanism`] registered with [`register_mechanism`]
(`tests/test_custom_mechanism.py` adds one without touching hf_dp).

| | sampled unit | a unit's gradient | accountant's group size | G |
|---|---|---|---|---|
| ULS | a user | of the user's mean loss over ≤ G rows | 1 | optional |
| ELS | a row | of the row's loss | G (a user moves up to G rows) | required |
| example-level | a row | of the row's loss | 1 | none (every row kept) |

[`MECHANISMS`] names every registered mechanism and the two comparisons that are not DP (`"non-private"`,
`"public-only"`) for tables, plots and result JSON.

Pure: no torch, no transformers (the planner and `hf-dp plan` use it too).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import accounting
from .user_counts import UserCounts, private_quantile, recommend_contribution_bound_els, \
    recommend_contribution_bound_uls, uls_bound_from_median

__all__ = [
    "DPMechanism", "ULS", "ELS", "ExampleLevel", "MechanismNames", "MECHANISMS", "DP_MECHANISMS", "PRIVACY_UNITS",
    "SAMPLING_SCHEMES", "register_mechanism", "unregister_mechanism", "get_mechanism", "registered_mechanisms",
    "mechanism", "mechanism_of", "privacy_units", "sampling_schemes",
]


@dataclass(frozen=True)
class MechanismNames:
    """How one mechanism (or one of the two comparisons without DP) is named and drawn everywhere."""

    key: str
    privacy_unit: str | None  # the `privacy_unit` argument; None for the two non-DP comparisons
    sampling: str | None  # the `sampling` argument; None where it is unused
    sampled_unit: str | None  # what `expected_batch_size` counts: "users" or "examples"
    label: str  # tables, plots, logs: "user-level DP, ULS"
    name: str  # headings: "ULS (user-level sampling)"
    description: str  # the report's and card's one-sentence account of a step
    marker: str = "o"
    color: str = "tab:gray"

    @property
    def is_private(self) -> bool:
        return self.privacy_unit is not None


# Every name a result can carry: the registered mechanisms (in order of registration), then the comparisons.
MECHANISMS: dict[str, MechanismNames] = {}
_REGISTRY: dict[str, "DPMechanism"] = {}


class DPMechanism:
    """One DP-SGD mechanism. Subclasses set `key`, the names, and override what differs from the defaults below."""

    key: str = ""
    # The two `DPTrainingArguments` fields that select it: `privacy_unit`, and `sampling` (None: unused).
    privacy_unit: str = "user"
    sampling: str | None = None
    label: str = ""  # tables, plots, logs
    name: str = ""  # headings
    description: str = ""  # the report's one-sentence account of a step
    marker: str = "o"
    color: str = "tab:gray"
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
    plan_note: str = ""  # the planner's caveat on every row of this mechanism

    def card_accounting(self, epsilon_group_privacy: str | None) -> str | None:
        """The card's paragraph on how this mechanism is accounted, beyond the accountant's name (or `None`)."""
        return None

    @property
    def presentation(self) -> MechanismNames:
        """Its names, description and plot style, as [`MECHANISMS`] holds them."""
        return MechanismNames(self.key, self.privacy_unit, self.sampling,
                              "users" if self.samples_users else "examples", self.label, self.name, self.description,
                              self.marker, self.color)

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
        """The accounting event of one step: the accountant composes a Poisson-subsampled Gaussian in which one
        protected unit moves up to this many sampled units (its mixture size: 1 but for ELS)."""
        return 1

    def group_privacy_epsilon(self, **accounting) -> float | None:
        """The loose group-privacy ε beside the tight one (ELS only), for the card; `None` otherwise."""
        return None

    # ---- the contribution bound G ----

    def planned_bound(self, counts: UserCounts, contribution_bound: int | None, *, examples_per_step: float,
                      steps: int, target_epsilon: float, delta: float) -> tuple[int | None, str]:
        """(G, a note) the planner uses for these public or assumed counts: the given G, else the median
        count (ELS's rule), or `None` (every row kept) for a guarantee that protects rows."""
        if not self.protects_users:
            return None, ""
        return contribution_bound or recommend_contribution_bound_els(counts), ""

    def choose_contribution_bound(self, counts, *, epsilon: float, expected_batch_size: int, steps: int,
                                  target_epsilon: float, delta, rng) -> int | None:
        """G chosen with ε-DP from the rows per user (`contribution_bound="auto"`): a DP median on a public grid."""
        return private_quantile(counts, epsilon=epsilon, rng=rng)

    def bound_rule(self) -> str:
        """How "auto" turns the DP median into G, for the report and the card."""
        return "the DP median"


def register_mechanism(cls: type[DPMechanism]) -> type[DPMechanism]:
    """Class decorator: register a mechanism by its `key`, and its names in [`MECHANISMS`].

    Raises:
        ValueError: an empty or taken key, a `privacy_unit` other than `"user"`/`"example"`, or a
            (`privacy_unit`, `sampling`) pair another mechanism already answers to.
    """
    mechanism = cls()
    key = mechanism.key
    if not key or key in MECHANISMS:
        raise ValueError(f"mechanism key {key!r}: give the class a key no mechanism or comparison uses "
                         f"(taken: {tuple(MECHANISMS)}).")
    if mechanism.privacy_unit not in ("user", "example") or mechanism.protects_users != (
            mechanism.privacy_unit == "user"):
        raise ValueError(f"mechanism {key!r}: privacy_unit={mechanism.privacy_unit!r} must be 'user' (protects_users)"
                         " or 'example'.")
    for other in _REGISTRY.values():
        if other.privacy_unit == mechanism.privacy_unit and None in (other.sampling, mechanism.sampling) or (
                other.privacy_unit, other.sampling) == (mechanism.privacy_unit, mechanism.sampling):
            raise ValueError(f"mechanism {key!r}: privacy_unit={mechanism.privacy_unit!r} with sampling="
                             f"{mechanism.sampling!r} already selects {other.key!r}; give it its own sampling.")
    _REGISTRY[key] = mechanism
    comparisons = {k: v for k, v in MECHANISMS.items() if not v.is_private}
    for k in comparisons:
        del MECHANISMS[k]
    MECHANISMS[key] = mechanism.presentation
    MECHANISMS.update(comparisons)  # the comparisons stay last
    return cls


def unregister_mechanism(key: str) -> None:
    """Remove the mechanism `key` (one a test registered); the others are untouched."""
    get_mechanism(key)
    del _REGISTRY[key], MECHANISMS[key]


def get_mechanism(key: str) -> DPMechanism:
    """The registered mechanism for `key`, or one line naming the keys that exist."""
    try:
        return _REGISTRY[key]
    except (KeyError, TypeError):
        raise ValueError(f"mechanism={key!r}: use one of {tuple(_REGISTRY)}.") from None


def registered_mechanisms() -> tuple[DPMechanism, ...]:
    """Every registered mechanism, in order of registration (the planner's rows, the built-ins first)."""
    return tuple(_REGISTRY.values())


def mechanism(key: str) -> MechanismNames:
    """The names of `key` (a mechanism or a comparison), or one line naming the keys that exist."""
    try:
        return MECHANISMS[key]
    except (KeyError, TypeError):
        raise ValueError(f"mechanism={key!r}: use one of {tuple(MECHANISMS)}.") from None


def privacy_units() -> tuple[str, ...]:
    """The `privacy_unit` values some registered mechanism answers to."""
    return tuple(dict.fromkeys(m.privacy_unit for m in _REGISTRY.values()))


def sampling_schemes() -> tuple[str, ...]:
    """The `sampling` values some registered mechanism answers to."""
    return tuple(dict.fromkeys(m.sampling for m in _REGISTRY.values() if m.sampling is not None))


def mechanism_of(privacy_unit: str, sampling: str | None) -> str:
    """The key of the mechanism the two arguments a user sets select; a clear error for anything else."""
    units = privacy_units()
    if privacy_unit not in units:
        raise ValueError(f"privacy_unit={privacy_unit!r}: use one of {units}.")
    candidates = [m for m in _REGISTRY.values() if m.privacy_unit == privacy_unit]
    for candidate in candidates:
        if candidate.sampling is None or candidate.sampling == str(sampling).lower():
            return candidate.key
    schemes = tuple(m.sampling for m in candidates)
    raise ValueError(f"sampling={sampling!r}: use one of {schemes} (privacy_unit={privacy_unit!r}).")


@register_mechanism
class ULS(DPMechanism):
    """User-level sampling: Poisson-sampled users, each user's mean loss over at most G rows clipped as one."""

    key = "uls"
    sampling = "uls"
    label = "user-level DP, ULS"
    name = "ULS (user-level sampling)"
    description = "user-level sampling (ULS): Poisson-sampled users, per-user clipped mean gradient, Gaussian noise"
    color = "tab:blue"
    samples_users = True
    rows_may_be_redrawn = True
    card_step = ("Each step Poisson-samples users, each independently with probability q; a sampled user's gradient "
                 "is\nthe gradient of the mean loss over their (at most G) examples, clipped to norm C; Gaussian noise"
                 "\nN(0, σ²C²I) is added once to the sum, which is divided by the expected number of users per step"
                 "\n(`expected_batch_size`; Charles et al. 2024).")

    def planned_bound(self, counts, contribution_bound, *, examples_per_step, steps, target_epsilon, delta):
        """The noise-prediction heuristic (Charles et al. 2024) for this compute budget, or the median count (with
        the heuristic's reason) when no G fits it."""
        if contribution_bound is not None:
            return contribution_bound, ""
        try:
            return recommend_contribution_bound_uls(counts, examples_per_step=examples_per_step, steps=steps,
                                                    target_epsilon=target_epsilon, target_delta=delta), ""
        except ValueError as error:
            return recommend_contribution_bound_els(counts), str(error)

    def choose_contribution_bound(self, counts, *, epsilon, expected_batch_size, steps, target_epsilon, delta, rng):
        """The noise-prediction heuristic (Charles et al. 2024) run on the DP median, for this compute budget."""
        median = super().choose_contribution_bound(counts, epsilon=epsilon, expected_batch_size=expected_batch_size,
                                                   steps=steps, target_epsilon=target_epsilon, delta=delta, rng=rng)
        return uls_bound_from_median(len(counts), median, expected_batch_size=expected_batch_size, steps=steps,
                                     target_epsilon=target_epsilon, delta=delta)

    def bound_rule(self) -> str:
        return "the ULS noise-prediction heuristic on that median"


@register_mechanism
class ELS(DPMechanism):
    """Example-level sampling, user-level accounting: rows sampled and clipped alone, at most G per user."""

    key = "els"
    sampling = "els"
    label = "user-level DP, ELS"
    name = "ELS (example-level sampling, user-level accounting)"
    description = ("example-level sampling (ELS): Poisson-sampled examples, per-example clipping, at most G examples "
                   "per user, user-level guarantee by the mixture-of-Gaussians accountant")
    marker = "s"
    color = "tab:orange"
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

    def group_privacy_epsilon(self, **accounting_inputs) -> float | None:
        return accounting.group_privacy_epsilon(**accounting_inputs)


@register_mechanism
class ExampleLevel(DPMechanism):
    """Plain DP-SGD: rows sampled and clipped alone, each row protected (not each user)."""

    key = "example"
    privacy_unit = "example"
    label = "example-level DP-SGD"
    name = "example-level DP-SGD (protects rows, not users)"
    description = "DP-SGD: Poisson-sampled examples, per-example clipping, Gaussian noise (example-level guarantee)"
    marker = "^"
    color = "tab:green"
    protects_users = False
    card_step = ("Each step Poisson-samples examples, each independently with probability q; every sampled example's"
                 "\ngradient is clipped to norm C; Gaussian noise N(0, σ²C²I) is added once to the sum, which is "
                 "divided\nby the expected number of examples per step (`expected_batch_size`).")
    plan_note = "protects single rows only: a user with many rows is not protected as a whole"

    def choose_contribution_bound(self, counts, **kwargs) -> int | None:
        return None  # every row is kept: a bound would drop rows the guarantee counts


MECHANISMS.update({
    "non-private": MechanismNames("non-private", None, None, None, "non-private fine-tuning", "non-private fine-tuning",
                                  "fine-tuning without differential privacy (for comparison only)", marker="*",
                                  color="tab:red"),
    "public-only": MechanismNames("public-only", None, None, None, "public-only baseline", "public-only baseline",
                                  "the public model without the private data (the baseline DP has to beat)",
                                  marker="D", color="black"),
})
# The built-in mechanisms and the arguments that select them (`DPTrainingArguments`' choices on the command line).
DP_MECHANISMS: tuple[str, ...] = tuple(_REGISTRY)
PRIVACY_UNITS: tuple[str, ...] = privacy_units()
SAMPLING_SCHEMES: tuple[str, ...] = sampling_schemes()
