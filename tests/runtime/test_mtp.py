"""`--spec mtp`: DeepSeek's multi-token-prediction layer as a proposer (runtime/models/mtp.py,
runtime/spec_decode/mtp_drafter.py), on the tiny DeepSeek-V3 of testkit/family_models.py with a
random MTP layer added as DeepSeek ships it (testkit `add_mtp_layer`).

With random weights the drafts are rarely accepted: the proof is exactness (greedy outputs equal
to speculation off, chunked prefill, batching and prefix hits included), the accounting, and the
module's first drafts equal to the formula computed directly from the checkpoint's tensors."""
from __future__ import annotations

import copy

import pytest
import torch

from contract.config import EngineConfig
from contract.sampling_params import SamplingParams
from runtime.spec_decode.config import SpecConfig
from runtime.spec_decode.governor import Governor
from testkit.family_models import add_mtp_layer, write_family_checkpoint

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=24, max_num_seqs=4,
              kv_cache_dtype="float32", spec_max_batch=8)
PROMPTS = [list(range(5, 60)), [7, 9, 11] * 9, [3, 4], list(range(100, 130))]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from runtime.loading.loader import load_checkpoint
    folder = tmp_path_factory.mktemp("deepseek_v3_mtp")
    reference = write_family_checkpoint(folder, "deepseek_v3")
    added = add_mtp_layer(folder)
    return folder, load_checkpoint(str(folder), keep_mtp=True), reference, added


def _engine(checkpoint, **overrides):
    from runtime.engine import LLMEngine
    return LLMEngine(checkpoint, EngineConfig(**{**ENGINE, **overrides}))


@pytest.fixture
def always_speculate(monkeypatch):
    """The governor would pause a drafter this poor after a step or two: every decode step
    verifies the most drafts allowed, so the module's cache is exercised on every step."""
    monkeypatch.setattr(Governor, "best_k", lambda self, rate: (self.config.num_tokens, 2.0))


def test_flag_parsing():
    assert SpecConfig.parse("mtp").method == "mtp"
    assert SpecConfig.parse("mtp", num_tokens=4).num_tokens == 4
    assert SpecConfig.parse("mtp:3").num_tokens == 3
    for bad in ("mtp:0", "mtp:x", "mtp:", "mtp2"):
        with pytest.raises(ValueError):
            SpecConfig.parse(bad)


def test_mtp_tensors_kept_only_when_asked(mtp_model):
    from runtime.loading.loader import load_checkpoint
    folder, checkpoint, _, added = mtp_model
    assert set(added) <= set(checkpoint.weights)
    plain = load_checkpoint(str(folder))
    assert not [n for n in plain.weights if n.startswith("model.layers.3.")]


def test_checkpoint_without_mtp_refused(mtp_model, tmp_path):
    from runtime.engine import LLMEngine
    from runtime.loading.loader import load_checkpoint
    folder, _, _, _ = mtp_model
    write_family_checkpoint(tmp_path / "plain", "deepseek_v3")
    for checkpoint in (load_checkpoint(str(tmp_path / "plain"), keep_mtp=True),
                       load_checkpoint(str(folder))):  # the layer skipped at load
        with pytest.raises(ValueError, match="no multi-token-prediction layer"):
            _engine(checkpoint, spec="mtp")
    # the engine's own load keeps the layer when --spec mtp is asked for
    engine = LLMEngine.from_model_path(str(folder), EngineConfig(**{**ENGINE, "spec": "mtp"}))
    assert engine.runner.drafter is not None and engine.runner.drafter.follows_target


@pytest.mark.parametrize("spec,overrides", [("mtp:1", {}), ("mtp:3", {}),
                                             ("mtp:2", {"num_blocks": 24})])  # preemption
def test_greedy_identical_and_accounting(mtp_model, always_speculate, spec, overrides):
    """Several sequences batched with chunked prefill, then the first prompt again (a prefix
    hit): tokens equal to speculation off; accepted <= drafted, per-position counts summing
    to the accepted ones and never rising with the position; nothing leaked."""
    _, checkpoint, _, _ = mtp_model
    base = _engine(checkpoint, **overrides)
    expected = base.generate(PROMPTS, GREEDY) + base.generate([PROMPTS[0]], GREEDY)
    engine = _engine(checkpoint, spec=spec, **overrides)
    got = engine.generate(PROMPTS, GREEDY)
    hits = engine.kv.stats.hits
    got += engine.generate([PROMPTS[0]], GREEDY)
    assert got == expected
    assert engine.kv.stats.hits > hits or overrides  # a tight pool evicted the prompt's
    c = engine.counters
    k = SpecConfig.parse(spec).num_tokens
    assert c.spec_drafts > 0 and c.spec_draft_tokens == k * c.spec_drafts or k > 1
    assert 0 <= c.spec_accepted_tokens <= c.spec_draft_tokens
    assert sum(c.spec_accepted_per_pos) == c.spec_accepted_tokens
    assert len(c.spec_accepted_per_pos) <= k
    assert all(a >= b for a, b in zip(c.spec_accepted_per_pos, c.spec_accepted_per_pos[1:]))
    snap = engine.snapshot()  # what the stats endpoint reports
    assert snap["spec_draft_tokens"] == c.spec_draft_tokens
    assert snap["spec_accepted_per_pos"] == c.spec_accepted_per_pos
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    if overrides:
        assert c.num_preemptions > 0


