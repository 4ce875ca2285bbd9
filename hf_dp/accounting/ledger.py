"""The privacy ledger that travels with training: every step's (q, σ, G) and every ε-DP release."""
from __future__ import annotations

import math
import warnings

import numpy as np

from .checks import check_delta, check_steps, make_kind
from .composition import composition_bounds, describe_accounting

__all__ = ["ACCOUNTANT_NAME", "PrivacyAccountant"]

ACCOUNTANT_NAME = "prv-accountant (Gopi, Lee, Wutschitz 2021), both adjacency directions"  # what composes the ledger


class PrivacyAccountant:
    """Ledger of DP-SGD steps (q, σ, G per step) and the ε they spend, saved with every checkpoint.

    Steps may change q, σ or G mid-run; consecutive steps with equal parameters are merged into
    one segment. ε composes all segments in both adjacency directions (the larger is reported).
    Affects nothing by itself: it records what the trainer did.

    Example:
        >>> from hf_dp.accounting import PrivacyAccountant, epsilon
        >>> accountant = PrivacyAccountant()
        >>> accountant.step(sample_rate=0.01, noise_multiplier=1.0, steps=500)
        >>> accountant.epsilon_after(1e-5, steps=500) == epsilon(
        ...     sample_rate=0.01, noise_multiplier=1.0, steps=1000, delta=1e-5)
        True
        >>> state = accountant.state_dict()  # JSON-safe, restore with load_state_dict
    """

    # Format 2 names each segment's multiplier `effective_noise_multiplier` (σ_eff: the one Gaussian a step composes,
    # σ itself when the step releases nothing else), so a ledger never reads as the card's σ; format 1 is still read.
    STATE_FORMAT = 2
    _READ_FORMATS = {1: "noise_multiplier", 2: "effective_noise_multiplier"}

    def __init__(self) -> None:
        self._segments: list[list] = []  # [Kind, steps]
        self._pure_dp: list[dict] = []  # [{"label": str, "epsilon": float}]: data-dependent choices

    def record_pure_dp(self, label: str, epsilon: float) -> None:
        """Record one ε-DP release made from the private data (e.g. a DP quantile that chose G).

        It composes with the DP-SGD steps by basic composition: `epsilon(delta)` adds its ε
        (affects accounting). Raises `ValueError` for a non-positive or non-finite ε.
        """
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float, np.number)) \
                or not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon={epsilon!r} of the {label!r} release must be a positive finite number.")
        self._pure_dp.append({"label": str(label), "epsilon": float(epsilon)})

    @property
    def pure_dp(self) -> list[dict]:
        """The ε-DP releases recorded with `record_pure_dp`, oldest first."""
        return [dict(r) for r in self._pure_dp]

    @property
    def pure_dp_epsilon(self) -> float:
        """Total ε of the recorded ε-DP releases (added to the DP-SGD ε)."""
        return float(sum(r["epsilon"] for r in self._pure_dp))

    def step(self, *, sample_rate: float, noise_multiplier: float, group_size: int = 1, steps: int = 1) -> None:
        """Record `steps` DP-SGD steps with these parameters (affects accounting)."""
        kind = make_kind(sample_rate, noise_multiplier, group_size)
        steps = check_steps(steps)
        if steps == 0:
            return
        if self._segments and self._segments[-1][0] == kind:
            self._segments[-1][1] += steps
        else:
            self._segments.append([kind, steps])

    @property
    def steps(self) -> int:
        """Total steps recorded."""
        return sum(n for _, n in self._segments)

    @property
    def history(self) -> list[dict]:
        """The segments, oldest first: dicts with sample_rate, effective_noise_multiplier (the `noise_multiplier`
        each `step` composed), group_size, steps."""
        return [{"sample_rate": kind.sample_rate, "effective_noise_multiplier": kind.noise_multiplier,
                 "group_size": kind.group_size, "steps": n} for kind, n in self._segments]

    @property
    def description(self) -> str:
        """One line saying what was composed, e.g. "180 steps of Poisson-subsampled Gaussian (DP-SGD), ..."."""
        if not self._segments:
            return "no steps"
        groups = sorted({kind.group_size for kind, _ in self._segments})
        parts = "; ".join(describe_accounting(g) for g in groups)
        return f"{self.steps} steps of {parts}"

    @property
    def mechanism(self) -> str:
        """Deprecated alias of [`description`] (a *mechanism* is a key of `hf_dp.vocabulary.MECHANISMS`)."""
        # Deprecated: kept so that code written against hf_dp 0.1.0 keeps working; not used inside hf_dp.
        warnings.warn("PrivacyAccountant.mechanism is deprecated: use PrivacyAccountant.description.",
                      DeprecationWarning, stacklevel=2)
        return self.description

    def epsilon_bounds(self, delta: float) -> tuple[float, float, float]:
        """(lower, estimate, upper) ε of all recorded steps and ε-DP releases at `delta` ((0, 0, 0) when empty)."""
        extra = self.pure_dp_epsilon
        return tuple(e + extra for e in composition_bounds([tuple(s) for s in self._segments], check_delta(delta)))

    def epsilon(self, delta: float) -> float:
        """ε spent so far at `delta`: the upper bound, never understated (0 when empty)."""
        return self.epsilon_bounds(delta)[2]

    def epsilon_after(self, delta: float, *, steps: int = 1, sample_rate: float | None = None,
                      noise_multiplier: float | None = None, group_size: int | None = None) -> float:
        """ε if `steps` more steps were taken (parameters default to the last segment's).

        The trainer asks this before every step so that it stops before exceeding its target.
        Equals `epsilon(delta)` after those steps are recorded (the same cached computation); one
        more step than last time costs ~10-50 ms (one Fourier-space multiplication and inverse FFT
        per adjacency direction), a new discretisation only when the steps pass a horizon.

        Args:
            delta (`float`): δ ∈ (0, 1).
            steps (`int`, *optional*, defaults to `1`): further steps.
            sample_rate, noise_multiplier, group_size (*optional*): their parameters, defaulting
                to the last segment's (required for the first steps of an empty ledger).

        Raises:
            ValueError: out-of-range arguments, or an empty ledger without parameters.
        """
        steps = check_steps(steps)
        last = self._segments[-1][0] if self._segments else None
        if steps == 0 and sample_rate is None and noise_multiplier is None and group_size is None:
            return self.epsilon(delta)
        if last is None and (sample_rate is None or noise_multiplier is None):
            raise ValueError("The ledger is empty: pass sample_rate and noise_multiplier (and group_size for ELS) "
                             "to epsilon_after.")
        kind = make_kind(
            last.sample_rate if sample_rate is None else sample_rate,
            last.noise_multiplier if noise_multiplier is None else noise_multiplier,
            (last.group_size if last is not None else 1) if group_size is None else group_size,
        )
        return self.pure_dp_epsilon + composition_bounds(
            [tuple(s) for s in self._segments] + [(kind, steps)], check_delta(delta))[2]

    def state_dict(self) -> dict:
        """JSON-safe state: {"format": 2, "segments": [{sample_rate, effective_noise_multiplier, group_size, steps}],
        "pure_dp": [...]}."""
        return {"format": self.STATE_FORMAT, "segments": self.history, "pure_dp": self.pure_dp}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` output (validated; the ledger is replaced, never merged).

        Raises:
            ValueError: the state is not a ledger written by this class.
        """
        multiplier = self._READ_FORMATS.get(state.get("format")) if isinstance(state, dict) else None
        if multiplier is None or not isinstance(state.get("segments"), list) \
                or not isinstance(state.get("pure_dp", []), list):
            raise ValueError(f"Not a PrivacyAccountant state (expected {{'format': {self.STATE_FORMAT}, "
                             f"'segments': [...]}}), got {state!r:.200}.")
        segments = []
        for i, seg in enumerate(state["segments"]):
            keys = {"sample_rate", multiplier, "group_size", "steps"}
            if not isinstance(seg, dict) or set(seg) != keys:
                raise ValueError(f"Ledger segment {i} must have exactly the keys {sorted(keys)}, got {seg!r:.200}.")
            try:
                kind = make_kind(seg["sample_rate"], seg[multiplier], seg["group_size"])
                steps = check_steps(seg["steps"], minimum=1)
            except ValueError as error:
                raise ValueError(f"Ledger segment {i} is invalid: {error}") from error
            if segments and segments[-1][0] == kind:
                segments[-1][1] += steps
            else:
                segments.append([kind, steps])
        pure_dp = []
        for i, release in enumerate(state.get("pure_dp", [])):
            if not isinstance(release, dict) or set(release) != {"label", "epsilon"}:
                raise ValueError(f"Ledger pure_dp entry {i} must have exactly the keys ['epsilon', 'label'], "
                                 f"got {release!r:.200}.")
            epsilon = release["epsilon"]
            if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) \
                    or not (epsilon > 0 and math.isfinite(epsilon)):
                raise ValueError(f"Ledger pure_dp entry {i} has an invalid epsilon {epsilon!r}.")
            pure_dp.append({"label": str(release["label"]), "epsilon": float(epsilon)})
        self._segments = segments
        self._pure_dp = pure_dp

    def __repr__(self) -> str:
        return f"PrivacyAccountant(steps={self.steps}, segments={len(self._segments)})"
