"""DeepSeek's Multi-head Latent Attention over the latent KV cache (runtime/models/mla.py).

The tiny DeepSeek-V3 of testkit/family_models.py (tests/runtime/test_families.py checks its
logits and greedy tokens against transformers): the absorbed form equal to the expanded
reference through the paged kernels (chunked prefill, then decodes), the cache one tensor of
kv_lora_rank + rope values per token and layer, a block's read/write round trip and the disk
tier, a prefix hit's tokens, the float16 cache, and DeepSeek's block-scaled FP8 weights
dequantized at load (against a direct reference, and served against transformers)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.loading.fp8 import FP8Error, dequantize_block_fp8, dequantize_checkpoint
from runtime.scheduling.output import ScheduledRequest
from testkit.family_models import MLA, reference_greedy, write_family_checkpoint

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
              kv_cache_dtype="float32")
LATENT = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]  # 40 values per token and layer


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from runtime.loading.loader import load_checkpoint
    folder = tmp_path_factory.mktemp("deepseek_v3")
    reference = write_family_checkpoint(folder, "deepseek_v3")
    return folder, load_checkpoint(str(folder)), reference


def _engine(checkpoint, **overrides):
    from runtime.engine import LLMEngine
    return LLMEngine(checkpoint, EngineConfig(**{**ENGINE, **overrides}))


def test_cache_holds_one_latent_row_per_token(deepseek):
    _, checkpoint, _ = deepseek
    cfg = checkpoint.config
    assert cfg.is_latent_attention and cfg.kv_cache_heads == 1 and cfg.kv_cache_dim == LATENT
    engine = _engine(checkpoint)
    try:
        runner = engine.runner
        for k, v in runner.kv_caches:
            assert tuple(k.shape[1:]) == (1, LATENT) and k.data_ptr() == v.data_ptr()
        assert runner.block_shape == (cfg.num_hidden_layers, 1, 4, 1, LATENT)
        # the bytes --kv-cache-gb buys per token: the latent rows only
        assert cfg.kv_bytes_per_token == cfg.num_hidden_layers * LATENT * 4
        expanded = dataclasses.replace(cfg, kv_lora_rank=0, q_lora_rank=0, head_dim=24)
        assert expanded.kv_bytes_per_token == 2 * cfg.num_hidden_layers * 4 * 24 * 4
    finally:
        engine.close()


def test_absorbed_attention_equals_expanded(deepseek):
    """Layer 0's attention on random hidden states: 13 positions as two prefill chunks (the
    second over the first's cached latents) and then a decode, through the paged kernels,
    against every head's keys and values expanded and causal softmax attention."""
    from runtime.models.mla import expanded_attention
    _, checkpoint, _ = deepseek
    engine = _engine(checkpoint)
    try:
        runner = engine.runner
        mla = runner.model.layers[0].latent
        cache = torch.zeros_like(runner.kv_caches[0][0])
        g = torch.Generator().manual_seed(1)
        h = torch.randn(13, checkpoint.config.hidden_size, generator=g)
        blocks = (5, 2, 9, 7)  # any pages, in position order
        outs = []
        for start, end in ((0, 7), (7, 12), (12, 13)):
            step = [ScheduledRequest("a", start, tuple(range(end - start)), blocks)]
            _, meta, _ = runner.prepare(step)
            outs.append(mla(h[start:end], cache, meta))
        cos, sin = runner._rotary(checkpoint.config)(torch.arange(13))
        want = expanded_attention(mla, h, cos, sin)
        got = torch.cat(outs)
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    finally:
        engine.close()


def test_chunked_batched_greedy_and_prefix_hit(deepseek):
    """Several sequences, chunks of 24 tokens beside decodes, 12 tokens each, against
    transformers; the same prompt again hits the prefix cache and gives the same tokens."""
    _, checkpoint, reference = deepseek
    engine = _engine(checkpoint)
    try:
        prompts = [list(range(5, 60)), [7, 9, 11] * 9, [3, 4]]
        got = engine.generate(prompts, GREEDY)
        for ids, tokens in zip(prompts, got):
            assert tokens == reference_greedy(reference, ids, 12)
        hits = engine.kv.stats.hits
        assert engine.generate([prompts[0]], GREEDY) == [got[0]]
        assert engine.kv.stats.hits > hits
    finally:
        engine.close()


