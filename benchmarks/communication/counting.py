"""Byte accounting of collectives and the textbook communication formulas, for ``benchmarks.communication``.

Pure: no torch, no processes. The rank side (``benchmarks/communication.py``) turns every dispatched ``c10d.*`` or
``_c10d_functional.*`` op into a record with ``OP_RULES``; everything after that (the ring model of the bytes a rank
sends, data against control, the sums by kind and phase, the formulas, the markdown) is here and unit-tested.

[Note: two conventions for communication bytes]
*Payload* is the whole tensor a collective reduces, assembles or moves, as handed to it: an all-reduce's input, an
all-gather's output (group size × its input), a reduce-scatter's input, a broadcast's tensor, a send's tensor. It
does not depend on the algorithm. *Wire* is what one rank sends under ring algorithms on a group of n ranks: an
all-reduce 2(n−1)/n of its payload (a ring reduce-scatter then a ring all-gather), an all-gather, reduce-scatter or
all-to-all (n−1)/n, a send all of it, a receive nothing. A broadcast is a chain: the source and every rank but the
last send the whole payload. The textbook figures ("DDP moves 2Ψ per rank", "ZeRO-3 3Ψ") are wire figures in
elements, 2Ψ(n−1)/n and 3Ψ(n−1)/n, which at n = 2 are Ψ and 1.5Ψ elements. The rank side also reads what the
process really wrote to its sockets (gloo's TCP transport), a third figure that needs no model at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONTROL_MAX_BYTES",
    "GLOO_HEADER_BYTES",
    "GLOO_REDUCE_SCATTER_AS_ALL_REDUCE",
    "KINDS",
    "NOT_COLLECTIVES",
    "OP_RULES",
    "Formula",
    "OpRule",
    "analyse_rank",
    "formula",
    "gloo_wire_bytes",
    "is_control",
    "markdown",
    "point_to_point_kind",
    "signature",
    "summarize_step",
    "wire_bytes",
]

# Collective kinds in table order.
KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send",
    "receive",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)

# A collective whose payload is at most this many bytes is "control": a loss scalar, a non-finite vote, a gradient
# norm, a bucket-order broadcast. Everything larger moves model state or activations ("data").
CONTROL_MAX_BYTES = 512


@dataclass(frozen=True)
class OpRule:
    """How to read one dispatcher op: its kind and which schema argument holds the whole payload.

    Args:
        kind: one of ``KINDS``.
        payload: name of the schema argument whose tensors make up the payload (for gathers, the gathered output;
            for reduce-scatters, the input).
        times_group: the payload is the named argument × the group size (functional all-gather: only its input is
            an argument).
        peer: name of the argument holding the root (broadcast, reduce, gather, scatter: a rank within the group),
            the destination (send) or the source (receive); ``None`` when every rank plays the same part.
        operations: name of the argument listing, per payload tensor, whether it is sent or received (a batch of
            point-to-point operations, one record each); ``None`` for a single collective.
    """

    kind: str
    payload: str
    times_group: bool = False
    peer: str | None = None
    operations: str | None = None


# Every collective op of torch 2.13's ``c10d`` and ``_c10d_functional`` namespaces, by ``str(func._overloadpacket)``.
# ``c10d.*`` is what ``torch.distributed.*`` calls, and what the C++ ``ProcessGroup`` methods dispatch to (so DDP's
# reducer shows up as ``c10d.allreduce_``); ``_c10d_functional.*`` is what DTensor and functional collectives call.
OP_RULES: dict[str, OpRule] = {
    "c10d.allreduce_": OpRule("all_reduce", "tensors"),
    "c10d.allreduce_coalesced_": OpRule("all_reduce", "tensors"),
    "c10d.allgather_": OpRule("all_gather", "output_tensors"),
    "c10d._allgather_base_": OpRule("all_gather", "output_tensor"),
    "c10d.allgather_coalesced_": OpRule("all_gather", "output_lists"),
    "c10d.allgather_into_tensor_coalesced_": OpRule("all_gather", "outputs"),
    "c10d.reduce_scatter_": OpRule("reduce_scatter", "input_tensors"),
    "c10d._reduce_scatter_base_": OpRule("reduce_scatter", "input_tensor"),
    "c10d.reduce_scatter_tensor_coalesced_": OpRule("reduce_scatter", "inputs"),
    "c10d.alltoall_": OpRule("all_to_all", "input_tensors"),
    "c10d.alltoall_base_": OpRule("all_to_all", "input"),
    "c10d.broadcast_": OpRule("broadcast", "tensors", peer="root_rank"),
    "c10d.reduce_": OpRule("reduce", "tensors", peer="root_rank"),
    "c10d.gather_": OpRule("gather", "output_tensors", peer="root_rank"),
    "c10d.scatter_": OpRule("scatter", "input_tensors", peer="root_rank"),
    "c10d.send": OpRule("send", "tensors", peer="dst"),
    "c10d.recv_": OpRule("receive", "tensors", peer="src"),
    "c10d.recv_any_source_": OpRule("receive", "tensors"),
    "c10d.barrier": OpRule("barrier", "tensor"),
    "c10d.monitored_barrier_": OpRule("barrier", "tensor"),
    "_c10d_functional.all_reduce": OpRule("all_reduce", "input"),
    "_c10d_functional.all_reduce_": OpRule("all_reduce", "input"),
    "_c10d_functional.all_reduce_coalesced": OpRule("all_reduce", "inputs"),
    "_c10d_functional.all_reduce_coalesced_": OpRule("all_reduce", "inputs"),
    "_c10d_functional.all_gather_into_tensor": OpRule("all_gather", "input", times_group=True),
    "_c10d_functional.all_gather_into_tensor_out": OpRule("all_gather", "input", times_group=True),
    "_c10d_functional.all_gather_into_tensor_coalesced": OpRule("all_gather", "inputs", times_group=True),
    "_c10d_functional.reduce_scatter_tensor": OpRule("reduce_scatter", "input"),
    "_c10d_functional.reduce_scatter_tensor_out": OpRule("reduce_scatter", "input"),
    "_c10d_functional.reduce_scatter_tensor_coalesced": OpRule("reduce_scatter", "inputs"),
    "_c10d_functional.all_to_all_single": OpRule("all_to_all", "input"),
    "_c10d_functional.broadcast": OpRule("broadcast", "input", peer="src"),
    "_c10d_functional.broadcast_": OpRule("broadcast", "input", peer="src"),
    "_c10d_functional.isend": OpRule("send", "tensor", peer="dst"),
    "_c10d_functional.irecv": OpRule("receive", "tensor", peer="src"),
    # A batch of sends and receives (op_list entries "isend"/"irecv", one per tensor): one record per entry.
    "_c10d_functional.batch_p2p_ops": OpRule("send", "tensors", peer="peer_list", operations="op_list"),
}


def point_to_point_kind(operation: str) -> str:
    """The kind of one entry of a batch of point-to-point operations (``isend``, ``irecv``, ...)."""
    return "receive" if "recv" in operation else "send"


# The reduce-scatters that torch's gloo backend sends as many bytes for as for an all-reduce of the whole input, 2(n−1)/n
# of the payload rather than (n−1)/n (measured by the benchmark's primitives launch). ``_reduce_scatter_base`` calls
# ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``, which all-reduces a copy of the input and keeps this rank's
# slice; the list form measures the same bytes.
GLOO_REDUCE_SCATTER_AS_ALL_REDUCE = frozenset(
    {
        "c10d._reduce_scatter_base_",
        "c10d.reduce_scatter_",
        "c10d.reduce_scatter_tensor_coalesced_",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.reduce_scatter_tensor_out",
        "_c10d_functional.reduce_scatter_tensor_coalesced",
    }
)

# Bytes of the header gloo's TCP transport writes before each message.
GLOO_HEADER_BYTES = 48

# Ops of those namespaces that move nothing themselves.
# ``_wrap_tensor_autograd`` is registered lazily, when DTensor's differentiable functional collectives first run.
NOT_COLLECTIVES = frozenset(
    {"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd", "c10d.check_for_nan"}
)


def wire_bytes(kind: str, payload_bytes: float, group_size: int, role: str | None = None) -> float:
    """Bytes this rank sends for one collective under ring (and chain) algorithms ([Note: two conventions for
    communication bytes]).

    Args:
        kind: one of ``KINDS``.
        payload_bytes: the collective's payload.
        group_size: ranks in its group (n).
        role: ``"root"`` or ``"other"`` for rooted collectives (broadcast, reduce, gather, scatter); ignored otherwise.

    Raises:
        ValueError: an unknown kind, or a rooted kind without its role.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload_bytes
    if kind == "send":
        return float(payload_bytes)
    if kind in ("receive", "barrier"):
        return 0.0
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        if role not in ("root", "other"):
            raise ValueError(f"a {kind} needs role='root' or role='other', got {role!r}")
        if kind == "broadcast":
            # A chain from the root: n − 1 of the n ranks send the whole payload (the root and all but the last).
            return float(payload_bytes) if role == "root" else (n - 2) / (n - 1) * payload_bytes
        if kind == "reduce":
            # The mirror chain towards the root: every rank but the root sends the whole payload.
            return 0.0 if role == "root" else float(payload_bytes)
        if kind == "gather":
            return 0.0 if role == "root" else payload_bytes / n
        return (n - 1) / n * payload_bytes if role == "root" else 0.0
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")


