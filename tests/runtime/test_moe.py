"""Mixture-of-experts layers (runtime/models/moe.py, routing.py): every router against
transformers' own router module and against a per-token reference, DeepSeek's MoE block (router,
group-limited selection, correction bias, shared experts) against transformers' modules, the
grouped expert computation against a per-token loop, the expert load counts, the config rules
(dense layers, refusals), both storage forms of the experts, and a quantized MoE model.
The whole-model checks of the MoE families (logits and greedy tokens through the engine) are
tests/runtime/test_families.py's, over testkit/family_models.py's MOE_FAMILIES."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from contract.config import EngineConfig, ModelConfig
from contract.errors import ModelLoadError
from runtime.loading.hf import config_from_hf, expert_names, moe_traits, read_safetensors
from runtime.models.moe import ExpertLoad, SparseMoE
from runtime.models.routing import (
    Router,
    sigmoid_group_topk,
    softmax_group_topk,
    softmax_topk,
)
from runtime.models.weights import LinearMaker, ModelWeights
from testkit.tolerances import relative_error

transformers = pytest.importorskip("transformers")

H = 64  # hidden size of the direct module checks


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) of each token sorted by expert id: routers return k in any order."""
    ids_sorted, order = ids.sort(dim=-1)
    return ids_sorted, weights.gather(1, order)


def _assert_same_routing(ours, theirs) -> None:
    ids, w = _by_expert(*ours)
    ref_ids, ref_w = _by_expert(*theirs)
    assert torch.equal(ids, ref_ids.long())
    # the same float32 ops on the same logits, in another order at most
    torch.testing.assert_close(w, ref_w.float(), rtol=1e-6, atol=1e-7)


# ---- routers against transformers' router modules ----------------------------------------------
def _hf_router(module_path: str, cls: str, config):
    import importlib
    router = getattr(importlib.import_module(module_path), cls)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) * H ** -0.5)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(
                torch.randn(router.e_score_correction_bias.shape, generator=g) * 0.1)
    return router


def _deepseek_v3_config(**kw):
    return transformers.DeepseekV3Config(**{
        "hidden_size": H, "moe_intermediate_size": 32, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_hidden_layers": 4,
        "first_k_dense_replace": 1, "vocab_size": 100, **kw})


def _deepseek_v2_config(**kw):
    return transformers.DeepseekV2Config(**{
        "hidden_size": H, "moe_intermediate_size": 32, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
        "routed_scaling_factor": 2.5, "topk_method": "group_limited_greedy",
        "num_hidden_layers": 4, "vocab_size": 100, **kw})


def _our_config(arch: str, hf_config) -> ModelConfig:
    raw = hf_config.to_dict()
    return ModelConfig(architecture=arch, vocab_size=100, hidden_size=H, intermediate_size=128,
                       num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=64,
                       **moe_traits(arch, raw, int(raw["num_hidden_layers"])))


ROUTER_CASES = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter",
                lambda: transformers.MixtralConfig(hidden_size=H, num_local_experts=8,
                                                   num_experts_per_tok=2, num_hidden_layers=2)),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter",
                  lambda: transformers.Qwen3MoeConfig(
                      hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                      moe_intermediate_size=32, num_hidden_layers=2)),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter",
                  lambda: transformers.Qwen2MoeConfig(
                      hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                      moe_intermediate_size=32, num_hidden_layers=2)),
    "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3",
                    "DeepseekV3TopkRouter", _deepseek_v3_config),
    "deepseek_v2": ("transformers.models.deepseek_v2.modeling_deepseek_v2",
                    "DeepseekV2TopkRouter", _deepseek_v2_config),
    "deepseek_v2_greedy": ("transformers.models.deepseek_v2.modeling_deepseek_v2",
                           "DeepseekV2TopkRouter",
                           lambda: _deepseek_v2_config(topk_method="greedy")),
}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_router_matches_transformers_router(case):
    module, cls, make = ROUTER_CASES[case]
    hf_config = make()
    ref = _hf_router(module, cls, hf_config)
    arch = case.removesuffix("_greedy")
    cfg = _our_config(arch, hf_config)
    bias = getattr(ref, "e_score_correction_bias", None)
    ours = Router(cfg, ref.weight.detach(), None if bias is None else bias.detach())
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, ref_weights, ref_ids = ref(x)
    _assert_same_routing(ours(x), (ref_weights, ref_ids))


