"""From raw run records to per-configuration figures, a text table and a ready-to-paste markdown block.

Pure functions over the JSON-able run records of ``benchmarks.peers``; no process, torch or Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.harness.measure import MODEL_STATE_FORMULAS, Summary, paired_ratios, run_step_time, summarize

__all__ = ["ConfigurationSummary", "format_markdown", "format_text", "summarize_configurations"]

_MIB = 1024 * 1024
# Only runs under the load limit (or taken without one) enter the figures; the others stay in the raw JSON.
ACCEPTED_STATUSES = ("accepted",)


@dataclass(frozen=True)
class RankBytes:
    """Measured model-state bytes of one rank, next to the formula for its mode.

    ``memory_report``, ``gathered_peak`` (with where it came from) and ``tensor_walk`` are only present for Gemini
    ranks, whose bytes come from the engine's report (see ``benchmarks.harness.measure.gemini_model_state_bytes``).
    ``parameter_split``, ``engine_other_bytes`` and ``engine_bytes_by_attribute`` only for DeepSpeed ranks
    (``benchmarks.peers.deepspeed_worker``): what their parameter bytes are made of, and the tensors their ZeRO optimizer
    holds beyond the model state.
    """

    rank: int
    parameters: int
    gradients: int
    optimizer_state: int
    optimizer_state_by_key: dict[str, int]
    formula_parameters: float | None
    formula_gradients: float | None
    formula_optimizer_state: float | None
    memory_report: dict[str, Any] | None = None
    gathered_peak: int | None = None
    gathered_peak_source: str | None = None
    tensor_walk: dict[str, int | None] | None = None
    parameter_split: dict[str, int] | None = None
    engine_other_bytes: int | None = None
    engine_bytes_by_attribute: dict[str, int] | None = None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def formula_total(self) -> float | None:
        parts = (self.formula_parameters, self.formula_gradients, self.formula_optimizer_state)
        return None if any(part is None for part in parts) else sum(part for part in parts if part is not None)


@dataclass(frozen=True)
class ConfigurationSummary:
    """The figures of one configuration over its accepted runs."""

    label: str
    strategy: str
    mode: str | None
    formula_expression: str | None
    parameter_count: int
    step_time_by_repeat: dict[int, float]
    step_time: Summary
    tokens_per_second: float
    ratio_to_peer: Summary | None
    ratios_to_peer: list[float]
    peak_rss_bytes_per_rank: list[float]
    model_state: list[RankBytes]
    bytes_identical_across_runs: bool
    other_load: Summary | None
    final_loss: float
    tensor_parallel_parameter_count: int | None = None
    #: What a user waits for besides the steps (slowest rank per run; ``None`` for runs that did not record it):
    #: setup from the Trainer's construction to the first batch, teardown from the last batch's end to ``fit``'s return.
    setup_seconds: Summary | None = None
    teardown_seconds: Summary | None = None
    #: The whole ``fit`` (setup, every step, warm-up ones too, teardown) against the peer's of the same repeat: what a
    #: harness that times ``trainer.fit`` sees.
    fit_ratio_to_peer: Summary | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["model_state"] = [
            {**asdict(rank_bytes), "total": rank_bytes.total, "formula_total": rank_bytes.formula_total}
            for rank_bytes in self.model_state
        ]
        return data


def _median(values: Sequence[float]) -> float:
    return summarize(values).median


def _rank_bytes(rank_result: Mapping[str, Any], mode: str | None, world_size: int) -> RankBytes:
    measured = rank_result["bytes"]
    formula = None
    if mode is not None:
        formula = MODEL_STATE_FORMULAS[mode].bytes(
            rank_result["parameter_count"], world_size, rank_result.get("tensor_parallel_parameter_count")
        )
    return RankBytes(
        rank=rank_result["rank"],
        parameters=measured["parameters"],
        gradients=measured["gradients"],
        optimizer_state=measured["optimizer_state"],
        optimizer_state_by_key=measured["optimizer_state_by_key"],
        formula_parameters=formula.parameters if formula else None,
        formula_gradients=formula.gradients if formula else None,
        formula_optimizer_state=formula.optimizer_state if formula else None,
        memory_report=measured.get("memory_report"),
        gathered_peak=measured.get("gathered_peak"),
        gathered_peak_source=measured.get("gathered_peak_source"),
        tensor_walk=measured.get("tensor_walk"),
        parameter_split=measured.get("parameter_split"),
        engine_other_bytes=measured.get("engine_other_bytes"),
        engine_bytes_by_attribute=measured.get("engine_bytes_by_attribute"),
    )


def _fit_spans(run: Mapping[str, Any]) -> dict[str, float] | None:
    """A run's setup, teardown and whole-``fit`` seconds from its ranks' moments, or None when a rank did not record
    them (workers of other harnesses). Each span starts when the last rank got there (ranks finish their imports at
    different times and then wait for each other when the process group forms) and ends when the last rank did."""
    moments = [rank.get("moments") or {} for rank in run["ranks"]]
    needed = ("before_trainer", "first_batch", "last_batch_end", "fit_returned")
    if not moments or any(name not in rank_moments for rank_moments in moments for name in needed):
        return None
    last = {name: max(rank_moments[name] for rank_moments in moments) for name in needed}
    return {
        "setup": last["first_batch"] - last["before_trainer"],
        "teardown": last["fit_returned"] - last["last_batch_end"],
        "fit": last["fit_returned"] - last["before_trainer"],
    }


def _step_times_by_label(accepted: Sequence[Mapping[str, Any]], statistic: str) -> dict[str, dict[int, float]]:
    """Each accepted run's step time (``statistic`` over its ranks' steps), by label and repeat."""
    step_times: dict[str, dict[int, float]] = {}
    for run in accepted:
        per_rank = [rank["step_times"] for rank in run["ranks"]]
        step_times.setdefault(run["label"], {})[run["repeat"]] = run_step_time(per_rank, statistic)
    return step_times


def _summarize_configuration(
    configuration: Mapping[str, Any],
    own_runs: Sequence[Mapping[str, Any]],
    by_repeat: dict[int, float],
    ratios: list[float],
    tokens_per_step: int,
    spans: list[dict[str, float]],
    fit_ratios: list[float],
) -> ConfigurationSummary:
    """One configuration's figures from its accepted runs (in repeat order) and their step times by repeat."""
    label, mode = configuration["label"], configuration["mode"]
    world_size = len(own_runs[0]["ranks"])
    # Runs of one configuration should hold the same model state: a second fingerprint means they did not.
    byte_fingerprints = {
        tuple(
            (rank["bytes"]["parameters"], rank["bytes"]["gradients"], rank["bytes"]["optimizer_state"])
            for rank in run["ranks"]
        )
        for run in own_runs
    }
    loads = [run["other_load"] for run in own_runs if run["other_load"] is not None]
    first = own_runs[0]
    data_parallel_size = first["ranks"][0].get("data_parallel_size", world_size)
    return ConfigurationSummary(
        label=label,
        strategy=configuration["strategy"],
        mode=mode,
        formula_expression=MODEL_STATE_FORMULAS[mode].expression() if mode else None,
        parameter_count=first["ranks"][0]["parameter_count"],
        step_time_by_repeat=by_repeat,
        step_time=summarize(list(by_repeat.values())),
        tokens_per_second=tokens_per_step * data_parallel_size / world_size / _median(list(by_repeat.values())),
        ratio_to_peer=summarize(ratios) if ratios else None,
        ratios_to_peer=ratios,
        peak_rss_bytes_per_rank=[
            _median([run["ranks"][rank]["peak_rss_bytes"] for run in own_runs]) for rank in range(world_size)
        ],
        model_state=[_rank_bytes(rank_result, mode, world_size) for rank_result in first["ranks"]],
        bytes_identical_across_runs=len(byte_fingerprints) == 1,
        other_load=summarize(loads) if loads else None,
        final_loss=sum(rank["losses"][-1] for rank in first["ranks"]) / world_size,
        tensor_parallel_parameter_count=first["ranks"][0].get("tensor_parallel_parameter_count"),
        setup_seconds=summarize([span["setup"] for span in spans]) if spans else None,
        teardown_seconds=summarize([span["teardown"] for span in spans]) if spans else None,
        fit_ratio_to_peer=summarize(fit_ratios) if fit_ratios else None,
    )


