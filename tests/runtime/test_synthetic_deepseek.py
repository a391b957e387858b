"""bench/synthetic_deepseek.py's file, at its tiny preset: every tensor and key one llama.cpp
knows for `deepseek2`, the parameter count it prints equal to the file's, our engine's logits
and greedy tokens those of transformers' DeepseekV2 holding the weights the file holds
(gguf's own reader and dequantizers: testkit/family_gguf.py's `file_weights`), and, where
llama.cpp's server is built (bench/peers/build_llama_server.sh), that server loads the file and
answers a chat request."""
from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import gguf
import orjson
import pytest
import torch

from bench.synthetic_deepseek import config, parameters, write
from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from testkit.family_gguf import file_reference, file_weights
from testkit.family_models import reference_greedy
from testkit.tolerances import relative_error

pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
LAYERS = 3  # the dense first layer and two MoE layers
PROMPTS = [[300 + (i * 37) % 700 for i in range(24)], list(range(400, 470))]
STEPS = 32
LLAMA_SERVER = Path(os.environ.get("INFERSTACK_PEER_CACHE",
                                   Path.home() / ".cache" / "inferstack" / "llamacpp")) \
    / "build" / "bin" / "llama-server"


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("synthetic-deepseek") / "tiny-q8_0.gguf"
    write(path, config("tiny", LAYERS), Q.Q8_0)
    return path


def test_names_keys_and_parameter_count(tiny_file):
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    reader = gguf.GGUFReader(str(tiny_file))
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.DEEPSEEK2]}
    for t in reader.tensors:
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", t.name.rsplit(".", 1)[0]) in known, t.name
    keys = {v.replace("{arch}", "deepseek2") for group in vars(gguf.Keys).values()
            if isinstance(group, type) for v in vars(group).values() if isinstance(v, str)}
    assert all(name in keys for name in reader.fields if not name.startswith("GGUF."))
    # llama.cpp reads no q_lora_rank only at V2-Lite's depths (27, 26): here it says 0
    assert reader.fields["deepseek2.attention.q_lora_rank"].parts[-1][0] == 0
    names = {t.name for t in reader.tensors}
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.ffn_gate_exps.weight",
            "blk.2.ffn_down_shexp.weight", "blk.0.ffn_gate.weight"} <= names
    assert not any(n.startswith("blk.0.ffn_gate_inp") for n in names)  # layer 0 is dense
    matrices = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) > 1)
    assert matrices == parameters(config("tiny", LAYERS))[0]


def test_served_like_transformers(tiny_file):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from runtime.engine import LLMEngine

    model = DeepseekV2ForCausalLM(DeepseekV2Config(**config("tiny", LAYERS))).eval()
    file_weights(model, tiny_file)  # every weight the file's (its Q8_0 blocks undone)
    reference = file_reference(model, "deepseek_v2_lite")
    engine = LLMEngine.from_model_path(str(tiny_file), EngineConfig(
        num_blocks=96, block_size=4, max_num_batched_tokens=48, max_num_seqs=4,
        kv_cache_dtype="float32"))
    try:
        cfg = engine.model_config
        assert (cfg.num_experts, cfg.experts_per_token, cfg.kv_lora_rank, cfg.q_lora_rank) \
            == (8, 2, 64, 0)
        assert cfg.moe_layers == (False, True, True)
        for ids in PROMPTS:
            with torch.no_grad():
                ref = reference(torch.tensor([ids])).logits[0]
            assert relative_error(engine.prompt_logits(ids), ref) < 1e-4
        ours = engine.generate(PROMPTS, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                       ignore_eos=True))
        for ids, tokens in zip(PROMPTS, ours):
            assert tokens == reference_greedy(reference, ids, STEPS)
    finally:
        engine.close()


def test_expert_share_times_the_moe_blocks(tiny_file):
    """bench/expert_share.py's hooks: each part within its step, the block within the step,
    and one sequence runs exactly k experts in each MoE layer."""
    from bench.expert_share import expert_bytes, measure

    assert expert_bytes(str(tiny_file)) == 3 * 128 * 64 * 34 // 32  # Q8_0: 34 bytes a block
    one, two = measure(str(tiny_file), [1, 2], 3, 1 << 22)
    assert one.experts == [2 * 2] * 3  # 2 MoE layers x 2 experts a token
    assert all(4 <= n <= 8 for n in two.experts)
    for r in (one, two):
        assert len(r.step_s) == 3
        for step, block, router, routed in zip(r.step_s, r.block_s, r.router_s, r.routed_s):
            assert 0 < router + routed < block < step
        assert 0 < r.summary()["expert_share"] < r.summary()["moe_block_share"] < 1


@pytest.mark.subprocess
@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="llama.cpp's server is not built "
                    "(bench/peers/build_llama_server.sh)")
def test_llama_cpp_serves_the_file(tiny_file):
    from bench.gateway_servers import ServerProcess, free_port

    port = free_port()
    server = ServerProcess("llama.cpp", [str(LLAMA_SERVER), "-m", str(tiny_file), "--host",
                                         "127.0.0.1", "--port", str(port), "-np", "1", "-c",
                                         "512", "--threads", "1", "--no-webui"],
                           port, ready_timeout=60.0, ready_path="/health")
    try:
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = orjson.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 8
    finally:
        server.stop()
