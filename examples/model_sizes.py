"""The model sizes of examples/train.py (no jax import: bench/train_bench.py reads them too)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    d_ff: int
    seq: int  # training sequence length (tokens per example)
    batch_per_device: int
    lr: float  # peak learning rate
    tied: bool = False  # output head = embedding^T
    rope_theta: float = 10000.0
    vocab: int = 256  # set from the data (bytes: 256)
    remat: str = "dots"  # activation policy (tide_jax.remat_policy names): dots | none | full | ...
    reshard: bool = True  # free gathered parameters after each layer's forward, re-gather in the backward
    attention: str | None = None  # jax.nn.dot_product_attention's implementation: None (auto), "xla", "cudnn"
    experts: int = 0  # > 0: each layer's MLP is a top-k mixture of this many experts (SwiGLU, expert_ff wide)
    expert_ff: int = 0
    top_k: int = 2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (layers + output head), for MFU."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.heads * hd * 2 + d * self.kv_heads * hd * 2
        mlp = 3 * d * self.d_ff if not self.experts else d * self.experts + self.top_k * 3 * d * self.expert_ff
        return self.layers * (attn + mlp) + d * self.vocab

    def n_params(self) -> int:
        d = self.d_model
        embed = self.vocab * d * (1 if self.tied else 2)
        experts = self.layers * (self.experts - self.top_k) * 3 * d * self.expert_ff if self.experts else 0
        return self.matmul_params() - d * self.vocab + embed + (2 * self.layers + 1) * d + experts

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N (matmul params) + 12 L T d_attn (attention scores and
        values, forward + backward, causal mask not discounted: PaLM's convention)."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * self.seq * self.heads * self.head_dim


# Odd sizes in `tiny` on purpose: rows that do not divide by the device count get padded.
MODELS: dict[str, Config] = {
    "tiny": Config(d_model=64, layers=2, heads=4, kv_heads=2, d_ff=172, seq=64, batch_per_device=2, lr=3e-3),
    # tiny with a top-2 mixture of 4 experts as the MLP (--mesh fsdp=4,expert=2: 2 experts per device)
    "tiny-moe": Config(d_model=64, layers=2, heads=4, kv_heads=2, d_ff=0, seq=64, batch_per_device=2, lr=3e-3,
                       experts=4, expert_ff=44),
    "150m": Config(d_model=1024, layers=12, heads=16, kv_heads=8, d_ff=2816, seq=1024, batch_per_device=16, lr=6e-4),
    "1b": Config(d_model=2048, layers=16, heads=32, kv_heads=8, d_ff=8192, seq=2048, batch_per_device=8, lr=3e-4,
                 tied=True, rope_theta=500000.0),
    # Llama-3-8B's layer shapes; choose the depth with --layers to fit one or two GPUs.
    "8b-layers": Config(d_model=4096, layers=4, heads=32, kv_heads=8, d_ff=14336, seq=4096, batch_per_device=2,
                        lr=1.5e-4, rope_theta=500000.0),
}
