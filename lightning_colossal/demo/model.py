"""A small nanoGPT-like causal language model in plain PyTorch.

The model is the workload of the README's main command, of the tests and of the benchmarks. Its submodule
names are a contract: tensor-parallel plans, wrap policies and pipeline splits are written against them.

```
GPT
  token_embedding     nn.Embedding(vocab_size, embed_dim)
  position_embedding  nn.Embedding(block_size, embed_dim)
  blocks              nn.ModuleList of Block
    attn_norm         nn.LayerNorm
    attn              CausalSelfAttention (qkv: fused nn.Linear, proj: nn.Linear)
    mlp_norm          nn.LayerNorm
    mlp               MLP (fc: nn.Linear, proj: nn.Linear)
  final_norm          nn.LayerNorm
  lm_head             nn.Linear(embed_dim, vocab_size, bias=False), tied to token_embedding when tie_weights
```

[Note: head-major fused qkv]
The fused ``qkv`` projection orders its output features as ``(head, {q, k, v}, head_dim)`` rather than
GPT-2's ``({q, k, v}, head, head_dim)``. Column-wise tensor parallelism shards a Linear's output features in
contiguous pieces; with the head-major order each piece holds the q, k and v of whole heads, so a colwise
``qkv`` followed by a rowwise ``proj`` is correct without any re-layout. The forward pass infers the number
of local heads from the feature count for the same reason.

[Note: initialisation without a second RNG draw]
``GPT.__init__`` builds its submodules on the meta device, moves them to the current default device with
``to_empty`` and then calls ``reset_parameters``. The torch layers' own initialisers therefore draw nothing
from the RNG, and ``GPT(config)`` after ``torch.manual_seed(s)`` gives exactly the weights of a model built
under ``torch.device("meta")``, materialised with ``to_empty`` and initialised with ``reset_parameters``
after the same ``torch.manual_seed(s)``. Strategies that materialise meta models rely on this to match the
single-process reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from lightning_colossal.parallel.policy import ModelPolicy

__all__ = ["GPT", "GPTConfig", "Block", "TRANSFORMER_BLOCK_CLASSES"]

_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: Number of token ids; 256 for the byte-level demo corpus.
        block_size: Longest sequence the model accepts (size of the learned position table).
        num_layers: Number of transformer blocks.
        num_heads: Number of attention heads; must divide ``embed_dim``.
        embed_dim: Width of the residual stream.
        mlp_ratio: Hidden width of the MLP as a multiple of ``embed_dim``.
        dropout: Dropout probability on embeddings, attention weights and residual branches.
        bias: Whether Linear and LayerNorm layers carry a bias (the LM head never does).
        tie_weights: Whether the LM head shares its weight with the token embedding.
    """

    vocab_size: int = 256
    block_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "num_layers", "num_heads", "embed_dim", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}; pass e.g. {name}=1.")
        if self.embed_dim % self.num_heads != 0:
            divisors = [heads for heads in range(1, min(self.embed_dim, 64) + 1) if self.embed_dim % heads == 0]
            lower = self.embed_dim // self.num_heads * self.num_heads
            nearby = [width for width in (lower, lower + self.num_heads) if width > 0]
            raise ValueError(
                f"GPTConfig.embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}. "
                f"Pick num_heads from {divisors} or an embed_dim that is a multiple of {self.num_heads} "
                f"(e.g. {' or '.join(map(str, nearby))})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}; pass e.g. dropout=0.0.")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.embed_dim // self.num_heads


