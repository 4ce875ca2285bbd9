"""What a DP trainer refuses after it is built: the guarantee it planned must stay the one it states.

- a class whose bases put a `transformers.Trainer` before the DP mixin (its plain, non-private training step would
  run instead of the DP one): refused when the class is defined;
- another arguments object in place of the trainer's (its privacy plan, ledger and card were made from the first;
  a privacy field changed on the trainer's own arguments is refused by
  [`~hf_dp.DPTrainingArguments.freeze_privacy_fields`]);
- `evaluate()` or `predict()` on data that shares users with the training data: their exact metrics on private
  users are outside ε (the same check as for the `eval_dataset` given at construction).

Mixed into [`~hf_dp.trainer.DPTrainerMixin`], before the reporting mixin.
"""

from __future__ import annotations

from transformers import Trainer

from .compatibility import check_eval_users


class PrivacyGuards:
    """Refusals a DP trainer keeps after construction (see the module docstring)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        guarded = mro.index(PrivacyGuards)
        before = [base for base in mro[1:guarded] if issubclass(base, Trainer) and not issubclass(base, PrivacyGuards)]
        if before:
            raise TypeError(f"class {cls.__name__}: {before[0].__name__} comes before DPTrainerMixin in its bases, so "
                            f"{before[0].__name__}'s plain, non-private training step would run; put DPTrainerMixin "
                            f"first, e.g. class {cls.__name__}(DPTrainerMixin, {before[0].__name__}).")

    def __setattr__(self, name, value):
        if name == "args" and "args" in self.__dict__ and value is not self.__dict__["args"] \
                and self.__dict__["args"].__dict__.get("_privacy_fields_frozen"):
            raise ValueError(f"{type(self).__name__}.args replaced after construction: the privacy plan, the ledger "
                             "and the card were made from the arguments given then, and a new object's privacy fields "
                             "would be ignored while the card stated them; build a new trainer with the new arguments.")
        super().__setattr__(name, value)

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        """Trainer's `evaluate`, refused on data sharing users with the training data.

        Raises:
            ValueError: `eval_dataset` (or `self.eval_dataset`) shares a user with the training data.
        """
        self._check_held_out(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset, *args, **kwargs):
        """Trainer's `predict`, refused on data sharing users with the training data.

        Raises:
            ValueError: `test_dataset` shares a user with the training data.
        """
        self._check_held_out(test_dataset, "test_dataset")
        return super().predict(test_dataset, *args, **kwargs)

    def _check_held_out(self, dataset, name: str) -> None:
        """[`~hf_dp.compatibility.check_eval_users`] against the training users, once per dataset object."""
        if dataset is None or isinstance(dataset, str):  # Trainer's own eval_dataset, or one of its named sets
            dataset, name = self.eval_dataset, "eval_dataset"
        if dataset is None:
            return
        checked = self.__dict__.setdefault("_held_out_checked", [])
        if any(seen is dataset for seen in checked):
            return
        check_eval_users(dataset if isinstance(dataset, dict) else {name: dataset}, self._user_dataset,
                         self.args.user_id_column)
        checked.append(dataset)