def summarize_configurations(
    runs: Sequence[Mapping[str, Any]],
    configurations: Sequence[Mapping[str, Any]],
    peer: str | None,
    statistic: str,
    tokens_per_step: int,
) -> list[ConfigurationSummary]:
    """Per-configuration figures from the accepted runs (discarded runs are only counted elsewhere).

    Args:
        runs: Run records of ``benchmarks.peers`` (``label``, ``repeat``, ``status``, ``ranks``, ``other_load``).
        configurations: ``{"label", "strategy", "mode"}`` per configuration, in the order to report them.
        peer: Label whose run of the same repeat divides every other configuration's, or ``None``.
        statistic: Per-run step-time statistic (``p20``, ``min``, ``median``).
        tokens_per_step: Tokens of one global batch when every rank reads its own batch. A run whose ranks report a
            smaller ``data_parallel_size`` (tensor- or sequence-parallel ranks share a batch) is scaled down to it.
    """
    accepted = [run for run in runs if run["status"] in ACCEPTED_STATUSES]
    step_times = _step_times_by_label(accepted, statistic)
    spans: dict[str, dict[int, dict[str, float]]] = {}  # by label and repeat, for the runs that recorded them
    for run in accepted:
        span = _fit_spans(run)
        if span is not None:
            spans.setdefault(run["label"], {})[run["repeat"]] = span
    fit_seconds = {label: {repeat: span["fit"] for repeat, span in by.items()} for label, by in spans.items()}
    summaries = []
    for configuration in configurations:
        label = configuration["label"]
        own_runs = sorted((run for run in accepted if run["label"] == label), key=lambda run: run["repeat"])
        if not own_runs:
            continue
        by_repeat = step_times[label]
        ratios = paired_ratios(by_repeat, step_times.get(peer, {})) if peer and label != peer else []
        fit_ratios = (
            paired_ratios(fit_seconds.get(label, {}), fit_seconds.get(peer, {})) if peer and label != peer else []
        )
        summaries.append(
            _summarize_configuration(
                configuration,
                own_runs,
                by_repeat,
                ratios,
                tokens_per_step,
                list(spans.get(label, {}).values()),
                fit_ratios,
            )
        )
    return summaries


