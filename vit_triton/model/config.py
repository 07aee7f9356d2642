"""ViTConfig: one dataclass that describes every supported Vision Transformer."""

from __future__ import annotations

from dataclasses import asdict, dataclass

POOLS = ("token", "avg", "map")
# The MLP's, each one of the linear kernel's epilogues; "swiglu" is gated: silu(x Wg^T) * (x Wv^T), fc1 twice as tall.
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
# How the position table is resampled to another patch grid, as each library does it (model/pos_embed.py).
POS_RESAMPLES = ("bicubic_float32_antialias", "bicubic_float32", "bicubic", "bucket")
# Rotary position embeddings, each as its library builds the tables (model/rope.py).
ROPES = ("none", "axial", "mixed", "centered", "centered_inv_freq")
# BEiT's relative position bias on the attention scores (model/rel_pos_bias.py): none, a table per block, one for all.
REL_POS_BIASES = ("none", "block", "shared")


@dataclass(frozen=True)
class ViTConfig:
    """The shape and the variant choices of a ViT; defaults are ViT-B/16 at 224 px (timm's).

    pool "token" takes the class token, "avg" the mean of the patch tokens, "map" an attention-pool head
    (model.attention_pool: one learned query, the blocks' heads, MLP width and activation). fc_norm moves the
    final LayerNorm after the pooling (timm's avg-pool models); final_norm=False drops it.
    pos_embed_prefix: the position embedding also covers the prefix tokens (timm's default;
    False is no_embed_class). pre_norm adds a LayerNorm before the blocks (CLIP), where the patch
    projection has no bias (patch_bias=False). dist_token adds DeiT's distillation token right after
    the class token; head_dist gives it a classifier of its own, whose logits are averaged with the
    head's, and makes the pooled embedding the mean of the two tokens (DeiT distilled, as timm).
    pos_resample: how the position embedding of the patches is resampled for images of another size than
    image_size, bicubically (align_corners=False) as the checkpoint's library does: "bicubic_float32_antialias"
    in float32 and antialiased (timm's resample_abs_pos_embed; transformers' Dinov2WithRegisters),
    "bicubic_float32" in float32 (transformers' Dinov2), "bicubic" in the table's own dtype (transformers' ViT,
    DeiT, CLIP, SigLIP, ViTMAE, InternVL); "bucket" picks, for each patch, the table row of the cell its fractional
    position falls in (transformers' Idefics3 and SmolVLM), at the checkpoint's own grid too.
    rope: rotary position embeddings on q and k of the patch tokens in every block (model/rope.py), "none" for
    none; "axial" as timm's RotaryEmbeddingCat (EVA02, RoPE-ViT axial, SBB): per axis, index * rope_theta^(-4k/Dh);
    "mixed" as timm's RotaryEmbeddingMixed (RoPE-ViT mixed): learned frequencies per layer and head, the model's
    rope_freqs; "centered" as timm's RotaryEmbeddingDinoV3: patch centres in [-1, 1], angle 2 pi c / rope_theta^(4k/Dh);
    "centered_inv_freq" as transformers' DINOv3ViT: 2 pi c * (1 / rope_theta^(4k/Dh)), which differs in last bits.
    rope_half pairs channels a half apart (i, i + Dh/2) instead of (2i, 2i + 1), for a head dim that is a power of
    two up to 128; rope_xy orders the coordinates (column, row) instead of (row, column) (timm's rope_grid_indexing
    "xy"); rope_offset is added to every index or centre (timm's rope_grid_offset); rope_ref_grid (rows, cols),
    "axial" only, stretches the positions of any grid onto that one (EVA's ref_feat_shape). rope_cpu computes the tables on the CPU, then moves them, as timm's
    fixed-size models build theirs at creation; else on the device, as with timm's dynamic_img_size and in
    transformers (a GPU's sin and cos differ from the CPU's in last bits).
    abs_pos_embed=False: no absolute position embedding (models with rotary embeddings only). norm: "layernorm" or
    "rmsnorm" (no bias, no mean subtracted) for every norm of the model. proj_bias, mlp_bias: the attention output
    projection's and the MLP's biases. act "swiglu": a gated MLP, fc2(silu(gate) * value), mlp_dim the gated width;
    mlp_norm adds a norm over that width before fc2 (EVA02's scale_mlp sub-norm).
    embed_norm: a norm of the patch embeddings before the position embedding is added (AIMv2's: timm's
    embed_norm_layer, transformers' Aimv2VisionEmbeddings.rms_norm); no prefix tokens. pos_sincos: the absolute
    position embedding is no parameter but a fixed 2-D sin-cos table built for each patch grid as transformers'
    AIMv2 (is_native) builds it: [sin(c w) | cos(c w) | sin(r w) | cos(r w)] for the patch at row r and column c,
    over the D/4 frequencies w_k = 10000^(-k / (D/4)), in float64, then rounded to the model's dtype (no prefix
    tokens, D a multiple of 4). pool "map" without pool_query_proj: the learned query attends as it is, with no q
    projection; without pool_mlp: the pool's output is its proj, with no norm and MLP after it (both off:
    transformers' Aimv2AttentionPoolingHead). pool_heads, pool_mlp_dim: the attention pool's heads and MLP width where
    they are not the blocks' (timm's attn_pool_num_heads, attn_pool_mlp_ratio: Perception Encoder); 0: the blocks'.
    attn_norm: a norm of the attention's output before its projection (EVA02-CLIP: timm's scale_attn_inner).
    embed_proj_bias: the embedding projection (proj_dim) has a bias (OpenCLIP's timm towers, whose projection is the
    timm model's head).
    layer_scale: LayerScale in every block (DeiT III, DINOv2, DINOv3, EVA02-L, the RoPE ViTs): a learned per-channel
    gamma (the blocks' ls1 and ls2) multiplying the attention's and the MLP's output before the residual add, in
    the proj and fc2 GEMMs' epilogues.
    key_bias=False: the key projection has no bias (DINOv3, timm's Eva, BEiT): the key third of the blocks' qkv.bias
    holds zeros, and no gradient reaches it.
    rel_pos_bias: BEiT's relative position bias, a learned [H, T, T] bias added to each head's attention scores,
    gathered from a table of one value per head for each offset between two patches of the checkpoint's grid (and
    three for the class token's row, column and itself): "block" a table in every block (blocks.i.rel_pos_table),
    "shared" one for all blocks (rel_pos_table: transformers' use_shared_relative_position_bias, timm's
    use_shared_rel_pos_bias), "none" none. The table is learned for the grid of image_size only, which the pixels
    must then make; it needs the class token as the only prefix token.
    Training only (model.train(), timm's names and semantics): drop_path_rate, stochastic depth, the largest rate
    of the linear ramp 0 .. drop_path_rate over the blocks (each block's attention and MLP branch dropped per image,
    the kept ones scaled by 1 / keep, in the proj and fc2 GEMMs' epilogues); drop_rate, dropout of the pooled
    features before the classifier; pos_drop_rate, dropout of the tokens after the position embedding. Dropout
    inside the blocks (timm's proj_drop_rate, attn_drop_rate) is not offered: the fused epilogues and the attention
    kernel have no per-element dropout.
    """

    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    qkv_bias: bool = True
    norm_eps: float = 1e-6
    act: str = "gelu"
    class_token: bool = True
    dist_token: bool = False
    reg_tokens: int = 0
    pos_embed_prefix: bool = True
    patch_bias: bool = True
    pre_norm: bool = False
    final_norm: bool = True
    fc_norm: bool = False
    pool: str = "token"
    num_classes: int = 0
    head_dist: bool = False
    proj_dim: int = 0
    pos_resample: str = "bicubic_float32_antialias"
    rope: str = "none"
    rope_theta: float = 10000.0
    rope_half: bool = False
    rope_xy: bool = False
    rope_offset: float = 0.0
    rope_ref_grid: tuple[int, int] | None = None
    rope_cpu: bool = False
    abs_pos_embed: bool = True
    norm: str = "layernorm"
    proj_bias: bool = True
    mlp_bias: bool = True
    mlp_norm: bool = False
    embed_norm: bool = False
    pos_sincos: bool = False
    pool_query_proj: bool = True
    pool_mlp: bool = True
    pool_heads: int = 0
    pool_mlp_dim: int = 0
    attn_norm: bool = False
    embed_proj_bias: bool = False
    layer_scale: bool = False
    key_bias: bool = True
    rel_pos_bias: str = "none"
    drop_path_rate: float = 0.0
    drop_rate: float = 0.0
    pos_drop_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size < self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be at least patch_size {self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} must be a multiple of num_heads {self.num_heads}")
        if not 16 <= self.head_dim <= 256:
            raise ValueError(f"head dim must be between 16 and 256, got {self.head_dim}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {self.act!r}")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.pos_resample not in POS_RESAMPLES:
            raise ValueError(f"pos_resample must be one of {POS_RESAMPLES}, got {self.pos_resample!r}")
        if self.pool == "token" and not self.class_token:
            raise ValueError("pool 'token' needs class_token=True")
        if self.fc_norm and not self.final_norm:
            raise ValueError("fc_norm is the final norm moved after pooling: it needs final_norm=True")
        if self.dist_token and not self.class_token:
            raise ValueError("dist_token follows the class token: it needs class_token=True")
        if self.head_dist and not (self.dist_token and self.num_classes and self.pool == "token"
                                   and not self.fc_norm):
            raise ValueError("head_dist needs dist_token=True, num_classes > 0, pool 'token' and no fc_norm")
        if self.proj_dim and self.num_classes:
            raise ValueError(f"a model has a classifier or an embedding projection, not both: got num_classes "
                             f"{self.num_classes} and proj_dim {self.proj_dim}")
        if (self.embed_norm or self.pos_sincos) and self.num_prefix_tokens:
            raise ValueError(f"embed_norm and pos_sincos cover the patches only: they need no prefix tokens, got "
                             f"{self.num_prefix_tokens} (class_token, dist_token, reg_tokens)")
        if self.pos_sincos and (not self.abs_pos_embed or self.embed_dim % 4):
            raise ValueError(f"pos_sincos needs abs_pos_embed=True and embed_dim a multiple of 4, got abs_pos_embed "
                             f"{self.abs_pos_embed} and embed_dim {self.embed_dim}")
        if not (self.pool_query_proj and self.pool_mlp) and self.pool != "map":
            raise ValueError(f"pool_query_proj and pool_mlp shape the attention pool: pool_query_proj=False or "
                             f"pool_mlp=False needs pool 'map', got pool {self.pool!r}")
        if self.pool_heads and self.pool != "map" or self.pool_mlp_dim and not (self.pool == "map" and self.pool_mlp):
            raise ValueError(f"pool_heads and pool_mlp_dim shape the attention pool: they need pool 'map' "
                             f"(pool_mlp_dim also pool_mlp), got pool {self.pool!r} and pool_mlp {self.pool_mlp}")
        if self.pool_heads and (self.embed_dim % self.pool_heads or not 16 <= self.embed_dim // self.pool_heads <= 256):
            raise ValueError(f"pool_heads must divide embed_dim {self.embed_dim} into heads of 16 to 256, got "
                             f"{self.pool_heads}")
        if self.embed_proj_bias and not self.proj_dim:
            raise ValueError("embed_proj_bias is the bias of the embedding projection: it needs proj_dim > 0")
        if self.rel_pos_bias not in REL_POS_BIASES:
            raise ValueError(f"rel_pos_bias must be one of {REL_POS_BIASES}, got {self.rel_pos_bias!r}")
        if self.rel_pos_bias != "none" and (not self.class_token or self.num_prefix_tokens != 1):
            raise ValueError(f"rel_pos_bias needs the class token as the only prefix token (its table has rows for it "
                             f"alone), got class_token {self.class_token}, dist_token {self.dist_token} and reg_tokens "
                             f"{self.reg_tokens}")
        for name in ("drop_path_rate", "drop_rate", "pos_drop_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        self._check_rope()

    def _check_rope(self) -> None:
        if self.rope not in ROPES:
            raise ValueError(f"rope must be one of {ROPES}, got {self.rope!r}")
        # Numbers as JSON gives them back (to_dict then json): the ref grid as a list, a theta as an int.
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if self.rope_ref_grid is not None:
            object.__setattr__(self, "rope_ref_grid", tuple(self.rope_ref_grid))
            if len(self.rope_ref_grid) != 2 or min(self.rope_ref_grid) < 1 or self.rope != "axial":
                raise ValueError(f"rope_ref_grid must be None or (rows, cols) of at least 1 with rope 'axial', got "
                                 f"{self.rope_ref_grid} with rope {self.rope!r}")
        if self.rope != "none" and (self.head_dim % 4 or self.rope_theta <= 0):
            raise ValueError(f"rope needs a head dim that is a multiple of 4 and rope_theta > 0, got head dim "
                             f"{self.head_dim} and rope_theta {self.rope_theta}")
        dh = self.head_dim
        if self.rope != "none" and self.rope_half and (dh & (dh - 1) or dh > 128):
            # the QKV GEMM rotates a pair within one output tile, which then holds whole heads (kernels.linear)
            raise ValueError(f"rope_half needs a head dim that is a power of two up to 128, got {dh}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def attn_pool_heads(self) -> int:
        """The attention pool's heads: pool_heads, else the blocks'."""
        return self.pool_heads or self.num_heads

    @property
    def attn_pool_mlp_dim(self) -> int:
        """The attention pool's MLP width: pool_mlp_dim, else the blocks'."""
        return self.pool_mlp_dim or self.mlp_dim

    @property
    def embedding_dim(self) -> int:
        """Width of the image embedding (ViT.embedding): the projection's, else the tokens'."""
        return self.proj_dim or self.embed_dim

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid (rows, columns) of image_size images, the one pos_embed is stored at."""
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.dist_token) + self.reg_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    def to_dict(self) -> dict:
        return asdict(self)


# Named shapes (timm's names), random weights; "tiny" is sized for Triton's CPU interpreter.
PRESETS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(image_size=40, patch_size=8, embed_dim=96, depth=2, num_heads=3, mlp_dim=160,
                      num_classes=10),
    "vit_small_patch16_224": ViTConfig(embed_dim=384, num_heads=6, mlp_dim=1536, num_classes=1000),
    "vit_base_patch16_224": ViTConfig(num_classes=1000),
    "vit_large_patch16_224": ViTConfig(embed_dim=1024, depth=24, num_heads=16, mlp_dim=4096, num_classes=1000),
    "vit_large_patch14_clip_336": ViTConfig(image_size=336, patch_size=14, embed_dim=1024, depth=24,
                                            num_heads=16, mlp_dim=4096, norm_eps=1e-5, pre_norm=True,
                                            patch_bias=False),
}