def gloo_wire_bytes(record: Mapping[str, Any]) -> float:
    """What this rank sends for a record on gloo: the ring model, except for the reduce-scatters gloo runs as
    all-reduces (``GLOO_REDUCE_SCATTER_AS_ALL_REDUCE``)."""
    if record["op"] in GLOO_REDUCE_SCATTER_AS_ALL_REDUCE:
        return wire_bytes("all_reduce", record["payload_bytes"], record["group_size"])
    return record["wire_bytes"]


def is_control(record: Mapping[str, Any], max_bytes: int = CONTROL_MAX_BYTES) -> bool:
    """Whether a collective is control traffic (scalars, votes, norms, barriers), not model state or activations."""
    return record["kind"] == "barrier" or record["payload_bytes"] <= max_bytes


def _empty_totals() -> dict[str, float]:
    return {"count": 0, "payload_bytes": 0, "wire_bytes": 0.0}


def _add(totals: dict[str, float], record: Mapping[str, Any]) -> None:
    totals["count"] += 1
    totals["payload_bytes"] += record["payload_bytes"]
    totals["wire_bytes"] += record["wire_bytes"]


def summarize_step(records: Iterable[Mapping[str, Any]], max_control_bytes: int = CONTROL_MAX_BYTES) -> dict[str, Any]:
    """Sums of one rank's collectives in one step: data and control apart, by kind and by phase.

    Every record needs ``kind``, ``payload_bytes``, ``wire_bytes`` and ``phase``.
    """
    data = {kind: _empty_totals() for kind in KINDS}
    control = {kind: _empty_totals() for kind in KINDS}
    by_phase: dict[str, dict[str, float]] = {}
    data_total, control_total = _empty_totals(), _empty_totals()
    for record in records:
        if is_control(record, max_control_bytes):
            _add(control[record["kind"]], record)
            _add(control_total, record)
        else:
            _add(data[record["kind"]], record)
            _add(data_total, record)
            _add(by_phase.setdefault(record["phase"], _empty_totals()), record)
    return {
        "data": {kind: totals for kind, totals in data.items() if totals["count"]},
        "control": {kind: totals for kind, totals in control.items() if totals["count"]},
        "data_total": data_total,
        "control_total": control_total,
        "data_by_phase": by_phase,
    }