def _reference_logits(reference, added: dict[str, torch.Tensor], tokens: list[int]
                      ) -> torch.Tensor:
    """The MTP formula on the checkpoint's tensors, for every position i of `tokens` but the
    last: logits of t_{i+2} = head(norm(block(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]))))
    with h_i the main model's hidden state before its final norm (transformers' model), the
    block a transformers DeepSeek-V3 decoder layer holding the MTP layer's weights (causal,
    positions 0, 1, ...)."""
    cfg = reference.config
    p = f"model.layers.{cfg.num_hidden_layers}."
    mtp = {n[len(p):]: t for n, t in added.items()}
    block = copy.deepcopy(reference.model.layers[1])  # an MoE layer of the same shapes
    own = block.state_dict()
    state = {n: t for n, t in mtp.items() if n in own}
    e = "mlp.experts."
    state[e + "gate_up_proj"] = torch.stack([torch.cat([
        mtp[f"{e}{i}.gate_proj.weight"], mtp[f"{e}{i}.up_proj.weight"]])
        for i in range(cfg.n_routed_experts)])
    state[e + "down_proj"] = torch.stack([mtp[f"{e}{i}.down_proj.weight"]
                                          for i in range(cfg.n_routed_experts)])
    block.load_state_dict(state, strict=True)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    captured: dict[str, torch.Tensor] = {}
    hook = reference.model.norm.register_forward_hook(
        lambda module, args, out: captured.setdefault("h", args[0]))
    with torch.no_grad():
        reference(torch.tensor([tokens]))
        hook.remove()
        h = captured["h"][0, :-1]  # h_i, i = 0 .. T-2
        emb = reference.model.embed_tokens.weight[torch.tensor(tokens[1:])]  # t_{i+1}
        x = torch.cat([rms(emb, mtp["enorm.weight"]), rms(h, mtp["hnorm.weight"])], dim=-1)
        x = (x @ mtp["eh_proj.weight"].T)[None]
        positions = torch.arange(x.shape[1])[None]
        cos_sin = reference.model.rotary_emb(x, positions)
        out = block(x, attention_mask=None, position_ids=positions,
                    position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return rms(out[0], mtp["shared_head.norm.weight"]) @ mtp["shared_head.head.weight"].T


@pytest.mark.parametrize("oracle", [False, True])
def test_first_draft_is_the_formula(mtp_model, always_speculate, oracle):
    """Every step's first draft logits (the module's output kept at the request's last row,
    its cache written through chunked prefill, decodes and rejected drafts) against the
    formula computed directly over the final sequence. `oracle`: the module still drafts
    (and writes its rows), but the proposals verified are replaced by the true continuation,
    all of it or its first token only by turns, so accepted positions' rows are checked too."""
    _, checkpoint, reference, added = mtp_model
    prompt = PROMPTS[0][:37]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    truth = prompt + _engine(checkpoint).generate([prompt], params)[0]
    engine = _engine(checkpoint, spec="mtp:2", max_num_batched_tokens=16)
    drafter = engine.runner.drafter
    seen: list[tuple[int, torch.Tensor]] = []
    propose, logits_of = drafter.propose, drafter.model.compute_logits

    def recording_propose(out, requests):
        first = {}

        def logits(g):
            result = logits_of(g)
            if not first:
                first["logits"] = result[0].clone()
            return result
        drafter.model.compute_logits = logits
        try:
            drafts = propose(out, requests)
        finally:
            drafter.model.compute_logits = logits_of
        starts = [s.start_position for s in out.scheduled if s.num_spec]
        if first and starts:
            seen.append((starts[0], first["logits"]))
        if oracle:
            for s in out.scheduled:
                if s.num_spec:
                    true = truth[s.start_position + 1:s.start_position + 1 + s.num_spec]
                    true += [0] * (s.num_spec - len(true))
                    if len(seen) % 2:  # the first right, the rest wrong
                        true = true[:1] + [(t + 1) % 400 for t in true[1:]]
                    drafts[s.request_id] = tuple(true)
        return drafts
    drafter.propose = recording_propose
    tokens = prompt + engine.generate([prompt], params)[0]
    assert tokens == truth
    assert len(seen) >= (3 if oracle else 4)
    accepted = engine.counters.spec_accepted_tokens
    assert accepted >= len(seen) if oracle else accepted <= engine.counters.spec_draft_tokens
    want = _reference_logits(reference, added, tokens)
    for start, got in seen:  # the step decoding position `start` drafted t_{start+1}
        ref = want[start - 1]
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4, start


def test_sampled_and_bfloat16_runs_leak_nothing(mtp_model, always_speculate):
    """Seeded sampling through rejection sampling (the drafts are greedy: q one-hot), and the
    module in bfloat16, and in the int8 served form: runs to the end, every block returned."""
    _, checkpoint, _, _ = mtp_model
    for overrides in ({}, {"dtype": "bfloat16", "kv_cache_dtype": "auto"},
                      {"quantization": "int8"}):
        engine = _engine(checkpoint, spec="mtp:2", **overrides)
        params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        out = engine.generate(PROMPTS, params)
        assert [len(o) for o in out] == [10] * len(PROMPTS)
        assert engine.counters.spec_draft_tokens > 0
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
