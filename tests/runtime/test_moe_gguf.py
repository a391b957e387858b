"""Mixtures of experts and DeepSeek as llama.cpp's converter writes their GGUF files
(testkit/family_gguf.py: stacked [E, N, K] expert tensors, routers, DeepSeek's MLA tensors in
either converter's form) and served from those files, against transformers on the same
weights: Qwen3-MoE (`qwen3moe`, with a dense middle layer), Mixtral (`llama` with experts, Q/K
interleaved), DeepSeek-V3 (`deepseek2`: sigmoid router with the correction bias in groups,
shared expert, leading dense layer, q_lora, kv_b split into attn_k_b / attn_v_b, YaRN) and
DeepSeek-V2-Lite (softmax router, no q_lora, the older attn_kv_b form). Float32 files within
float32 rounding; Q8_0 files against the weights the file holds, every expert served as its
own slice of the stacked tensor's blocks (no float copy)."""
from __future__ import annotations

import re

import gguf
import pytest
import torch

from contract.config import EngineConfig
from contract.errors import ModelLoadError
from contract.sampling_params import SamplingParams
from testkit.family_gguf import file_reference, file_weights, write_family_gguf
from testkit.family_models import reference_greedy, write_family_checkpoint
from testkit.tolerances import relative_error

pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 42, 99, 123, 7, 64, 88] * 3, list(range(40, 110))]
STEPS = 64


def _engine(path):
    from runtime.engine import LLMEngine

    return LLMEngine.from_model_path(str(path), EngineConfig(
        num_blocks=128, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
        kv_cache_dtype="float32"))


def _written(tmp_path, family: str, kind=Q.F32, split_kv_b: bool = True):
    folder = tmp_path / family
    model = write_family_checkpoint(folder, family)
    path = tmp_path / f"{family}-{kind.name}.gguf"
    write_family_gguf(path, family, model, folder / "tokenizer.json", kind, split_kv_b)
    reference = file_reference(model, family)
    if kind != Q.F32:
        file_weights(reference, path)  # the reference holds what the file holds
    return path, reference


# (family, type, DeepSeek's kv_b in the newer converter's split form)
CASES = [("qwen3_moe", Q.F32, True), ("qwen3_moe", Q.Q8_0, True),
         ("qwen3_moe", Q.Q4_0, True), ("mixtral", Q.F32, True),
         ("mixtral", Q.Q8_0, True), ("deepseek_v3", Q.F32, True), ("deepseek_v3", Q.Q8_0, True),
         ("deepseek_v2_lite", Q.F32, False), ("deepseek_v2_lite", Q.Q8_0, False)]
ARCH = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "deepseek_v3": "deepseek_v3",
        "deepseek_v2_lite": "deepseek_v2"}


@pytest.mark.parametrize(("family", "kind", "split"), CASES,
                         ids=lambda c: getattr(c, "name", str(c)))
def test_moe_gguf_matches_transformers(tmp_path, family, kind, split):
    path, reference = _written(tmp_path, family, kind, split)
    engine = _engine(path)
    try:
        cfg = engine.model_config
        assert cfg.architecture == ARCH[family] and cfg.num_experts == 8
        assert cfg.moe_layers == tuple(
            not (family == "qwen3_moe" and i == 1) and not (family.startswith("deepseek")
                                                            and i == 0) for i in range(3))
        if kind != Q.F32:  # every matrix, each expert included, served as the file's blocks
            linears = engine.runner.model.linears()
            assert len(linears) >= 2 * 8 * 2, family  # the experts are among them
            for lin in linears:
                assert lin.small is not None and lin.dense is None, family
        for ids in PROMPTS:
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0]
            assert relative_error(engine.prompt_logits(ids), ref) < 1e-4, family
        ours = engine.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                       ignore_eos=True))
        for ids, tokens in zip(PROMPTS, ours):
            assert tokens == reference_greedy(reference, ids, STEPS), family
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2_lite"])
def test_written_names_are_llama_cpps(tmp_path, family):
    """Every tensor the writer puts in the file is one gguf-py's constants list for the
    architecture (llama.cpp's own table), and every key is one of its `Keys`."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    path, _ = _written(tmp_path, family, split_kv_b=family != "deepseek_v2_lite")
    reader = gguf.GGUFReader(str(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    known = {TENSOR_NAMES[t] for a, name in MODEL_ARCH_NAMES.items() if name == arch
             for t in MODEL_TENSORS[a]}
    if family == "qwen3_moe":
        # the tiny model's dense middle layer (mlp_only_layers, which real Qwen3-MoE
        # checkpoints leave empty) under the converter's dense names: llama.cpp's qwen3moe
        # lists none, our loader reads it as a dense layer (no router: not a MoE layer)
        known |= {"blk.{bid}.ffn_gate", "blk.{bid}.ffn_up", "blk.{bid}.ffn_down"}
    for t in reader.tensors:
        base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name.rsplit(".", 1)[0])
        assert base in known, (family, t.name)
    keys = {v.replace("{arch}", arch) for group in vars(gguf.Keys).values()
            if isinstance(group, type) for v in vars(group).values() if isinstance(v, str)}
    for name in reader.fields:
        if not name.startswith("GGUF."):
            assert name in keys, (family, name)


def test_expert_slices_are_views_of_the_stack(tmp_path):
    """Expert e of a stacked Q8_0 tensor is read from its own byte range: its blocks equal
    the stack's e-th slice, dequantized by gguf."""
    from runtime.loading.gguf import open_gguf

    path, _ = _written(tmp_path, "qwen3_moe", Q.Q8_0)
    _, weights, _ = open_gguf(str(path))
    reader = gguf.GGUFReader(str(path))
    stack = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    floats = gguf.quants.dequantize(stack.data, stack.tensor_type).reshape(8, 64, 32)
    for e in (0, 5, 7):
        name = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        blocks = weights.blocks(name)
        assert blocks is not None and blocks.kind.startswith("int8")
        assert torch.equal(blocks.dequantized(), torch.from_numpy(floats[e]))