# ---------------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------------


def _range(summary: Summary, digits: int) -> str:
    return f"{summary.median:.{digits}f} [{summary.minimum:.{digits}f}–{summary.maximum:.{digits}f}]"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / _MIB:.2f}"


def _timing_rows(summaries: Sequence[ConfigurationSummary], peer: str | None) -> tuple[list[str], list[list[str]]]:
    header = [
        "configuration",
        "runs",
        "step time s, median [min–max]",
        "tokens/s",
        f"ratio vs {peer}, median [min–max]" if peer else "ratio",
        "setup / teardown s",
        f"whole fit vs {peer}" if peer else "whole fit",
        "peak RSS MiB per rank",
        "other load (cores), median [min–max]",
        "last loss",
    ]
    rows = []
    for summary in summaries:
        if summary.ratio_to_peer is not None:
            ratio = f"{_range(summary.ratio_to_peer, 3)} (n={summary.ratio_to_peer.count})"
        else:
            ratio = "1 (peer)" if summary.label == peer else "n/a"
        rows.append(
            [
                summary.label,
                str(summary.step_time.count),
                _range(summary.step_time, 3),
                f"{summary.tokens_per_second:.0f}",
                ratio,
                _setup_and_teardown(summary),
                _fit_ratio(summary, peer),
                " / ".join(f"{value / _MIB:.0f}" for value in summary.peak_rss_bytes_per_rank),
                _range(summary.other_load, 2) if summary.other_load else "unknown",
                f"{summary.final_loss:.6f}",
            ]
        )
    return header, rows