def test_block_round_trip_and_disk_tier(deepseek, tmp_path):
    _, checkpoint, _ = deepseek
    engine = _engine(checkpoint, disk_cache_dir=str(tmp_path / "kv"), num_blocks=16)
    prompt = list(range(10, 50))  # 10 blocks of 4
    try:
        runner = engine.runner
        block = torch.randn(runner.block_shape)
        runner.write_block(3, block)
        assert torch.equal(runner.read_block(3), block)
        k, v = runner.kv_caches[1]
        assert torch.equal(k[12:16], block[1, 0]) and torch.equal(v[12:16], block[1, 0])
        expected = engine.generate([prompt], GREEDY)[0]
        engine.generate([[5] * 48], GREEDY)  # evicts the prompt's blocks to the disk tier
        engine.disk_cache.flush()
    finally:
        engine.close()
    again = _engine(checkpoint, disk_cache_dir=str(tmp_path / "kv"), num_blocks=16)
    try:
        assert again.generate([prompt], GREEDY)[0] == expected
        assert again.disk_cache.stats.reads > 0
    finally:
        again.close()


def test_float16_latent_cache(deepseek):
    _, checkpoint, reference = deepseek
    engine = _engine(checkpoint, kv_cache_dtype="float16")
    try:
        assert engine.runner.kv_caches[0][0].dtype == torch.float16
        ids = list(range(5, 45))
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        # the latents rounded to float16 (11 significant bits) before attention
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-2
    finally:
        engine.close()