def test_unserved_expert_files_are_refused_by_name(tmp_path):
    from runtime.loading.gguf import open_gguf

    path, _ = _written(tmp_path, "deepseek_v3")
    reader = gguf.GGUFReader(str(path))
    # an unknown gating function
    bad = tmp_path / "bad-gating.gguf"
    _rewrite(reader, bad, {"deepseek2.expert_gating_func": 7})
    with pytest.raises(ModelLoadError, match="expert_gating_func 7"):
        open_gguf(str(bad))
    # V3's correction bias under softmax gating: no router of ours does that
    bad = tmp_path / "bad-bias.gguf"
    _rewrite(reader, bad, {"deepseek2.expert_gating_func": 1})
    with pytest.raises(ModelLoadError, match="exp_probs_b"):
        open_gguf(str(bad))
    # a stack whose expert count is not the file's
    bad = tmp_path / "bad-count.gguf"
    _rewrite(reader, bad, {"deepseek2.expert_count": 4, "deepseek2.expert_used_count": 2,
                           "deepseek2.expert_group_count": 2,
                           "deepseek2.expert_group_used_count": 1})
    with pytest.raises(ModelLoadError, match="ffn_.*_exps.weight has expert layout"):
        open_gguf(str(bad))


def _rewrite(reader: gguf.GGUFReader, path, overrides: dict) -> None:
    """A copy of the file `reader` read with some integer keys replaced."""
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if field.name in overrides:
            writer.add_uint32(field.name, overrides[field.name])
        elif kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [str(bytes(field.parts[i]), "utf-8") if sub == gguf.GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(field.name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, str(bytes(field.parts[-1]), "utf-8"))
        else:
            writer.add_key_value(field.name, field.parts[-1].tolist()[0], kind)
    for name, value in overrides.items():
        if name not in reader.fields:
            writer.add_uint32(name, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=tuple(int(d) for d in t.data.shape),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size",
          "shared_expert_intermediate_size", "router", "router_normalizes",
          "routed_scaling_factor", "router_groups", "router_groups_kept",
          "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "head_dim", "num_key_value_heads", "intermediate_size", "qk_norm", "attention_scale",
          "architecture")


@pytest.mark.parametrize(("family", "split"), [("qwen3_moe", True), ("mixtral", True),
                                               ("deepseek_v3", True), ("deepseek_v3", False),
                                               ("deepseek_v2_lite", False)])
def test_file_config_is_the_folders(tmp_path, family, split):
    """The config read from the file equals the one read from the Hugging Face folder it was
    written from, field for field (the experts, the router, MLA's widths, the softmax scale)."""
    from runtime.loading.gguf import open_gguf
    from runtime.loading.hf import read_hf_folder

    path, _ = _written(tmp_path, family, split_kv_b=split)
    ours, _, _ = open_gguf(str(path))
    theirs, _, _ = read_hf_folder(str(tmp_path / family))
    for field in FIELDS:
        assert getattr(ours, field) == pytest.approx(getattr(theirs, field)), (family, field)
    layers = range(ours.num_hidden_layers)
    assert [ours.is_moe_layer(i) for i in layers] == [theirs.is_moe_layer(i) for i in layers]


def test_deepseek_v2_groups_are_group_limited_greedy(tmp_path):
    """A V2 file with expert groups (DeepSeek-V2's group_limited_greedy; V2-Lite has none)."""
    from runtime.loading.gguf import open_gguf

    path, _ = _written(tmp_path, "deepseek_v2_lite", split_kv_b=False)
    grouped = tmp_path / "grouped.gguf"
    _rewrite(gguf.GGUFReader(str(path)), grouped, {"deepseek2.expert_group_count": 4,
                                                   "deepseek2.expert_group_used_count": 2})
    config, _, _ = open_gguf(str(grouped))
    assert (config.router, config.router_groups, config.router_groups_kept) == \
        ("softmax_group_topk", 4, 2)
