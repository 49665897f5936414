"""Activation memory per rank: the bytes autograd saves for backward during one micro-batch's forward.

[Note: the activation formula]
Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023,
arXiv:2205.05198), section 4: per layer s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations and 1-byte dropout
masks, s·b·h·(10 + 24/t + 5·a·s/(h·t)) under t-way tensor parallelism. We keep the paper's term-by-term derivation
but count every saved tensor at the dtype and in the number of copies it really has. Per token and layer, with h
hidden, I the MLP width, a heads, kv the key/value width, R the residual stream's bytes per element, E the matmuls'
bytes per element, t the tensor-parallel size and c the matmuls reading a norm's output:

- two norms: LayerNorm saves its input (R·h) and mean and rstd (8 bytes); Hugging Face's Python RMSNorm saves its
  input in fp32 (4·h, a copy when R = 2), the normalised values (R·h) and rstd (4 bytes). The output is the next
  matmuls' input, E·h, and under autocast each of the c matmuls casts, and saves, its own copy  (paper: 4 + 4)
- q, k, v: E·(h + 2·kv)/t                                                                        (paper: 4 + 2)
- the attention output, which is the out-projection's input: E·h/t                                 (paper: 2)
- scores: fused attention (SDPA, flash) saves only its log-sum-exp, 4·a/t bytes; eager attention saves the fp32
  softmax, 4·a·s/t, and under 16-bit compute its cast, E·a·s/t                       (paper: 5·a·s, dropout incl.)
- MLP: Linear-activation-Linear saves the activation's input and output, 2·E·I/t (Hugging Face's Python
  tanh-GELU saves 3 more intermediates); a gated MLP (SwiGLU) saves gate, its activation, up and their product,
  4·E·I/t                                                                             (paper: 8 + 8 with I = 4h)
- dropout, when above 0: a mask per residual branch, h elements each, of 1 byte on CUDA (``native_dropout``'s bool
  mask) but of the input's dtype on the CPU (torch multiplies by a noise tensor there); attention dropout is fused on
  CUDA, while on the CPU it sends SDPA to its math path, which computes in fp32 and saves q, k, v, the softmax, the
  mask and the dropped probabilities in fp32, 4·(h + 2·kv + 3·a·s)/t                          (paper: 1 + 1 + a·s)

Outside the layers, per token: token ids and targets (int64: 16 bytes), the final norm as above (its output is the
head's input), the cross entropy's fp32 log-probabilities 4·V (V/t under a vocabulary-parallel head; the paper's
4·s·b·v) and, with dropout, the embedding dropout's mask.

Precision (``lightning_colossal/precision.py``): ``32-true`` has R = E = 4 and ``bf16-true`` R = E = 2. Mixed
precision is autocast: the residual stream and the norms stay fp32 (R = 4) while matmul inputs are cast (E = 2), and
autocast also casts each matmul weight, whose 2-byte copy autograd saves (``cache_enabled=False``: no sharing across
calls). FSDP gathers its parameters in the compute dtype already, so nothing is cast there.

Ring attention (``sp_size`` ranks, ``sequence_parallel="ring"``): every rank holds ``1 / sp_size`` of each sequence,
so every per-token term above applies to ``tokens / sp_size``; the ring's own backward keeps its output in fp32 (the
fp32 accumulation it merges blocks in), which under a 16-bit compute dtype is a tensor beside the cast output the
out-projection reads: 4·h/t more per token (none in fp32, where they are one tensor). Nothing of another rank's tokens is kept: key/value blocks pass through and are sent again in backward
(``ring_exchange_bytes``).

With activation checkpointing each layer keeps only its input (R·h per token), and one layer's activations exist
again while it is recomputed in backward. Measured against the bytes of the tensors saved for backward
(``saved_tensors_hooks``) in ``tests/unit/test_plan.py`` and ``tests/distributed/test_plan_against_engines.py``;
docs/planner.md states the error.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.model_state import Training

__all__ = [
    "ActivationEstimate",
    "Workload",
    "activation_estimate",
    "layer_bytes_per_token",
    "outside_bytes_per_token",
    "ring_exchange_bytes",
]

INDEX_BYTES = 8  # int64 token ids and targets
FP32 = 4


@dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-batch.

    Args:
        micro_batch_size: sequences per rank per forward.
        sequence_length: tokens per sequence.
        activation_checkpointing: recompute each layer's activations in backward.
    """

    micro_batch_size: int
    sequence_length: int
    activation_checkpointing: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.sequence_length


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward on one rank, in parts (see [Note: the activation formula])."""

    layers: int
    outside_layers: int
    weight_copies: int

    @property
    def total(self) -> int:
        return self.layers + self.outside_layers + self.weight_copies


@dataclass(frozen=True)
class _Widths:
    """Bytes per element: the residual stream, the matmul inputs; whether autocast casts per matmul; mask bytes."""

    residual: int
    compute: int
    autocast: bool
    mask: int


def _widths(training: Training, dtype_bytes: int) -> _Widths:
    if training.precision == "32-true":
        residual, compute = FP32, FP32
    elif training.precision == "bf16-true":
        residual, compute = 2, 2
    else:
        residual, compute = FP32, 2
    mask = 1 if training.device_type == "cuda" else dtype_bytes or compute
    return _Widths(residual, compute, training.mixed, mask)


def compute_bytes(training: Training) -> int:
    """Bytes of one activation element in the compute dtype (2 under bf16, 4 under fp32)."""
    return _widths(training, 0).compute


def _norm_bytes(model: ModelShape, widths: _Widths, consumers: int) -> int:
    """One norm per token: what it saves, and its output as the input of its ``consumers`` matmuls."""
    hidden = model.architecture.hidden
    output = widths.compute * hidden * (consumers if widths.autocast else 1)
    if model.architecture.norm == "rmsnorm":
        return FP32 * hidden + widths.residual * hidden + 4 + output
    return widths.residual * hidden + 8 + output


def _attention_bytes(model: ModelShape, widths: _Widths, sequence_length: int, cpu: bool) -> float:
    """q, k, v, the output and what the score computation saves, per token, before the tensor-parallel split."""
    shape = model.architecture
    kv_width = shape.hidden // shape.heads * shape.kv_heads
    scores = shape.heads * sequence_length
    if shape.attention == "sdpa" and shape.dropout > 0 and cpu:
        # SDPA's math path, which computes in fp32: q, k, v, softmax, mask and dropped probabilities in fp32.
        return FP32 * (shape.hidden + 2 * kv_width) + widths.compute * shape.hidden + 3 * FP32 * scores
    saved = widths.compute * (2 * shape.hidden + 2 * kv_width)
    if shape.attention == "sdpa":
        return saved + FP32 * shape.heads  # fused kernels save only the log-sum-exp
    saved += scores * (FP32 + (widths.compute if widths.compute != FP32 else 0))
    if shape.dropout > 0:
        saved += scores * (widths.mask + widths.compute)  # the mask and the dropped probabilities
    return saved


def layer_bytes_per_token(
    model: ModelShape, training: Training, tp_size: int, sequence_length: int, ring: bool = False
) -> float:
    """Bytes one transformer layer saves per token (see [Note: the activation formula]); ``ring``: under ring
    attention."""
    shape = model.architecture
    widths = _widths(training, 0)
    norms = _norm_bytes(model, widths, shape.attention_input_matmuls)
    norms += _norm_bytes(model, widths, shape.mlp_input_matmuls)
    cpu = training.device_type == "cpu"
    attention = _attention_bytes(model, widths, sequence_length, cpu)
    if ring:
        # The ring keeps its fp32 output for backward; in fp32 that is the output it returns, otherwise a second
        # tensor beside the cast one the out-projection reads.
        attention += FP32 * shape.hidden if widths.compute != FP32 else 0
    mlp_tensors = 4 if shape.gated_mlp else shape.activation_saves + 1
    mlp = widths.compute * shape.intermediate * mlp_tensors
    masks = 2 * widths.mask * shape.hidden if shape.dropout > 0 else 0
    return norms + (attention + mlp) / tp_size + masks


def outside_bytes_per_token(model: ModelShape, training: Training, tp_size: int) -> float:
    """Bytes saved per token outside the layers: ids, targets, final norm (and head input), fp32 log-probabilities."""
    shape = model.architecture
    widths = _widths(training, 0)
    vocab = shape.vocab / tp_size if shape.vocab_parallel else shape.vocab
    # The embedding output is the residual stream (fp32 under autocast), and so is its dropout mask on the CPU.
    embedding_mask = _widths(training, widths.residual).mask * shape.hidden if shape.dropout > 0 else 0
    return 2 * INDEX_BYTES + _norm_bytes(model, widths, 1) + FP32 * vocab + embedding_mask


def _head_numel(model: ModelShape, tp_size: int) -> int:
    divisor = tp_size if model.architecture.vocab_parallel else 1
    return -(-model.architecture.vocab // divisor) * model.architecture.hidden


def _weight_copy_bytes(model: ModelShape, training: Training, tp_size: int, casts: bool, checkpointing: bool) -> int:
    """Autocast's saved 2-byte weight copies: every matmul weight, or with checkpointing one layer's and the head's."""
    if not training.mixed or not casts:
        return 0
    everything = model.matmul_weight_numel(tp_size)
    if not checkpointing:
        return 2 * everything
    head = _head_numel(model, tp_size)
    return 2 * ((everything - head) // max(model.architecture.layers, 1) + head)


def activation_estimate(
    model: ModelShape,
    training: Training,
    workload: Workload,
    tp_size: int = 1,
    casts_weights: bool = True,
    sp_size: int = 1,
) -> ActivationEstimate:
    """Bytes one rank saves for backward in one micro-batch (see [Note: the activation formula]).

    Args:
        model: the model.
        training: precision and device type.
        workload: micro-batch, sequence length, activation checkpointing.
        tp_size: tensor-parallel ranks splitting the layers (hybrid; 1 otherwise).
        casts_weights: whether autocast casts the weights (not under FSDP, which gathers them in the compute dtype).
        sp_size: ring-attention ranks each holding ``1 / sp_size`` of every sequence (hybrid; 1 otherwise).
    """
    tokens = workload.tokens / sp_size
    per_layer = layer_bytes_per_token(model, training, tp_size, workload.sequence_length, ring=sp_size > 1)
    layers = model.architecture.layers
    if workload.activation_checkpointing:
        residual = _widths(training, 0).residual
        layer_total = tokens * (layers * residual * model.architecture.hidden + per_layer)
    else:
        layer_total = tokens * layers * per_layer
    return ActivationEstimate(
        layers=round(layer_total),
        outside_layers=round(tokens * outside_bytes_per_token(model, training, tp_size)),
        weight_copies=_weight_copy_bytes(model, training, tp_size, casts_weights, workload.activation_checkpointing),
    )


def ring_exchange_bytes(model: ModelShape, training: Training, workload: Workload, tp_size: int, sp_size: int) -> int:
    """Bytes one rank sends per layer per micro-batch under ring attention over ``sp_size`` ranks: its key/value
    block (``sp_size - 1`` hops forward and again in backward, in the compute dtype) and the fp32 key/value gradient
    accumulators (``sp_size`` hops, back to their owner); see ``distributed/ring_attention.py``. 0 without a ring."""
    if sp_size == 1:
        return 0
    shape = model.architecture
    kv_width = shape.hidden // shape.heads * shape.kv_heads / tp_size
    block_elements = 2 * kv_width * workload.tokens / sp_size  # keys and values of this rank's tokens
    compute = _widths(training, 0).compute
    return round(block_elements * (2 * (sp_size - 1) * compute + sp_size * FP32))
