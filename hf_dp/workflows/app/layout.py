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

from .budget import budget_view, study_budget_defaults
from .cards import privacy_card_markdown
from .common import error_md
from .compare import CLASSIFIER_HEADINGS, EXAMPLE_TEXTS, Decoding, compare_layout, compare_steps, preload
from .plot import privacy_utility_figure
from .results import default_run, list_runs, results_overview_markdown
from .training import (
    DEFAULT_TRAIN_TASK,
    TRAIN_LABELS,
    TRAIN_MECHANISMS,
    TRAIN_TASKS,
    TrainingJob,
    TrainingSettings,
    batch_size_label,
    check_settings,
    form_error,
    job_status_markdown,
    progress_html,
    train_description,
)

EPSILON_RANGE = (0.5, 16.0)
# The page's own styles (given to `launch`): tables keep each number on one line and scroll sideways on a phone;
# the ε slider shows no log₂ box; dropdown text stops before the arrow.
APP_CSS = """
#results-overview table { display: block; overflow-x: auto; max-width: 100%; }
#results-overview td, #results-overview th { white-space: nowrap; }
#eps-log2 input[type=number], #eps-log2 .reset-button { display: none !important; }
.gradio-dropdown input, [data-testid="dropdown"] input { padding-right: 2.2em !important; text-overflow: ellipsis; }
"""


def eps_from_log2(value: float) -> float:
    """The ε the log-scale slider stands for (2 ** value, two decimals)."""
    return round(2.0 ** float(value), 2)


def log2_from_eps(value: float | None) -> float:
    """The slider position for ε (clamped to [`EPSILON_RANGE`]; 3, i.e. ε = 8, when unset)."""
    if value is None or not value > 0:
        return 3.0
    return math.log2(min(max(float(value), EPSILON_RANGE[0]), EPSILON_RANGE[1]))


def _budget_tab(gr, demo, results_dir: str) -> None:
    """The Budget tab: the planner's table for the settings on the page, recomputed when one changes."""
    study = study_budget_defaults(results_dir)
    gr.Markdown(f"Opens on the study's budget, from {study['source']}. Every number below is "
                "`hf_dp.mechanism_table.compare`'s.", elem_id="budget-source")
    with gr.Row():
        with gr.Column(scale=1):
            # the slider moves on log₂ ε; its own number box (which would show log₂ ε, "3" beside ε = 8) is
            # hidden by APP_CSS: ε is read and typed in the box below
            eps_log2 = gr.Slider(math.log2(EPSILON_RANGE[0]), math.log2(EPSILON_RANGE[1]),
                                 value=log2_from_eps(study["target_epsilon"]), step=0.05,
                                 label="ε on a log scale: 0.5 … 16 (drag, or type ε below)",
                                 info="0.5 · 1 · 2 · 4 · 8 · 16 at equal steps", elem_id="eps-log2")
            # no minimum/maximum/precision on the boxes: gradio would refuse out-of-range values in a
            # toast and leave the last table on screen; budget_view says what is wrong, in the page
            epsilon = gr.Number(study["target_epsilon"], label="target_epsilon (ε)", step=0.1,
                                elem_id="epsilon")
            delta = gr.Number(study["target_delta"], label="target_delta (δ: below 1/users; below "
                              "1/examples for example-level)", step=1e-5, elem_id="delta")
            unit = gr.Radio(["user", "example"], value=study["privacy_unit"], label="privacy_unit",
                            elem_id="privacy-unit")
            sampling = gr.Radio([("ULS", "uls"), ("ELS", "els")], value=study["sampling"],
                                label="sampling (privacy_unit user)", elem_id="sampling")
            bound = gr.Number(study["contribution_bound"], label="contribution_bound (G: the most rows "
                              "kept per user; empty: the planner recommends one for each ε)",
                              elem_id="contribution-bound")
        with gr.Column(scale=1):
            users = gr.Number(study["users"], label="users", elem_id="users")
            per_user = gr.Number(study["examples_per_user"], label="examples_per_user",
                                 elem_id="examples-per-user")
            per_step = gr.Number(study["examples_per_step"], label="examples_per_step: expected "
                                 "examples processed per step (the compute budget, the same for every "
                                 "mechanism)", elem_id="examples-per-step")
            steps = gr.Number(study["steps"], label="steps", elem_id="steps")
            fixed_sigma = gr.Number(1.0, label="noise_multiplier: a fixed σ (for ‘ε at fixed σ’; empty "
                                    "or 0: not shown)", step=0.05, elem_id="fixed-sigma")
    budget_md = gr.Markdown(elem_id="budget-result")
    budget_table = gr.HTML(elem_id="budget-table")
    budget_state = gr.State(None)

    budget_inputs = [epsilon, delta, unit, sampling, users, per_user, per_step, steps, fixed_sigma,
                     bound]

    def on_budget(*values):
        *inputs, previous = values
        return budget_view(results_dir, *inputs, previous=previous)

    # The slider moves ε (log scale); typing ε moves the slider. Only ε's change recomputes.
    eps_log2.input(eps_from_log2, eps_log2, epsilon, queue=False, show_progress="hidden")
    epsilon.input(log2_from_eps, epsilon, eps_log2, queue=False, show_progress="hidden")
    budget_outputs = [budget_md, budget_table, budget_state]
    for control in budget_inputs:
        control.change(on_budget, budget_inputs + [budget_state], budget_outputs,
                       trigger_mode="always_last", concurrency_id="budget", concurrency_limit=1)
    demo.load(on_budget, budget_inputs + [budget_state], budget_outputs)


