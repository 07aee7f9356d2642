"""FLOPs and the fewest bytes each kernel of one forward pass must move, counted from the config.

Model FLOPs count multiply-adds as 2 and only the matrix products: patch embedding, the QKV,
out, fc1 and fc2 projections, the two attention products (q k^T and p v) and the head. LayerNorm,
softmax, GELU and the epilogues are O(T*D) per image, under 1% for every supported shape, and are
left out, as is usual for MFU; the row kernels (LayerNorm, token mean) still carry their own
arithmetic (8 and 1 FLOPs an element) so that they can be placed on a roofline. Per image, with
T tokens, Np patches, width D, MLP width F, C*S*S values per patch and depth L:

    2*Np*D*C*S*S + L * (2*T*D*3D + 4*T*T*D + 2*T*D*D + 4*T*D*F) + 2*D*num_classes

with 6*T*D*F for a gated MLP (act "swiglu": fc1 is 2F wide).

Bytes are each kernel's inputs read once and outputs written once (weights included), the floor
for a kernel that cannot keep its operands on chip between launches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ViTConfig

MATMUL_KINDS = ("patch_embed", "linear", "fused_attention")


@dataclass(frozen=True)
class KernelCost:
    """One kernel launch of a forward pass, `count` times per pass; `dims` are the kernel's sizes."""

    name: str
    kind: str
    shape: str
    flops: int
    bytes: int
    count: int = 1
    dims: dict = field(default_factory=dict)

    @property
    def is_matmul(self) -> bool:
        return self.kind in MATMUL_KINDS


def model_flops(cfg: ViTConfig, batch: int = 1) -> int:
    """Matrix-product FLOPs of one forward pass of `batch` images (formula in the module doc)."""
    t, d, f = cfg.num_tokens, cfg.embed_dim, cfg.mlp_dim
    patch = 2 * cfg.num_patches * d * cfg.in_chans * cfg.patch_size ** 2
    mlp = (6 if cfg.act == "swiglu" else 4) * t * d * f
    block = 2 * t * d * 3 * d + 4 * t * t * d + 2 * t * d * d + mlp
    return batch * (patch + cfg.depth * block + 2 * d * cfg.num_classes)


def linear_cost(name: str, m: int, n: int, k: int, elem: int, bias: bool = True, residual: bool = False,
                act: str = "none", count: int = 1) -> KernelCost:
    """y = act(x [m, k] @ w[n, k]^T + b) (+ residual): y is [m, n], or [m, n / 2] gated ("swiglu")."""
    out = m * n // 2 if act == "swiglu" else m * n
    moved = m * k + n * k + out + (out if residual else 0) + (n if bias else 0)
    return KernelCost(name, "linear", f"{m}x{k} @ {k}x{n}", 2 * m * n * k, moved * elem, count,
                      dict(m=m, n=n, k=k, bias=bias, residual=residual, act=act))


def forward_costs(cfg: ViTConfig, batch: int, elem: int) -> list[KernelCost]:
    """Every kernel launch of one forward pass (blocks counted once, with count=depth), as the model runs
    them where no GEMM is split along K (kernels.split_k: fc2 at a few images, whose fp32 partial sums
    move more bytes than this floor)."""
    t, d, f, depth = cfg.num_tokens, cfg.embed_dim, cfg.mlp_dim, cfg.depth
    m, k_patch = batch * t, cfg.in_chans * cfg.patch_size ** 2
    pixels = batch * cfg.in_chans * cfg.image_size ** 2
    pos = (t if cfg.pos_embed_prefix else cfg.num_patches) * d if cfg.abs_pos_embed else 0
    rms = cfg.norm == "rmsnorm"
    bias = cfg.rel_pos_bias != "none"   # each head's score bias [H, T, T], read once a launch (then from L2)

    def ln(name, rows, count=1, width=d, post_add=0):   # post_add: the rows of a table added after the norm
        return KernelCost(name, "layer_norm", f"{rows}x{width}", 8 * rows * width,
                          (2 * rows * width + (1 if rms else 2) * width + post_add * width) * elem, count,
                          dict(m=rows, d=width, rms=rms, post_add=post_add))

    # With embed_norm (AIMv2) the norm of the patch embeddings adds the position table, not patch_embed.
    costs = [KernelCost("patch_embed", "patch_embed", f"{batch}x{cfg.in_chans}x{cfg.image_size}^2 -> {t}x{d}",
                        2 * batch * cfg.num_patches * d * k_patch,
                        (pixels + d * k_patch + m * d + (0 if cfg.embed_norm else pos) + cfg.num_prefix_tokens * d)
                        * elem, dims=dict(batch=batch))]
    if cfg.embed_norm:
        costs.append(ln("layer_norm embed", m, post_add=cfg.num_patches))
    if cfg.pre_norm:
        costs.append(ln("layer_norm pre", m))
    costs += [
        ln("layer_norm", m, 2 * depth),
        linear_cost("linear qkv", m, 3 * d, d, elem, bias=cfg.qkv_bias, count=depth),
        KernelCost("fused_attention", "fused_attention", f"{batch}x{cfg.num_heads}x{t}x{cfg.head_dim}",
                   4 * batch * t * t * d, (4 * m * d + bias * cfg.num_heads * t * t) * elem, depth,
                   dict(batch=batch, bias=bias)),
        linear_cost("linear proj +res", m, d, d, elem, bias=cfg.proj_bias, residual=True, count=depth),
        linear_cost(f"linear fc1 +{cfg.act}", m, 2 * f if cfg.act == "swiglu" else f, d, elem, bias=cfg.mlp_bias,
                    act=cfg.act, count=depth),
        linear_cost("linear fc2 +res", m, d, f, elem, bias=cfg.mlp_bias, residual=True, count=depth),
    ]
    if cfg.attn_norm:
        costs.append(ln("layer_norm attn", m, depth))
    if cfg.mlp_norm:
        costs.append(ln("layer_norm mlp", m, depth, width=f))
    if cfg.final_norm and not cfg.fc_norm:
        costs.append(ln("layer_norm final", m))
    if cfg.pool == "avg":
        costs.append(KernelCost("token_mean", "token_mean", f"{batch}x{t}x{d}", batch * cfg.num_patches * d,
                                (batch * cfg.num_patches * d + batch * d) * elem, dims=dict(batch=batch)))
    if cfg.fc_norm:
        costs.append(ln("layer_norm fc", batch))
    if cfg.num_classes:
        costs.append(linear_cost("linear head", batch, cfg.num_classes, d, elem))
    return costs
