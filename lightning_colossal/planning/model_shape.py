"""What the planner knows of a model: its trainable parameter shapes and its transformer shape.

A ``ModelShape`` comes from a real module built on the meta device (the demo GPT or a Hugging Face config: exact
shapes, tied weights counted once, blocks found the way FSDP finds them) or from a parameter count and a layer shape
(a Llama-like layout synthesised to that count). Torch, transformers and the demo are imported only by the source
that needs them, so ``import lightning_colossal.plan`` stays light.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Architecture", "ModelShape", "ParameterShape", "describe_module"]

NormKind = Literal["layernorm", "rmsnorm"]
AttentionKind = Literal["sdpa", "eager"]


@dataclass(frozen=True)
class ParameterShape:
    """One trainable parameter tensor.

    Args:
        name: its name in the model (the first name of a tied weight).
        shape: its whole shape.
        block: index of the repeated transformer block holding it (a sharding unit of FSDP), ``None`` outside blocks.
        tensor_parallel: whether ``colossal_hybrid`` splits it over the tensor-parallel ranks (Megatron: the
            matrices of the blocks, and vocabulary-parallel embeddings where the policy makes them so).
    """

    name: str
    shape: tuple[int, ...]
    block: int | None
    tensor_parallel: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tensor_parallel_shape(self, tp_size: int) -> tuple[int, ...]:
        """This parameter's shape on one tensor-parallel rank (the first dimension split, rounded up)."""
        if not self.tensor_parallel or tp_size == 1 or not self.shape:
            return self.shape
        return (math.ceil(self.shape[0] / tp_size), *self.shape[1:])


@dataclass(frozen=True)
class Architecture:
    """The transformer shape the activation estimate needs.

    Args:
        layers: repeated transformer blocks.
        hidden: width of the residual stream.
        heads: attention (query) heads.
        kv_heads: key/value heads (fewer than ``heads`` under grouped-query attention).
        intermediate: width of the MLP's hidden layer.
        vocab: vocabulary size (width of the logits).
        gated_mlp: a gated MLP (SwiGLU: gate and up projections) instead of Linear-activation-Linear.
        norm: ``"layernorm"`` (one fused op) or ``"rmsnorm"`` (Hugging Face's Python RMSNorm, which computes in fp32
            and saves its fp32 input and the normalised copy as well).
        attention: ``"sdpa"`` (fused attention: no score matrix is saved) or ``"eager"`` (scores are saved).
        dropout: the largest dropout probability of the model (masks are saved when it is above 0).
        attention_input_matmuls: matmuls reading the attention norm's output: 1 for a fused qkv, 3 for separate q,
            k, v projections (under autocast each casts, and saves, its own copy of the input).
        mlp_input_matmuls: matmuls reading the MLP norm's output: 1, or 2 for separate gate and up projections.
        activation_saves: tensors of the MLP width the activation function saves (besides its output, which the
            next matmul saves): 1 for a fused op (GELU, SiLU), 4 for Hugging Face's Python tanh-GELU (gelu_new).
        max_sequence: the longest sequence the model accepts (learned position table), ``None`` if unknown.
        tensor_parallel_policy: the ``colossal_hybrid`` policy that would split this model, ``None`` if none would.
        vocab_parallel: whether that policy splits the embedding and head over the vocabulary.
        experts: routed experts per mixture-of-experts layer (0: a dense model); each experts module stores them as
            fused 3-D weights ``[experts, ...]``, which expert parallelism (``ep_size``) divides.
        experts_per_token: experts each token is routed to (top-k).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    norm: NormKind
    attention: AttentionKind
    dropout: float
    attention_input_matmuls: int
    mlp_input_matmuls: int
    activation_saves: int
    max_sequence: int | None
    tensor_parallel_policy: str | None
    vocab_parallel: bool
    experts: int = 0
    experts_per_token: int = 0


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it.

    Args:
        description: one line naming the model and where its shape came from.
        parameters: the trainable parameters, each once, in registration order (the order the engines use).
        architecture: the transformer shape.
        source: ``"demo"``, ``"huggingface"``, ``"parameters"`` or ``"module"``.
    """

    description: str
    parameters: tuple[ParameterShape, ...]
    architecture: Architecture
    source: str

    @property
    def numel(self) -> int:
        return sum(parameter.numel for parameter in self.parameters)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [parameter.shape for parameter in self.parameters]

    def tensor_parallel_shapes(self, tp_size: int) -> list[tuple[int, ...]]:
        """Every parameter's shape on one tensor-parallel rank."""
        return [parameter.tensor_parallel_shape(tp_size) for parameter in self.parameters]

    def block_numels(self) -> list[int]:
        """Elements of each repeated block, in block order."""
        sizes: dict[int, int] = {}
        for parameter in self.parameters:
            if parameter.block is not None:
                sizes[parameter.block] = sizes.get(parameter.block, 0) + parameter.numel
        return [sizes[index] for index in sorted(sizes)]

    def matmul_weight_numel(self, tp_size: int = 1) -> int:
        """Elements of the weights used in matrix multiplications on one tensor-parallel rank: the blocks' matrices
        and the output head (a tied head is the embedding matrix, used once more as a Linear)."""
        blocks = sum(
            math.prod(parameter.tensor_parallel_shape(tp_size))
            for parameter in self.parameters
            if parameter.block is not None and len(parameter.shape) >= 2
        )
        head_divisor = tp_size if self.architecture.vocab_parallel else 1
        return blocks + math.ceil(self.architecture.vocab / head_divisor) * self.architecture.hidden


def _block_of_parameters(module: nn.Module) -> dict[int, int]:
    """``id(parameter) -> block index`` for the repeated blocks ``module`` declares in ``_no_split_modules`` (as
    Hugging Face models and the demo GPT do, and as ``lightning_colossal/fsdp/wrap.py`` reads them)."""
    block_classes: set[str] = set()
    for submodule in module.modules():
        block_classes.update(getattr(submodule, "_no_split_modules", None) or ())
    block_of: dict[int, int] = {}
    index = 0
    for submodule in module.modules():
        if type(submodule).__name__ not in block_classes:
            continue
        new = [parameter for parameter in submodule.parameters() if id(parameter) not in block_of]
        if not new:
            continue  # a block nested in a block already counted
        for parameter in new:
            block_of[id(parameter)] = index
        index += 1
    return block_of


def describe_module(
    module: nn.Module, description: str, architecture: Architecture, source: str = "module"
) -> ModelShape:
    """The planner's view of a real (meta or materialised) module: its trainable parameters, each once.

    Matrices inside blocks are marked tensor-parallel; so are the vocabulary-sized matrices outside blocks when the
    architecture says the policy splits the vocabulary.
    """
    block_of = _block_of_parameters(module)
    parameters = []
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue  # frozen parameters are held whole and get no gradient or optimizer state
        block = block_of.get(id(parameter))
        is_matrix = parameter.dim() >= 2
        vocabulary_matrix = is_matrix and block is None and parameter.shape[0] == architecture.vocab
        split = is_matrix and (block is not None or (architecture.vocab_parallel and vocabulary_matrix))
        parameters.append(ParameterShape(name, tuple(parameter.shape), block, split))
    if not parameters:
        raise ValueError(f"{description} has no trainable parameters: there is nothing to plan.")
    return ModelShape(description, tuple(parameters), architecture, source)