def _train_tab(gr, demo, job: TrainingJob, results_dir: str):
    """The Train tab: a short run of the settings on the page; returns its status box (a run's end reloads runs)."""
    train_about = gr.Markdown(train_description(DEFAULT_TRAIN_TASK, results_dir))
    train_task = gr.Radio([(spec["label"], key) for key, spec in TRAIN_TASKS.items()],
                          value=DEFAULT_TRAIN_TASK, label="task", elem_id="train-task")
    defaults = TRAIN_TASKS[DEFAULT_TRAIN_TASK]
    with gr.Row():
        train_mechanism = gr.Radio([(MECHANISMS[key].label, key) for key in TRAIN_MECHANISMS],
                                   value="uls", label=TRAIN_LABELS["mechanism"], elem_id="train-mechanism")
        # plain boxes, no minimum/maximum/precision: every value reaches check_settings, which says in
        # the page what is wrong (gradio's bounds would refuse it in a toast instead)
        train_eps = gr.Number(8.0, label=TRAIN_LABELS["target_epsilon"], elem_id="train-epsilon")
        train_users = gr.Number(defaults["max_train_users"], label=TRAIN_LABELS["max_train_users"],
                                info="roles trained on, 2 or more (the chat study has 817)",
                                elem_id="train-users")
        train_steps = gr.Number(defaults["max_steps"], label=TRAIN_LABELS["max_steps"],
                                info="1 or more; a step takes a few seconds on 2 CPU cores",
                                elem_id="train-steps")
        train_batch = gr.Number(defaults["expected_batch_size"], label=batch_size_label("uls"),
                                elem_id="train-batch")
    start = gr.Button("Start training", variant="primary", elem_id="start-training")
    notice = gr.Markdown(elem_id="train-notice")  # the form's answer to a Start: an error, or "already training"
    progress = gr.HTML(progress_html(job.poll()), elem_id="train-progress-box")
    train_status = gr.Markdown(job_status_markdown(job.poll()), elem_id="train-status")
    timer = gr.Timer(1.0, active=job.running)

    def on_task(task):
        spec = TRAIN_TASKS[task]
        return (train_description(task, results_dir), spec["max_train_users"], spec["max_steps"],
                spec["expected_batch_size"])

    def on_start(task, mechanism, eps, n_users, n_steps, batch):
        """Every setting checked before a run starts (the form's values, then the trainer's
        arguments); the data-dependent plan is checked in the run, before the model loads. A Start during a run
        is answered in words; a form error clears a failed run's bar."""
        if job.running:
            state = job.poll()
            return progress_html(state), job_status_markdown(state), error_md(job.busy_message()), gr.Timer(
                active=True)
        try:
            # the values as typed: TrainingSettings refuses an empty box, 0, NaN or a fraction
            settings = TrainingSettings(task=task, mechanism=mechanism, target_epsilon=eps,
                                        max_train_users=n_users, max_steps=n_steps,
                                        expected_batch_size=batch)
            check_settings(settings, results_dir)
            job.start(settings, results_dir)
        except Exception as error:  # one line in the page, in the form's words
            message = form_error(error, mechanism if mechanism in MECHANISMS else None)
            job.dismiss_failure()
            state = job.poll()
            return progress_html(state), job_status_markdown(state), error_md(message), gr.Timer(active=job.running)
        return progress_html(job.poll()), "", "", gr.Timer(active=True)

    def on_tick():
        """The run's progress; once it ends, an "already training" answer on the page is stale and goes."""
        state = job.poll()
        active = state.get("status") in ("starting", "checking", "loading", "training")
        return progress_html(state), job_status_markdown(state), gr.skip() if active else "", gr.Timer(active=active)

    train_task.change(on_task, train_task, [train_about, train_users, train_steps, train_batch],
                      queue=False, show_progress="hidden")
    train_mechanism.change(lambda key: gr.Number(label=batch_size_label(key)), train_mechanism,
                           train_batch, queue=False, show_progress="hidden")
    start.click(on_start, [train_task, train_mechanism, train_eps, train_users, train_steps, train_batch],
                [progress, train_status, notice, timer])
    timer.tick(on_tick, None, [progress, train_status, notice, timer])
    demo.load(on_tick, None, [progress, train_status, notice, timer])  # a reloaded page shows the run as it stands
    return train_status