class ScaledDotProductAttention(nn.Module):
    """Causal attention of ``[batch, heads, time, head_dim]`` queries, keys and values, with dropout on the weights
    while training. A module of its own (without parameters, so state dicts do not see it) because a parallel policy
    replaces the attention core whole, as ring attention does (``demo/parallel_policy.py``); a hook could not
    replace a function call inside ``forward``."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, causal=True"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused, head-major qkv projection (see the module Note)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=config.bias)
        self.core = ScaledDotProductAttention(config.dropout)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim, bias=config.bias)
        self.residual_dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(hidden)
        # Shapes from qkv, not hidden: under sequence parallelism the input is a sequence shard and qkv's output the
        # whole sequence (split-gather: the column-parallel qkv gathers it; Ulysses: a hook on qkv exchanges heads
        # for it, demo/parallel_policy.py).
        batch_size, sequence_length, _ = qkv.shape
        # -1 heads: under column-wise tensor parallelism this rank holds only its share of the heads.
        qkv = qkv.view(batch_size, sequence_length, -1, 3, self.head_dim)
        query, key, value = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [batch, heads, time, head_dim]
        attended = self.core(query, key, value)
        attended = attended.transpose(1, 2).reshape(batch_size, sequence_length, -1)
        return self.residual_dropout(self.proj(attended))


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear, GELU, Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden_dim = config.mlp_ratio * config.embed_dim
        self.fc = nn.Linear(config.embed_dim, hidden_dim, bias=config.bias)
        self.activation = nn.GELU()
        self.proj = nn.Linear(hidden_dim, config.embed_dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.activation(self.fc(hidden))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.embed_dim, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


# The block classes, for code that imports the demo. The engines never do: they read ``GPT._no_split_modules``.
TRANSFORMER_BLOCK_CLASSES: tuple[type[nn.Module], ...] = (Block,)


class GPT(nn.Module):
    """A GPT-2-style decoder-only language model.

    Args:
        config: The model shape.

    Example:
        >>> model = GPT(GPTConfig(num_layers=2))
        >>> model(torch.zeros(3, 16, dtype=torch.long)).shape
        torch.Size([3, 16, 256])

    [Note: the GPT declares its blocks and its policy]
    The engines find what they need from the demo GPT by declarations on the model, never by importing the demo
    (which imports Lightning): ``_no_split_modules`` names the repeated block class, as Hugging Face models do (FSDP
    shards each ``Block`` as its own unit, ``lightning_colossal/fsdp/wrap.py`` ``detect_block_classes``), and
    ``parallel_policy()`` returns the hybrid-parallel policy (``find_policy`` in
    ``lightning_colossal/parallel/policies.py`` asks every module for one before the built-in policies).
    """

    #: The repeated block class, by name, as Hugging Face models declare theirs (see the Note above).
    _no_split_modules = ["Block"]

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        target_device = torch.get_default_device()
        # Built on meta so the torch layers' own initialisers draw no random numbers; see the module Note
        # "initialisation without a second RNG draw".
        with torch.device("meta"):
            self.token_embedding = nn.Embedding(config.vocab_size, config.embed_dim)
            self.position_embedding = nn.Embedding(config.block_size, config.embed_dim)
            self.embedding_dropout = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
            self.final_norm = nn.LayerNorm(config.embed_dim, bias=config.bias)
            self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        self.to_empty(device=target_device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every parameter from the current torch RNG, GPT-2 style.

        Linear and Embedding weights draw from N(0, 0.02); the residual output projections (``attn.proj``,
        ``mlp.proj``) from N(0, 0.02 / sqrt(2 * num_layers)); biases are zero, LayerNorms are (1, 0).
        Parameters are drawn in module registration order, so the result depends only on the RNG state.
        Re-ties the LM head to the token embedding when ``tie_weights`` (``to_empty`` unties them).
        """
        if self.config.tie_weights and self.lm_head.weight is not self.token_embedding.weight:
            self.lm_head.weight = self.token_embedding.weight
        residual_std = _INIT_STD / math.sqrt(2 * self.config.num_layers)
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    if module is self.lm_head and self.config.tie_weights:
                        continue  # its weight is the token embedding, drawn once there
                    is_residual_projection = name.endswith((".attn.proj", ".mlp.proj"))
                    std = residual_std if is_residual_projection else _INIT_STD
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.Embedding):
                    nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)

    def parallel_policy(self) -> ModelPolicy:
        """The policy ``colossal_hybrid`` splits this model with (see [Note: the GPT declares its blocks and its
        policy])."""
        from lightning_colossal.demo.parallel_policy import GPTPolicy  # tensor-parallel layers load only when needed

        return GPTPolicy()

    def num_parameters(self) -> int:
        """Number of distinct parameter elements; a tied weight counts once."""
        # parameters() already de-duplicates shared Parameter objects.
        return sum(parameter.numel() for parameter in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            input_ids: Integer token ids of shape ``[batch, time]`` with ``time <= block_size``.

        Returns:
            Logits of shape ``[batch, time, vocab_size]``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"GPT expects input_ids of shape [batch, time], got shape {tuple(input_ids.shape)}.")
        sequence_length = input_ids.shape[1]
        if sequence_length > self.config.block_size:
            raise ValueError(
                f"Sequence length {sequence_length} exceeds block_size={self.config.block_size}; crop the input "
                f"to at most {self.config.block_size} tokens or build the model with a larger block_size."
            )
        positions = torch.arange(sequence_length, device=input_ids.device)
        hidden = self.embedding_dropout(self.token_embedding(input_ids) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.lm_head(self.final_norm(hidden))
