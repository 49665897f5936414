"""Theory and markdown for ``benchmarks.hybrid``: pure functions over its JSON document (no torch, no processes)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["bubble_markdown", "memory_markdown", "theory_bubble", "traffic_markdown", "wire_bytes"]

_MIB = 1024 * 1024


def theory_bubble(case: dict[str, Any], pipeline_size: int) -> float:
    """Idle fraction of a rank's step when every stage's forward and backward take equal time.

    1F1B: (p-1)/(m+p-1). Interleaved 1F1B with v chunks per rank: (p-1)/(v*m+p-1) (each chunk's work is 1/v of a
    rank's, so the fill and drain shrink by v). ZB-V: 0, the Zero Bubble paper's figure when a chunk's forward,
    input-gradient and weight-gradient passes take equal time (T_F = T_B = T_W) and there are enough micro-batches to
    fill the V; real passes are not equal, and the difference shows up as bubble.
    """
    p, m = pipeline_size, case["microbatches"]
    if case["schedule"] == "1f1b":
        return (p - 1) / (m + p - 1)
    if case["schedule"] == "interleaved":
        return (p - 1) / (case["chunks"] * m + p - 1)
    return 0.0


def _range(values: Sequence[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def _header(document: dict[str, Any]) -> list[str]:
    software = document["software"]
    model = ", ".join(f"{key}={value}" for key, value in document["model"].items())
    return [
        f"- Machine: {document['machine']}",
        f"- Date: {document['started_at']}",
        f"- Command: `{document['command']}`",
        f"- Model: GPT ({model})",
        f"- Software: torch {software['torch']}, lightning {software['lightning']}, python {software['python']}, "
        f"lightning_colossal {software['lightning_colossal']} (git {document['git']})",
        f"- Wall time: {document['wall_seconds']:.0f} s",
    ]


def bubble_markdown(document: dict[str, Any]) -> str:
    settings = document["settings"]
    latencies = document["point_to_point"]
    one_way = statistics.median(latency["one_way_seconds_median"] for latency in latencies)
    message = latencies[0]["message_bytes"] if latencies else 0
    accepted = sum(len(row["runs"]) for row in document["rows"])
    lines = [
        *_header(document),
        f"- Method: 2 pipeline ranks; per case {settings['warmup']} warm-up + {settings['steps']} measured schedule "
        f"steps of {settings['microbatch_size']} sequence(s) x {settings['sequence_length']} tokens per micro-batch; "
        "bubble per rank and step = 1 − (time in forward_one_chunk + backward_one_chunk + backward_weight_one_chunk + "
        "loss) / (step wall: from a common barrier until the slowest rank returns from PipelineStep.train_step), median "
        "over the steps; then median [min–max] over the "
        f"accepted launches (target {settings['repeats']} per case)",
        f"- Launches: {document['launches']}; cases accepted {accepted}, discarded {len(document['discarded'])} (other "
        f"load over {settings['max_load']} cores during the case's measured steps)",
        f"- Point-to-point: one activation ({message:,} B) takes {one_way * 1e3:.2f} ms one way (median of ping-pongs)",
        "",
        "| schedule | m | theory | bubble rank 0 | bubble rank 1 | compute s/step r0 / r1 | wall s/step | "
        "point-to-point wait s r0 / r1 | transfers/step r0 / r1 | transfer share ≤ | runs | other load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in document["rows"]:
        runs = row["runs"]

        def per_rank(key: str, rank: int, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [run["ranks"][rank][key] for run in runs]

        compute = " / ".join(f"{statistics.median(per_rank('compute_seconds', rank)):.3f}" for rank in (0, 1))
        wait = " / ".join(f"{statistics.median(per_rank('point_to_point_wait_seconds', rank)):.3f}" for rank in (0, 1))
        transfers = " / ".join(f"{statistics.median(per_rank('transfers', rank)):.0f}" for rank in (0, 1))
        share = max(statistics.median(per_rank("communication_share", rank)) for rank in (0, 1))
        loads = [run["other_load"] for run in runs if run["other_load"] is not None]
        walls = [run["step_wall_seconds"] for run in runs]
        schedule = row["schedule"] if row["schedule"] == "1f1b" else f"{row['schedule']} (v={row['chunks']})"
        lines.append(
            f"| {schedule} | "
            f"{row['microbatches']} | {row['theory']:.3f} | {_range(per_rank('bubble', 0), 3)} | "
            f"{_range(per_rank('bubble', 1), 3)} | {compute} | {_range(walls, 3)} | {wait} | "
            f"{transfers} | {share:.3f} | {len(runs)} | {_range(loads, 2) if loads else 'unknown'} |"
        )
    lines.append("")
    lines.append(
        "Compute parts per step (median s, rank 0 / rank 1): forward, full backward, input backward, weight "
        "backward, loss:"
    )
    lines.append("")
    for row in document["rows"]:
        parts = []
        for part in ("forward", "backward", "backward_input", "backward_weight", "loss"):
            values = [
                f"{statistics.median(run['ranks'][rank]['parts_seconds'][part] for run in row['runs']):.3f}"
                for rank in (0, 1)
            ]
            parts.append(f"{part} {' / '.join(values)}")
        lines.append(f"- {row['schedule']} m={row['microbatches']}: {'; '.join(parts)}")
    return "\n".join(lines) + "\n"


def wire_bytes(kind: str, payload_bytes: int, group_size: int) -> float:
    """Bytes each rank sends under ring algorithms: an all-reduce 2(n-1)/n of its payload, a gather, scatter or
    all-to-all (n-1)/n, a point-to-point message all of it."""
    if kind == "all_reduce":
        return 2 * (group_size - 1) / group_size * payload_bytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return (group_size - 1) / group_size * payload_bytes
    return float(payload_bytes)


def _category(record: dict[str, Any], activation_bytes: int) -> str:
    """What a collective moved: a b·s·h activation (or its gradient), or another tensor by shape, with its call site."""
    what = "b·s·h" if record["payload_bytes"] == activation_bytes else f"{record['shape']} {record['dtype']}"
    return f"{what} from `{record['site']}`"


def _dimensions(document: dict[str, Any]) -> dict[str, int]:
    settings, model = document["settings"], document["model"]
    return {
        "b": settings["batch_size_per_rank"],
        "s": settings["sequence_length"],
        "h": model["embed_dim"],
        "layers": model["num_layers"],
        "vocabulary": model["vocab_size"],
    }


def traffic_markdown(document: dict[str, Any]) -> str:
    dimensions = _dimensions(document)
    b, s, h, layers = dimensions["b"], dimensions["s"], dimensions["h"], dimensions["layers"]
    activation = b * s * h * 4
    lines = [
        *_header(document),
        f"- Workload: b={b} sequences x s={s} tokens per rank (both tensor-parallel ranks read the same batch), h={h}, "
        f"{layers} layers, fp32; one b·s·h activation = {activation:,} B",
        "- Counted: every collective dispatched during training steps 2 and 3 (forward, backward, optimizer step) "
        "by a TorchDispatchMode over c10d and functional-collective ops; payload = the whole tensor reduced or "
        "gathered; wire = bytes a rank sends under ring algorithms (all-reduce 2(n−1)/n, gather/scatter (n−1)/n)",
        "",
    ]
    megatron_wire = 4 * layers * wire_bytes("all_reduce", activation, 2)
    for label, configuration in document["configurations"].items():
        steps = configuration["ranks"][0]["steps"]
        same_steps = all(step["collectives"] == steps[0]["collectives"] for step in steps)
        same_ranks = all(
            [(r["kind"], r["payload_bytes"]) for r in rank["steps"][0]["collectives"]]
            == [(r["kind"], r["payload_bytes"]) for r in steps[0]["collectives"]]
            for rank in configuration["ranks"]
        )
        records = steps[0]["collectives"]
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for record in records:
            key = (record["phase"], record["kind"], _category(record, activation))
            groups.setdefault(key, []).append(record)
        total_payload = sum(record["payload_bytes"] for record in records)
        total_wire = sum(wire_bytes(r["kind"], r["payload_bytes"], r["group_size"]) for r in records)
        lines.append(
            f"**{label}** (`colossal_hybrid` {configuration['init_args']}): {len(records)} collectives per step; "
            f"identical in both probed steps: {same_steps}; identical on both ranks: {same_ranks}"
        )
        lines.append("")
        lines.append("| phase | collective | what | count | payload B | wire B per rank |")
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for (phase, kind, category), members in sorted(groups.items()):
            payload = sum(record["payload_bytes"] for record in members)
            wire = sum(wire_bytes(kind, record["payload_bytes"], record["group_size"]) for record in members)
            lines.append(f"| {phase} | {kind} | {category} | {len(members)} | {payload:,} | {wire:,.0f} |")
        lines.append(f"| total | | | {len(records)} | {total_payload:,} | {total_wire:,.0f} |")
        lines.append("")
        lines.append(
            f"Megatron, blocks only: 4 × {layers} all-reduces of b·s·h = {4 * layers * activation:,} B payload, "
            f"{megatron_wire:,.0f} B wire per rank (split-gather: 4 × {layers} all-gathers + 4 × {layers} "
            f"reduce-scatters of b·s·h, the same wire bytes). Measured wire / Megatron blocks-only wire = "
            f"{total_wire / megatron_wire:.4f}."
        )
        lines.append("")
    return "\n".join(lines) + "\n"


def memory_markdown(document: dict[str, Any]) -> str:
    dimensions = _dimensions(document)
    configurations = document["configurations"]
    lines = [
        *_header(document),
        f"- Workload: b={dimensions['b']} sequences x s={dimensions['s']} tokens per rank before any sequence split, "
        f"fp32, dropout 0",
        "- Counted: unique storage bytes of every tensor autograd saved for backward during training steps 2 and 3 "
        "(saved_tensors_hooks; parameters and views of them excluded); all are alive at the end of forward, so this "
        "is the peak of saved activations",
        "",
        "| configuration | tokens per rank | saved activation bytes r0 / r1 | MiB | vs baseline | baseline | target "
        "| vs dp2 (no model parallelism) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    baselines = {"sp2_ulysses": "dp2", "tp2_split_gather": "tp2"}

    def saved(label: str) -> list[int]:
        return [rank["steps"][0]["saved_activation_bytes"] for rank in configurations[label]["ranks"]]

    for label, configuration in configurations.items():
        values = saved(label)
        batch, length = configuration["ranks"][0]["steps"][0]["batch_shape"]
        # Ulysses ranks keep 1/sp of every sequence (the strategy splits the batch after the loader).
        length //= configuration["init_args"].get("sp_size", 1)
        baseline = baselines.get(label)
        ratio = f"{values[0] / saved(baseline)[0]:.4f}" if baseline in configurations else ""
        against_dp = f"{values[0] / saved('dp2')[0]:.4f}" if "dp2" in configurations else ""
        lines.append(
            f"| {label} | {batch} × {length} | "
            f"{' / '.join(f'{value:,}' for value in values)} | {values[0] / _MIB:.2f} | {ratio} | {baseline or ''} | "
            f"{'0.5 (÷sp)' if baseline else ''} | "
            f"{against_dp} |"
        )
    lines.append("")
    lines.append("Largest saved storages on rank 0 (shape of the first tensor saved from each storage):")
    lines.append("")
    for label, configuration in configurations.items():
        rows = configuration["ranks"][0]["steps"][0]["saved_activations_by_shape"]
        parts = [f"{row['count']}× {row['shape']} {row['bytes'] / _MIB:.2f} MiB" for row in rows[:10]]
        lines.append(f"- {label}: {'; '.join(parts)}")
    return "\n".join(lines) + "\n"
