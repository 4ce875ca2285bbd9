"""The page: four tabs wired to the functions of [`budget`], [`training`], [`compare`], [`results`] and [`cards`].

Nothing here computes: each event handler calls one function of a tab's module and puts what it returns in the
page. Inputs a user types carry the [`~hf_dp.DPTrainingArguments`] field names (`target_epsilon`, `target_delta`,
`privacy_unit`, `sampling`, `expected_batch_size`) and the planner's (`users`, `examples_per_user`,
`examples_per_step`, `steps`, `noise_multiplier`).
"""

from __future__ import annotations

import math
import os

from hf_dp.vocabulary import MECHANISMS

from .budget import budget_view
from .cards import privacy_card_markdown
from .common import error_md, one_line
from .compare import EXAMPLE_TEXTS, MAX_NEW_TOKENS, Decoding, compare_view
from .plot import privacy_utility_figure
from .results import default_run, list_runs, results_overview_markdown
from .training import (
    TRAIN_MECHANISMS,
    TRAIN_TASKS,
    TrainingJob,
    TrainingSettings,
    batch_size_label,
    job_status_markdown,
    progress_html,
    train_description,
)

EPSILON_RANGE = (0.5, 16.0)
# The Compare tab's column headings for a classifier (a language model's come with its columns).
CLASSIFIER_HEADINGS = ("#### Public-only baseline (no private data)", "#### Fine-tuned model")


def eps_from_log2(value: float) -> float:
    """The ε the log-scale slider stands for (2 ** value, two decimals)."""
    return round(2.0 ** float(value), 2)


def log2_from_eps(value: float | None) -> float:
    """The slider position for ε (clamped to [`EPSILON_RANGE`]; 3, i.e. ε = 8, when unset)."""
    if value is None or not value > 0:
        return 3.0
    return math.log2(min(max(float(value), EPSILON_RANGE[0]), EPSILON_RANGE[1]))


