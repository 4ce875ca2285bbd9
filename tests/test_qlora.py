"""QLoRA: a bitsandbytes NF4 base under peft LoRA adapters, loaded as users load it (`from_pretrained(...,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))`, or TRL's
`quantization_config`), on CPU, from a tiny config-built model saved to a temporary folder.

The 4-bit weights (`Params4bit`) are frozen; peft's `lora_A`/`lora_B` inside its `bnb.Linear4bit` are plain
`nn.Linear` and take the linear rule; a trainable bias of a 4-bit base layer (`bias="lora_only"`) takes it too,
captured at the layer's input and output. bitsandbytes' 4-bit matmul is an `autograd.Function` torch.func cannot
transform, so the oracle takes plain autograd on a batch of one, example by example (`clipping_oracle.py`).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from clipping_oracle import UNIT_IDS, assert_rel_close, check_against_oracle, clip_by_engine, clip_by_oracle, hf_loss
from tiny_models import model_inputs, tiny_batch, tiny_config, trainable_parameters
from trainer_fixtures import make_trainer, tiny_llama, user_dataset
from transformers import BitsAndBytesConfig, LlamaForCausalLM, Qwen2ForCausalLM

from hf_dp import sharding

bnb = pytest.importorskip("bitsandbytes")  # in the test extra (hf_dp[qlora]): CI runs these


def nf4(compute_dtype=torch.float32) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def qlora(model_class, config, tmp_path, compute_dtype=torch.float32, **lora):
    """`config`'s model saved, loaded back in NF4 and wrapped in LoRA (r=4) with a random B (every factor gets a
    gradient)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model_class(config).save_pretrained(tmp_path / "base")
    model = model_class.from_pretrained(tmp_path / "base", quantization_config=nf4(compute_dtype), dtype=compute_dtype)
    settings = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, LoraConfig(**{**settings, **lora}))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator).to(param.dtype))
    return model.train()


def test_the_4bit_layers_are_frozen_and_the_adapters_clip_exactly(tmp_path):
    from peft.tuners.lora.bnb import Linear4bit

    model = qlora(LlamaForCausalLM, tiny_config("llama"), tmp_path)
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each layer: all-linear (the LM head excluded)
    assert all(isinstance(m.base_layer, bnb.nn.Linear4bit) and not m.base_layer.weight.requires_grad for m in layers)
    assert all("lora_" in name for name in trainable_parameters(model))
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", padding=True)
    check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS)


def test_a_trainable_bias_of_a_4bit_layer_clips_exactly(tmp_path):
    model = qlora(Qwen2ForCausalLM, tiny_config("qwen2"), tmp_path, target_modules=["q_proj", "v_proj"],
                  bias="lora_only")
    biases = [name for name in trainable_parameters(model) if name.endswith("base_layer.bias")]
    assert len(biases) == 4
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", padding=True, seed=1)
    check_against_oracle(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS)


def test_bf16_compute_matches_the_batch_own_per_example_gradients(tmp_path):
    """With bnb_4bit_compute_dtype=bfloat16 a batch of one rounds differently from the batch (the oracle agrees
    to ~1e-3 only), so the reference is autograd of each example's loss through the batch's own forward pass."""
    model = qlora(LlamaForCausalLM, tiny_config("llama"), tmp_path, compute_dtype=torch.bfloat16)
    batch = tiny_batch(len(UNIT_IDS), 8, head="causal_lm", padding=True, seed=2)
    params = trainable_parameters(model)
    assert {p.dtype for p in params.values()} == {torch.float32}  # peft keeps the adapters in float32
    losses = hf_loss("causal_lm")(model(**model_inputs(batch)), batch["labels"])
    rows = [torch.autograd.grad(loss, list(params.values()), retain_graph=True) for loss in losses]
    _, units = torch.unique(UNIT_IDS, sorted=True, return_inverse=True)
    unit_grads = {name: torch.stack([row[i] for row in rows]).double() for i, name in enumerate(params)}
    unit_grads = {name: g.new_zeros((len(set(UNIT_IDS.tolist())),) + g.shape[1:]).index_add_(0, units, g)
                  for name, g in unit_grads.items()}
    expected_norms, _ = clip_by_oracle(unit_grads, 1.0)
    max_grad_norm = float(expected_norms.median())
    _, expected = clip_by_oracle(unit_grads, max_grad_norm)
    model.zero_grad(set_to_none=True)
    norms, clipped = clip_by_engine(model, model_inputs(batch), batch["labels"], hf_loss("causal_lm"), UNIT_IDS,
                                    max_grad_norm)
    assert_rel_close(norms, expected_norms, "norms")
    for name in expected:
        assert_rel_close(clipped[name], expected[name], f"clipped sum of {name}")


