"""Privacy accounting for DP-SGD: pure math on prv-accountant (no torch, no transformers).

Notation: the project's names in code, Greek letters only inside the accounting math:

| Greek | name in code                                  | meaning                                   |
|-------|-----------------------------------------------|-------------------------------------------|
| σ     | `noise_multiplier`                            | noise std divided by the clipping norm C  |
| q     | `sample_rate`                                 | Poisson sampling probability of one item  |
| T     | `steps`                                       | number of DP-SGD steps (compositions)     |
| G     | `group_size` (the `contribution_bound`)       | most items one user can hold (ELS)        |
| C     | `max_grad_norm`                               | clipping norm (ε does not depend on it)   |
| ε, δ  | `epsilon`, `delta` (`target_epsilon`, ...)    | the (ε, δ)-DP guarantee                   |

`group_size=1` accounts example-level DP-SGD and ULS user-level DP-SGD (the Poisson-subsampled
Gaussian); `group_size=G>1` accounts ELS user-level DP-SGD (the mixture of Gaussians of
Charles et al. 2024). Both adjacency directions (add and remove) are accounted and the larger
ε is reported; the ε reported is prv-accountant's certified upper bound, so it is never understated.

Modules, in the order the numbers flow: `checks` (arguments and the tested domain),
`mixture_loss` (each step's privacy loss function L and its inverse), `privacy_loss` (each step's
privacy loss random variable: the distribution of L, per adjacency direction), `renyi` (its Rényi
divergences), `discretisation` (prv-accountant's mesh, with a checked mean), `composition` (ε and
its bounds), `calibration` (σ for a target), `group_privacy` (the loose comparison for ELS),
`ledger` (`PrivacyAccountant`, the record of every release), `cache` (one memo for all of it,
`CACHE.clear()`).
"""
import warnings

from .cache import CACHE, AccountingCache
from .calibration import noise_multiplier, rdp_noise_multiplier
from .checks import MAX_GROUP_SIZE, MAX_STEPS
from .discretisation import AccountingError
from .composition import describe_accounting, epsilon, epsilon_bounds
from .group_privacy import group_privacy_epsilon
from .ledger import PrivacyAccountant
from .privacy_loss import MixtureOfGaussiansPRV

__all__ = [
    "CACHE",
    "MAX_GROUP_SIZE",
    "MAX_STEPS",
    "AccountingCache",
    "AccountingError",
    "MixtureOfGaussiansPRV",
    "PrivacyAccountant",
    "describe_accounting",
    "epsilon",
    "epsilon_bounds",
    "group_privacy_epsilon",
    "noise_multiplier",
    "rdp_noise_multiplier",
]

# Deprecated names of hf_dp 0.1.0 (they were in `__all__`), kept importable with a DeprecationWarning and used
# nowhere inside hf_dp: a *mechanism* is only a key of `hf_dp.vocabulary.MECHANISMS`.
_DEPRECATED = {"MixtureOfGaussiansMechanism": "MixtureOfGaussiansPRV", "describe_mechanism": "describe_accounting"}


def __getattr__(name: str):
    if name in _DEPRECATED:
        warnings.warn(f"hf_dp.accounting.{name} is deprecated: use hf_dp.accounting.{_DEPRECATED[name]}.",
                      DeprecationWarning, stacklevel=2)
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
