"""The Gradio app in a real browser: Debian's chromium, headless, driven by Playwright, against 127.0.0.1.

Checks that the page loads, that moving the budget controls changes the planner's numbers (and that a bad or
out-of-range budget is said in the page, with no σ table left from the last one), that no number of the table is
split over two lines at 390 px, that the Train tab labels `expected_batch_size` in the unit of the picked
mechanism, that a comparison renders on a fabricated run (a language model's with none of a classifier's
placeholders), and that the Results tab shows the plot and the privacy card. Screenshots go to the test's tmp dir
(and to `$HF_DP_SCREENSHOT_DIR` when set). Requests to anything but the local server are blocked and recorded: the
page must not need the network.

Needs `/usr/bin/chromium` (`apt-get install chromium chromium-driver`; `.ci/run` installs it). Without it the
test fails, it does not skip.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest

from app_fixtures import make_results_dir
from hf_dp.formatting import format_epsilon
from hf_dp.vocabulary import MECHANISMS
from hf_dp.workflows import app
from hf_dp.workflows.app.training import run_app_training

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("HF_DP_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
TIMEOUT_MS = 60_000  # the planner takes about a second per update on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    results = make_results_dir(tmp_path_factory.mktemp("browser-results"))
    port = free_port()
    demo = app.serve(results, host="127.0.0.1", port=port, block=False)
    yield f"http://127.0.0.1:{port}/", results
    demo.close()


@pytest.fixture(scope="module")
def lm_server(tmp_path_factory):
    """An empty results folder; the Train tab's real chat run (SmolLM2, DPSFTTrainer), its test set cut to 4 rows."""
    results = tmp_path_factory.mktemp("browser-lm-results")

    def run_fn(settings, results_dir, callbacks):
        return run_app_training(dataclasses.replace(settings, max_eval_examples=4), results_dir, callbacks)

    port = free_port()
    demo = app.serve(results, host="127.0.0.1", port=port, block=False,
                     demo=app.build_app(results, training_job=app.TrainingJob(run_fn=run_fn)))
    yield f"http://127.0.0.1:{port}/", results
    demo.close()


@pytest.fixture
def page():
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium chromium-driver) "
                    "or set HF_DP_CHROMIUM to a Chromium binary. The browser test does not skip.")
    from playwright.sync_api import sync_playwright

    blocked = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 1000})

        def only_local(route):
            if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
                return route.continue_()
            blocked.append(route.request.url)
            return route.abort()

        context.route("**/*", only_local)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.blocked_requests = blocked
        yield page
        context.close()
        browser.close()


def screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    extra = os.environ.get("HF_DP_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)
    return path


def sigma_text(page) -> str:
    text = page.locator("#budget-result").inner_text()
    match = re.search(r"σ = ([0-9.]+)", text)
    return match.group(1) if match else ""


def wait_for_sigma_change(page, old: str) -> str:
    page.wait_for_function(
        """old => { const t = document.querySelector('#budget-result')?.innerText || '';
                    const m = t.match(/σ = ([0-9.]+)/); return m && m[1] !== old; }""", arg=old)
    return sigma_text(page)


def wait_for_text(page, selector: str, text: str) -> None:
    page.wait_for_function("([sel, text]) => (document.querySelector(sel)?.innerText || '').includes(text)",
                           arg=[selector, text])


def pick_run(page, name: str) -> None:
    page.locator("#compare-run input").click()
    pattern = re.escape(name).replace("/", r"\/")  # Playwright writes the pattern between slashes
    page.get_by_role("option", name=re.compile(pattern + " ")).click()


def test_app_in_headless_chromium(server, page, tmp_path):
    url, results = server
    page.goto(url)
    page.get_by_text("user-level differentially private fine-tuning").first.wait_for()

    # --- Budget: the planner's numbers appear and follow the controls ---------------------------
    page.wait_for_function("() => /σ = [0-9.]+/.test(document.querySelector('#budget-result')?.innerText || '')")
    sigma_8 = sigma_text(page)
    users = page.locator("#users input").input_value()
    assert "Measured accuracy at ε = 8" in page.locator("#budget-result").inner_text()
    assert "expected_batch_size" in page.locator("#budget-result").inner_text()
    assert MECHANISMS["els"].label in page.locator("#budget-table").inner_text()
    # the Budget opens on the study's numbers, and its slider shows no log₂ ε box beside ε
    from hf_dp.workflows.app.budget import study_budget_defaults

    study = study_budget_defaults(results)
    assert float(page.locator("#examples-per-user input").input_value()) == study["examples_per_user"]
    assert not page.locator("#eps-log2 input[type=number]").is_visible()
    assert "log₂" not in page.locator("#eps-log2").inner_text()

    page.locator("#eps-log2 input[type=range]").fill("0")  # slider to log₂ ε = 0, i.e. ε = 1
    sigma_1 = wait_for_sigma_change(page, sigma_8)
    assert float(sigma_1) > float(sigma_8)  # more privacy, more noise
    assert page.locator("#epsilon input").input_value() in ("1", "1.0")

    page.locator("#sampling").get_by_text("ELS").click()
    sigma_els = wait_for_sigma_change(page, sigma_1)
    assert MECHANISMS["els"].name in page.locator("#budget-result").inner_text()
    assert "examples per step" in page.locator("#budget-result").inner_text()
    screenshot(page, tmp_path, "budget")

    page.locator("#delta input").fill("0.5")
    page.locator("#delta input").press("Tab")
    wait_for_text(page, "#budget-result", "⚠️")
    error_text = page.locator("#budget-result").inner_text()
    assert "delta" in error_text and "Traceback" not in page.content()
    # the reason is in the page, and the σ table of the last good budget is gone (not left under a toast)
    assert page.locator("#budget-table").inner_text().strip() == "" and not page.locator(".toast-body").count()
    screenshot(page, tmp_path, "budget-error")
    page.locator("#users input").fill("-5")  # out of range: said in the page too, no toast
    page.locator("#users input").press("Tab")
    wait_for_text(page, "#budget-result", "users = -5")
    assert page.locator("#budget-table").inner_text().strip() == "" and not page.locator(".toast-body").count()
    page.locator("#users input").fill(str(users))
    page.locator("#users input").press("Tab")
    page.locator("#delta input").fill("0.0001")
    page.locator("#delta input").press("Tab")
    assert wait_for_sigma_change(page, "")  # numbers are back
    assert sigma_els and re.search(r"σ = [0-9.]+ at G = \d+", page.locator("#budget-result").inner_text())

    # on a phone (390 px) no number in the table is split over two lines: the table scrolls sideways instead
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(500)
    split = page.evaluate("""() => [...document.querySelectorAll('#budget-table .num')]
        .filter(n => n.getClientRects().length !== 1 || n.getBoundingClientRect().height > 1.6 *
                parseFloat(getComputedStyle(n).lineHeight || '20'))
        .map(n => n.innerText)""")
    assert page.locator("#budget-table .num").count() >= 20 and split == [], split
    screenshot(page, tmp_path, "budget-phone")
    page.set_viewport_size({"width": 1280, "height": 1000})

    # --- Train: expected_batch_size is labelled in the unit the picked mechanism samples ----------
    page.get_by_role("tab", name="Train").click()
    wait_for_text(page, "#train-batch", "users per step")
    page.locator("#train-mechanism").get_by_text(MECHANISMS["els"].label).click()
    wait_for_text(page, "#train-batch", "examples per step")

    # --- Compare: baseline and DP model side by side on a fabricated run ------------------------
    page.get_by_role("tab", name="Compare").click()
    pick_run(page, "els-eps8")
    wait_for_text(page, "#compare-text", "class probabilities")  # a classifier's words, no decoding settings
    assert not page.locator("#compare-decoding-settings").is_visible()
    page.locator("#compare-text textarea").fill("Once more unto the breach, dear friends")
    page.locator("#compare-button").click()
    wait_for_text(page, "#compare-header", "els-eps8")
    for side in ("#baseline-label", "#dp-label"):
        text = page.locator(side).inner_text()
        assert all(label in text for label in ("comedy", "history", "tragedy")), text
        assert "%" in text
    page.wait_for_timeout(1000)  # let the output fade-in finish before the screenshot
    screenshot(page, tmp_path, "compare")

    pick_run(page, "lm-uls-eps8")  # a causal LM: generations side by side
    page.locator("#compare-button").click()
    wait_for_text(page, "#compare-header", "lm-uls-eps8")
    page.locator("#dp-text textarea").wait_for()
    assert page.locator("#baseline-text textarea").is_visible()
    # a language model's columns only: none of a classifier's placeholders
    assert not page.locator("#baseline-label").is_visible() and not page.locator("#dp-label").is_visible()
    assert "no private data" in page.locator("#baseline-heading").inner_text()
    assert "Fine-tuned model" not in page.locator("#dp-heading").inner_text()
    assert "continues it" in page.locator("#compare-text").inner_text()
    assert page.locator("#compare-decoding-settings").is_visible()

    # --- Results: the plot and the rendered privacy card -----------------------------------------
    page.get_by_role("tab", name="Results").click()
    page.locator("#privacy-utility-plot img, #privacy-utility-plot svg").first.wait_for()
    page.wait_for_timeout(1000)
    wait_for_text(page, "#privacy-card", "Privacy guarantee")
    assert "uls-eps8" in page.locator("#results-overview").inner_text()
    screenshot(page, tmp_path, "results")

    assert page.blocked_requests == [], f"the page tried to reach the network: {page.blocked_requests}"


def textarea_filled(page, selector: str) -> str:
    page.wait_for_function("sel => (document.querySelector(sel)?.value || '').trim().length > 0", arg=selector,
                           timeout=120_000)  # loading two SmolLM2s and generating on a busy 2-core machine
    return page.locator(selector).input_value()


@pytest.mark.slow
def test_train_a_chat_model_then_compare_its_generations(lm_server, page, tmp_path):
    """Train tab: a real DP chat SFT run of SmolLM2 (2 steps, 16 roles) with live ε; Compare: the untouched
    SmolLM2's and the DP model's replies to a typed prompt, side by side, with the same seeded sampling."""
    url, results = lm_server
    page.goto(url)
    page.get_by_role("tab", name="Train").click()
    assert page.locator("#train-task").get_by_label(re.compile("Chat SFT")).is_checked()  # the default task
    for box, value in (("#train-users", "16"), ("#train-steps", "2")):
        page.locator(f"{box} input[type=number]").fill(value)
        page.locator(f"{box} input[type=number]").press("Tab")
    page.locator("#train-batch input").fill("4")
    page.locator("#train-batch input").press("Tab")
    page.locator("#start-training").click()
    page.wait_for_function("() => /Finished|Failed|⚠️/.test(document.querySelector('#train-status')?.innerText "
                           "|| '') || /⚠️/.test(document.querySelector('#train-notice')?.innerText || '')",
                           timeout=240_000)
    status = page.locator("#train-status").inner_text()
    assert "Finished" in status and "completion perplexity" in status, status
    progress = page.locator("#train-progress").inner_text()
    assert "step 2/2" in progress and re.search(r"ε spent [0-9.]+ of 8", progress), progress
    result = app.list_runs(results)[0].result
    assert result["task"] == "chat-sft" and result["config"]["expected_batch_size"] == 4
    assert result["epsilon"] <= 8.0 and result["config"]["max_steps"] == 2
    screenshot(page, tmp_path, "train-chat")

    page.get_by_role("tab", name="Compare").click()
    pick_run(page, f"{app.APP_RUNS_DIR}/{result['run']}")
    prompt = "Good morrow, sweet lady. Wilt thou walk with me tonight?"
    page.locator("#compare-text textarea").fill(prompt)
    page.locator("#compare-max-new-tokens input").fill("16")
    page.locator("#compare-button").click()
    texts = {side: textarea_filled(page, f"#{side}-text textarea") for side in ("baseline", "dp")}
    for side, text in texts.items():
        assert text.strip() and text.strip() != prompt and "⚠️" not in text, (side, text)
    assert "no private data" in page.locator("#baseline-heading").inner_text()
    assert "user message" in page.locator("#compare-text").inner_text()
    assert not page.locator("#baseline-label").is_visible()
    dp_heading = page.locator("#dp-heading").inner_text()
    # ε spent, rounded up as the card does (never below what was spent: 7.9946 reads 8.00)
    assert result["run"] in dp_heading and f"ε = {format_epsilon(result['epsilon'])}," in dp_heading, dp_heading
    assert "completion perplexity" in dp_heading
    assert not page.locator("#non-private-text").is_visible()  # no non-private run in this folder
    decoding = page.locator("#compare-decoding").inner_text()
    assert "seed 0" in decoding and "chat template" in decoding and "16 new tokens" in decoding
    page.wait_for_timeout(500)
    screenshot(page, tmp_path, "compare-chat")
    assert page.blocked_requests == [], f"the page tried to reach the network: {page.blocked_requests}"


@pytest.fixture
def held_run_server(tmp_path):
    """A Train tab whose run (a fake: no model) takes one step, then waits for the test's signal and fails."""
    import threading
    from types import SimpleNamespace

    release = threading.Event()

    def run_fn(settings, results_dir, callbacks):
        for step in (0, 1):
            for callback in callbacks:
                callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=3), None)
        release.wait(timeout=120)
        raise ValueError("the fake run failed after its first step")

    results = make_results_dir(tmp_path / "results")
    port = free_port()
    demo = app.serve(results, host="127.0.0.1", port=port, block=False,
                     demo=app.build_app(results, training_job=app.TrainingJob(run_fn=run_fn)))
    yield f"http://127.0.0.1:{port}/", release
    release.set()
    demo.close()


