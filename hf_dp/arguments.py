"""DPTrainingArguments: the privacy fields of a DP fine-tuning run, validated, no logic."""

from __future__ import annotations

import copy
import math
import numbers
import os
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

from transformers import TrainingArguments

from .accounting.checks import MAX_GROUP_SIZE
from .accounting.floating_point import MAX_SAMPLER_DELTA_SHARE, NOISE_REACH, max_sampler_epsilon
from .mechanisms import PRIVACY_UNITS, SAMPLING_SCHEMES, get_mechanism, mechanism_of, privacy_units, sampling_schemes


@dataclass
class DPTrainingArguments(TrainingArguments):
    r"""
    [`~transformers.TrainingArguments`] plus the privacy fields of [`DPTrainer`].

    Every field below affects accounting unless marked otherwise. Invalid values raise `ValueError` at
    construction (and again in [`DPTrainer`], for fields set afterwards), one line per field saying what to
    change; checks that need the data (δ < 1/units, sample rate ≤ 1) happen in [`DPTrainer`]. The trainer works on a
    copy, whose privacy fields are frozen once its plan is made (`trainer.args.target_epsilon = ...` is refused).

    Parameters:
        > Privacy

        target_epsilon (`float`, *optional*, defaults to `8.0`):
            ε to spend over the whole run. Used to calibrate `noise_multiplier` when it is not given, and
            training stops before a step that would exceed it. `None` with a fixed `noise_multiplier`
            trains for the planned steps and reports the ε spent.
        target_delta (`float`, *optional*):
            δ of the guarantee. Defaults to `1 / (10 * units)`, units being users for `privacy_unit="user"`
            and examples otherwise; it must be below `1 / units`.
        privacy_unit (`str`, *optional*, defaults to `"user"`):
            `"user"`: the guarantee covers each user's whole contribution. `"example"`: plain example-level
            DP-SGD; a user with many rows is then *not* protected as a whole.
        user_id_column (`str`, *optional*, defaults to `"user_id"`):
            Column of the training dataset holding the user id (any hashable value). It never reaches the
            model or the data collator.

        > Sampling

        sampling (`str`, *optional*, defaults to `"uls"`):
            User-level scheme (Charles et al. 2024). `"uls"`: Poisson-sample users, clip each user's mean
            gradient. `"els"`: Poisson-sample examples, clip per example, account users through the
            mixture-of-Gaussians accountant. Ignored for `privacy_unit="example"`.
        expected_batch_size (`int`, *optional*, defaults to `64`):
            Expected logical batch size: users per step for ULS, examples per step for ELS and example-level.
            The sample rate is `expected_batch_size / units`; the sampled size is random (Poisson).
        per_device_train_batch_size (`int`, *optional*, defaults to `None`):
            The most rows one physical pass (forward + backward) holds on one device: it bounds memory, not the
            logical batch. Unset, it is sized from the tail of the Poisson sample (the 1 − 10⁻³ quantile of the
            units sampled on this rank, times G rows per user for ULS), so a step is one pass in all but about one
            step in a thousand. A sample larger than it is split into the fewest passes of balanced size, a user
            never across two. No effect on ε.
        ddp_timeout (`int`, *optional*, defaults to `600`):
            Seconds a rank waits in a collective (all-reduce, reduce-scatter, a checkpoint's gather) before it
            fails: Trainer's default is 1800. With several ranks, one that stalls or dies stops the others within
            this time; the run then resumes from its newest complete checkpoint. Raise it when a step or a save
            legitimately keeps one rank busy longer (slow storage).
        contribution_bound (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            G, the most rows one user may contribute (a random subset is kept, drawn per user from a secret and
            the user id only). `"auto"`: chosen with ε-DP from a public grid (1, 2, 3, 4, 6, 8, 12, ..., 256):
            for ELS a DP median of the rows per user; for ULS the noise-prediction heuristic
            ([`~hf_dp.mechanism_table.private_contribution_bound`]) run on that DP median. Not used for
            example-level.
            `None` (every row kept) is refused for ELS, whose user-level accounting needs G.
        redraw_rows (`bool`, *optional*, defaults to `False`):
            ULS only: draw each sampled user's (at most G) rows afresh every step, from all of that user's rows
            (keyed by the run's secret, the user and the step), instead of once before training. A user still
            brings one clipped gradient to a step, so ε is the same; a user with more than G rows is then trained
            on all of them over the run rather than on one fixed subset. ELS accounts a user's G fixed rows, so it
            refuses this.
        contribution_bound_epsilon (`float`, *optional*, defaults to `0.1`):
            ε spent choosing G when `contribution_bound="auto"` (the exponential mechanism); it is part of
            `target_epsilon` (DP-SGD gets the rest) and is recorded in the ledger. Unused for a given G.

        > Clipping

        max_grad_norm (`float`, *optional*, defaults to `1.0`):
            C, the clip norm of each unit's gradient over all trainable parameters jointly. Replaces
            [`~transformers.TrainingArguments`]'s global clipping, which DP training does not use. With
            `adaptive_clipping`, the initial C only. ε does not depend on C.
        adaptive_clipping (`bool`, *optional*, defaults to `False`):
            Private adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021): C starts at `max_grad_norm` and
            after every step moves geometrically towards the `target_unclipped_quantile` of the per-unit gradient
            norms, estimated from a noised count of the units left unclipped, C ← C·exp(−η_C·(b̃ − γ)). The count
            (noise std `clipping_count_noise`) is released every step, also with `private_logging=False`, and the
            accountant composes it with the gradient: at a target ε the gradient noise grows, by 0.8 % with the default
            count noise at 64 units per step and σ_eff = 0.8, but by 5 % at 16 units and σ_eff = 0.46 and 24 % at 16
            units and σ_eff = 0.94 (raise `clipping_count_noise` for small batches). Affects accounting; the C
            reached is in the logs (`dp/clipping_norm`), the report and the card.
        target_unclipped_quantile (`float`, *optional*, defaults to `0.5`):
            γ ∈ (0, 1): the fraction of units whose gradient C should leave unclipped (0.5: C tracks the median
            norm, the paper's choice). Only with `adaptive_clipping`; no effect on ε.
        clipping_learning_rate (`float`, *optional*, defaults to `0.2`):
            η_C > 0 of the geometric update (the paper's value): log C moves by at most η_C·max(γ, 1 − γ) per step,
            so a C off by a factor 100 is recovered in about 50-100 steps. Only with `adaptive_clipping`; no effect
            on ε.
        clipping_count_noise (`float`, *optional*):
            σ_b, the std of the Gaussian noise on the count of unclipped units, in units (not a multiplier). Defaults
            to `expected_batch_size / 20` (the paper's; the estimated unclipped fraction then has noise std 0.05 per
            step). It must exceed σ_eff / 2; the larger it is, the less of ε the count takes and the noisier each
            step's estimate (std `clipping_count_noise / expected_batch_size`). Only with `adaptive_clipping`.
            Affects accounting.

        > Accounting

        noise_multiplier (`float`, *optional*):
            σ: the noise standard deviation is σ·C. Calibrated from `target_epsilon` when absent.
        noise_seed (`int`, *optional*):
            Seeds the Poisson sampling and the noise. For tests only: a known seed voids the guarantee for
            anyone who knows it. Default: fresh OS entropy, never written to disk.
        secure_noise (`bool`, *optional*, defaults to `False`):
            Draw the uniform bits of the Gaussian noise from a cryptographic generator (SHAKE-256 keyed by the whole
            secret) instead of the statistical Philox (numpy's on the CPU, a Triton kernel on a CUDA device). The same
            Box–Muller sampler turns either into normals (draws reach 14.85σ), so ε and δ are the same; slower on
            large models (the bits are made on the host).

        > Logging

        private_logging (`bool`, *optional*, defaults to `True`):
            Log `loss` and `dp/clipped_fraction` as noised sums over the sampled units, covered by ε: each unit's
            loss clipped to [0, `max_loss`] plus N(0, (σ_log·max_loss)²), and the number of clipped units plus
            N(0, σ_log²), both divided by the expected batch size. The accountant composes the gradient, loss and
            count releases as one Gaussian release of noise multiplier (σ⁻² + 2·σ_log⁻²)^(-1/2). `False`: log
            only ε, δ, σ and q, nothing computed from the data. With `adaptive_clipping` the noised count of
            unclipped units that sets C replaces the clipped-count release (σ_eff = (σ⁻² + (2σ_b)⁻² +
            σ_log⁻²)^(-1/2)); it is released with or without private logging, so `dp/clipped_fraction` and
            `dp/clipping_norm` (post-processing of it) are logged either way. Affects accounting.
        logging_noise_ratio (`float`, *optional*, defaults to `10.0`):
            r = σ_log / σ. At a target ε the gradient noise grows by a factor √(1 + 2/r²): about 1 % for r = 10.
            Affects accounting.
        max_loss (`float`, *optional*, defaults to `5.0`):
            Each unit's loss (ULS: the user's mean loss; ELS and example-level: one example's loss) is clipped to
            [0, `max_loss`] before it is summed and logged; the logged loss's noise std is
            σ_log·max_loss / expected batch size. Post-processing of the clip: no effect on ε.

    Defaults that differ from [`~transformers.TrainingArguments`]: `max_grad_norm` means the per-unit clip
    norm; `per_device_train_batch_size` bounds the rows of one physical pass and is unset by default (sized from
    the Poisson batch); `gradient_accumulation_steps` must stay 1 (the logical batch is `expected_batch_size`,
    split into passes of at most `per_device_train_batch_size` rows); `num_train_epochs` counts expected passes over
    the units (steps = epochs / sample rate); `fp16` is refused (its loss scaling bypasses clipping): use `bf16`;
    with `push_to_hub`, `hub_strategy` `"checkpoint"` and `"all_checkpoints"` are refused (a checkpoint's ledger holds
    the secret that drew G and each user's rows); `torch_compile` is refused (the per-unit clipping hooks the
    model's layers: pass an uncompiled model).

    Example:

    ```python
    >>> from hf_dp import DPTrainingArguments
    >>> args = DPTrainingArguments(output_dir="out", target_epsilon=3.0, sampling="els", expected_batch_size=32)
    >>> args.privacy_unit
    'user'
    ```
    """

    target_epsilon: float | None = field(
        default=8.0,
        metadata={"help": "Privacy budget ε for the whole run; σ is calibrated to it when --noise_multiplier is "
                          "unset. None with --noise_multiplier: train the planned steps at that σ and report the ε "
                          "spent (hf_dp's parsers read 'None'; transformers' HfArgumentParser does not, use "
                          "hf_dp.command_line.ArgumentParser)."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "δ of the guarantee. Default: 1 / (10 × number of privacy units); must be < 1/units."},
    )
    privacy_unit: str = field(
        default="user",
        metadata={"help": "What the guarantee protects: 'user' (all of a user's rows) or 'example' (one row).",
                  "choices": list(PRIVACY_UNITS)},
    )
    user_id_column: str = field(
        default="user_id",
        metadata={"help": "Training dataset column holding the user id; never passed to the model."},
    )
    sampling: str = field(
        default="uls",
        metadata={"help": "User-level scheme: 'uls' (sample users, clip per user) or 'els' (sample examples, "
                          "clip per example, mixture-of-Gaussians accounting).", "choices": list(SAMPLING_SCHEMES)},
    )
    expected_batch_size: int = field(
        default=64,
        metadata={"help": "Expected logical batch: users per step (ULS) or examples per step (ELS, example-level)."},
    )
    per_device_train_batch_size: int | None = field(
        default=None,
        metadata={"help": "Most rows of one physical pass (memory). Unset: sized from the tail of the Poisson batch, "
                          "so a step is one pass in all but ~1 step in 1000; a larger sample is split in balanced "
                          "passes."},
    )
    ddp_timeout: int = field(
        default=600,
        metadata={"help": "Seconds a rank waits in a collective before failing (Trainer's default: 1800): a stalled or "
                          "dead rank stops the others within this time."},
    )
    contribution_bound: str | None = field(
        default="auto",
        metadata={"help": "G, the most rows kept per user: an integer, or 'auto' (an ε-DP median of the rows per user "
                          "on a public grid; ULS then applies the noise-prediction heuristic to it)."},
    )
    redraw_rows: bool = field(
        default=False,
        metadata={"help": "ULS: draw each sampled user's ≤ G rows afresh every step from all their rows, instead of "
                          "once before training (ε unchanged: still one clipped gradient per user per step)."},
    )
    contribution_bound_epsilon: float = field(
        default=0.1,
        metadata={"help": "ε spent choosing G privately when --contribution_bound is 'auto' (a DP median of the rows "
                          "per user); part of --target_epsilon. Unused when G is given."},
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "C, the clip norm of each unit's gradient (replaces Trainer's global clipping)."},
    )
    adaptive_clipping: bool = field(
        default=False,
        metadata={"help": "Private adaptive clipping (Andrew et al. 2021): C starts at --max_grad_norm and tracks "
                          "--target_unclipped_quantile of the per-unit gradient norms, from a noised count of "
                          "unclipped units released every step and covered by ε."},
    )
    target_unclipped_quantile: float = field(
        default=0.5,
        metadata={"help": "γ in (0, 1): the fraction of units adaptive clipping aims to leave unclipped (0.5: the "
                          "median norm)."},
    )
    clipping_learning_rate: float = field(
        default=0.2,
        metadata={"help": "η_C > 0: adaptive clipping's geometric step, C <- C·exp(-η_C·(unclipped fraction - γ))."},
    )
    clipping_count_noise: float | None = field(
        default=None,
        metadata={"help": "σ_b: noise std of adaptive clipping's count of unclipped units, in units. Default: "
                          "expected_batch_size / 20. Must exceed σ_eff / 2."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "σ (noise std = σ·C). Calibrated from --target_epsilon when unset."},
    )
    noise_seed: int | None = field(
        default=None,
        metadata={"help": "Seed for Poisson sampling and noise, for tests only. Default: OS entropy, never saved."},
    )
    secure_noise: bool = field(
        default=False,
        metadata={"help": "Draw the noise's bits from a cryptographic generator (SHAKE-256) instead of Philox; "
                          "slower on large models. The same sampler and reach: no effect on ε or δ."},
    )
    private_logging: bool = field(
        default=True,
        metadata={"help": "Log the training loss and clipped fraction as noised sums covered by ε (default). "
                          "False: log only ε, δ, σ and q, nothing computed from the data."},
    )
    logging_noise_ratio: float = field(
        default=10.0,
        metadata={"help": "r: the logged loss and clipped count get noise r·σ (in units of --max_loss and of one "
                          "unit); r = 10 costs about 1 percent more gradient noise at the same ε."},
    )
    max_loss: float = field(
        default=5.0,
        metadata={"help": "Each unit's loss is clipped to [0, max_loss] before its noised sum is logged."},
    )

    def __post_init__(self):
        if self.fp16:  # before Trainer's own checks, which would complain about the device instead
            raise ValueError(_message([_FP16]))
        if _compiles(self):  # before Trainer sets up compilation
            raise ValueError(_message([_TORCH_COMPILE]))
        if self.deepspeed or _env_true("ACCELERATE_USE_DEEPSPEED"):  # before Trainer imports DeepSpeed for it
            raise ValueError(_message([_DEEPSPEED]))
        super().__post_init__()
        self.validate_privacy_fields()

    @cached_property
    def _setup_devices(self):
        """Trainer's device setup, with `ddp_timeout` also for CPU processes (transformers passes it on GPUs only):
        the process group is made first, with the timeout, and Trainer's setup then finds it made."""
        import os

        if self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist
            from accelerate import PartialState

            if not dist.is_initialized():
                PartialState(cpu=True, backend=self.ddp_backend, timeout=timedelta(seconds=self.ddp_timeout))
        return super()._setup_devices

    def checked_copy(self) -> DPTrainingArguments:
        """A checked copy for a trainer (its plan sets `max_steps`, and the caller may reuse its arguments)."""
        args = copy.copy(self)
        args.validate_privacy_fields()  # again: a field may have been set after the arguments were built
        if args.include_num_input_tokens_seen not in ("no", False, None):
            raise ValueError("include_num_input_tokens_seen: the exact number of tokens in each Poisson sample is "
                             "data-dependent and not covered by ε; set it to 'no' for DP training.")
        if self.skip_memory_metrics is False:
            raise ValueError("skip_memory_metrics=False: transformers' memory metrics (train_mem_*_delta) grow with "
                             "each step's Poisson sample and its rows' lengths, so they are computed from the data and "
                             "not noised, outside what ε covers; leave skip_memory_metrics=True for DP training.")
        args.ignore_data_skip = True  # sampling resumes from the ledger's step: no batches to skip
        return args

    def freeze_privacy_fields(self) -> None:
        """Refuse any later change of a privacy field ([`PRIVACY_FIELDS`]): the trainer freezes its copy once its
        privacy plan is made, since the plan (σ, q, steps) would not follow the change but the report and the card
        would state it."""
        self.__dict__["_privacy_fields_frozen"] = True

    def __setattr__(self, name, value):
        if name in PRIVACY_FIELDS and self.__dict__.get("_privacy_fields_frozen") and name in self.__dict__ \
                and not _same_value(self.__dict__[name], value):
            raise ValueError(
                f"{name}={value!r} set after the DP trainer was built (it planned with {self.__dict__[name]!r}): the "
                "privacy plan, the ledger and the card are fixed at construction, so the change would be ignored "
                f"while the card stated it; set {name} in the arguments before building the trainer.")
        super().__setattr__(name, value)

    def __getstate__(self):
        """Copies and pickles (`training_args.bin`) are not frozen."""
        state = dict(self.__dict__)
        state.pop("_privacy_fields_frozen", None)
        return state

    def validate_privacy_fields(self) -> None:
        """Check the privacy fields (and the Trainer fields DP training constrains); normalise `contribution_bound`
        and `expected_batch_size`.

        Runs at construction and again in [`DPTrainer`], so a field set after construction (`args.noise_seed = ...`)
        is checked too.

        Raises:
            ValueError: one line naming the field and what to change (one line per field when several are wrong).
        """
        problems = [*self._noise_and_budget_problems(), *self._clipping_and_logging_problems(),
                    *self._trainer_field_problems()]
        self._contribution_problems(problems)
        if problems:
            raise ValueError(_message(problems))
        self.expected_batch_size = int(self.expected_batch_size)

    def _noise_and_budget_problems(self) -> list[str]:
        """What is wrong with the unit, the budget (ε, δ), σ and C, and the precision they run in."""
        problems = []
        if self.fp16:
            problems.append(_FP16)
        if getattr(self, "neftune_noise_alpha", None) is not None:
            problems.append(f"neftune_noise_alpha={self.neftune_noise_alpha!r}: NEFTune scales its embedding noise by "
                            "the batch's padded length, so one user's rows change every other user's forward pass "
                            "(and its noise is not accounted); unset it for DP training.")
        if self.privacy_unit not in privacy_units():
            problems.append(f"privacy_unit={self.privacy_unit!r}: use one of {privacy_units()}.")
        if not (isinstance(self.user_id_column, str) and self.user_id_column):
            problems.append(f"user_id_column={self.user_id_column!r}: name the dataset column that holds the user id "
                            "(e.g. 'user_id').")
        if self.sampling not in sampling_schemes():
            problems.append(f"sampling={self.sampling!r}: use one of {sampling_schemes()}.")
        if self.target_epsilon is not None and not _positive_finite(self.target_epsilon):
            problems.append(f"target_epsilon={self.target_epsilon!r}: ε must be a finite number > 0 (e.g. 8); an "
                            "infinite ε is no guarantee (train with transformers.Trainer for a non-private run).")
        elif self.target_epsilon is not None:
            problems.extend(_beyond_the_sampler(self.target_epsilon, self.target_delta))
        if self.target_epsilon is None and self.noise_multiplier is None:
            problems.append("set target_epsilon (to calibrate the noise) or noise_multiplier (or both).")
        if self.target_delta is not None and not (_positive_finite(self.target_delta) and self.target_delta < 1):
            problems.append(f"target_delta={self.target_delta!r}: must be in (0, 1); leave it unset for "
                            "1/(10·units).")
        if self.noise_multiplier is not None and not _positive_finite(self.noise_multiplier):
            problems.append(f"noise_multiplier={self.noise_multiplier!r}: must be a finite number > 0 (unset it to "
                            "calibrate).")
        if not _positive_finite(self.max_grad_norm):
            problems.append(f"max_grad_norm={self.max_grad_norm!r}: the per-unit clip norm must be a finite number "
                            "> 0.")
        elif self.max_grad_norm > MAX_MAGNITUDE:
            problems.append(f"max_grad_norm={self.max_grad_norm:g}: above {MAX_MAGNITUDE:g}, σ·C overflows the "
                            "gradients' precision; typical values are 0.1 to 10.")
        for name in ("adaptive_clipping", "private_logging", "secure_noise", "redraw_rows"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name}={getattr(self, name)!r}: use True or False (a string such as 'no' would be "
                                "read as True).")
        return problems

    def _clipping_and_logging_problems(self) -> list[str]:
        """What is wrong with adaptive clipping, the noise seed and the private logs."""
        problems = []
        quantile = self.target_unclipped_quantile
        if not (isinstance(quantile, numbers.Real) and not isinstance(quantile, bool) and 0 < quantile < 1):
            problems.append(f"target_unclipped_quantile={quantile!r}: must lie strictly between 0 and 1 (0.5 clips "
                            "at the median norm).")
        if not _positive_finite(self.clipping_learning_rate):
            problems.append(f"clipping_learning_rate={self.clipping_learning_rate!r}: must be a finite number > 0 "
                            "(e.g. 0.2).")
        if self.clipping_count_noise is not None and not _positive_finite(self.clipping_count_noise):
            problems.append(f"clipping_count_noise={self.clipping_count_noise!r}: must be a finite number > 0, or "
                            "unset for expected_batch_size / 20.")
        if _compiles(self):
            problems.append(_TORCH_COMPILE)
        seed = self.noise_seed
        if seed is not None and not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
                                     and 0 <= seed < 2**512):
            problems.append(f"noise_seed={self.noise_seed!r}: use an integer in [0, 2**512), or leave it unset "
                            "(a fresh 256-bit secret from OS entropy).")
        if not _positive_finite(self.logging_noise_ratio):
            problems.append(f"logging_noise_ratio={self.logging_noise_ratio!r}: must be a finite number > 0.")
        if not _positive_finite(self.max_loss):
            problems.append(f"max_loss={self.max_loss!r}: the clip of each unit's logged loss must be a finite "
                            "number > 0.")
        elif self.max_loss > MAX_MAGNITUDE:
            problems.append(f"max_loss={self.max_loss:g}: above {MAX_MAGNITUDE:g}, the noised loss sum overflows; "
                            "a few times the typical loss (e.g. 5) is enough.")
        if self.noise_multiplier is not None and _positive_finite(self.noise_multiplier) \
                and self.noise_multiplier > MAX_MAGNITUDE:
            problems.append(f"noise_multiplier={self.noise_multiplier:g}: above {MAX_MAGNITUDE:g} the update is all "
                            "noise; typical values are 0.3 to 5.")
        return problems

    def _trainer_field_problems(self) -> list[str]:
        """What is wrong with the Trainer fields DP training constrains (batches, steps, accumulation, sharding)."""
        problems = []
        micro_batch = self.per_device_train_batch_size
        if micro_batch is not None and not (_is_integer(micro_batch) and micro_batch >= 1):
            problems.append(f"per_device_train_batch_size={micro_batch!r}: set an integer >= 1, the most rows of one "
                            "physical pass, or leave it unset to size passes from the Poisson batch.")
        if not (_is_integer(self.expected_batch_size) and self.expected_batch_size >= 1):
            problems.append(f"expected_batch_size={self.expected_batch_size!r}: set an integer >= 1, the expected "
                            "users per step (ULS) or examples per step (ELS, example-level), e.g. 64.")
        if not (_is_integer(self.max_steps) and (self.max_steps >= 1 or _positive_finite(self.num_train_epochs))):
            problems.append(f"num_train_epochs={self.num_train_epochs!r} with max_steps={self.max_steps!r}: nothing "
                            "to train; set num_train_epochs > 0 (expected passes over the units, e.g. 1) or "
                            "max_steps >= 1.")
        if self.gradient_accumulation_steps != 1:
            problems.append(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: DP training forms its logical "
                "batch itself; set expected_batch_size for the logical batch and per_device_train_batch_size for "
                "memory, and leave gradient_accumulation_steps at 1."
            )
        if self.label_smoothing_factor:
            problems.append(
                f"label_smoothing_factor={self.label_smoothing_factor}: DP training computes plain per-example "
                "cross-entropy for clipping; set it to 0."
            )
        if self.deepspeed:
            problems.append(_DEEPSPEED)
        if self.fsdp and int((self.fsdp_config or {}).get("version", 2)) != 2:
            problems.append("fsdp_config version 1: DP training supports FSDP2 only (fully_shard); set "
                            "fsdp_config={'version': 2}.")
        if self.push_to_hub and self.hub_strategy in ("checkpoint", "all_checkpoints"):
            problems.append(
                f"hub_strategy={str(getattr(self.hub_strategy, 'value', self.hub_strategy))!r}: it uploads checkpoint "
                "folders, whose resume state (dp_resume.json) holds the secret that drew G and each user's rows; "
                "use hub_strategy='every_save' or 'end' (the model and the privacy card only)."
            )
        return problems

    def _contribution_problems(self, problems: list[str]) -> None:
        """Add what is wrong with the contribution bound G and its draw to `problems`; normalise G."""
        mechanism = _mechanism_or_none(self.privacy_unit, self.sampling)
        if mechanism is not None and mechanism.requires_contribution_bound and self.contribution_bound is None:
            problems.append(f"contribution_bound=None with sampling={self.sampling!r}: {mechanism.name} "
                            "accounts users through the bound G; set contribution_bound to an integer or 'auto'.")
        self.contribution_bound = _parse_contribution_bound(self.contribution_bound, problems)
        if mechanism is not None and mechanism.requires_contribution_bound and \
                isinstance(self.contribution_bound, int) and self.contribution_bound > MAX_GROUP_SIZE:
            problems.append(f"contribution_bound={self.contribution_bound} with sampling={self.sampling!r}: "
                            f"{mechanism.name} accounts each user as a group of G examples, and its "
                            f"accountant is tested up to G = {MAX_GROUP_SIZE}; set contribution_bound <= "
                            f"{MAX_GROUP_SIZE} (or 'auto'), or use sampling='uls', which clips each user's mean "
                            "over any G.")
        if self.redraw_rows and mechanism is not None and not mechanism.rows_may_be_redrawn:
            problems.append(f"redraw_rows=True with {mechanism.name}: its accounting holds for rows "
                            "fixed before training; use sampling='uls' (privacy_unit='user'), or redraw_rows=False.")
        elif self.redraw_rows and self.contribution_bound is None:
            problems.append("redraw_rows=True with contribution_bound=None: every row of a sampled user is already "
                            "used each step; set contribution_bound (an integer or 'auto'), or redraw_rows=False.")
        if mechanism is not None and not mechanism.protects_users and isinstance(self.contribution_bound, int):
            problems.append(f"contribution_bound={self.contribution_bound} with privacy_unit='example': example-level "
                            "DP-SGD keeps every row (a bound would drop rows the report counts as kept); leave "
                            "contribution_bound at 'auto' or None, or use privacy_unit='user'.")
        if not _positive_finite(self.contribution_bound_epsilon):
            problems.append(f"contribution_bound_epsilon={self.contribution_bound_epsilon!r}: must be a finite "
                            "number > 0.")
        elif self.contribution_bound == "auto" and mechanism is not None and mechanism.protects_users \
                and _positive_finite(self.target_epsilon) and self.contribution_bound_epsilon >= self.target_epsilon:
            problems.append(f"contribution_bound_epsilon={self.contribution_bound_epsilon} leaves nothing of "
                            f"target_epsilon={self.target_epsilon} for training: lower it or set contribution_bound.")

    @property
    def mechanism(self) -> str:
        """`"uls"`, `"els"` or `"example"`: the key of [`~hf_dp.vocabulary.MECHANISMS`] these arguments select."""
        return mechanism_of(self.privacy_unit, self.sampling)