# ---- routers against a per-token reference ---------------------------------------------------
def _per_token(scores: torch.Tensor, choice: torch.Tensor, k: int, groups: int, kept: int,
               group_score, normalize: bool, scale: float):
    """Each token alone, in plain Python: rank the groups, then the allowed experts."""
    e = scores.shape[1]
    size = e // groups
    out_w, out_ids = [], []
    for s, c in zip(scores.tolist(), choice.tolist()):
        ranked = sorted(range(groups), key=lambda g: -group_score(c[g * size:(g + 1) * size]))
        allowed = [i for g in ranked[:kept] for i in range(g * size, (g + 1) * size)]
        ids = sorted(allowed, key=lambda i: -c[i])[:k]
        w = [s[i] for i in ids]
        if normalize:
            w = [v / sum(w) for v in w]
        out_w.append([v * scale for v in w])
        out_ids.append(ids)
    return torch.tensor(out_w), torch.tensor(out_ids)


def test_group_limited_selection_matches_a_per_token_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 32, generator=g)  # continuous: no ties
    bias = torch.randn(32, generator=g) * 0.2

    def top2(v):
        return sum(sorted(v)[-2:])

    scores = logits.sigmoid()
    ours = sigmoid_group_topk(logits, bias, k=6, groups=8, groups_kept=3, normalize=True,
                              scale=2.5)
    ref = _per_token(scores, scores + bias, 6, 8, 3, top2, True, 2.5)
    _assert_same_routing(ours, ref)
    # the groups and the bias decide: without them other experts would have been chosen
    plain = torch.topk(scores, 6, dim=-1)[1].sort(dim=-1)[0]
    assert not torch.equal(plain, ours[1].sort(dim=-1)[0])

    probs = logits.softmax(-1)
    ours = softmax_group_topk(logits, k=6, groups=8, groups_kept=3, normalize=False, scale=1.5)
    _assert_same_routing(ours, _per_token(probs, probs, 6, 8, 3, max, False, 1.5))

    ours = softmax_topk(logits, k=5, normalize=True)
    _assert_same_routing(ours, _per_token(probs, probs, 5, 1, 1, max, True, 1.0))


def test_the_correction_bias_chooses_but_does_not_weigh():
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 2.0])
    w, ids = sigmoid_group_topk(logits, bias, k=2, groups=1, groups_kept=1, normalize=False)
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w, torch.full((1, 2), 0.5))  # sigmoid(0), not the bias


# ---- DeepSeek's MoE blocks against transformers' modules -------------------------------------
def _our_block(arch: str, hf_config, module, dtype=torch.float32, quantization="none",
               load: ExpertLoad | None = None) -> SparseMoE:
    """Our SparseMoE over `module`'s weights, named as a checkpoint's layer 1 would be."""
    cfg = _our_config(arch, hf_config)
    prefix = "model.layers.1.mlp."
    weights = expert_names({prefix + k: v.detach().clone()
                            for k, v in module.state_dict().items()})
    maker = LinearMaker(quantization, dtype, None, 0 if quantization != "none" else None)
    return SparseMoE(cfg, ModelWeights(weights, torch.device("cpu"), dtype), prefix, maker, 1,
                     load)


