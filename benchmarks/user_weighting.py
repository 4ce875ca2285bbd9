"""Why user-level DP struggles to beat the zero-shot baseline on Shakespeare genres: user weighting.

ULS clips each user's *mean* gradient, so it optimises the mean over users of each user's mean loss: every
speaking role counts once, however many speeches it has. Roles are spread over the genres differently from
speeches (many small history roles), so even without noise that objective moves the classifier towards a
label prior the test speeches do not have. This script measures it without DP, on the frozen embeddings of
the embedded MiniLM (only the similarity head is trained, full batch, no noise, no clipping):

- the genre shares of training speeches, training roles and test speeches;
- test accuracy of the zero-shot baseline, of the head trained per speech (every speech weighted equally,
  the objective of ELS and example-level DP-SGD), and per role (every role weighted equally, the ULS
  objective), with at most G speeches per role as in the study.

- with `--finetune`, the study's own non-private fine-tuning (LoRA + similarity head, `hf_dp.workflows.study`'s
  settings: 400 steps of 32 speeches) on the speeches a contribution bound G keeps, for each G: what a
  user-level DP run with that G could reach with no noise at all.

    python benchmarks/user_weighting.py [--steps 300] [--contribution_bound 2 8 1000] [--finetune]

About 2 minutes on 2 CPU cores (most of it embedding 30 k speeches once); `--finetune` adds about
3 minutes per G.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np
import torch

from hf_dp.workflows import study_runs, study_settings
from hf_dp.workflows.tasks.classification import (
    ClassificationConfig,
    build_model,
    load_classification_data,
    run_classification,
)
from hf_dp.data import partition_by_user


def label_shares(labels: torch.Tensor, num_labels: int) -> list[float]:
    return (torch.bincount(labels, minlength=num_labels).float() / len(labels)).tolist()


def train_head(model, features, labels, weights, steps: int) -> torch.nn.Module:
    """Full-batch Adam on Σ_i w_i · CE_i (Σ w = 1), the head only, starting from the zero-shot prototypes."""
    head = torch.nn.Linear(features.shape[1], labels.max().item() + 1)
    head.load_state_dict(model.head.state_dict())
    optimizer = torch.optim.Adam(head.parameters(), lr=2e-3)
    for _ in range(steps):
        loss = (weights * torch.nn.functional.cross_entropy(model.logit_scale * head(features), labels,
                                                            reduction="none")).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head


def bounded(data, user_id_column: str, bound: int):
    """The training rows a contribution bound G keeps (DPTrainer's choice, keyed by a fixed secret here)."""
    indexed = data.train.add_column("row", list(range(len(data.train))))
    part = partition_by_user(indexed, user_id_column, bound, secret=0)  # a fixed key: the same rows every run
    return part, part.dataset["row"]


def finetune_on_bounded(data, bound: int, baseline: float) -> float:
    """Test accuracy of the study's non-private fine-tuning on the rows G keeps."""
    entry = study_runs.StudyRun(run=f"non-private-G{bound}", mechanism="non-private")
    with tempfile.TemporaryDirectory() as results_dir:
        config, training_args = study_runs.configure_run(entry, study_settings.DEMO_SETTINGS, results_dir,
                                                         examples_per_step=0, baseline_result=baseline)
        _, rows = bounded(data, config.user_id_column, bound)
        result = run_classification(config, training_args,
                                    data=dataclasses.replace(data, train=data.train.select(rows)))
    return result["eval_result"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--contribution_bound", "--contribution-bound", type=int, nargs="+", default=[2, 8, 1000])
    parser.add_argument("--finetune", action="store_true", help="also the study's non-private LoRA fine-tuning")
    args = parser.parse_args()

    config = ClassificationConfig(run="user-weighting", use_lora=False)
    data = load_classification_data(config)
    model = build_model(config, data.label_names)
    k = len(data.label_names)
    train_x = model.embed(data.train["text"], max_length=config.max_length, progress=True)
    test_x = model.embed(data.test["text"], max_length=config.max_length, progress=True)
    train_y, test_y = torch.tensor(data.train["labels"]), torch.tensor(data.test["labels"])

    users = data.train[config.user_id_column]
    first_row = {}
    for row, user in enumerate(users):
        first_row.setdefault(user, row)
    role_y = train_y[sorted(first_row.values())]
    print(f"genres {data.label_names}")
    print(f"  training speeches: {np.round(label_shares(train_y, k), 3)}  ({len(train_y)})")
    print(f"  training roles:    {np.round(label_shares(role_y, k), 3)}  ({len(role_y)})")
    print(f"  test speeches:     {np.round(label_shares(test_y, k), 3)}  ({len(test_y)})")

    def accuracy(head) -> float:
        with torch.no_grad():
            return (head(test_x).argmax(1) == test_y).float().mean().item()

    baseline = accuracy(model.head)
    print(f"\nzero-shot baseline: test accuracy {baseline:.4f}")
    print(f"head trained without noise for {args.steps} full-batch steps (test accuracy):")
    print("      G   per speech   per role (ULS objective)")
    for bound in args.contribution_bound:
        part, rows = bounded(data, config.user_id_column, bound)
        rows = torch.as_tensor(rows)
        units = torch.as_tensor(part.row_user)
        per_speech = torch.full((len(rows),), 1.0 / len(rows))
        per_role = 1.0 / torch.bincount(units)[units].float() / part.num_users
        x, y = train_x[rows], train_y[rows]
        speech = accuracy(train_head(model, x, y, per_speech, args.steps))
        role = accuracy(train_head(model, x, y, per_role, args.steps))
        print(f"  {bound:5d}   {speech:.4f}       {role:.4f}", flush=True)
    if args.finetune:
        print("\nthe study's non-private LoRA fine-tuning on the speeches G keeps (test accuracy):")
        for bound in args.contribution_bound:
            print(f"  G = {bound:5d}: {finetune_on_bounded(data, bound, baseline):.4f}", flush=True)


if __name__ == "__main__":
    main()