def build_app(results_dir: str | os.PathLike = "results", *, training_job: TrainingJob | None = None):
    """Build the Gradio page over `results_dir` (finished runs are read from disk at each action).

    Args:
        results_dir (`str` or `os.PathLike`, *optional*, defaults to `"results"`): the study's output folder.
        training_job ([`TrainingJob`], *optional*): the Train tab's runner (tests pass one with a fake run).

    Returns:
        `gradio.Blocks`: call `.launch()` on it, or use [`hf_dp.workflows.app.serve`].
    """
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no version check, no telemetry
    import gradio as gr

    results_dir = str(results_dir)
    job = training_job or TrainingJob()

    with gr.Blocks(title="hf_dp: user-level DP fine-tuning", analytics_enabled=False) as demo:
        gr.Markdown(
            "# hf_dp — user-level differentially private fine-tuning\n"
            f"Results folder: `{results_dir}`. Set a privacy budget, train a short run, compare the DP model's "
            "outputs with the public-only baseline's, and read each run's privacy card."
        )
        with gr.Tabs():
            # ---- Budget -------------------------------------------------------------------------
            with gr.Tab("Budget", id="budget"):
                with gr.Row():
                    with gr.Column(scale=1):
                        eps_log2 = gr.Slider(math.log2(EPSILON_RANGE[0]), math.log2(EPSILON_RANGE[1]), value=3.0,
                                             step=0.05, label="log₂ ε (slider: 0.5 … 16)",
                                             info="−1 → ε 0.5, 0 → 1, 1.58 → 3, 3 → 8, 4 → 16",
                                             elem_id="eps-log2")
                        epsilon = gr.Number(8.0, label="target_epsilon (ε)", step=0.1, elem_id="epsilon")
                        delta = gr.Number(1e-5, label="target_delta (δ: below 1/users; below 1/examples for "
                                          "example-level)", step=1e-6, elem_id="delta")
                        unit = gr.Radio(["user", "example"], value="user", label="privacy_unit",
                                        elem_id="privacy-unit")
                        sampling = gr.Radio([("ULS", "uls"), ("ELS", "els")], value="uls",
                                            label="sampling (privacy_unit user)", elem_id="sampling")
                    with gr.Column(scale=1):
                        users = gr.Number(1101, label="users", precision=0, minimum=1, elem_id="users")
                        per_user = gr.Number(14, label="examples_per_user", precision=0, minimum=1,
                                             elem_id="examples-per-user")
                        per_step = gr.Number(175, label="examples_per_step: expected examples processed per step "
                                             "(the compute budget, the same for every mechanism)", minimum=1,
                                             elem_id="examples-per-step")
                        steps = gr.Number(40, label="steps", precision=0, minimum=1, elem_id="steps")
                        fixed_sigma = gr.Number(1.0, label="noise_multiplier: a fixed σ (for ‘ε at fixed σ’)",
                                                minimum=0, step=0.05, elem_id="fixed-sigma")
                budget_md = gr.Markdown(elem_id="budget-result")
                budget_table = gr.Markdown(elem_id="budget-table")

                budget_inputs = [epsilon, delta, unit, sampling, users, per_user, per_step, steps, fixed_sigma]

                def on_budget(*values):
                    return budget_view(results_dir, *values)

                # The slider moves ε (log scale); typing ε moves the slider. Only ε's change recomputes.
                eps_log2.input(eps_from_log2, eps_log2, epsilon, queue=False, show_progress="hidden")
                epsilon.input(log2_from_eps, epsilon, eps_log2, queue=False, show_progress="hidden")
                for control in budget_inputs:
                    control.change(on_budget, budget_inputs, [budget_md, budget_table], trigger_mode="always_last",
                                   concurrency_id="budget", concurrency_limit=1)
                demo.load(on_budget, budget_inputs, [budget_md, budget_table])

            # ---- Train --------------------------------------------------------------------------
            with gr.Tab("Train", id="train"):
                train_about = gr.Markdown(train_description("chat-sft", results_dir))
                train_task = gr.Radio([(spec["label"], key) for key, spec in TRAIN_TASKS.items()], value="chat-sft",
                                      label="task", elem_id="train-task")
                defaults = TRAIN_TASKS["chat-sft"]
                with gr.Row():
                    train_mechanism = gr.Radio([(MECHANISMS[key].label, key) for key in TRAIN_MECHANISMS],
                                               value="uls", label="mechanism", elem_id="train-mechanism")
                    train_eps = gr.Number(8.0, label="target_epsilon", minimum=0.1, elem_id="train-epsilon")
                    train_users = gr.Slider(16, 512, value=defaults["max_train_users"], step=8,
                                            label="training users (subset)", elem_id="train-users")
                    train_steps = gr.Slider(1, 50, value=defaults["max_steps"], step=1, label="max_steps",
                                            elem_id="train-steps")
                    train_batch = gr.Number(defaults["expected_batch_size"], label=batch_size_label("uls"),
                                            precision=0, minimum=1, elem_id="train-batch")
                start = gr.Button("Start training", variant="primary", elem_id="start-training")
                progress = gr.HTML(progress_html(job.poll()), elem_id="train-progress-box")
                train_status = gr.Markdown(job_status_markdown(job.poll()), elem_id="train-status")
                timer = gr.Timer(1.0, active=job.running)

                def on_task(task):
                    spec = TRAIN_TASKS[task]
                    return (train_description(task, results_dir), spec["max_train_users"], spec["max_steps"],
                            spec["expected_batch_size"])

                def on_start(task, mechanism, eps, n_users, n_steps, batch):
                    try:
                        # the values as typed: TrainingSettings refuses an empty box, 0, NaN or a fraction
                        settings = TrainingSettings(task=task, mechanism=mechanism, target_epsilon=eps,
                                                    max_train_users=n_users, max_steps=n_steps,
                                                    expected_batch_size=batch)
                        job.start(settings, results_dir)
                    except Exception as error:
                        gr.Warning(one_line(error))
                        return progress_html(job.poll()), error_md(error), gr.Timer(active=job.running)
                    return progress_html(job.poll()), "", gr.Timer(active=True)

                def on_tick():
                    state = job.poll()
                    active = state.get("status") in ("starting", "training")
                    return progress_html(state), job_status_markdown(state), gr.Timer(active=active)

                train_task.change(on_task, train_task, [train_about, train_users, train_steps, train_batch],
                                  queue=False, show_progress="hidden")
                train_mechanism.change(lambda key: gr.Number(label=batch_size_label(key)), train_mechanism,
                                       train_batch, queue=False, show_progress="hidden")
                start.click(on_start, [train_task, train_mechanism, train_eps, train_users, train_steps, train_batch],
                            [progress, train_status, timer])
                timer.tick(on_tick, None, [progress, train_status, timer])

            # ---- Compare ------------------------------------------------------------------------
            with gr.Tab("Compare", id="compare"):
                with gr.Row():
                    compare_run = gr.Dropdown(choices=[], label="fine-tuned run", elem_id="compare-run", scale=3)
                    refresh = gr.Button("Reload runs", scale=1)
                compare_text = gr.Textbox(EXAMPLE_TEXTS[0], lines=2, elem_id="compare-text",
                                          label="text: a classifier labels it, a language model replies to it")
                gr.Examples([[t] for t in EXAMPLE_TEXTS], [compare_text], label="pick a text")
                with gr.Accordion("Decoding (language models): the same for every column", open=True):
                    with gr.Row():
                        seed = gr.Number(0, label="seed (torch.manual_seed before each generation)", precision=0,
                                         minimum=0, elem_id="compare-seed")
                        max_new_tokens = gr.Number(Decoding.max_new_tokens, label="max_new_tokens", precision=0,
                                                   minimum=1, maximum=MAX_NEW_TOKENS, elem_id="compare-max-new-tokens")
                        temperature = gr.Number(Decoding.temperature, label="temperature (0: greedy)", minimum=0,
                                                step=0.1, elem_id="compare-temperature")
                        top_p = gr.Number(Decoding.top_p, label="top_p", minimum=0.01, maximum=1, step=0.05,
                                          elem_id="compare-top-p")
                compare_button = gr.Button("Compare / generate", variant="primary", elem_id="compare-button")
                compare_header = gr.Markdown(elem_id="compare-header")
                with gr.Row():
                    with gr.Column():
                        baseline_heading = gr.Markdown(CLASSIFIER_HEADINGS[0], elem_id="baseline-heading")
                        baseline_label = gr.Label(label="baseline: class probabilities", num_top_classes=5,
                                                  elem_id="baseline-label")
                        baseline_text = gr.Textbox(label="generation", visible=False, lines=6,
                                                   elem_id="baseline-text")
                    with gr.Column():
                        dp_heading = gr.Markdown(CLASSIFIER_HEADINGS[1], elem_id="dp-heading")
                        dp_label = gr.Label(label="fine-tuned model: class probabilities", num_top_classes=5,
                                            elem_id="dp-label")
                        dp_text = gr.Textbox(label="generation", visible=False, lines=6, elem_id="dp-text")
                    with gr.Column(visible=False) as non_private_column:
                        non_private_heading = gr.Markdown(elem_id="non-private-heading")
                        non_private_text = gr.Textbox(label="generation", lines=6, elem_id="non-private-text")
                decoding_md = gr.Markdown(elem_id="compare-decoding")

                def on_compare(run_name, text, seed_value, new_tokens, temp, nucleus):
                    try:
                        decoding = Decoding(seed=seed_value, max_new_tokens=new_tokens, temperature=temp,
                                            top_p=nucleus)
                    except Exception as error:
                        out = {"error": error_md(error)}
                    else:
                        out = compare_view(results_dir, run_name, text, decoding)
                    lm = bool(out.get("language_model"))
                    columns = list(out.get("columns") or []) + [None] * 3
                    headings = ([c["heading"] if c else "" for c in columns[:3]] if lm
                                else list(CLASSIFIER_HEADINGS) + [""])
                    return (out["error"] or out["header"], *headings, gr.Column(visible=lm and bool(columns[2])),
                            gr.Label(value=out.get("baseline"), visible=not lm),
                            gr.Label(value=out.get("dp"), visible=not lm),
                            *[gr.Textbox(value=c["text"] if c else "", visible=lm) for c in columns[:3]],
                            out.get("decoding", ""))

                compare_button.click(on_compare, [compare_run, compare_text, seed, max_new_tokens, temperature, top_p],
                                     [compare_header, baseline_heading, dp_heading, non_private_heading,
                                      non_private_column, baseline_label, dp_label, baseline_text, dp_text,
                                      non_private_text, decoding_md])

            # ---- Results ------------------------------------------------------------------------
            with gr.Tab("Results", id="results"):
                overview = gr.Markdown(elem_id="results-overview")
                plot = gr.Plot(label="privacy / utility", elem_id="privacy-utility-plot")
                card_run = gr.Dropdown(choices=[], label="privacy card of run", elem_id="card-run")
                card_md = gr.Markdown(elem_id="privacy-card")

                card_run.change(lambda name: privacy_card_markdown(results_dir, name), card_run, card_md)

        def on_reload():
            runs = list_runs(results_dir)
            with_model = [(r.label(), r.name) for r in runs if r.model_path is not None]
            default = default_run(runs)
            dp_first = default.name if default is not None else None
            try:
                figure = privacy_utility_figure(runs)
            except Exception:  # a plot is decoration: the table still shows the numbers
                figure = None
            return (gr.Dropdown(choices=with_model, value=dp_first),
                    gr.Dropdown(choices=with_model, value=dp_first),
                    results_overview_markdown(results_dir), figure)

        reload_outputs = [compare_run, card_run, overview, plot]
        demo.load(on_reload, None, reload_outputs)
        refresh.click(on_reload, None, reload_outputs)
        train_status.change(on_reload, None, reload_outputs)
    return demo
