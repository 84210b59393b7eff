"""GPT-2 as published (Radford et al. 2019), written so that every parallel layout computes the same math.

- Pre-LayerNorm blocks, learned position embeddings, GELU (tanh), token embedding tied to lm_head,
  residual projections initialised with std 0.02/sqrt(2*n_layer), vocab padded to 50304.
- Attention keeps q, k and v as three linears (HF's fused c_attn is split on load) so that tensor
  parallelism can give each rank whole heads by sharding each of them by output columns.
- Init is a pure function of (seed, parameter name): `init_parameter` draws every tensor from its own
  CPU generator, so a model built on `meta` and materialised later, one module at a time, on any
  device or rank, gets exactly the eager weights.
- A Block's feed-forward is GPT-2's MLP, or on MoE Blocks (`GPTConfig.is_moe`) model/moe.py's `MoE`.
- The head and its loss, chunked over the rows (no (N, V) logits), are model/loss.py's (`head_output`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.loss import cross_entropy, head_output, linear_cross_entropy
from model.moe import MoE, SideLosses


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 (divides every TP size we use)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    # mixture of experts (`MoE`): 0 experts is GPT-2's dense MLP in every Block
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1  # Block i is an MoE Block when i % moe_every == moe_every - 1
    moe_ffn_hidden: int = 0  # each expert's hidden width (0: 4 * n_embd, GPT-2's MLP)
    moe_aux_loss_coeff: float = 0.0  # Switch / GShard load-balancing loss, added to the objective
    moe_bias_update_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing: the expert bias's step

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def is_moe(self, layer: int) -> bool:
        """Whether Block `layer` has an MoE feed-forward."""
        return self.moe_num_experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or 4 * self.n_embd


# Parameter counts are for the padded vocab, tied embedding counted once (see `GPT.num_params`).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64),  # 3.4M (3.2M of it the embedding)
    "small": GPTConfig(n_layer=6, n_head=6, n_embd=384),  # 30.4M
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124.5M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 354.9M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774.1M
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1557.7M
}


def make_config(preset: str, **overrides: int | float | None) -> GPTConfig:
    """The preset's config with any non-None override (n_layer, n_head, n_embd, block_size, ...) applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(GPTConfig)}
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None and k in known})