_FP16 = ("fp16=True: fp16 training scales the loss (GradScaler), which the per-unit clipping and noise do not go "
         "through, so updates would be silently wrong; use --bf16 (bfloat16 needs no loss scaling) or full precision.")

_TORCH_COMPILE = ("torch_compile=True (or a torch_compile_backend / torch_compile_mode, which turn it on): the "
                  "per-unit clipping hooks into the model's layers, which makes the compiled graph break and "
                  "recompile at every batch shape (slower, not faster); leave torch_compile off and pass an "
                  "uncompiled model.")


_DEEPSPEED = ("deepspeed (a --deepspeed config, or accelerate launch with a DeepSpeed config): its engine owns the "
              "backward pass and the gradient reduction, which DP training replaces, so DP training refuses it "
              "whether or not DeepSpeed is installed; shard with FSDP2 instead (accelerate launch --config_file "
              "recipes/configs/fsdp.yaml), or drop the DeepSpeed config for DDP.")


# The fields a trainer's privacy plan, ledger and card are made from: DPTrainingArguments' own, and C.
PRIVACY_FIELDS = frozenset({name for name in DPTrainingArguments.__dataclass_fields__
                            if name not in TrainingArguments.__dataclass_fields__} | {"max_grad_norm"})


def _same_value(old, new) -> bool:
    try:
        return old is new or bool(old == new)
    except Exception:  # e.g. an array's ambiguous truth value
        return False


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


