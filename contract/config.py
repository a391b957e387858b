"""Frozen configuration: the model's shape (read from a checkpoint) and the engine's limits."""
from __future__ import annotations

from dataclasses import dataclass

from contract.rope import DEFAULT_ROPE, RopeScaling, yarn_mscale

HIDDEN_ACTS = ("silu", "gelu_tanh")  # the MLP's gate activation (runtime/models/llama.py)
# how a mixture-of-experts layer picks each token's experts (runtime/models/routing.py):
# softmax_topk: softmax over all experts, the k largest (Mixtral, Qwen2/3-MoE, DeepSeek-V2's
#   "greedy"); softmax_group_topk: DeepSeek-V2's "group_limited_greedy" (groups ranked by their
#   best probability); sigmoid_group_topk: DeepSeek-V3's sigmoid scores, chosen with the
#   correction bias added (groups ranked by the sum of their two best biased scores), weighted
#   without it
ROUTERS = ("softmax_topk", "softmax_group_topk", "sigmoid_group_topk")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; field names follow Hugging Face's `config.json`.

    The family's traits are fields too, so one decoder serves them all (runtime/models/
    llama.py): Qwen 3 and Gemma 3 normalise q and k per head (`qk_norm`); Gemma 3 also puts
    a norm after attention and around the MLP (`sandwich_norms`), gates with tanh-GELU, scales
    the embeddings, takes its attention scale from `query_pre_attn_scalar`, and runs most
    layers over a sliding window with their own rope base (`layer_windows`,
    `rope_local_theta`). Norm weights are stored as the multiplier itself: a checkpoint that
    keeps Gemma's (1 + w) form has it added at load. A mixture of experts (Mixtral, Qwen2/3-MoE)
    replaces the MLP of its MoE layers (`moe_layers`) by `num_experts` routed experts, of which
    each token runs `experts_per_token`, chosen and weighted by `router`, plus a shared expert
    where it has one (runtime/models/moe.py). DeepSeek-V2/V3 attend with Multi-head Latent
    Attention (`kv_lora_rank` > 0, runtime/models/mla.py): their KV cache holds one latent row
    per token (`kv_cache_heads`, `kv_cache_dim`, `kv_shared`), and `head_dim` is then the width
    of each head's rotated part (`qk_rope_head_dim`, what the rotary tables are built for)."""

    # "llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
    # "deepseek_v2", "deepseek_v3"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # how the file stores its matrices: "float", or the GGUF type most of them have ("Q4_1");
    # `--quantization auto` quantizes only what the file had quantized
    weight_format: str = "float"
    rope_scaling: RopeScaling = DEFAULT_ROPE  # of the global layers (contract/rope.py)
    qk_norm: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    # per layer, the window of keys a query sees (0: every earlier key); () for all global
    layer_windows: tuple[int, ...] = ()
    rope_local_theta: float | None = None  # rope base of the windowed layers (plain rope)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # mixture of experts (runtime/models/moe.py): 0 experts for a dense model
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # k: routed experts each token runs
    moe_intermediate_size: int = 0  # each routed expert's MLP width
    # the always-run expert's width (DeepSeek: moe_intermediate_size * n_shared_experts,
    # Qwen2-MoE: shared_expert_intermediate_size); 0: none
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False  # Qwen2-MoE: scaled by sigmoid(x . shared_expert_gate)
    router: str = "softmax_topk"  # one of ROUTERS
    router_normalizes: bool = False  # the k weights divided by their sum (norm_topk_prob)
    routed_scaling_factor: float = 1.0  # the routed experts' sum multiplied by this
    router_groups: int = 1  # experts split into this many groups (n_group) ...
    router_groups_kept: int = 1  # ... of which a token's experts come from the best (topk_group)
    # per layer, whether its MLP is the experts (DeepSeek's first_k_dense_replace and
    # moe_layer_freq, Qwen's decoder_sparse_step and mlp_only_layers); () with experts: all
    moe_layers: tuple[bool, ...] = ()
    # Multi-head Latent Attention (DeepSeek-V2/V3, runtime/models/mla.py); kv_lora_rank 0: none.
    # Each token's keys and values are made from one compressed latent of kv_lora_rank values
    # (kv_a_proj_with_mqa, then kv_a_layernorm) and one rotated key part of qk_rope_head_dim
    # values shared by every head: those two are what the cache holds. Per head, the key is
    # [qk_nope_head_dim values expanded from the latent | the shared rotated part], the value
    # v_head_dim values expanded from the latent (kv_b_proj holds both expansions).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # the query's own low-rank width (q_a_proj, q_b_proj); 0: one q_proj
    qk_nope_head_dim: int = 0  # each head's query/key part without position (from the latent)
    qk_rope_head_dim: int = 0  # each head's query/key part rotated by position (shared key)
    v_head_dim: int = 0  # each head's value width

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not served (one of "
                             f"{', '.join(HIDDEN_ACTS)})")
        if self.layer_windows and len(self.layer_windows) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for "
                             f"{self.num_hidden_layers} layers")
        if self.num_experts:
            self._check_experts()
        if self.kv_lora_rank:
            self._check_latent_attention()

    def _check_latent_attention(self) -> None:
        if min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1 \
                or self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ValueError("latent attention needs positive qk_nope_head_dim, v_head_dim and "
                             "an even qk_rope_head_dim")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(f"latent attention's head_dim is its rotated part "
                             f"({self.qk_rope_head_dim}), not {self.head_dim}")

    def _check_experts(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} is not served (one of "
                             f"{', '.join(ROUTERS)})")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.experts_per_token} experts per token of "
                             f"{self.num_experts}")
        if self.moe_intermediate_size < 1:
            raise ValueError("a mixture of experts needs moe_intermediate_size")
        if self.num_experts % self.router_groups or \
                not 0 < self.router_groups_kept <= self.router_groups:
            raise ValueError(f"{self.num_experts} experts in {self.router_groups} groups, "
                             f"{self.router_groups_kept} kept")
        if self.router_groups_kept * (self.num_experts // self.router_groups) \
                < self.experts_per_token:
            raise ValueError(f"the {self.router_groups_kept} groups kept hold fewer than "
                             f"{self.experts_per_token} experts")
        if self.moe_layers and len(self.moe_layers) != self.num_hidden_layers:
            raise ValueError(f"{len(self.moe_layers)} MoE layer flags for "
                             f"{self.num_hidden_layers} layers")
        if self.shared_expert_gated and not self.shared_expert_intermediate_size:
            raise ValueError("a shared expert gate without a shared expert")

    def window(self, layer: int) -> int:
        """How many keys (itself included) a query of `layer` sees; 0 for all."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed experts (else the dense MLP)."""
        if not self.num_experts:
            return False
        return self.moe_layers[layer] if self.moe_layers else True

    @property
    def is_latent_attention(self) -> bool:
        """Multi-head Latent Attention (DeepSeek-V2/V3) instead of per-head K/V."""
        return self.kv_lora_rank > 0

    @property
    def attention_scale(self) -> float:
        if self.is_latent_attention:
            # over the whole query/key head; YaRN with mscale_all_dim also sharpens the
            # softmax by its temperature squared (DeepSeek's and transformers' rule)
            scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
            r = self.rope_scaling
            if r.type != "default" and r.mscale_all_dim:
                scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_cache_heads(self) -> int:
        """Heads of each layer's cache rows: one latent row for latent attention."""
        return 1 if self.is_latent_attention else self.num_key_value_heads

    @property
    def kv_cache_dim(self) -> int:
        """Values per cache head: the latent and the rotated key part for latent attention."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_latent_attention \
            else self.head_dim

    @property
    def kv_shared(self) -> bool:
        """Whether one cache tensor serves as K and V (latent attention: the latent is both),
        so each layer allocates one tensor, not two."""
        return self.is_latent_attention

    @property
    def kv_tensors(self) -> int:
        """Cache tensors per layer: 1 where K and V share one, else 2."""
        return 1 if self.kv_shared else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the KV cache, over all layers, for one token in float32."""
        return self.kv_tensors * self.num_hidden_layers * self.kv_cache_heads \
            * self.kv_cache_dim * 4


# the named choices of EngineConfig's string settings, written once: the modules acting on
# them import these, and the config refuses any other name wherever an engine is configured
# (so the gateway refuses it at its start, not each worker as it starts)
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # runtime/loading/quantization.py
OVERLAP_MODES = ("auto", "on", "off")  # runtime/execution/overlap.py
THREAD_POLICIES = ("adaptive", "fixed")  # runtime/execution/thread_governor.py
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")  # runtime/execution/runner.py
_CHOICES = {"quantization": QUANTIZATIONS, "overlap": OVERLAP_MODES,
            "thread_policy": THREAD_POLICIES, "kv_cache_dtype": KV_CACHE_DTYPES}


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the scheduler and the KV pool. All counts are in tokens unless named otherwise."""

    block_size: int = 16
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running requests per step
    kv_cache_bytes: int = 1 << 30  # memory budget of the KV pool
    num_blocks: int | None = None  # overrides kv_cache_bytes when set (tests)
    # the longest prompt plus output of a request; None: the model's context, which it may
    # not exceed (runtime/engine.py refuses that at start, as vLLM does)
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    disk_cache_dir: str | None = None  # the prefix cache's disk tier; None turns it off
    disk_cache_bytes: int = 4 << 30  # size limit of the disk tier
    spec: str = "off"  # speculative decoding: off | ngram | self:L | draft:PATH | mtp[:K]
    num_spec_tokens: int = 4  # the most proposed tokens per request per step
    spec_max_batch: int = 4  # no speculation in steps decoding more requests than this
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    # the KV cache's elements: auto (float16 under a float32 model on the CPU, else the
    # model's dtype), float32, float16 or bfloat16 (runtime/execution/runner.py)
    kv_cache_dtype: str = "auto"
    # decode steps replay CUDA graphs on CUDA (runtime/execution/cuda_graphs.py)
    cuda_graphs: bool = True
    # auto | on | off: plan a step while the last runs (runtime/execution/overlap.py)
    overlap: str = "auto"
    thread_policy: str = "adaptive"  # adaptive | fixed (runtime/execution/thread_governor.py)
    # the inter-token budget (runtime/scheduling/itl_budget.py): while requests decode, a
    # step's prefill is capped to fit this many ms; 0 (the default): off, prefill chunks as
    # large as max_num_batched_tokens; None: automatic (from measured step costs), off by
    # default because on the 2-core CPU it cost more time to first token and throughput than
    # it took off the inter-token tail (docs/perf.md, bench/itl_tail.py)
    itl_target_ms: float | None = 0.0
    quantization: str = "auto"  # auto | none | int8 | int4 (runtime/loading/quantization.py)
    # replaces the model's chat template: a Jinja template file, or the template text itself
    # (contract/tokenizer.load_chat_template); None keeps the model's own
    chat_template: str | None = None
    quant_max_rows: int | None = None  # steps of at most this many rows use the quantized
    # kernel; None: measured per weight shape at start (runtime/loading/calibration.py)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.itl_target_ms is not None and not self.itl_target_ms >= 0:
            raise ValueError(f"itl_target_ms must be >= 0 (0: off), not {self.itl_target_ms}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, not {self.max_model_len}")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