class AttentionCore(nn.Module):
    """Causal softmax attention of (B, nh, T, hs) queries, keys and values: the one place a wrapper swaps to
    change how attention sees the sequence (context parallelism: a ring over the ranks holding it)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.c_q = nn.Linear(C, C, bias=config.bias)
        self.c_k = nn.Linear(C, C, bias=config.bias)
        self.c_v = nn.Linear(C, C, bias=config.bias)
        self.c_proj = nn.Linear(C, C, bias=config.bias)
        self.head_dim = config.head_dim
        self.core = AttentionCore(
            config.dropout
        )  # context parallelism swaps in a ring (parallel/context_parallel/ring.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallelism the linears return this rank's heads only, hence -1 for the head count.
        q = self.c_q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.c_k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = self.c_v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = self.core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hs)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if config.is_moe(layer) else MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        x = x + self.drop(self.mlp(self.ln_2(x)))
        return x


def token_positions(T: int, device) -> torch.Tensor:
    """Absolute positions 0..T-1 of a sequence a rank holds whole: GPT's default `positions` (context
    parallelism swaps in its rank's share of a longer sequence)."""
    return torch.arange(T, device=device)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.head_loss = linear_cross_entropy  # (x, lm_head weight, targets) -> loss, chunked; vocab-parallel under TP
        self.loss_fn = cross_entropy  # (logits, targets) -> loss, for a head that runs whole (head_output)
        self.positions = token_positions  # (T, device) -> the T tokens' absolute positions

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Returns (logits (B, T, V), None) without targets; with them (None, loss), loss the mean cross-entropy
        over the B*T targets, computed with lm_head chunk by chunk over the rows (`head_output`), plus the MoE
        layers' balancing loss where it is on (`SideLosses`)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = self.positions(T, idx.device)
        # (B, T, C); under sequence parallelism both embeddings give only this rank's T/tp positions
        with SideLosses() as side:  # the MoE balancing loss, when on
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
        x = self.transformer.ln_f(x)  # (B, T, C)
        logits, loss = head_output(self, x, targets)  # logits (B, T, V) or this rank's vocab slice (loss parallel)
        return logits, loss if loss is None or side.total is None else loss + side.total

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (the tied embedding counted once); optionally without position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def init_weights(self, seed: int, device: torch.device | str | None = None) -> None:
        """Initialise (and, for a meta model, materialise) every parameter from (seed, name), one module
        at a time: embeddings, each Block, the final norm. lm_head shares wte's weight."""
        for prefix, module in self.init_units():
            materialize_module(module, prefix, self.config, seed, device)
        self.lm_head.weight = self.transformer.wte.weight

    def init_units(self) -> list[tuple[str, nn.Module]]:
        """(name, module) pairs that together own every parameter once, in forward order."""
        t = self.transformer
        return (
            [("transformer.wte", t.wte), ("transformer.wpe", t.wpe)]
            + [(f"transformer.h.{i}", b) for i, b in enumerate(t.h)]
            + [("transformer.ln_f", t.ln_f)]
        )

    @classmethod
    def from_hf_state_dict(
        cls, sd: dict[str, torch.Tensor], vocab_size: int | None = None, n_head: int | None = None
    ) -> "GPT":
        """Build our model from a transformers GPT2LMHeadModel state dict (config inferred from shapes).

        Shapes carry no head count: it is GPT-2's for the published widths (64-dim heads), else pass
        `n_head`.

        HF stores Linear weights as Conv1D (in, out), so they are transposed; its fused c_attn
        (C -> 3C) is split into c_q, c_k and c_v. The vocab is padded with zero rows to `vocab_size`
        (default: 50304 when HF has 50257 tokens, else unchanged).
        """
        sd = {k.removeprefix("transformer.") if k.startswith("transformer.") else k: v for k, v in sd.items()}
        n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("h."))
        hf_vocab, n_embd = sd["wte.weight"].shape
        n_head = n_head or _infer_n_head(n_embd)
        if vocab_size is None:
            vocab_size = 50304 if hf_vocab == 50257 else hf_vocab
        config = GPTConfig(
            block_size=sd["wpe.weight"].shape[0],
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            bias="ln_f.bias" in sd,
        )
        model = cls(config)
        ours = {}
        wte = torch.zeros(vocab_size, n_embd, dtype=sd["wte.weight"].dtype)
        wte[:hf_vocab] = sd["wte.weight"]
        ours["transformer.wte.weight"] = wte
        for k, v in sd.items():
            if k == "wte.weight" or k.endswith((".attn.bias", ".attn.masked_bias")) or k == "lm_head.weight":
                continue  # causal-mask buffers and the tied head
            if ".attn.c_attn." in k:
                prefix = "transformer." + k.split(".attn.c_attn.")[0] + ".attn."
                kind = k.rsplit(".", 1)[1]
                parts = (v.t() if kind == "weight" else v).chunk(3, dim=0)
                for name, part in zip(("c_q", "c_k", "c_v"), parts):
                    ours[f"{prefix}{name}.{kind}"] = part
                continue
            is_conv1d = k.endswith(".weight") and any(s in k for s in ("c_proj", "c_fc"))
            ours["transformer." + k] = v.t() if is_conv1d else v
        missing, unexpected = model.load_state_dict(ours, strict=False)
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"HF state dict does not match GPT-2: missing {missing}, unexpected {unexpected}")
        return model

    def to_hf_state_dict(self, hf_vocab: int = 50257) -> dict[str, torch.Tensor]:
        """The inverse of `from_hf_state_dict`: our weights in GPT2LMHeadModel's layout and names."""
        out = {}
        for k, v in self.state_dict().items():
            v = v.detach()
            if k == "lm_head.weight":
                continue
            if k == "transformer.wte.weight":
                out[k] = v[:hf_vocab].clone()
                continue
            if ".attn.c_q." in k:
                kind = k.rsplit(".", 1)[1]
                prefix = k.split(".attn.c_q.")[0]
                q, kk, vv = (self.state_dict()[f"{prefix}.attn.c_{n}.{kind}"] for n in "qkv")
                fused = torch.cat([q, kk, vv], dim=0)
                out[f"{prefix}.attn.c_attn.{kind}"] = (fused.t() if kind == "weight" else fused).contiguous()
                continue
            if ".attn.c_k." in k or ".attn.c_v." in k:
                continue
            is_conv1d = k.endswith(".weight") and any(s in k for s in ("c_proj", "c_fc"))
            out[k] = (v.t() if is_conv1d else v).contiguous()
        out["lm_head.weight"] = out["transformer.wte.weight"]
        return out