MAX_MAGNITUDE = 1e6  # above this a clip norm, loss clip or noise multiplier overflows float32 arithmetic


def _compiles(args) -> bool:
    """torch_compile, or a compile backend or mode (either turns torch_compile on in TrainingArguments)."""
    return bool(args.torch_compile) or args.torch_compile_backend is not None or args.torch_compile_mode is not None


def _message(problems: list[str]) -> str:
    """One line for one problem; a line per problem when there are several."""
    if len(problems) == 1:
        return f"Invalid DPTrainingArguments: {problems[0]}"
    return "Invalid DPTrainingArguments:\n  - " + "\n  - ".join(problems)


def _positive_finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _is_integer(value) -> bool:
    """An int (not a bool), or a float with an integer value (e.g. 64.0 from a config file)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())


def _mechanism_or_none(privacy_unit, sampling):
    """The mechanism the two fields select, or `None` when they are invalid (reported on their own)."""
    try:
        return get_mechanism(mechanism_of(privacy_unit, sampling))
    except ValueError:
        return None


def _parse_contribution_bound(value, problems: list[str]):
    if value is None or value == "auto":
        return value
    try:
        bound = int(value)
    except (TypeError, ValueError):
        problems.append(f"contribution_bound={value!r}: use a positive integer or 'auto'.")
        return value
    if bound < 1 or str(bound) != str(value).strip():
        problems.append(f"contribution_bound={value!r}: use a positive integer or 'auto'.")
    return bound


def _beyond_the_sampler(target_epsilon: float, target_delta) -> list[str]:
    """A target ε no plan can state, whatever the model and data: above it even one draw of the noise sampler adds
    more than its share of δ ([`~hf_dp.accounting.floating_point.max_sampler_epsilon`] at one draw; δ < 1/2 with
    2 units or more). The plan names the exact, lower limit of its own steps and parameters."""
    given = _positive_finite(target_delta) and target_delta < 1
    delta = target_delta if given else 0.5
    largest = max_sampler_epsilon(delta=delta, draws=1)
    if target_epsilon <= largest:
        return []
    return [f"target_epsilon={target_epsilon:g} is beyond what the noise sampler can state for any model: its draws "
            f"reach {NOISE_REACH:.2f}σ, and even one draw adds (e^ε + δ)·2⁻¹⁵⁹ to δ, more than "
            f"{MAX_SAMPLER_DELTA_SHARE:.0%} of {f'δ = {delta:g}' if given else 'any δ (below 1/2)'} once "
            f"ε > {math.floor(largest * 10) / 10:.1f} (a plan's steps and parameters lower that limit further; the "
            "trainer names it): ask for a smaller ε."]