def _randomize(module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        for b in module.buffers():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_moe_block_matches_transformers(arch):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    hf_config = _deepseek_v3_config() if arch == "deepseek_v3" else _deepseek_v2_config()
    module = (DeepseekV3MoE if arch == "deepseek_v3" else DeepseekV2Moe)(hf_config).eval()
    _randomize(module, 4)
    load = ExpertLoad(4, 16, torch.device("cpu"))
    ours = _our_block(arch, hf_config, module, load=load)
    assert ours.shared_down is not None  # n_shared_experts 2: one MLP twice as wide
    x = torch.randn(1, 29, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = module(x)[0]
    got = ours(x[0])
    # float32 both sides, sums of at most a few hundred terms: 1e-5 of the largest value is
    # far above their reordering's rounding and far below a wrong expert or weight
    assert relative_error(got, ref) < 1e-5
    _, ids = ours.router(x[0])
    assert torch.equal(load.total()[1], torch.bincount(ids.reshape(-1), minlength=16))


def test_deepseek_layer_rule_and_router_settings():
    raw = _deepseek_v3_config(num_hidden_layers=6, first_k_dense_replace=2).to_dict()
    traits = moe_traits("deepseek_v3", {**raw, "moe_layer_freq": 2}, 6)
    assert traits["moe_layers"] == (False, False, True, False, True, False)
    assert traits["router"] == "sigmoid_group_topk" and traits["router_groups"] == 4
    assert traits["shared_expert_intermediate_size"] == 64  # 2 shared experts of 32
    assert traits["routed_scaling_factor"] == 2.5 and traits["router_normalizes"]
    with pytest.raises(ValueError, match="topk_method 'sparsemixer'"):
        moe_traits("deepseek_v3", {**raw, "topk_method": "sparsemixer"}, 6)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        moe_traits("deepseek_v2", {**_deepseek_v2_config().to_dict(), "norm_topk_prob": True},
                   4)


# ---- the grouped computation, the counts -----------------------------------------------------
def _qwen2_moe_block(quantization="none", load=None):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    hf_config = transformers.Qwen2MoeConfig(
        hidden_size=H, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=2)
    module = Qwen2MoeSparseMoeBlock(hf_config).eval()
    _randomize(module, 6)
    return module, _our_block("qwen2_moe", hf_config, module, quantization=quantization,
                              load=load)


def test_grouped_experts_equal_a_per_token_loop():
    load = ExpertLoad(2, 8, torch.device("cpu"))
    module, ours = _qwen2_moe_block(load=load)
    x = torch.randn(41, H, generator=torch.Generator().manual_seed(7))
    weights, ids = ours.router(x)
    grouped = ours.routed(x, weights, ids)
    naive = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            y = ours.down[e](torch.nn.functional.silu(
                x[t:t + 1] @ ours.gate_up[e].weight[:32].T) * (x[t:t + 1] @
                                                               ours.gate_up[e].weight[32:].T))
            naive[t] += w * y[0]
    torch.testing.assert_close(grouped, naive, rtol=1e-5, atol=1e-6)
    # a CUDA graph capture's form (every expert on every row, zero-weighted): the same sum
    torch.testing.assert_close(ours._every_expert(x, weights, ids), grouped,
                               rtol=1e-5, atol=1e-6)
    # each (token, expert) assignment counted once, in layer 1's row only
    counts = load.snapshot_and_reset()
    assert torch.equal(counts[1], torch.bincount(ids.reshape(-1), minlength=8))
    assert int(counts[0].sum()) == 0 and int(counts.sum()) == 41 * 3
    assert int(load.snapshot_and_reset().sum()) == 0 and torch.equal(load.total(), counts)
    # and the block with its gated shared expert is transformers' Qwen2-MoE block
    with torch.no_grad():
        ref = module(x[None])[0]
    assert relative_error(ours(x), ref) < 1e-5


def test_int8_experts_serve_their_dequantized_weights():
    """Each expert's matrices are built by the LinearMaker like a dense layer's: with int8
    they are int8 Linears, and the block computes exactly their dequantized weights (up to
    the int8 kernel's bfloat16 activations), the routing held fixed."""
    module, ours = _qwen2_moe_block(quantization="int8")
    assert all(lin.packed is not None for lin in ours.linears())
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(8))
    weights, ids = ours.router(x)
    through_float_copy = ours.routed(x, weights, ids)  # max_quant_rows 0: the float copy
    for lin in ours.linears():
        lin.max_quant_rows = 1 << 20  # every run through the int8 kernel
    through_int8 = ours.routed(x, weights, ids)
    # the only difference between the two paths: activations rounded to bfloat16
    assert relative_error(through_int8, through_float_copy) < 2e-2
    with torch.no_grad():  # transformers on our dequantized weights
        for e in range(8):
            module.experts.gate_up_proj[e].copy_(ours.gate_up[e].weight)
            module.experts.down_proj[e].copy_(ours.down[e].weight)
        module.shared_expert.gate_proj.weight.copy_(ours.shared_gate_up.weight[:48])
        module.shared_expert.up_proj.weight.copy_(ours.shared_gate_up.weight[48:])
        module.shared_expert.down_proj.weight.copy_(ours.shared_down.weight)
        ref = module(x[None])[0]
    for lin in ours.linears():
        lin.max_quant_rows = 0
    assert relative_error(ours(x), ref) < 1e-5


# ---- config rules, storage forms, the engine -------------------------------------------------
def test_qwen_dense_layer_rule_and_refusals():
    base = transformers.Qwen3MoeConfig(
        num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
        mlp_only_layers=[3], architectures=["Qwen3MoeForCausalLM"]).to_dict()
    cfg = config_from_hf(base)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.num_experts == 8
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ModelLoadError, match="experts per token"):
        config_from_hf({**base, "num_experts_per_tok": 9})
    mixtral = config_from_hf(transformers.MixtralConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"]).to_dict())
    assert mixtral.router_normalizes and mixtral.moe_intermediate_size == 14336


def test_stacked_and_per_expert_tensors_name_the_same_weights():
    g = torch.Generator().manual_seed(9)
    per_expert = {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight":
                  torch.randn(32 if w != "w2" else 16, 16 if w != "w2" else 32, generator=g)
                  for e in range(4) for w in ("w1", "w2", "w3")}
    stacked = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.stack([torch.cat([
            per_expert[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"],
            per_expert[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"]])
            for e in range(4)]),
        "model.layers.0.mlp.experts.down_proj": torch.stack([
            per_expert[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"]
            for e in range(4)])}
    a, b = expert_names(per_expert), expert_names(stacked)
    assert sorted(a) == sorted(b) and "model.layers.0.mlp.experts.3.up_proj.weight" in a
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    from testkit.family_models import write_family_checkpoint
    folder = tmp_path_factory.mktemp("mixtral")
    return folder, write_family_checkpoint(folder, "mixtral")


def _engine(folder, **kw):
    from runtime.engine import LLMEngine
    return LLMEngine.from_model_path(str(folder), EngineConfig(
        num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
        kv_cache_dtype="float32", **kw))


def test_engine_counts_expert_load_and_reports_it(mixtral_folder):
    folder, reference = mixtral_folder
    engine = _engine(folder)
    model = engine.runner.model
    assert model.fused is None and all(layer.moe is not None for layer in model.layers)
    ids = engine.tokenizer.encode("The history of the Roman Empire")
    before = model.expert_load.total()
    engine.prompt_logits(ids)
    added = model.expert_load.total() - before
    assert added.sum(dim=1).tolist() == [len(ids) * 2] * 3  # every token, k = 2, each layer
    assert engine.snapshot()["expert_tokens"] == model.expert_load.total().tolist()


def test_a_folder_with_stacked_experts_serves_the_same(mixtral_folder, tmp_path):
    """transformers 5's in-memory form (experts stacked in 3-D tensors under mlp.) loads too."""
    import shutil

    from safetensors.torch import save_file
    folder, _ = mixtral_folder
    weights = read_safetensors(str(folder))
    stacked = {}
    for name, t in weights.items():
        if ".experts." not in name:
            stacked[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer in range(3):
        p = f"model.layers.{layer}.block_sparse_moe.experts."
        stacked[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{p}{e}.w1.weight"], weights[f"{p}{e}.w3.weight"]])
            for e in range(8)])
        stacked[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([
            weights[f"{p}{e}.w2.weight"] for e in range(8)])
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(stacked, str(tmp_path / "model.safetensors"))
    ids = _engine(folder).tokenizer.encode("Paris is the capital of France")
    assert torch.equal(_engine(tmp_path).prompt_logits(ids), _engine(folder).prompt_logits(ids))


def test_a_missing_expert_is_refused_by_name(mixtral_folder, tmp_path):
    import shutil

    from safetensors.torch import save_file
    folder, _ = mixtral_folder
    weights = read_safetensors(str(folder))
    del weights["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        _engine(tmp_path)


def test_int8_mixtral_serves_its_dequantized_weights(mixtral_folder):
    """A quantized MoE model end to end: int8 experts (every step through their float copy,
    which holds exactly the int8 weights) against transformers on those same weights."""
    import copy
    folder, reference = mixtral_folder
    engine = _engine(folder, quantization="int8", quant_max_rows=0)
    model = engine.runner.model
    hf = copy.deepcopy(reference)
    with torch.no_grad():
        for ours, theirs in zip(model.layers, hf.model.layers):
            for e in range(8):
                theirs.mlp.experts.gate_up_proj[e].copy_(ours.moe.gate_up[e].weight)
                theirs.mlp.experts.down_proj[e].copy_(ours.moe.down[e].weight)
            cfg = engine.model_config
            nq = cfg.num_attention_heads * cfg.head_dim
            nk = cfg.num_key_value_heads * cfg.head_dim
            a = theirs.self_attn
            a.q_proj.weight.copy_(ours.qkv.weight[:nq])
            a.k_proj.weight.copy_(ours.qkv.weight[nq:nq + nk])
            a.v_proj.weight.copy_(ours.qkv.weight[nq + nk:])
            a.o_proj.weight.copy_(ours.o_proj.weight)
        hf.lm_head.weight.copy_(model.lm_head.weight)
    assert any(lin.packed is not None for lin in model.layers[0].moe.linears())
    ids = engine.tokenizer.encode("def add(a, b):\n    return a + b\n")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # float32 both sides on the same (int8-valued) weights: float32's tolerance
    assert relative_error(engine.prompt_logits(ids), ref) < 1e-4


def test_config_replace_keeps_moe_checks():
    cfg = config_from_hf(transformers.MixtralConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        architectures=["MixtralForCausalLM"]).to_dict())
    with pytest.raises(ValueError, match="router"):
        dataclasses.replace(cfg, router="hash")
    with pytest.raises(ValueError, match="groups"):
        dataclasses.replace(cfg, router_groups=3)