def _setup_and_teardown(summary: ConfigurationSummary) -> str:
    if summary.setup_seconds is None or summary.teardown_seconds is None:
        return "n/a"
    return f"{summary.setup_seconds.median:.2f} / {summary.teardown_seconds.median:.2f}"


def _fit_ratio(summary: ConfigurationSummary, peer: str | None) -> str:
    if summary.fit_ratio_to_peer is not None:
        return _range(summary.fit_ratio_to_peer, 3)
    return "1 (peer)" if summary.label == peer else "n/a"


def _bytes_rows(summaries: Sequence[ConfigurationSummary]) -> tuple[list[str], list[list[str]]]:
    header = [
        "configuration",
        "rank",
        "params MiB",
        "grads MiB",
        "optimizer state MiB",
        "total bytes",
        "formula",
        "formula bytes",
        "measured − formula (bytes)",
        "measured / formula",
    ]
    rows = []
    for summary in summaries:
        for rank_bytes in summary.model_state:
            formula_total = rank_bytes.formula_total
            rows.append(
                [
                    summary.label,
                    str(rank_bytes.rank),
                    _mib(rank_bytes.parameters),
                    _mib(rank_bytes.gradients),
                    _mib(rank_bytes.optimizer_state),
                    f"{rank_bytes.total:,}",
                    summary.formula_expression or "n/a",
                    "n/a" if formula_total is None else f"{formula_total:,.0f}",
                    "n/a" if formula_total is None else f"{rank_bytes.total - formula_total:+,.0f}",
                    "n/a" if formula_total is None else f"{rank_bytes.total / formula_total:.6f}",
                ]
            )
    return header, rows


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _memory_report_notes(label: str, model_state: Sequence[RankBytes]) -> list[str]:
    """What a Gemini row's bytes are made of, its gathered working set, and whether the tensor walk agrees."""
    reports = [
        (rank_bytes, rank_bytes.memory_report) for rank_bytes in model_state if rank_bytes.memory_report is not None
    ]
    if not reports:
        return []
    first = reports[0][1]
    parts = "; ".join(
        f"rank {rank_bytes.rank}: shards {report['chunks']['shard']:,} B + separate masters "
        f"{report['chunks']['master']:,} B + whole parameters outside chunks {report['replicated_bytes']:,} B"
        for rank_bytes, report in reports
    )
    notes = [
        f"{label}: bytes from the engine's memory_report(), because its parameters are empty placeholders between "
        f"uses (chunks: {first['num_chunks']} × {first['chunk_numel']:,} elements); params = {parts}."
    ]
    peaks = [rank_bytes.gathered_peak for rank_bytes, _ in reports]
    if all(peak is not None for peak in peaks):
        sources = sorted({str(rank_bytes.gathered_peak_source) for rank_bytes, _ in reports})
        notes.append(
            f"{label}: peak of gathered chunks and full gradients ({', '.join(sources)}), MiB per rank: "
            f"{' / '.join(_mib(peak) for peak in peaks)}. Working memory while modules run, not in the total "
            "(the peer's unsharded blocks are not in its total either)."
        )
    else:
        notes.append(
            f"{label}: no peak of gathered chunks: this engine's report has none, and the harness samples it only in "
            "warm-up steps (give --warmup 1 or more)."
        )
    for rank_bytes, _ in reports:
        walk = rank_bytes.tensor_walk or {}
        differences = [
            f"{key} {getattr(rank_bytes, key):,} B by the report, {walk[key]:,} B by the tensors"
            for key in ("gradients", "optimizer_state")
            if walk.get(key) is not None and walk[key] != getattr(rank_bytes, key)
        ]
        if differences:
            notes.append(
                f"{label}: rank {rank_bytes.rank}: the report and the tensor walk differ: {'; '.join(differences)}."
            )
    return notes


