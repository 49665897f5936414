"""The pure parts of ``benchmarks.communication``: ring-model bytes, the formulas, the sums of a captured op list,
the analysis of a rank's probed steps and the markdown; and that the op table covers torch's collective ops.

No process group: records are built by hand, as the rank side's dispatch mode writes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed  # noqa: F401  (registers the c10d ops)

from benchmarks.communication.counting import (
    CONTROL_MAX_BYTES,
    GLOO_REDUCE_SCATTER_AS_ALL_REDUCE,
    KINDS,
    NOT_COLLECTIVES,
    OP_RULES,
    analyse_rank,
    formula,
    gloo_wire_bytes,
    is_control,
    markdown,
    signature,
    summarize_step,
    wire_bytes,
)

PSI = 2_644_992  # the small GPT's parameters


def record(
    kind: str, payload: int, phase: str = "backward", group_size: int = 2, role: str | None = None, op: str = "c10d.x"
) -> dict:
    return {
        "op": op,
        "kind": kind,
        "payload_bytes": payload,
        "wire_bytes": wire_bytes(kind, payload, group_size, role),
        "phase": phase,
        "group_size": group_size,
        "role": role,
        "shapes": [[payload // 4]],
        "site": "somewhere.py:function",
    }


# ---------------------------------------------------------------------------------------------------------------
# Ring model
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "n", "expected"),
    [
        ("all_reduce", 2, 1000.0),  # 2(n-1)/n = 1 at two ranks
        ("all_reduce", 4, 1500.0),
        ("all_gather", 2, 500.0),
        ("all_gather", 4, 750.0),
        ("reduce_scatter", 4, 750.0),
        ("all_to_all", 2, 500.0),
        ("send", 4, 1000.0),
        ("receive", 4, 0.0),
        ("barrier", 4, 0.0),
    ],
)
def test_wire_bytes_follow_ring_algorithms(kind: str, n: int, expected: float) -> None:
    assert wire_bytes(kind, 1000, n) == pytest.approx(expected)


def test_wire_bytes_of_rooted_collectives_depend_on_the_role() -> None:
    # A broadcast chain: the root and all but the last of the others send the whole payload.
    assert wire_bytes("broadcast", 1000, 2, "root") == 1000
    assert wire_bytes("broadcast", 1000, 2, "other") == 0
    root, others = wire_bytes("broadcast", 900, 4, "root"), wire_bytes("broadcast", 900, 4, "other")
    assert root + 3 * others == pytest.approx(3 * 900)  # n - 1 ranks send it in all
    assert wire_bytes("reduce", 1000, 4, "root") == 0 and wire_bytes("reduce", 1000, 4, "other") == 1000
    assert wire_bytes("gather", 1000, 4, "other") == 250 and wire_bytes("scatter", 1000, 4, "root") == 750
    with pytest.raises(ValueError, match="role"):
        wire_bytes("broadcast", 1000, 2)


def test_wire_bytes_alone_and_unknown_kinds() -> None:
    assert wire_bytes("all_reduce", 1000, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind"):
        wire_bytes("all_reduce_twice", 1000, 2)


# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------


def test_data_parallel_formulas_per_rank() -> None:
    ddp = formula("ddp", PSI, 2)
    assert ddp.payload_bytes == 4 * PSI and ddp.wire_bytes == 4 * PSI  # 2Ψ(n-1)/n elements = Ψ at n = 2
    zero = formula("zero", PSI, 2)
    assert zero.payload_bytes == 8 * PSI and zero.wire_bytes == ddp.wire_bytes  # ZeRO-1/2 move what DDP moves
    zero3 = formula("zero3", PSI, 2)
    assert zero3.payload_bytes == 12 * PSI and zero3.wire_bytes == pytest.approx(1.5 * ddp.wire_bytes)
    large = formula("zero3", PSI, 8)
    assert large.wire_bytes == pytest.approx(3 * PSI * 4 * 7 / 8)
    assert formula("ddp", PSI, 2, element_size=2).wire_bytes == 2 * PSI


def test_tensor_parallel_formulas_count_four_activations_per_layer() -> None:
    bsh, layers = 4 * 64 * 256, 2
    tp = formula("tp", PSI, 2, activation_elements=bsh, layers=layers)
    assert tp.payload_bytes == 4 * layers * bsh * 4 and tp.wire_bytes == tp.payload_bytes
    sequence_parallel = formula("tp_sequence_parallel", PSI, 2, activation_elements=bsh, layers=layers)
    # Each all-reduce becomes an all-gather plus a reduce-scatter: twice the payload, the same wire.
    assert sequence_parallel.payload_bytes == 2 * tp.payload_bytes
    assert sequence_parallel.wire_bytes == tp.wire_bytes
    with pytest.raises(ValueError, match="unknown mode"):
        formula("zero4", PSI, 2)


# ---------------------------------------------------------------------------------------------------------------
# Sums of a captured op list
# ---------------------------------------------------------------------------------------------------------------


def test_control_is_small_payloads_and_barriers() -> None:
    assert is_control(record("all_reduce", 16))
    assert is_control(record("all_reduce", CONTROL_MAX_BYTES))
    assert not is_control(record("all_reduce", CONTROL_MAX_BYTES + 4))
    assert is_control({**record("barrier", 10_000)})


def zero2_step(all_reduce: bool) -> list[dict[str, Any]]:
    """A ZeRO-2 step as the dispatch mode records it: the loop's SIGTERM flag, the gradient reduction, the
    parameter-presence flags and the non-finite vote, then the parameter exchange."""
    gradients = record(
        "all_reduce" if all_reduce else "reduce_scatter",
        4 * PSI,
        op="c10d.allreduce_" if all_reduce else "c10d._reduce_scatter_base_",
    )
    parameters = record("all_reduce" if all_reduce else "all_gather", 4 * PSI, phase="optimizer step")
    return [
        record("broadcast", 8, phase="between steps", role="root"),
        gradients,
        record("all_reduce", 116),
        record("all_reduce", 16, phase="after backward"),
        parameters,
    ]


def test_summary_of_a_zero2_step_by_kind_phase_and_control() -> None:
    summary = summarize_step(zero2_step(all_reduce=True))
    assert summary["data"] == {"all_reduce": {"count": 2, "payload_bytes": 8 * PSI, "wire_bytes": 8 * PSI}}
    assert summary["control"]["all_reduce"] == {"count": 2, "payload_bytes": 132, "wire_bytes": 132}
    assert summary["control"]["broadcast"]["count"] == 1
    assert summary["control_total"]["payload_bytes"] == 140
    assert set(summary["data_by_phase"]) == {"backward", "optimizer step"}
    textbook = formula("zero", PSI, 2)
    # All-reduce on gloo: the formula's payload, twice its wire.
    assert summary["data_total"]["payload_bytes"] == textbook.payload_bytes
    assert summary["data_total"]["wire_bytes"] == 2 * textbook.wire_bytes
    scatter_gather = summarize_step(zero2_step(all_reduce=False))
    assert scatter_gather["data_total"]["wire_bytes"] == textbook.wire_bytes
    assert set(scatter_gather["data"]) == {"reduce_scatter", "all_gather"}


def test_signature_tells_steps_apart() -> None:
    step = zero2_step(all_reduce=True)
    assert signature(step) == signature([dict(entry) for entry in step])
    assert signature(step) != signature(step[:-1])


def test_analyse_rank_uses_the_last_step_and_checks_the_others() -> None:
    steps = [
        {"step": index, "collectives": zero2_step(True), "socket_bytes_sent": 8 * PSI + 4000, "socket_writes": 40}
        for index in (2, 3)
    ]
    analysis = analyse_rank({"rank": 0, "steps": steps})
    assert analysis["step"] == 3 and analysis["identical_steps"]
    assert analysis["ring_model_bytes"] == 8 * PSI + 132 + 8
    assert analysis["gloo_model_bytes"] == analysis["ring_model_bytes"]  # no reduce-scatter in this step
    assert analysis["socket_bytes_sent"] == 8 * PSI + 4000
    sites = analysis["control_by_site"]
    assert [group["count"] for group in sites] == [1, 1, 1]
    assert {group["kind"] for group in analysis["data_by_phase_and_kind"]} == {"all_reduce"}
    steps[0]["collectives"] = zero2_step(False)
    assert not analyse_rank({"rank": 0, "steps": steps})["identical_steps"]
    # gloo's reduce-scatter is an all-reduce of the whole input: it sends twice the ring model's bytes.
    scatter_gather = analyse_rank({"rank": 0, "steps": [{**steps[0], "step": 4}]})
    assert scatter_gather["gloo_model_bytes"] - scatter_gather["ring_model_bytes"] == 2 * PSI


def test_cpu_seconds_are_medians_over_the_probed_steps() -> None:
    clocks = [(0.070, 0.020, 0.110), (0.060, 0.010, 0.090), (0.080, 0.030, 0.200)]
    steps = [
        {
            "step": index,
            "collectives": zero2_step(True),
            "socket_bytes_sent": 0,
            "socket_writes": 0,
            "main_thread_cpu_seconds": main,
            "other_threads_cpu_seconds": other,
            "wall_seconds": wall,
        }
        for index, (main, other, wall) in zip((2, 3, 4), clocks, strict=True)
    ]
    analysis = analyse_rank({"rank": 0, "steps": steps})
    assert analysis["main_thread_cpu_seconds"] == pytest.approx(0.070)
    assert analysis["other_threads_cpu_seconds"] == pytest.approx(0.020)
    assert analysis["wall_seconds"] == pytest.approx(0.110)


def test_gloo_wire_bytes_of_reduce_scatters_are_those_of_an_all_reduce() -> None:
    for op in GLOO_REDUCE_SCATTER_AS_ALL_REDUCE:
        assert gloo_wire_bytes(record("reduce_scatter", 4000, op=op, group_size=4)) == 6000
    assert gloo_wire_bytes(record("all_gather", 4000, op="c10d._allgather_base_", group_size=4)) == 3000


def test_markdown_puts_measurement_next_to_formula() -> None:
    steps = [{"step": 2, "collectives": zero2_step(True), "socket_bytes_sent": 8 * PSI, "socket_writes": 30}]
    ranks = [analyse_rank({"rank": rank, "steps": steps}) for rank in (0, 1)]
    document = {
        "machine": "test machine",
        "started_at": "2026-11-24 00:00 UTC",
        "command": "python -m benchmarks.communication",
        "software": {"torch": "t", "lightning": "l", "python": "p", "lightning_colossal": "c"},
        "git": "abc",
        "wall_seconds": 1.0,
        "model": {"embed_dim": 256, "num_layers": 2},
        "parameters": PSI,
        "control_max_bytes": CONTROL_MAX_BYTES,
        "settings": {"batch_size_per_rank": 4, "sequence_length": 64, "world_size": 2, "probed_steps": [2]},
        "configurations": {
            "colossal_zero2_all_reduce": {"analysis": {"formula": formula("zero", PSI, 2).__dict__, "ranks": ranks}}
        },
        "primitives": {
            "payload_bytes": 4096,
            "rows": [
                {
                    "name": "reduce_scatter_tensor",
                    "payload_bytes": 4096,
                    "ring_model_bytes": [2048, 2048],
                    "socket_bytes_sent": [4144, 4144],
                    "socket_writes": [2, 2],
                }
            ],
        },
    }
    text = markdown(document)
    assert "| colossal_zero2_all_reduce | 21,159,936 (2) | – | – | – | 21,159,936 |" in text
    assert "| 1.0000 |" in text  # payload against the formula's payload
    assert "| 2.0000 |" in text  # wire against the formula's wire
    assert "`somewhere.py:function`" in text
    assert "| reduce_scatter_tensor | 2,048 / 2,048 | 4,144 / 4,144 | 2 / 2 | 2,096 / 2,096 |" in text
    assert "| colossal_zero2_all_reduce | 2 | 0 / 0 | 0 / 0 | 0 / 0 |" in text  # steps without clocks: zeros


# ---------------------------------------------------------------------------------------------------------------
# The op table against the installed torch
# ---------------------------------------------------------------------------------------------------------------


def _collective_ops() -> dict[str, Any]:
    ops = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace in ("c10d", "_c10d_functional"):
            ops[f"{namespace}.{name}"] = getattr(getattr(torch.ops, namespace), name)
    return ops


def test_every_collective_op_of_torch_has_a_rule_naming_real_arguments() -> None:
    ops = _collective_ops()
    assert ops, "torch registers no c10d ops"
    missing = sorted(set(ops) - set(OP_RULES) - NOT_COLLECTIVES)
    assert not missing, f"collective ops without a rule (they would be reported as unknown): {missing}"
    for name, rule in OP_RULES.items():
        assert rule.kind in KINDS
        if name not in ops:
            continue  # a rule for an op another torch version has
        packet = ops[name]
        for overload in packet.overloads():
            arguments = {argument.name for argument in getattr(packet, overload)._schema.arguments}
            assert rule.payload in arguments, (name, overload, rule.payload)
            assert rule.peer is None or rule.peer in arguments, (name, overload, rule.peer)


def test_world_size_other_than_two_takes_only_the_data_parallel_configurations(capsys: pytest.CaptureFixture[str]):
    from benchmarks.communication.exchanges import _training_spec, parse_arguments

    arguments = parse_arguments(["--world-size", "4", "--configurations", "colossal_ddp,colossal_fsdp"])
    assert _training_spec("colossal_fsdp", arguments)["world_size"] == 4
    with pytest.raises(SystemExit):
        parse_arguments(["--world-size", "4", "--configurations", "colossal_ddp,colossal_hybrid_tp2"])
    assert "colossal_hybrid_tp2 are measured at --world-size 2 only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_arguments(["--world-size", "0", "--configurations", "colossal_ddp"])
    assert "pass 1 or more ranks" in capsys.readouterr().err
