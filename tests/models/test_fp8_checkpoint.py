"""Fine-grained FP8 checkpoints (FP4-packed experts included) load dequantized
(`kvplan.models.fp8_checkpoint`): the dequantization equals an element-by-element reference and
transformers' own; a quantized DeepSeek-V4 folder (DeepSeek's ``.scale`` names, UE8M0 scales,
FP4 experts, BF16 compressor / indexer projections) gives HF's logits and greedy tokens as HF
loads it; a quantized Qwen3 folder (``weight_scale_inv`` fp32 scales) gives HF's greedy tokens
through `kvplan.LLM`; bad configs and tensors are named."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from kvplan import LLM, SamplingParams
from kvplan.backends.hybrid.reference import ReferenceHybridFamily
from kvplan.models.deepseek_v4 import load_deepseek_v4
from kvplan.models.fp8_checkpoint import dequantize_fp4, dequantize_fp8, read_quantization
from tests.engine.hf_models import hf_greedy, make_hf_model, random_prompts
from tests.models.dsv4_testlib import hf_config, hf_logits, hf_model, random_tokens, run_step
from tests.models.fp8_testlib import quantize_fp4, quantize_fp8, write_quantized

DSV4_QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "expert_dtype": "fp4",
}
# what DeepSeek-V4-Flash stores in FP8 / FP4 (its compressor / indexer projections stay BF16)
DSV4_RULES = [
    (r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$", "fp8"),
    (r"shared_experts\.w[123]\.weight$", "fp8"),
    (r"experts\.\d+\.w[123]\.weight$", "fp4"),
]


def _elementwise(codes, scale, bn, bk):
    out = torch.empty(codes.shape)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            out[i, j] = codes[i, j].float() * scale[i // bn, j // bk].float()
    return out


@pytest.mark.parametrize("shape", [(40, 72), (33, 17), (64, 64), (48, 96)])
@pytest.mark.parametrize("scales", ["ue8m0", "fp32", "uint8"])
def test_fp8_blocks_equal_an_elementwise_reference(shape, scales):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * 3
    codes, scale = quantize_fp8(w, (16, 32), ue8m0=scales != "fp32")
    stored = scale.view(torch.uint8) if scales == "uint8" else scale
    got = dequantize_fp8(codes, stored, (16, 32))
    assert got.dtype == torch.float32
    assert torch.equal(got, _elementwise(codes, scale, 16, 32))
    assert (got - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 4 significant bits
    single = dequantize_fp8(codes, torch.tensor(0.5), None)  # one scale for the tensor
    assert torch.equal(single, codes.float() * 0.5)


def test_fp8_and_fp4_equal_transformers_dequantization():
    fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")
    hf = fp8_mod.Fp8Dequantize(None)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=gen)
    for ue8m0 in (True, False):
        codes, scale = quantize_fp8(w, (128, 128), ue8m0)
        want = hf._dequantize_one(codes, scale, torch.float32)
        assert torch.equal(dequantize_fp8(codes, scale, (128, 128)), want)
    packed, scale = quantize_fp4(w)
    got = dequantize_fp4(packed, scale)
    assert got.shape == w.shape
    assert torch.equal(got, hf._dequantize_one(packed, scale, torch.float32))
    experts = torch.stack([packed, packed.flip(0)])  # [E, N, K / 2] with [E, N, K / 32]
    got3 = dequantize_fp4(experts, torch.stack([scale, scale.flip(0)]))
    assert torch.equal(got3[1], got.flip(0))


def test_fp4_codes_are_the_e2m1_values():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(1, 8).view(torch.int8)
    values = dequantize_fp4(packed, torch.tensor([[4.0]]).to(torch.float8_e8m0fnu))
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values[0, :16].tolist() == [4 * v for v in e2m1] + [-4 * v for v in e2m1]


def test_bad_scales_and_configs_are_named():
    codes, scale = quantize_fp8(torch.randn(40, 72), (16, 32))
    with pytest.raises(ValueError, match=r"w1.*scales of shape \(3, 3\).*got \(2, 3\)"):
        dequantize_fp8(codes, scale[:2], (16, 32), "w1")
    with pytest.raises(ValueError, match="weight_block_size"):
        dequantize_fp8(codes, scale, None)
    packed, s4 = quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"w2.*\(4, 2\).*got \(4, 1\)"):
        dequantize_fp4(packed, s4[:, :1], "w2")
    cfg = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ValueError, match=r"c\.json: quantization_config\.quant_method='gptq'"):
        read_quantization(cfg, "c.json")
    for field, value in (("weight_block_size", [128]), ("fmt", "e5m2"), ("expert_dtype", "int4"),
                         ("scale_fmt", "e4m3"), ("activation_scheme", "tensor")):  # fmt: skip
        bad = {"quantization_config": {**DSV4_QUANT, field: value}}
        with pytest.raises(
            ValueError, match=rf"quantization_config\.{field}={re.escape(repr(value))}"
        ):
            read_quantization(bad, "c.json")
    assert read_quantization({}, "c.json") is None
    gguf = {"quantization_config": {"quant_method": "gguf", "dequantize": False}}
    assert read_quantization(gguf, "c.json") is None  # a GGUF conversion's dequantized folder
    q = read_quantization({"quantization_config": DSV4_QUANT}, "c.json")
    assert q is not None and q.block == (128, 128) and q.expert_dtype == "fp4"


def _dsv4_folders(tmp_path, seed: int):
    # every width 128 or below: transformers infers a block from how the grid divides the
    # weight, which is only right when blocks tile it whole (partial blocks: the test above)
    cfg = hf_config(seed, hidden_size=128, moe_intermediate_size=64, q_lora_rank=128)
    hf = hf_model(cfg, seed)
    plain = tmp_path / "plain"
    hf.save_pretrained(plain)
    quant = tmp_path / "fp8"
    written = write_quantized(plain, quant, DSV4_RULES, DSV4_QUANT)
    assert any(t.dtype == torch.int8 for t in written.values())  # fp4 experts
    assert any(t.dtype == torch.float8_e4m3fn for t in written.values())
    return hf, plain, quant


def test_deepseek_v4_fp8_checkpoint_equals_transformers(tmp_path):
    _, _, folder = _dsv4_folders(tmp_path, seed=1)
    ref = tf.DeepseekV4ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert ref.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32  # dequantized
    model = load_deepseek_v4(folder)
    ids = random_tokens(3, 37, vocab=ref.config.vocab_size)
    (got,), _ = run_step(model, ReferenceHybridFamily(model.config.layer_specs()),
                         [(0, ids, 0, len(ids))])  # fmt: skip
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-4, rtol=0)
    llm = LLM(str(folder), device="cpu", max_num_batched_tokens=16, max_model_len=96)
    prompts = [random_tokens(10 + i, n) for i, n in enumerate((23, 9))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6,
                            do_sample=False)[0, len(p):].tolist()  # fmt: skip
        assert o.token_ids == want


def test_deepseek_v4_checkpoint_errors_name_the_tensor(tmp_path):
    _, _, folder = _dsv4_folders(tmp_path, seed=2)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("attn.wq_a.weight"))
    scale = name.removesuffix(".weight") + ".scale"
    cfg = json.loads((folder / "config.json").read_text())
    tensors["mtp.0.attn.wq_a.weight"] = tensors[name].clone()  # skipped, scale-less or not
    save_file({k: v for k, v in tensors.items() if k != scale}, str(path))
    with pytest.raises(ValueError, match=rf"{path.name}: tensor '{name}' is float8 but has no"):
        load_deepseek_v4(folder)
    save_file({**tensors, scale: torch.cat([tensors[scale]] * 2)}, str(path))  # a 2 x 1 grid
    with pytest.raises(ValueError, match=rf"'{name}'.*needs scales of shape"):
        load_deepseek_v4(folder)
    save_file(tensors, str(path))
    load_deepseek_v4(folder)  # the scale-less fp8 mtp tensor is skipped unread
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": None}))
    quantized = (
        r"tensor 'model\.layers\.\d+\.\S+' is quantized \(F8_E4M3\) .*no quantization_config"
    )
    with pytest.raises(ValueError, match=quantized):
        load_deepseek_v4(folder)


def test_qwen3_fp8_checkpoint_greedy_equals_transformers(tmp_path):
    hf = make_hf_model("qwen3", seed=5)
    plain = tmp_path / "plain"
    hf.save_pretrained(str(plain))
    folder = tmp_path / "fp8"
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    rules = [(r"(q|k|v|o|gate|up|down)_proj\.weight$", "fp8")]
    written = write_quantized(plain, folder, rules, quant, scale_suffix="weight_scale_inv",
                              block=(32, 32), ue8m0=False)  # fmt: skip
    assert sum(t.dtype == torch.float8_e4m3fn for t in written.values()) == 14
    ref = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                  attn_implementation="eager").eval()  # fmt: skip
    prompts = random_prompts(4, 3, 30, hf.config.vocab_size, seed=11)
    want = hf_greedy(ref, prompts, 16)
    assert want != hf_greedy(hf, prompts, 16)  # the quantization changed the model
    llm = LLM(str(folder), device="cpu", block_size=8, max_model_len=96)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == want


@pytest.mark.gpu
def test_deepseek_v4_fp8_checkpoint_dequantizes_on_cuda_as_on_cpu(tmp_path):
    """The loader multiplies FP8 / FP4 weights out on the model's device: on CUDA every
    parameter equals the CPU load bit for bit (the products are exact in fp32)."""
    _, _, folder = _dsv4_folders(tmp_path, seed=3)
    cpu = load_deepseek_v4(folder)
    cuda = load_deepseek_v4(folder, device="cuda")
    for (name, a), (_, b) in zip(cpu.state_dict().items(), cuda.state_dict().items()):
        assert b.is_cuda and torch.equal(a, b.cpu()), name