def _deepspeed_notes(label: str, model_state: Sequence[RankBytes]) -> list[str]:
    """What a DeepSpeed row's parameter bytes are made of and what else its ZeRO optimizer holds."""
    ranks = [rank_bytes for rank_bytes in model_state if rank_bytes.parameter_split is not None]
    if not ranks:
        return []
    parts = "; ".join(
        f"rank {rank_bytes.rank}: model parameter storage {split['model_storage']:,} B + DeepSpeed's separate "
        f"partitions and fp32 masters {split['separate_partitions_and_masters']:,} B"
        for rank_bytes in ranks
        if (split := rank_bytes.parameter_split) is not None
    )
    notes = [
        f"{label}: trained by DeepSpeed's own engine (Lightning's DeepSpeedStrategy refuses CPU); params = {parts}. "
        "Gradients are those present when the wrapped AdamW steps in the last step."
    ]
    first = ranks[0]
    if first.engine_other_bytes is not None:
        largest = sorted((first.engine_bytes_by_attribute or {}).items(), key=lambda item: -item[1])[:6]
        attributes = ", ".join(f"{name} {size / _MIB:.2f}" for name, size in largest)
        notes.append(
            f"{label}: other tensors its ZeRO optimizer holds at that step, not in the total, MiB per rank: "
            f"{' / '.join(_mib(rank_bytes.engine_other_bytes) for rank_bytes in ranks)} (allocated, not necessarily "
            f"touched; beyond the model state by attribute on rank {first.rank}, MiB: {attributes})."
        )
    return notes


def _notes(summaries: Sequence[ConfigurationSummary]) -> list[str]:
    notes = []
    for summary in summaries:
        if not summary.bytes_identical_across_runs:
            notes.append(f"{summary.label}: model-state bytes differ between runs; the table shows the first run.")
        for rank_bytes in summary.model_state[:1]:
            keys = ", ".join(f"{key} {value:,} B" for key, value in rank_bytes.optimizer_state_by_key.items())
            notes.append(f"{summary.label}: optimizer state by key on rank {rank_bytes.rank}: {keys}.")
        notes.extend(_memory_report_notes(summary.label, summary.model_state))
        notes.extend(_deepspeed_notes(summary.label, summary.model_state))
        if summary.mode is not None and MODEL_STATE_FORMULAS[summary.mode].tensor_parallel:
            split = summary.tensor_parallel_parameter_count or 0
            notes.append(
                f"{summary.label}: Ψₜ (parameters split by tensor parallelism, counted whole) = {split:,}; whole on "
                f"every rank: Ψ − Ψₜ = {summary.parameter_count - split:,}."
            )
    return notes


def format_text(summaries: Sequence[ConfigurationSummary], peer: str | None, header_lines: Sequence[str]) -> str:
    """The human-readable report: settings, timing table, bytes table, notes."""
    timing = _text_table(*_timing_rows(summaries, peer))
    model_state = _text_table(*_bytes_rows(summaries))
    notes = "\n".join(f"note: {line}" for line in _notes(summaries))
    return "\n".join([*header_lines, "", timing, "", model_state, "", notes]).rstrip() + "\n"


def format_markdown(summaries: Sequence[ConfigurationSummary], peer: str | None, header_lines: Sequence[str]) -> str:
    """A markdown block for ``benchmarks/RESULTS.md``: settings as a list, then the two tables and the notes."""
    settings = "\n".join(f"- {line}" for line in header_lines)
    timing = _markdown_table(*_timing_rows(summaries, peer))
    model_state = _markdown_table(*_bytes_rows(summaries))
    notes = "\n".join(f"- {line}" for line in _notes(summaries))
    return "\n\n".join([settings, timing, model_state, notes]).rstrip() + "\n"
