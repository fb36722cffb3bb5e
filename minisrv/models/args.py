"""ModelArgs: the shape of a decoder model, read from a HF config (or a GGUF's metadata through transformers).

One decoder serves every architecture; what differs between them is read here: qkv bias (Qwen2), per-head q/k
norms (Qwen3), which layers have a sliding window (Mistral, Phi-3: all; Gemma 2: every other; Gemma 3: five in six),
Gemma's ways (the (1 + weight) RMSNorm, norms after attention and around the MLP, the scaled embedding, tanh-GELU,
soft-capped logits, the query scale, Gemma 3's rope base of its local layers), LongRoPE and partial rotary (Phi-3,
Phi-4), gpt-oss's attention sinks, output bias and YaRN rope, and for mixtures of experts which layers are sparse,
how many experts, how many a token takes, and whether their weights are renormalised (Qwen3-MoE, Mixtral, Qwen2-MoE's
shared expert, gpt-oss's biased router and experts with their clamped SwiGLU). Gemma3ForConditionalGeneration is
read as its language model (`text_config`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

ARCHITECTURE_OF_MODEL_TYPE = {  # config.json's model_type (what a GGUF's config carries) -> architecture
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
}
VISION_LANGUAGE = ("Gemma3ForConditionalGeneration",)  # served as their language model alone
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# what a Gemma3ForConditionalGeneration's text_config leaves out (transformers' Gemma3TextConfig defaults)
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                            query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4096,
                            sliding_window_pattern=6, max_position_embeddings=131072, rms_norm_eps=1e-6,
                            tie_word_embeddings=True)
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# their sliding_window applies when set (transformers masks Phi-3's, e.g. Phi-3-mini-4k's 2047, whenever it is set)
ALWAYS_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# a bare decoder without an LM head (what embedding checkpoints such as gte-Qwen name) -> its causal LM's name, so
# that the rest of the config is read as that model's; ModelArgs.base_model remembers it
BASE_MODELS = {"LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
               "MistralModel": "MistralForCausalLM"}
SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURE_OF_MODEL_TYPE.values())  # all served by the one decoder (llama.py)


class UnsupportedArchitecture(ValueError):
    pass


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(f"architecture {architecture!r} is not supported; supported: "
                                      f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (dense models, and a MoE model's dense layers)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]  # (LongRoPE's with its original_max_position_embeddings and factor)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    torch_dtype: Optional[str] = None
    eos_token_ids: List[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    sliding_window: Optional[int] = None  # attention window of the layers in sliding_layers; None: no window
    sliding_layers: Tuple[int, ...] = ()
    attn_logit_softcap: Optional[float] = None  # Gemma 2 (see attention_options.py)
    query_pre_attn_scalar: Optional[float] = None  # the softmax scale is its inverse square root (None: head_dim's)
    final_logit_softcap: Optional[float] = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # (1 + weight) RMSNorms, also after attention and around the MLP; embedding * sqrt(hidden)
    gemma_norms: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation: silu, or gelu_tanh (Gemma)
    local_rope_theta: Optional[float] = None  # Gemma 3's sliding layers: this rope base, without rope_scaling
    quantization_config: Optional[Dict[str, Any]] = None  # a quantised checkpoint's (see fp8.py)
    # mixture of experts (num_experts 0: a dense model)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none), scaled by a sigmoid gate
    moe_layers: Tuple[int, ...] = ()  # the sparse layers; the others have a dense MLP
    base_model: bool = False  # the config names a bare decoder (Qwen3Model, ...): an embedding model, no LM head
    partial_rotary_factor: float = 1.0  # the share of each head's dims the rotary turns (Phi-4-mini: 0.75)
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss: attention_options.py)
    o_proj_bias: bool = False  # the attention's output projection has a bias (gpt-oss)
    expert_bias: bool = False  # the router and the experts' gate/up and down products have biases (gpt-oss)
    swiglu_limit: Optional[float] = None  # gpt-oss's clamped SwiGLU (kernels/moe_gemm.ClampedSwiGLU); None: SiLU
    swiglu_alpha: float = 1.702

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that the rotary turns (the rest pass through), as transformers has it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any]) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", ""),
                                                                      cfg.get("model_type", "<none>"))
        if arch == "Gemma3ForConditionalGeneration":  # its language model; the vision tower is not read
            cfg = {**GEMMA3_TEXT_DEFAULTS, "eos_token_id": cfg.get("eos_token_id"),
                   "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"), **cfg.get("text_config", {})}
        base_model = arch in BASE_MODELS
        arch = BASE_MODELS.get(arch, arch)
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_scaling") or {})
        params = cfg.get("rope_parameters") or {}  # transformers >= 5 moves rope settings here
        local_theta = cfg.get("rope_local_base_freq")
        if "full_attention" in params:  # one set per layer type (Gemma 3)
            local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
            params = params["full_attention"]
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not rope and params.get("rope_type", "default") != "default":
            rope = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            rope = {}
        elif arch == "Phi3ForCausalLM" and kind in ("su", "yarn", "longrope"):  # older Phi-3 names for LongRoPE
            rope = _longrope(rope, cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        window, sliding = cfg.get("sliding_window"), _sliding_layers(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in QKV_BIAS))),
            qk_norm=arch in QK_NORM,
            torch_dtype=str(dtype).replace("torch.", "") if dtype else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            sliding_window=int(window) if window and sliding else None,
            sliding_layers=sliding if window else (),
            attn_logit_softcap=cfg.get("attn_logit_softcapping"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            gemma_norms=arch in GEMMA,
            hidden_act="gelu_tanh" if arch in GEMMA else "silu",
            local_rope_theta=float(local_theta) if local_theta else None,
            quantization_config=cfg.get("quantization_config") or None,
            base_model=base_model,
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))),
            # gpt-oss's own: sinks, biases on the attention's output, the router and the experts, the clamped
            # SwiGLU (its windowed layers come from layer_types; YaRN from its rope settings)
            **(dict(attention_sinks=True, o_proj_bias=bool(cfg.get("attention_bias", True)), expert_bias=True,
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702))) if arch == "GptOssForCausalLM" else {}),
            **_experts(arch, cfg),
        )


def _sliding_layers(arch: str, cfg: Dict[str, Any]) -> Tuple[int, ...]:
    """The layers with a sliding window, as transformers reads them: each layer's type where the config lists them
    (`layer_types`), else Gemma 2's even layers, Gemma 3's all but every `sliding_window_pattern`-th, Mistral's,
    Mixtral's and Phi-3's every layer, and Qwen2/3's layers from max_window_layers on when use_sliding_window is set."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    if arch == "Gemma2ForCausalLM":
        return tuple(range(0, n, 2))
    if arch in GEMMA:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(i for i in range(n) if (i + 1) % pattern)
    if arch in ALWAYS_WINDOWED:
        return tuple(range(n))
    if cfg.get("use_sliding_window", False):
        return tuple(range(int(cfg.get("max_window_layers") or 0), n))
    return ()


def _longrope(rope: Dict[str, Any], cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A LongRoPE scaling with what its cos/sin need: original_max_position_embeddings (the top-level config's in
    Phi-3 configs) and `factor`, from which the attention factor comes where the config gives none (transformers
    takes max_position_embeddings / original_max_position_embeddings then)."""
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if not original:
        raise ValueError("a longrope rope scaling needs original_max_position_embeddings")
    factor = rope.get("factor") or cfg.get("max_position_embeddings", original) / original
    return dict(rope, rope_type="longrope", original_max_position_embeddings=int(original), factor=factor)


def _experts(arch: str, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The mixture-of-experts fields of a config (none for a dense one). Mixtral and gpt-oss: every layer sparse,
    experts as wide as intermediate_size, weights renormalised (gpt-oss's softmax over its top-k logits is that).
    Qwen2/3-MoE: layer i is sparse unless it is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step; renormalised when norm_topk_prob."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    layers = cfg["num_hidden_layers"]
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        return dict(num_experts=experts, experts_per_token=int(cfg.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    moe_layers=tuple(range(layers)))
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))