def test_a_train_run_survives_a_reload_a_second_start_is_answered_and_a_failure_clears(held_run_server, page):
    """Reloading during a run shows its progress (not "No run started."); a second Start is answered in words;
    a failed run's clock stops; the next form error replaces the failed bar."""
    url, release = held_run_server
    page.goto(url)
    page.get_by_role("tab", name="Train").click()
    page.locator("#start-training").click()
    wait_for_text(page, "#train-progress", "step 1/3")
    page.reload()
    page.get_by_role("tab", name="Train").click()
    wait_for_text(page, "#train-progress", "step 1/3")  # the page reloaded finds the run where it is
    assert "No run started" not in page.locator("#train-progress").inner_text()
    page.locator("#start-training").click()
    wait_for_text(page, "#train-notice", "A run is already training (step 1/3)")
    release.set()
    wait_for_text(page, "#train-progress", "Failed")
    assert "the fake run failed after its first step" in page.locator("#train-status").inner_text()
    page.wait_for_function("() => !(document.querySelector('#train-notice')?.innerText || '').includes('already')")
    clock = re.search(r"\((\d+) s\)", page.locator("#train-progress").inner_text()).group(1)
    page.wait_for_timeout(2500)
    assert re.search(r"\((\d+) s\)", page.locator("#train-progress").inner_text()).group(1) == clock  # stopped
    page.locator("#train-steps input[type=number]").fill("0")
    page.locator("#train-steps input[type=number]").press("Tab")
    page.locator("#start-training").click()
    wait_for_text(page, "#train-notice", "⚠️")
    assert "max_steps" in page.locator("#train-notice").inner_text() or "steps" in page.locator(
        "#train-notice").inner_text(), page.locator("#train-notice").inner_text()
    wait_for_text(page, "#train-progress", "No run started")  # the failed bar is cleared
    assert "Failed" not in page.locator("#train-status").inner_text()


def test_the_results_table_and_plot_read_on_a_phone(server, page, tmp_path):
    """At 390 px wide every number of the Results table stays on one line (the table scrolls sideways instead)."""
    url, _ = server
    page.set_viewport_size({"width": 390, "height": 900})
    page.goto(url)
    page.get_by_role("tab", name="Results").click()
    page.locator("#results-overview td").first.wait_for()
    wrapped = page.evaluate("""() => [...document.querySelectorAll('#results-overview td')].filter(td => {
        const style = getComputedStyle(td), line = parseFloat(style.lineHeight) || 1.2 * parseFloat(style.fontSize);
        return td.innerText.trim() && td.getBoundingClientRect().height - parseFloat(style.paddingTop)
               - parseFloat(style.paddingBottom) > 1.6 * line; }).map(td => td.innerText)""")
    assert wrapped == [], f"cells broken across lines at 390 px: {wrapped}"
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 400  # the page itself does not scroll
    screenshot(page, tmp_path, "results-390px")