def _compare_outputs(gr, out: dict) -> tuple:
    """The Compare tab's components' values for one of `compare_steps`' outputs."""
    lm = bool(out.get("language_model"))
    columns = list(out.get("columns") or []) + [None] * 3
    headings = ([c["heading"] if c else "" for c in columns[:3]] if lm
                else list(CLASSIFIER_HEADINGS) + [""])
    return (out["error"] or out["header"], *headings, gr.Column(visible=lm and bool(columns[2])),
            gr.Label(value=out.get("baseline"), visible=not lm),
            gr.Label(value=out.get("dp"), visible=not lm),
            *[gr.Textbox(value=c["text"] if c else "", visible=lm) for c in columns[:3]],
            out.get("decoding", ""))


def _compare_tab(gr, results_dir: str):
    """The Compare tab: the baseline's, the DP run's and the non-private run's outputs on one text; returns its
    run dropdown and its reload button."""
    with gr.Row():
        compare_run = gr.Dropdown(choices=[], label="fine-tuned run", elem_id="compare-run", scale=3)
        refresh = gr.Button("Reload runs", scale=1)
    opening = compare_layout(results_dir, None)  # the default run's kind: no other kind's placeholders
    lm_open = opening["language_model"]
    compare_text = gr.Textbox(EXAMPLE_TEXTS[0], lines=2, elem_id="compare-text",
                              label=opening["text_label"])
    gr.Examples([[t] for t in EXAMPLE_TEXTS], [compare_text], label="pick a text")
    with gr.Accordion("Decoding: the same for every column", open=True, visible=lm_open,
                      elem_id="compare-decoding-settings") as decoding_settings:
        with gr.Row():
            # no minimum/maximum/precision: Decoding says what is wrong, in the page, not in a toast
            seed = gr.Number(0, label="seed (torch.manual_seed before each generation)",
                             elem_id="compare-seed")
            max_new_tokens = gr.Number(Decoding.max_new_tokens, label="max_new_tokens",
                                       elem_id="compare-max-new-tokens")
            temperature = gr.Number(Decoding.temperature, label="temperature (0: greedy)", step=0.1,
                                    elem_id="compare-temperature")
            top_p = gr.Number(Decoding.top_p, label="top_p", step=0.05, elem_id="compare-top-p")
    compare_button = gr.Button("Compare / generate", variant="primary", elem_id="compare-button")
    compare_header = gr.Markdown(elem_id="compare-header")
    with gr.Row():
        with gr.Column():
            baseline_heading = gr.Markdown(opening["headings"][0], elem_id="baseline-heading")
            baseline_label = gr.Label(label="baseline: class probabilities", num_top_classes=5,
                                      visible=not lm_open, elem_id="baseline-label")
            baseline_text = gr.Textbox(label="generation", visible=lm_open, lines=6,
                                       elem_id="baseline-text")
        with gr.Column():
            dp_heading = gr.Markdown(opening["headings"][1], elem_id="dp-heading")
            dp_label = gr.Label(label="fine-tuned model: class probabilities", num_top_classes=5,
                                visible=not lm_open, elem_id="dp-label")
            dp_text = gr.Textbox(label="generation", visible=lm_open, lines=6, elem_id="dp-text")
        with gr.Column(visible=bool(opening["headings"][2])) as non_private_column:
            non_private_heading = gr.Markdown(opening["headings"][2], elem_id="non-private-heading")
            non_private_text = gr.Textbox(label="generation", lines=6, elem_id="non-private-text")
    decoding_md = gr.Markdown(elem_id="compare-decoding")

    def on_compare(run_name, text, seed_value, new_tokens, temp, nucleus):
        # a generator: the page shows each column's progress, and each text as soon as it is there
        try:
            decoding = Decoding(seed=seed_value, max_new_tokens=new_tokens, temperature=temp,
                                top_p=nucleus)
        except Exception as error:
            yield _compare_outputs(gr, {"error": error_md(error), "header": ""})
            return
        for out in compare_steps(results_dir, run_name, text, decoding):
            yield _compare_outputs(gr, out)

    def on_compare_run(run_name):
        """A run picked: the columns of its kind (headings, no generations yet); its models load in the
        background."""
        shown = compare_layout(results_dir, run_name)
        lm = shown["language_model"]
        preload(results_dir, run_name)
        return (shown["error"], *shown["headings"], gr.Column(visible=bool(shown["headings"][2])),
                gr.Label(value=None, visible=not lm), gr.Label(value=None, visible=not lm),
                *[gr.Textbox(value="", visible=lm) for _ in range(3)], "",
                gr.Textbox(label=shown["text_label"]), gr.Accordion(visible=lm))

    compare_components = [compare_header, baseline_heading, dp_heading, non_private_heading,
                          non_private_column, baseline_label, dp_label, baseline_text, dp_text,
                          non_private_text, decoding_md]
    compare_button.click(on_compare, [compare_run, compare_text, seed, max_new_tokens, temperature, top_p],
                         compare_components, show_progress="minimal")
    compare_run.change(on_compare_run, compare_run,
                       compare_components + [compare_text, decoding_settings], show_progress="hidden")
    return compare_run, refresh


def _results_tab(gr, results_dir: str):
    """The Results tab: the study's table and plot, and each run's privacy card; returns what a reload fills."""
    overview = gr.Markdown(elem_id="results-overview")
    plot = gr.Plot(label="privacy / utility", elem_id="privacy-utility-plot")
    card_run = gr.Dropdown(choices=[], label="privacy card of run", elem_id="card-run")
    card_md = gr.Markdown(elem_id="privacy-card")

    card_run.change(lambda name: privacy_card_markdown(results_dir, name), card_run, card_md)
    return overview, plot, card_run


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
            with gr.Tab("Budget", id="budget"):
                _budget_tab(gr, demo, results_dir)
            with gr.Tab("Train", id="train"):
                train_status = _train_tab(gr, demo, job, results_dir)
            with gr.Tab("Compare", id="compare"):
                compare_run, refresh = _compare_tab(gr, results_dir)
            with gr.Tab("Results", id="results"):
                overview, plot, card_run = _results_tab(gr, results_dir)

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