def signature(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, int]]:
    """What makes two steps' collectives the same: (kind, payload bytes, group size) of each, in order."""
    return [(record["kind"], record["payload_bytes"], record["group_size"]) for record in records]


# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Formula:
    """The textbook figure of one training mode, per rank and optimizer step, in both conventions.

    Args:
        text: the formula as written in the literature (wire, in elements).
        payload_text: the same traffic as payload (whole tensors handed to collectives).
        payload_bytes: payload in bytes.
        wire_bytes: wire bytes one rank sends under ring algorithms.
    """

    text: str
    payload_text: str
    payload_bytes: float
    wire_bytes: float


def formula(
    mode: str,
    parameters: int,
    group_size: int,
    element_size: int = 4,
    activation_elements: int = 0,
    layers: int = 0,
) -> Formula:
    """The textbook communication of ``mode`` per rank and step.

    - ``ddp``: one ring all-reduce of the gradients, 2Ψ(n−1)/n elements sent (payload Ψ).
    - ``zero`` (ZeRO-1 and -2): a reduce-scatter of the gradients and an all-gather of the updated parameters,
      (n−1)/n Ψ each: 2Ψ(n−1)/n, the same as DDP (payload 2Ψ).
    - ``zero3`` (ZeRO-3, FSDP, Gemini): an all-gather of the parameters in forward, another in backward and a
      reduce-scatter of the gradients: 3Ψ(n−1)/n (payload 3Ψ).
    - ``tp`` (Megatron tensor parallelism): per transformer layer 2 all-reduces of the b·s·h activations in forward
      (after the attention and MLP output projections) and 2 in backward (the input gradients of qkv and the MLP
      input): 4L all-reduces, 2(n−1)/n × 4L·bsh elements sent.
    - ``tp_sequence_parallel`` (Megatron with sequence parallelism): each of those all-reduces becomes an all-gather
      plus a reduce-scatter of b·s·h: 8L collectives of payload bsh, the same wire as ``tp``.

    Args:
        mode: one of the above.
        parameters: Ψ, the parameters whose gradients and values are exchanged.
        group_size: n, the ranks of the data-parallel (or tensor-parallel) group.
        element_size: bytes per element (4 for fp32).
        activation_elements: b·s·h, one layer's activation (``tp`` modes).
        layers: L, transformer layers (``tp`` modes).

    Raises:
        ValueError: an unknown mode.
    """
    n = group_size
    share = (n - 1) / n
    psi_bytes = parameters * element_size
    if mode == "ddp":
        return Formula("2Ψ(n−1)/n", "Ψ (all-reduce input)", psi_bytes, 2 * share * psi_bytes)
    if mode == "zero":
        return Formula(
            "2Ψ(n−1)/n", "2Ψ (reduce-scatter input + all-gather output)", 2 * psi_bytes, 2 * share * psi_bytes
        )
    if mode == "zero3":
        return Formula(
            "3Ψ(n−1)/n", "3Ψ (2 all-gather outputs + reduce-scatter input)", 3 * psi_bytes, 3 * share * psi_bytes
        )
    activation_bytes = activation_elements * element_size
    if mode == "tp":
        payload = 4 * layers * activation_bytes
        return Formula("2(n−1)/n · 4L·bsh", "4L·bsh (all-reduce inputs)", payload, 2 * share * payload)
    if mode == "tp_sequence_parallel":
        payload = 8 * layers * activation_bytes
        return Formula(
            "2(n−1)/n · 4L·bsh", "8L·bsh (4L all-gather outputs + 4L reduce-scatter inputs)", payload, share * payload
        )
    raise ValueError(f"unknown mode {mode!r}; expected ddp, zero, zero3, tp or tp_sequence_parallel")