def _infer_n_head(n_embd: int) -> int:
    # HF's state dict carries no head count; GPT-2's published sizes all use 64-dim heads.
    known = {768: 12, 1024: 16, 1280: 20, 1600: 25}
    return known.get(n_embd, max(1, n_embd // 64))


# ----------------------------------------------------------------------------- init as a pure function


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, parameter name) alone, stable across processes and machines."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


INIT_ROW_BLOCK = 64  # rows drawn per generator: any row/column slice can be made without the rest


def init_parameter(
    name: str,
    shape: torch.Size | tuple[int, ...],
    config: GPTConfig,
    seed: int,
    rows: slice | None = None,
    cols: slice | None = None,
) -> torch.Tensor:
    """The fp32 CPU value of parameter `name` (full shape `shape`) under GPT-2's init rule, or only its
    [rows, cols] slice.

    Weights of Linear/Embedding: N(0, 0.02); residual projections (`*.c_proj.weight`): N(0, 0.02/sqrt(2L));
    biases: 0; LayerNorm: weight 1, bias 0; MoE experts' stacked (E, in, out) weights: each expert e drawn as the
    matrix `name[e]` (`rows` then slices experts: an expert-parallel rank draws only its own). Random weights are drawn
    in blocks of INIT_ROW_BLOCK rows,
    block b from a CPU generator seeded by (seed, name, b). The value depends on nothing else (not the
    device, the rank, or the order modules are built in), and a tensor-parallel rank can make just its
    shard: rows it owns cost only their blocks, a column slice is taken block by block.
    """
    rows = rows or slice(None)
    cols = cols or slice(None)
    if name == "lm_head.weight":  # tied to wte: the same values (and a pipeline's copy of it starts equal)
        name = "transformer.wte.weight"
    if ".ln_" in name or name.startswith("transformer.ln_f"):
        fill = 1.0 if name.endswith("weight") else 0.0
        return torch.full(shape, fill)[rows] if len(shape) == 1 else torch.full(shape, fill)[rows, cols]
    if name.endswith("bias"):
        return torch.zeros(shape)[rows]
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
    if len(shape) == 3:  # MoE experts stacked (E, in, out): each expert its own matrix, drawn under its own name
        E = range(*rows.indices(shape[0]))
        out = torch.empty(len(E), shape[1], shape[2])
        for i, e in enumerate(E):
            out[i] = _normal(f"{name}[{e}]", shape[1:], std, seed, slice(None), cols)
        return out
    return _normal(name, shape, std, seed, rows, cols)


def _normal(name: str, shape: tuple[int, ...], std: float, seed: int, rows: slice, cols: slice) -> torch.Tensor:
    """N(0, std) of the 2-D parameter `name`, its [rows, cols] slice, drawn INIT_ROW_BLOCK rows per generator."""
    n_rows, n_cols = shape
    r0, r1, _ = rows.indices(n_rows)
    full_width = cols == slice(None)
    out = torch.empty(max(r1 - r0, 0), len(range(*cols.indices(n_cols))))
    for b in range(r0 // INIT_ROW_BLOCK, (r1 + INIT_ROW_BLOCK - 1) // INIT_ROW_BLOCK):
        lo, hi = b * INIT_ROW_BLOCK, min((b + 1) * INIT_ROW_BLOCK, n_rows)
        gen = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, f"{name}#{b}"))
        if full_width and r0 <= lo and hi <= r1:  # a whole block: draw straight into the output
            out[lo - r0 : hi - r0].normal_(0.0, std, generator=gen)
        else:
            block = torch.empty(hi - lo, n_cols).normal_(0.0, std, generator=gen)
            a, z = max(r0, lo), min(r1, hi)
            out[a - r0 : z - r0] = block[a - lo : z - lo, cols]
    return out


def materialize_module(
    module: nn.Module, prefix: str, config: GPTConfig, seed: int, device: torch.device | str | None = None
) -> None:
    """Give `module` (named `prefix` inside GPT; may be on meta or another device) storage on `device` and
    init it.

    Only this module's own parameters are allocated, so a meta model can be materialised one Block at a
    time. lm_head.weight takes wte's values (init_parameter's rule for the tied matrix). A module partly on
    meta and partly on `device` (a dimension that cut some of its parameters drew its own slices of them
    already: expert parallelism's experts) keeps those: only the ones on meta are allocated and drawn. Buffers
    it allocates (the MoE layers' expert bias and step statistics) start at zero, as GPT's constructor makes
    them.
    """
    if device is None:
        device = next(module.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
    device = torch.device(device)
    params = list(module.named_parameters())
    if any(p.is_meta for _, p in params) and any(p.device == device for _, p in params):
        params = [(name, p) for name, p in params if p.is_meta]
        for name, p in params:  # a new Parameter for each, as to_empty makes for one on meta
            owner, _, attr = name.rpartition(".")
            setattr(
                module.get_submodule(owner),
                attr,
                nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad),
            )
        params = [(name, module.get_parameter(name)) for name, _ in params]
        for sub in module.modules():
            for name, b in sub._buffers.items():
                if b is not None and b.is_meta:
                    sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    elif any(p.is_meta or p.device != device for _, p in params):
        module.to_empty(device=device, recurse=True)  # meta, or built elsewhere: every value is written below
        params = list(module.named_parameters())
        for b in module.buffers():
            b.zero_()
    for name, p in params:
        full = f"{prefix}.{name}" if prefix else name
        with torch.no_grad():
            p.copy_(init_parameter(full, p.shape, config, seed))


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matmul weights and embeddings (at least 2 dims), not on biases (the experts' stacked
    biases are 2-D) or LayerNorms."""
    return p.dim() >= 2 and not name.endswith("bias")


def param_groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matmul weights and embeddings (`decays`), none on the rest."""
    decay = [p for n, p in named_params if decays(n, p)]
    no_decay = [p for n, p in named_params if not decays(n, p)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