def test_dp_trainer_trains_the_adapters_of_a_4bit_base(tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny_llama().save_pretrained(tmp_path / "base")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "base", quantization_config=nf4())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(tmp_path, model=model, dataset=user_dataset(causal_lm=True), max_steps=2)
    trainer.train()
    assert trainer.accountant.steps == 2 and 0 < trainer.privacy_report()["epsilon"] <= 8.0
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    assert changed and all("lora_" in name for name in changed)  # the packed 4-bit weights stay as loaded


def test_dp_sft_trainer_loads_a_4bit_base_through_quantization_config(tmp_path):
    """As in TRL: a model path, `quantization_config` and `peft_config`; TRL casts the adapters to bf16 and, with
    gradient checkpointing (non-reentrant, DPSFTConfig's default), makes the embeddings' output require grad."""
    from peft import LoraConfig
    from test_sft import chat_tokenizer, config, conversations, tiny_chat_model

    from hf_dp.sft import DPSFTTrainer

    tiny_chat_model().save_pretrained(tmp_path / "base")

    sft = DPSFTTrainer(model=str(tmp_path / "base"), args=config(tmp_path, gradient_checkpointing=True),
                       train_dataset=conversations(), processing_class=chat_tokenizer(), quantization_config=nf4(),
                       peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert sft.model.is_loaded_in_4bit
    assert all("lora_" in name for name, p in sft.model.named_parameters() if p.requires_grad)
    sft.train()
    assert sft.accountant.steps == 2 and 0 < sft.privacy_report()["epsilon"] <= 8.0
    # The trained model as TRL prepared it clips a micro-batch of its rows exactly (adapters back in float32: the
    # oracle's batch of one rounds bf16 differently from the batch).
    for param in trainable_parameters(sft.model).values():
        param.data = param.data.float()
    rows = sft.partition.dataset
    picked = [int(r) for user_rows in sft.partition.user_rows[:4] for r in user_rows]
    batch = sft.data_collator([rows[i] for i in picked])
    unit_ids = torch.tensor([int(sft.partition.row_user[i]) for i in picked])
    sft.clipper.detach()  # the oracle check attaches its own clipper
    check_against_oracle(sft.model, {k: v for k, v in batch.items() if k != "labels"}, batch["labels"],
                         hf_loss("causal_lm"), unit_ids)


def test_a_4bit_base_is_refused_under_fsdp2_in_one_line():
    layer = bnb.nn.Linear4bit(16, 16, quant_type="nf4")
    plugin = SimpleNamespace(fsdp_version=2, activation_checkpointing=False, cpu_offload=None,
                             cpu_ram_efficient_loading=False)
    trainer = SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True, model=torch.nn.Sequential(layer),
                              accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    assert sharding.is_quantized(trainer.model) and not sharding.is_quantized(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="bitsandbytes-quantized .* under FSDP2.* train QLoRA on one process") as error:
        sharding.check_supported(trainer)
    assert "\n" not in str(error.value)
    trainer.is_fsdp_enabled = False
    sharding.check_supported(trainer)  # one process: QLoRA trains