# ---------------------------------------------------------------------------------------------------------------
# Analysis of a launch and the markdown of a document
# ---------------------------------------------------------------------------------------------------------------


def _grouped(records: Iterable[Mapping[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Records grouped by ``keys`` in first-seen order, with count, payload and wire sums."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        key = tuple(str(record[name]) for name in keys)
        group = groups.setdefault(key, {**dict(zip(keys, key, strict=True)), **_empty_totals()})
        _add(group, record)
    return list(groups.values())


def analyse_rank(rank: Mapping[str, Any], max_control_bytes: int = CONTROL_MAX_BYTES) -> dict[str, Any]:
    """One rank's probed steps: the last one's sums (the steady state), and whether every probed step matched it.

    ``rank`` holds ``rank`` and ``steps``, each step ``step``, ``collectives`` (records), ``socket_bytes_sent`` and
    ``socket_writes``.
    """
    steps = rank["steps"]
    steady = steps[-1]
    records = steady["collectives"]
    control = [record for record in records if is_control(record, max_control_bytes)]
    data = [record for record in records if not is_control(record, max_control_bytes)]
    return {
        "rank": rank["rank"],
        "step": steady["step"],
        "probed_steps": [step["step"] for step in steps],
        "identical_steps": all(signature(step["collectives"]) == signature(records) for step in steps),
        "summary": summarize_step(records, max_control_bytes),
        "ring_model_bytes": sum(record["wire_bytes"] for record in records),
        "gloo_model_bytes": sum(gloo_wire_bytes(record) for record in records),
        "socket_bytes_sent": steady["socket_bytes_sent"],
        "socket_writes": steady["socket_writes"],
        "socket_bytes_sent_per_step": [step["socket_bytes_sent"] for step in steps],
        # Medians over the probed steps ([Note: CPU time per rank] in benchmarks/communication.py).
        "main_thread_cpu_seconds": _median([step.get("main_thread_cpu_seconds", 0.0) for step in steps]),
        "other_threads_cpu_seconds": _median([step.get("other_threads_cpu_seconds", 0.0) for step in steps]),
        "wall_seconds": _median([step.get("wall_seconds", 0.0) for step in steps]),
        "data_by_phase_and_kind": _grouped(data, ("phase", "kind")),
        "control_by_site": _grouped(control, ("site", "kind", "shapes", "phase")),
    }


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _cpu_table(configurations: Mapping[str, Any]) -> list[str]:
    """Per rank and step: the main thread's CPU (compute) and the other threads' (gloo's collectives), and wall."""
    lines = [
        "",
        "CPU seconds per rank and step (median over the probed steps; rank 0 / rank 1 / ...): the main thread's "
        "(model, optimizer, buffer work) and the other threads' (gloo runs each collective on its own threads), "
        "then wall time, which with more ranks than cores measures the scheduler:",
        "",
        "| configuration | ranks | main thread CPU ms | other threads CPU ms | wall ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, result in configurations.items():
        ranks = result["analysis"]["ranks"]
        columns = [
            " / ".join(f"{rank[key] * 1000:.0f}" for rank in ranks)
            for key in ("main_thread_cpu_seconds", "other_threads_cpu_seconds", "wall_seconds")
        ]
        lines.append(f"| {label} | {len(ranks)} | {' | '.join(columns)} |")
    return lines


def _bytes(value: float) -> str:
    return f"{value:,.0f}"


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.4f}" if reference else "–"


def _per_rank(values: Sequence[float]) -> str:
    texts = [_bytes(value) for value in values]
    return texts[0] if len(set(texts)) == 1 else " / ".join(texts)


def _kind_cell(totals: Mapping[str, Mapping[str, float]], kinds: Sequence[str]) -> str:
    cells = [
        f"{_bytes(totals[kind]['payload_bytes'])} ({totals[kind]['count']:.0f})" for kind in kinds if kind in totals
    ]
    return "; ".join(cells) if cells else "–"


_TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def _header_lines(document: Mapping[str, Any]) -> list[str]:
    """The setting of the measurement: machine, date, command, model, ranks, software and wall time."""
    software, settings, model = document["software"], document["settings"], document["model"]
    parameters = document["parameters"]
    activation = settings["batch_size_per_rank"] * settings["sequence_length"] * model["embed_dim"]
    return [
        f"- Machine: {document['machine']}",
        f"- Date: {document['started_at']}",
        f"- Command: `{document['command']}`",
        f"- Model: GPT Ψ = {parameters:,} parameters ("
        + ", ".join(f"{key}={value}" for key, value in model.items())
        + f"), fp32; {settings['batch_size_per_rank']} sequences × {settings['sequence_length']} tokens per rank "
        f"(b·s·h = {activation:,} elements = {_bytes(4 * activation)} B)",
        f"- Ranks: {settings['world_size']} (gloo); counted: training steps {settings['probed_steps']} (each from the "
        "end of the step before), the last one shown; control = payload ≤ "
        f"{document['control_max_bytes']} B",
        f"- Software: torch {software['torch']}, lightning {software['lightning']}, python {software['python']}, "
        f"lightning_colossal {software['lightning_colossal']} (git {document['git']})",
        f"- Wall time: {document['wall_seconds']:.0f} s",
    ]


def _payload_table(configurations: Mapping[str, Any]) -> list[str]:
    """Rank 0's data collectives by kind, payload bytes against the formula's payload."""
    lines = [
        "",
        "Data collectives per step on rank 0 (payload bytes, and in brackets the number of collectives), against the formula's payload:",
        "",
        "| configuration | all_reduce | all_gather | reduce_scatter | other | payload | formula | formula B | "
        "measured / formula |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, result in configurations.items():
        analysis = result["analysis"]
        rank = analysis["ranks"][0]
        data = rank["summary"]["data"]
        other = _kind_cell(data, [kind for kind in KINDS if kind not in _TABLE_KINDS])
        cells = [_kind_cell(data, [kind]) for kind in _TABLE_KINDS]
        payload = rank["summary"]["data_total"]["payload_bytes"]
        textbook = analysis["formula"]
        lines.append(
            f"| {label} | {' | '.join(cells)} | {other} | {_bytes(payload)} | {textbook['payload_text']} | "
            f"{_bytes(textbook['payload_bytes'])} | {_ratio(payload, textbook['payload_bytes'])} |"
        )
    return lines


def _wire_table(configurations: Mapping[str, Any]) -> list[str]:
    """Bytes a rank sends: the ring model against the formula, then gloo's model against the socket bytes."""
    lines = [
        "",
        "Bytes one rank sends per step: the counted collectives under ring algorithms against the formula; then all of "
        "them (data + control) under gloo's own algorithms (its reduce-scatter is an all-reduce) against what the "
        "process wrote to its sockets (rank 0 / rank 1 where they differ; at 2 ranks each receives what the other "
        "sends):",
        "",
        "| configuration | ring model, data | formula | formula B | measured / formula | gloo model, all | "
        "socket bytes written | socket − gloo model (write calls × 48 B at most) | probed steps identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, result in configurations.items():
        analysis = result["analysis"]
        ranks = analysis["ranks"]
        wire = ranks[0]["summary"]["data_total"]["wire_bytes"]
        textbook = analysis["formula"]
        socket = [rank["socket_bytes_sent"] for rank in ranks]
        gloo = [rank["gloo_model_bytes"] for rank in ranks]
        residual = " / ".join(
            f"{_bytes(sent - model)} ({rank['socket_writes']} × 48 = {_bytes(rank['socket_writes'] * GLOO_HEADER_BYTES)})"
            for sent, model, rank in zip(socket, gloo, ranks, strict=True)
        )
        lines.append(
            f"| {label} | {_bytes(wire)} | {textbook['text']} | {_bytes(textbook['wire_bytes'])} | "
            f"{_ratio(wire, textbook['wire_bytes'])} | {_per_rank(gloo)} | {_per_rank(socket)} | {residual} | "
            f"{'yes' if all(rank['identical_steps'] for rank in ranks) else 'NO'} |"
        )
    return lines


def _control_table(configurations: Mapping[str, Any]) -> list[str]:
    """Rank 0's control collectives, grouped by call site."""
    lines = [
        "",
        "Control collectives per step on rank 0 (payload ≤ the control bound, or barriers):",
        "",
        "| configuration | collectives | payload B | what (count × kind shape, phase, call site) |",
        "| --- | --- | --- | --- |",
    ]
    for label, result in configurations.items():
        rank = result["analysis"]["ranks"][0]
        total = rank["summary"]["control_total"]
        what = "; ".join(
            f"{group['count']:.0f} × {group['kind']} {group['shapes']}, {group['phase']}, `{group['site']}`"
            for group in rank["control_by_site"]
        )
        lines.append(f"| {label} | {total['count']:.0f} | {_bytes(total['payload_bytes'])} | {what or '–'} |")
    return lines


def _notes(configurations: Mapping[str, Any]) -> list[str]:
    """Second counts next to the collectives (DDP's buckets, Gemini's chunks) and ops that had no rule."""
    notes = []
    for label, result in configurations.items():
        analysis = result["analysis"]
        buckets = analysis.get("ddp_bucket_bytes")
        if buckets:
            counted = sum(
                group["payload_bytes"]
                for group in analysis["ranks"][0]["data_by_phase_and_kind"]
                if group["kind"] == "all_reduce" and group["phase"] == "backward"
            )
            notes.append(
                f"- {label}: DDP's reducer reports buckets of {', '.join(_bytes(size) for size in buckets)} B "
                f"(sum {_bytes(sum(buckets))}); the all-reduces counted in backward: {_bytes(counted)} B."
            )
        chunks = analysis.get("gemini_chunks")
        if chunks:
            notes.append(
                f"- {label}: {chunks['num_chunks']} chunk(s) of {chunks['chunk_numel']:,} elements "
                "(the engine's memory report)."
            )
        if analysis.get("unknown_ops"):
            notes.append(f"- {label}: ops with no rule, not counted: {', '.join(analysis['unknown_ops'])}.")
    return notes


def _primitives_table(primitives: Mapping[str, Any]) -> list[str]:
    """gloo's own bytes for each collective by itself, against the ring model."""
    lines = [
        "",
        f"gloo's own bytes per collective ({_bytes(primitives['payload_bytes'])} B of fp32 payload, 2 ranks, "
        "rank 0 / rank 1):",
        "",
        "| collective | ring model | socket bytes written | write calls | socket − ring model |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in primitives["rows"]:
        model_bytes, socket = row["ring_model_bytes"], row["socket_bytes_sent"]
        lines.append(
            f"| {row['name']} | {' / '.join(_bytes(m) for m in model_bytes)} | "
            f"{' / '.join(_bytes(s) for s in socket)} | {' / '.join(str(w) for w in row['socket_writes'])} | "
            f"{' / '.join(_bytes(s - m) for s, m in zip(socket, model_bytes, strict=True))} |"
        )
    return lines


def markdown(document: Mapping[str, Any]) -> str:
    """The ``RESULTS.md`` block of a ``benchmarks.communication`` document."""
    configurations = document["configurations"]
    lines = [
        *_header_lines(document),
        *_payload_table(configurations),
        *_wire_table(configurations),
        *_control_table(configurations),
        *_cpu_table(configurations),
    ]
    notes = _notes(configurations)
    if notes:
        lines += ["", *notes]
    primitives = document.get("primitives")
    if primitives:
        lines += _primitives_table(primitives)
    return "\n".join(lines)
