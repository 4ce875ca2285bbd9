"""Why a clipping norm pays or loses: per-unit gradients at initialisation on the public tuning proxy.

DP-SGD adds Gaussian noise of standard deviation σ·C to the sum of the clipped per-unit gradients of a step. Over B
expected units and d trainable weights, the expected signal-to-noise ratio of a step is

    SNR(C) = |Σ_u min(1, C/‖g_u‖)·g_u| / (σ·C·√d) = B·|mean_u min(‖g_u‖/C, 1)·ĝ_u| / (σ·√d)     (ĝ_u = g_u/‖g_u‖)

It is largest as C → 0, where every unit is clipped and contributes its direction only (SNR(0) = B·|mean ĝ|/(σ√d)),
and falls as C grows past the per-unit norms. Clipping at the median (adaptive clipping's default target) gives some
of that ratio back for less clipping bias: the clipped mean points closer to the true mean gradient
mean_u g_u. Which side wins depends on how well the units agree (|mean ĝ|, the mean pairwise cosine) and on how the
norms and directions go together. This script measures both, at initialisation, on the public tuning proxy only:
the roles of [`~hf_dp.workflows.study_settings.TUNING_TRAIN_PLAYS`] (142 roles), never a training role or a test
play of the studies.

- `--task classification` (default): the classification study's model (MiniLM, 20 x cosine head, LoRA r = 8 on
  the queries and values, 32 tokens), one gradient per role (the ULS unit: the mean loss over at most G = 8 of its
  speeches), and one per speech (the unit of ELS and example-level DP-SGD);
- `--task causal_lm`: the causal-LM study's model (SmolLM2-135M-Instruct, LoRA r = 8 on q/v of the top 4 layers,
  40 tokens), one gradient per speech, one speech of each of `--lm_units` roles (ULS with G = 1). Slower.

For each it prints norm quantiles, the agreement of the units (mean pairwise cosine, |mean ĝ|, within and across
genres for classification), and for a few C: SNR(C)/SNR(0), the absolute SNR(C) with the study's σ (calibrated by
the accountant for the study's q, steps, ε = 8 and δ = 1/(10·820), as a study run does: `study_noise_multiplier` of
`causal_lm_tuning.py`) and B, and cos(clipped mean, mean gradient), the clipping bias. One JSON line per task is
appended to `--log`.

`--adam` also replays 200 (60) Adam steps with these fixed gradients and the study's noise, for a fixed C and for
the C trajectory adaptive clipping follows from C_0 (simulated from the same norms and the count noise): whether a C
that grows during training hurts beyond its SNR (Adam's second-moment estimate lags the growing noise). The
gradients do not change with the weights there, so it isolates the noise; it is no training run.

Examples (one thread on the shared 2-core machine, depending on its load: classification 3 to 19 minutes, the
causal LM with 64 units 14 minutes under heavy load):

    python benchmarks/clipping_snr.py --adam
    python benchmarks/clipping_snr.py --task causal_lm --lm_units 64 --adam
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


# ------------------------------------------------------------------------------------------------------------
# Per-unit gradients
# ------------------------------------------------------------------------------------------------------------


def _flat_grad(params):
    import torch

    return torch.cat([p.grad.detach().float().reshape(-1) for p in params])


def classification_gradients(contribution_bound: int, seed: int):
    """(per-speech gradients (n, d), the role index of each speech, the genre of each role, d) of the classification
    study's model at initialisation, on the proxy's training roles; at most `contribution_bound` random speeches
    per role. Train mode (dropout on), as the trainer runs the model."""
    import numpy as np
    import torch
    from classification_tuning import proxy_data
    from transformers import AutoTokenizer

    from hf_dp.workflows.study_settings import DEMO_SETTINGS
    from hf_dp.workflows.tasks.classification import ClassificationConfig, build_model
    from hf_dp.workflows.tasks.classifier_models import resolve_model_path

    fields = {k: v for k, v in DEMO_SETTINGS["config"].items() if k != "exclude_train_plays"}
    config = ClassificationConfig(run="snr", results_dir="/tmp/clipping-snr", progress=False, **fields)
    data = proxy_data(config)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model_name_or_path))
    torch.manual_seed(seed)
    model = build_model(config, data.label_names).train()
    params = [p for p in model.parameters() if p.requires_grad]
    rows_by_role: dict = {}
    for row, user in enumerate(data.train["user_id"]):
        rows_by_role.setdefault(user, []).append(row)
    rng = np.random.default_rng(seed)
    texts, labels = data.train["text"], data.train["labels"]
    grads, speech_role, role_genre = [], [], []
    for role_index, rows in enumerate(rows_by_role.values()):
        if len(rows) > contribution_bound:
            rows = sorted(rng.choice(rows, size=contribution_bound, replace=False).tolist())
        role_genre.append(labels[rows[0]])
        for row in rows:
            model.zero_grad()
            batch = tokenizer([texts[row]], truncation=True, max_length=config.max_length, return_tensors="pt")
            model(**batch, labels=torch.tensor([labels[row]])).loss.backward()
            grads.append(_flat_grad(params))
            speech_role.append(role_index)
    return torch.stack(grads).numpy(), np.array(speech_role), np.array(role_genre), sum(p.numel() for p in params)


def causal_lm_gradients(units: int, seed: int):
    """(per-speech gradients (n, d), d) of the causal-LM study's model at initialisation: one random speech of each
    of `units` proxy training roles (ULS with G = 1)."""
    import types

    import numpy as np
    import torch
    from causal_lm_tuning import lm_config, proxy_data
    from transformers import AutoTokenizer

    from hf_dp.workflows.study_settings import CAUSAL_LM_SETTINGS
    from hf_dp.workflows.tasks.language_modeling import build_model, tokenize_causal_lm

    study = CAUSAL_LM_SETTINGS["config"]
    args = types.SimpleNamespace(lora_layers=len(study["lora_layers"]), max_length=study["max_length"],
                                 lora_r=study["lora_r"], modules=study["lora_target_modules"], no_progress=True)
    data = proxy_data(eval_examples=1)
    config = lm_config(args, "/tmp/clipping-snr", "snr")
    tokenizer = AutoTokenizer.from_pretrained(config.model_name_or_path)
    torch.manual_seed(seed)
    model = build_model(config).train()
    rows_by_role: dict = {}
    for row, user in enumerate(data.train["user_id"]):
        rows_by_role.setdefault(user, []).append(row)
    rng = np.random.default_rng(seed)
    roles = rng.permutation(len(rows_by_role))[:units]
    chosen = [int(rng.choice(list(rows_by_role.values())[r])) for r in roles]
    rows = tokenize_causal_lm(data.train.select(chosen), tokenizer, max_length=args.max_length, keep_columns=())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for ids in rows["input_ids"]:
        model.zero_grad()
        ids = torch.tensor([ids])
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(_flat_grad(params))
    return torch.stack(grads).numpy(), sum(p.numel() for p in params)


# ------------------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------------------


def agreement(directions) -> dict:
    """|mean ĝ| and the mean pairwise cosine of unit directions (n, d): mean_{u≠v} ĝ_u·ĝ_v = (n|mean ĝ|² − 1)/(n − 1)
    (from |Σ ĝ_u|² = n + Σ_{u≠v} ĝ_u·ĝ_v)."""
    n = len(directions)
    mean_norm = float((directions.mean(axis=0) ** 2).sum() ** 0.5)
    return {"units": n, "mean_direction_norm": mean_norm, "mean_pairwise_cosine": (n * mean_norm**2 - 1) / (n - 1)}


def _cross_cosine(a, b) -> float:
    return float(a.mean(axis=0) @ b.mean(axis=0))


def clip_profile(grads, norms, clip_norms: dict, sigma: float, batch: float) -> dict:
    """Per named C: SNR(C)/SNR(0), the absolute SNR(C) with noise multiplier `sigma` and `batch` expected units, the
    clipped fraction and cos(clipped mean, mean gradient) (1: no clipping bias)."""
    import numpy as np

    d = grads.shape[1]
    directions = grads / norms[:, None]
    limit = np.linalg.norm(directions.mean(axis=0))  # |mean ĝ|: C -> 0
    true_mean = grads.mean(axis=0)
    out = {"C->0": {"C": 0.0, "snr_ratio": 1.0, "snr": batch * limit / (sigma * math.sqrt(d)),
                    "clipped_fraction": 1.0, "cos_to_mean_gradient": _cos(directions.mean(axis=0), true_mean)}}
    for name, c in clip_norms.items():
        clipped_mean = (np.minimum(norms / c, 1.0) @ directions) / len(norms)  # mean_u clip_C(g_u) / C
        ratio = float(np.linalg.norm(clipped_mean) / limit)
        out[name] = {"C": float(c), "snr_ratio": ratio, "snr": batch * limit * ratio / (sigma * math.sqrt(d)),
                     "clipped_fraction": float((norms > c).mean()),
                     "cos_to_mean_gradient": _cos(clipped_mean, true_mean)}
    return out


def _cos(a, b) -> float:
    import numpy as np

    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def unit_report(grads, norms, *, study_c: float, sigma: float, batch: float, label: str) -> dict:
    import numpy as np

    median = float(np.median(norms))
    clip_norms = {f"study C = {study_c:g}": study_c, "q0.1": float(np.quantile(norms, 0.1)),
                  "q0.25": float(np.quantile(norms, 0.25)), "median": median,
                  "q0.9": float(np.quantile(norms, 0.9)), "max (no clipping)": float(norms.max())}
    return {"unit": label, "trainable": int(grads.shape[1]), "sigma": sigma, "batch": batch,
            "norm_quantiles": {str(q): float(np.quantile(norms, q)) for q in QUANTILES},
            **agreement(grads / norms[:, None]),
            "norm_direction_correlation": _norm_direction_correlation(grads, norms),
            "clip": clip_profile(grads, norms, clip_norms, sigma, batch)}


def _norm_direction_correlation(grads, norms) -> float:
    """Correlation over units of ‖g_u‖ and ĝ_u·(mean ĝ)/|mean ĝ|: > 0 when the large gradients are the agreeing ones
    (then a larger C weights them up and SNR(C)/SNR(0) falls less)."""
    import numpy as np

    directions = grads / norms[:, None]
    mean = directions.mean(axis=0)
    alignment = directions @ (mean / np.linalg.norm(mean))
    return float(np.corrcoef(norms, alignment)[0, 1])


# ------------------------------------------------------------------------------------------------------------
# Adam with fixed gradients: does a growing C hurt beyond its SNR?
# ------------------------------------------------------------------------------------------------------------


def adaptive_trajectory(norms, *, initial: float, steps: int, batch: float, count_noise: float, rng,
                        quantile: float = 0.5, rate: float = 0.2):
    """C over `steps` steps of private quantile tracking (Poisson samples of the units, the centred count noised with
    `count_noise`, C <- C·exp(−rate·(b̃ − quantile))), with norms that stay those at initialisation."""
    import numpy as np

    q = batch / len(norms)
    c, path = initial, []
    for _ in range(steps):
        path.append(c)
        sampled = norms[rng.random(len(norms)) < q]
        count = float(((sampled <= c) - 0.5).sum()) + rng.normal(0.0, count_noise)
        c *= math.exp(-rate * (count / batch + 0.5 - quantile))
    return np.array(path)


def adam_replay(grads, norms, clip_path, *, sigma: float, batch: float, learning_rate: float, rng, seeds: int = 3,
                betas=(0.9, 0.999), eps=1e-8) -> dict:
    """Adam (linear decay, no weight decay, as the studies train) fed the fixed clipped mean of `grads` at the C of
    each step plus the study's noise N(0, (σC/B)²) per coordinate. Returns, over `seeds` noise draws, the mean of
    cos(−displacement, mean gradient) and of the displacement's norm: the share of the move along the gradient."""
    import numpy as np

    directions = grads / norms[:, None]
    true_mean = grads.mean(axis=0)
    steps, d = len(clip_path), grads.shape[1]
    cosines, lengths = [], []
    for _ in range(seeds):
        m, v, x = np.zeros(d), np.zeros(d), np.zeros(d)
        for t, c in enumerate(clip_path, start=1):
            clipped = c * (np.minimum(norms / c, 1.0) @ directions) / len(norms)  # mean_u clip_C(g_u)
            g = clipped + rng.normal(0.0, sigma * c / batch, d)
            m = betas[0] * m + (1 - betas[0]) * g
            v = betas[1] * v + (1 - betas[1]) * g * g
            update = (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
            x -= learning_rate * (1 - (t - 1) / steps) * update
        cosines.append(_cos(-x, true_mean))
        lengths.append(float(np.linalg.norm(x)))
    return {"cos_move_to_gradient": float(np.mean(cosines)), "cos_sd": float(np.std(cosines)),
            "move_norm": float(np.mean(lengths))}


def adam_report(grads, norms, *, study_c, sigma, batch, count_noise, steps, learning_rate, seed) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    path = adaptive_trajectory(norms, initial=study_c, steps=steps, batch=batch, count_noise=count_noise, rng=rng)
    median = float(np.median(norms))
    runs = {f"fixed C = {study_c:g}": np.full(steps, study_c), f"fixed C = median ({median:.3g})":
            np.full(steps, median), f"adaptive {study_c:g} -> {path[-1]:.3g}": path}
    out = {"adaptive_path": {"start": float(path[0]), "step_10": float(path[min(10, steps - 1)]),
                             "step_30": float(path[min(30, steps - 1)]), "end": float(path[-1])}}
    for name, clip_path in runs.items():
        out[name] = adam_replay(grads, norms, clip_path, sigma=sigma, batch=batch, learning_rate=learning_rate,
                                rng=rng)
    return out


# ------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["classification", "causal_lm"], default="classification")
    parser.add_argument("--lm_units", type=int, default=64, help="causal_lm: speeches (one per proxy role).")
    parser.add_argument("--epsilon", type=float, default=8.0, help="ε of the study run whose σ is used.")
    parser.add_argument("--adam", action="store_true", help="Also replay Adam with fixed and adaptive C.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--log", default="results-tuning/clipping_snr.jsonl")
    args = parser.parse_args(argv)

    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import numpy as np
    import torch
    from causal_lm_tuning import study_noise_multiplier

    from hf_dp.workflows.study_settings import CAUSAL_LM_SETTINGS, DEMO_SETTINGS

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    record = {"task": args.task, "epsilon_of_study": args.epsilon, "seed": args.seed}
    if args.task == "classification":
        dp = DEMO_SETTINGS["dp"]
        batch, steps, study_c = dp["expected_batch_size"], dp["max_steps"], dp["max_grad_norm"]
        count_noise = batch / 20  # the study's σ_b = m/20
        speech_grads, speech_role, role_genre, _ = classification_gradients(dp["contribution_bound"], args.seed)
        roles = np.stack([speech_grads[speech_role == r].mean(axis=0) for r in range(len(role_genre))])
    else:
        dp = CAUSAL_LM_SETTINGS["dp"]
        batch, steps, study_c = dp["expected_batch_size"], dp["max_steps"], dp["max_grad_norm"]
        count_noise = CAUSAL_LM_SETTINGS["adaptive"]["clipping_count_noise"]
        roles, _ = causal_lm_gradients(args.lm_units, args.seed)
    sigma_adaptive, _ = study_noise_multiplier(args.epsilon, batch, steps, count_noise=count_noise)
    record["gradient_seconds"] = round(time.perf_counter() - start, 1)
    norms = np.linalg.norm(roles, axis=1)
    unit = "role (ULS)" if args.task == "classification" else "speech, one per role (ULS, G = 1)"
    record["uls"] = unit_report(roles, norms, study_c=study_c, sigma=sigma_adaptive, batch=batch, label=unit)
    if args.task == "classification":
        directions = roles / norms[:, None]
        dots = {(a, b): _cross_cosine(directions[role_genre == a], directions[role_genre == b])
                for a in range(3) for b in range(a, 3)}
        record["uls"]["genre_mean_direction"] = {f"{a}-{b}": v for (a, b), v in dots.items()}  # mean ĝ_a · mean ĝ_b
        record["uls"]["genre_mean_direction_norm"] = [dots[(g, g)] ** 0.5 for g in range(3)]  # |mean ĝ| in a genre
        record["uls"]["genre_cosine"] = {f"{a}-{b}": dots[(a, b)] / (dots[(a, a)] * dots[(b, b)]) ** 0.5
                                         for a in range(3) for b in range(a + 1, 3)}  # between genre means
        record["uls"]["genre_roles"] = [int((role_genre == g).sum()) for g in range(3)]
        speech_norms = np.linalg.norm(speech_grads, axis=1)
        speech_batch = batch * float(np.minimum(np.bincount(speech_role), dp["contribution_bound"]).mean())
        record["speech"] = unit_report(speech_grads, speech_norms, study_c=study_c, sigma=float("nan"),
                                       batch=speech_batch, label="speech (ELS / example-level)")
    if args.adam:
        record["adam"] = adam_report(roles, norms, study_c=study_c, sigma=sigma_adaptive, batch=batch,
                                     count_noise=count_noise, steps=steps, learning_rate=dp["learning_rate"],
                                     seed=args.seed)
    record["seconds"] = round(time.perf_counter() - start, 1)
    _print(record)
    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(json.dumps(record, default=float) + "\n")  # numpy scalars
    return record


def _print(record: dict) -> None:
    for key in ("uls", "speech"):
        if key not in record:
            continue
        r = record[key]
        print(f"\n{record['task']}: per-{r['unit']} gradients at initialisation, {r['units']} units, "
              f"d = {r['trainable']}, σ = {r['sigma']:.3f}, B = {r['batch']:g}")
        print("  norm quantiles: " + ", ".join(f"{q}: {v:.3g}" for q, v in r["norm_quantiles"].items()))
        print(f"  |mean ĝ| = {r['mean_direction_norm']:.4f}, mean pairwise cosine = {r['mean_pairwise_cosine']:.4f}, "
              f"corr(‖g‖, alignment) = {r['norm_direction_correlation']:.3f}")
        if "genre_mean_direction" in r:
            print(f"  roles per genre (comedy, history, tragedy) {r['genre_roles']}; |mean ĝ| within a genre: "
                  + ", ".join(f"{v:.3f}" for v in r["genre_mean_direction_norm"]) + "; cosine between genre means: "
                  + ", ".join(f"{k}: {v:.3f}" for k, v in r["genre_cosine"].items()))
        print(f"  {'C':>24} {'value':>8} {'clipped':>8} {'SNR/SNR(0)':>11} {'SNR':>9} {'cos(clip mean, mean g)':>23}")
        for name, row in r["clip"].items():
            print(f"  {name:>24} {row['C']:8.3g} {row['clipped_fraction']:8.2f} {row['snr_ratio']:11.3f} "
                  f"{row['snr']:9.4f} {row['cos_to_mean_gradient']:23.3f}")
    if "adam" in record:
        a = record["adam"]
        print(f"\n  Adam replay: adaptive C path {a['adaptive_path']}")
        for name, row in a.items():
            if name != "adaptive_path":
                print(f"  {name:>32}: cos(move, −mean g) = {row['cos_move_to_gradient']:.4f} ± {row['cos_sd']:.4f}, "
                      f"|move| = {row['move_norm']:.3g}")
    print(f"\n{record['seconds']} s; appended to the log")


if __name__ == "__main__":
    main()