def _fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w quantized as DeepSeek's checkpoints are: per block, its absolute max maps to 448."""
    out, inp = w.shape
    rows, cols = -(-out // block[0]), -(-inp // block[1])
    scales = torch.empty(rows, cols)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            r = slice(i * block[0], (i + 1) * block[0])
            c = slice(j * block[1], (j + 1) * block[1])
            scales[i, j] = w[r, c].abs().max().clamp(min=1e-12) / 448.0
            q[r, c] = (w[r, c] / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def _fp8_reference(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]):
    """Each element times its block's scale, one element at a time: the direct reference."""
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = q[i, j].float() * scales[i // block[0], j // block[1]]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (40, 64)])
def test_fp8_block_dequantization(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g)
    q, scales = _fp8_blocks(w, (128, 128))
    got = dequantize_block_fp8(q, scales, (128, 128))
    assert torch.equal(got, _fp8_reference(q, scales, (128, 128)))
    assert float((got - w).abs().max() / w.abs().max()) < 0.07  # e4m3: 3 mantissa bits
    with pytest.raises(FP8Error, match="scales"):
        dequantize_block_fp8(q, torch.ones(scales.shape[0] + 1, scales.shape[1]), (128, 128))


def test_fp8_checkpoint_refusals():
    q = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(FP8Error, match="without .*scales"):
        dequantize_checkpoint({"a.weight": q}, config)
    with pytest.raises(FP8Error, match="quant_method 'gptq'"):
        dequantize_checkpoint({"a.weight": q, "a.weight_scale_inv": torch.ones(1, 1)},
                              {"quant_method": "gptq"})
    with pytest.raises(FP8Error, match="e5m2"):
        dequantize_checkpoint({"a.weight": q, "a.weight_scale_inv": torch.ones(1, 1)},
                              {**config, "fmt": "e5m2"})


def test_fp8_checkpoint_served_against_transformers(deepseek, tmp_path):
    """The checkpoint's matrices written as DeepSeek ships them (fp8 with 32x32-block scales:
    partial blocks at every edge of these widths); the reference holds the dequantized
    weights, computed element by element. Mtp layer tensors are skipped by name."""
    from safetensors.torch import load_file, save_file

    from runtime.loading.loader import load_checkpoint
    folder, _, reference = deepseek
    block = (32, 32)
    tensors = load_file(str(folder / "model.safetensors"))
    fp8, ref_state = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, scales = _fp8_blocks(t, block)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, scales
            ref_state[name] = _fp8_reference(q, scales, block)
        else:
            fp8[name] = t
    fp8["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP layer's: skipped
    out = tmp_path / "fp8"
    out.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(fp8, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (out / "config.json").write_text(json.dumps(config))
    checkpoint = load_checkpoint(str(out))
    assert checkpoint.config.weight_format == "fp8"
    assert "model.layers.3.eh_proj.weight" not in checkpoint.weights
    ref = type(reference)(reference.config).eval()
    ref.load_state_dict({**reference.state_dict(), **_transformers_names(ref, ref_state)})
    engine = _engine(checkpoint)
    try:
        ids = list(range(5, 45))
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        got = engine.prompt_logits(ids)
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    finally:
        engine.close()


def _transformers_names(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert names as the transformers model holds them (stacked
    gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
    own = model.state_dict()
    out = {n: t for n, t in state.items() if n in own}
    for layer in range(model.config.num_hidden_layers):
        e = f"model.layers.{layer}.mlp.experts."
        if e + "gate_up_proj" not in own:
            continue
        n = model.config.n_routed_experts
        out[e + "gate_up_proj"] = torch.stack([torch.cat([
            state[f"{e}{i}.gate_proj.weight"], state[f"{e}{i}.up_proj.weight"]]) for i in range(n)])
        out[e + "down_proj"] = torch.stack([state[f"{e}{i}.down_proj.weight"] for i in range(n)])
    return out


def test_int8_served_form(deepseek):
    """The latent attention's projections quantized as any Linear (kv_b_proj's per-head
    absorption matrices stay float)."""
    _, checkpoint, reference = deepseek
    engine = _engine(checkpoint, quantization="int8", quant_max_rows=1 << 20)
    try:
        assert engine.runner.model.layers[0].latent.in_proj.packed is not None
        ids = list(range(5, 45))
        ours = engine.prompt_logits(ids)
        with torch.no_grad():
            ref = reference(torch.tensor([ids])).logits[0]
        assert float((ours - ref).abs().max() / ref.abs().max()) < 5e-2
    finally:
        engine.close()


def test_unserved_deepseek_configs_refused(deepseek):
    from contract.errors import ModelLoadError
    from runtime.loading.hf import config_from_hf
    folder, _, _ = deepseek
    raw = json.loads((folder / "config.json").read_text())
    assert config_from_hf(raw).kv_cache_dim == LATENT
    with pytest.raises(ModelLoadError, match="index_topk"):
        config_from_hf({**raw, "index_topk": 2048})
    with pytest.raises(ModelLoadError, match="kv_lora_rank"):
        config_from_hf({**raw, "kv_lora_rank": None})


# DeepSeek-V3's config.json as the Hub ships it (the keys this loader reads)
V3_HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "max_position_embeddings": 163840, "vocab_size": 129280,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_deepseek_v3_hub_config():
    import math

    from runtime.loading.hf import config_from_hf
    cfg = config_from_hf(V3_HUB)
    assert (cfg.kv_cache_heads, cfg.kv_cache_dim, cfg.kv_tensors) == (1, 576, 1)
    assert cfg.head_dim == 64 and cfg.weight_format == "fp8"
    assert cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.factor == 40
    mscale = 0.1 * math.log(40) + 1
    assert cfg.attention_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert cfg.moe_layers == (False,) * 3 + (True,) * 58 and cfg.router == "sigmoid_group_topk"
    # per token over all layers in bfloat16: 61 x 576 x 2 bytes, against the expanded
    # cache's 61 x 128 heads x (192 + 128) x 2
    assert cfg.kv_bytes_per_token // 2 == 70_272


def test_prefill_decode_transfer_moves_the_latent_blocks(deepseek):
    """Prefill/decode disaggregation (tests/scaleout/harness.py's two workers over gloo): the
    latent blocks move, and the decode worker's tokens are the colocated engine's."""
    from tests.scaleout.harness import Pair
    _, checkpoint, _ = deepseek
    prompt = list(range(5, 38))
    colocated = _engine(checkpoint)
    try:
        want = colocated.generate([prompt], GREEDY)[0]
    finally:
        colocated.close()
    pair = Pair(lambda: _engine(checkpoint))
    try:
        params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        first = pair.prefill("r", prompt, params)
        pair.handoff("r", prompt, params, first)
        rest, _, transfer = pair.decode_rest("r")
        assert first["tokens"] + rest == want
        assert transfer["blocks"] == -(-len(prompt) // 4)
    finally:
        pair.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2_lite"])
def test_attention_biases_and_halves_rope(family, tmp_path, monkeypatch):
    """attention_bias (q_a_proj / q_proj's input projection, kv_a_proj_with_mqa, o_proj) and
    `rope_interleave: false` (V3 rotates halves then; V2 ignores the key, always pairs)."""
    import testkit.family_models as family_models
    from runtime.engine import LLMEngine
    plain = family_models._deepseek_config

    def variant(name, common):
        config = plain(name, common)
        config.attention_bias, config.rope_interleave = True, False
        return config
    monkeypatch.setattr(family_models, "_deepseek_config", variant)
    reference = family_models.write_family_checkpoint(tmp_path, family)
    engine = LLMEngine.from_model_path(str(tmp_path), EngineConfig(**ENGINE))
    try:
        ids = list(range(5, 45))
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
        got = engine.prompt_logits(ids)
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    finally:
        engine.close()
