"""Plant known engine bugs one at a time in a scratch copy of the repository and report which tests catch each.

Not a test module (pytest collects only ``test_*.py``). Run from the repository root::

    python tests/mutation/plant_bugs.py                  # every bug
    python tests/mutation/plant_bugs.py zero2-sum ddp-sum  # some of them
    python tests/mutation/plant_bugs.py --baseline         # first check that the selected tests pass unmutated

For each bug the copy is restored, the bug's string replacements are applied (each ``old`` must occur exactly once),
and the bug's test selection runs in a fresh pytest process with the copy first on ``PYTHONPATH`` (so the rank-pool
workers import the mutated ``lightning_colossal``). A bug is caught when at least one selected test fails or errors.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Bug:
    name: str
    description: str
    replacements: tuple[tuple[str, str, str], ...]  # (file relative to the repository, old, new)
    tests: tuple[str, ...]  # pytest arguments: files, node ids, or "-k" expressions as "FILE::-k EXPR"
    notes: list[str] = field(default_factory=list, compare=False)


DIST = "tests/distributed"
NEW_SCALE = f"{DIST}/test_gradient_scale_oracle.py"
NEW_VOTE = f"{DIST}/test_overflow_vote.py"

BUGS = [
    Bug(
        "zero2-sum",
        "ZeRO-2 sums the reduced gradient shards instead of averaging them",
        (
            (
                "lightning_colossal/zero/stages.py",
                "[own_slot[m.bucket_offset : m.bucket_offset + m.spec.local_numel] for m in members],\n"
                "                alpha=1.0 / self.world_size,",
                "[own_slot[m.bucket_offset : m.bucket_offset + m.spec.local_numel] for m in members],\n"
                "                alpha=1.0,",
            ),
        ),
        # The staged route is the one NCCL takes; on gloo only the native-route tests run it with plain SGD.
        (f"{DIST}/test_zero_oracle.py", NEW_SCALE, f"{DIST}/test_native_route.py"),
    ),
    Bug(
        "zero1-sum",
        "ZeRO-1 sums the all-reduced gradient buckets instead of averaging them",
        (("lightning_colossal/zero/stages.py", "bucket.gradients.div_(self.world_size)", "bucket.gradients.div_(1)"),),
        (f"{DIST}/test_zero_oracle.py", NEW_SCALE),
    ),
    Bug(
        "gemini-sum",
        "Gemini sums the reduced chunk gradients instead of averaging them",
        (
            (
                "lightning_colossal/gemini/manager.py",
                "torch._foreach_add_(targets, owns, alpha=1.0 / self.world_size)",
                "torch._foreach_add_(targets, owns, alpha=1.0)",
            ),
        ),
        (f"{DIST}/test_gemini_oracle.py", NEW_SCALE),
    ),
    Bug(
        "fsdp-divide-factor",
        "FSDP's gradient divide factor set to 1 (reduce-scatter sums)",
        (
            (
                "lightning_colossal/strategies/fsdp.py",
                "        if template is not None:\n            # Under CPU offload",
                "        for root in roots:\n"
                "            root.set_gradient_divide_factor(1.0)\n"
                "        if template is not None:\n            # Under CPU offload",
            ),
        ),
        (f"{DIST}/test_fsdp.py::-k oracle or clip", NEW_SCALE),
    ),
    Bug(
        "no-overflow-vote",
        "fp16 overflow decided per rank (the cross-rank MAX vote removed)",
        (
            (
                "lightning_colossal/precision.py",
                "        return collectives.any_rank_true(found_overflow, group=self.process_group)",
                "        return bool(found_overflow.item())",
            ),
        ),
        (f"{DIST}/test_zero_oracle.py::-k fp16", f"{DIST}/test_gemini_paths.py::-k fp16 or overflow", NEW_VOTE),
    ),
    Bug(
        "scalar-norm-twice",
        "a zero-dimensional (replicated) parameter counted on every rank in the global gradient norm",
        (
            (
                "lightning_colossal/engine_parts/sharded_state.py",
                "if gradient is None or not gradient.numel() or (rank != 0 and entry.spec.replicated):",
                "if gradient is None or not gradient.numel():",
            ),
        ),
        (f"{DIST}/test_zero_oracle.py::-k clip", NEW_SCALE),
    ),
    Bug(
        "clip-coefficient",
        "clip coefficient not clamped at 1 (steps under the threshold are scaled up)",
        (
            (
                "lightning_colossal/engine_parts/sharded_state.py",
                "coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)",
                "coefficient = max_norm / (norm + 1e-6)",
            ),
        ),
        (f"{DIST}/test_zero_oracle.py::-k clip", f"{DIST}/test_gemini_paths.py::-k clip", NEW_SCALE),
    ),
    Bug(
        "fsdp-meta-zeros",
        "FSDP materialises a meta-device model zero-filled instead of running its initialisers",
        (
            (
                "lightning_colossal/fsdp/initialise.py",
                "        target.to_local().copy_(shard.to_local())",
                "        target.to_local().zero_()",
            ),
        ),
        (f"{DIST}/test_fsdp.py::-k meta",),
    ),
    Bug(
        "rng-restore-wrong-rank",
        "resume restores rank 0's random state on every rank",
        (
            (
                "lightning_colossal/strategies/checkpoint_loading.py",
                "        own_rank = self.global_rank",
                "        own_rank = 0",
            ),
        ),
        (f"{DIST}/test_checkpoint_resume.py::-k resume or random_state", f"{DIST}/test_fsdp.py::-k same_world_size"),
    ),
    Bug(
        "optimizer-state-not-loaded",
        "resume reads the optimizer state into a copy and never applies it",
        (
            (
                "lightning_colossal/strategies/checkpoint_loading.py",
                "                destinations.optimizers.append(self.optimizer_names_and_state(optimizer))",
                "                destinations.optimizers.append(__import__('copy').deepcopy("
                "self.optimizer_names_and_state(optimizer)))",
            ),
            (
                "lightning_colossal/strategies/checkpoint_loading.py",
                "            self._load_optimizer_state(optimizer, state)",
                "            pass",
            ),
        ),
        (f"{DIST}/test_checkpoint_resume.py::-k resume or model_checkpoint or plain",),
    ),
    Bug(
        "ddp-sum",
        "colossal_ddp sums gradients over ranks (a comm hook without the division)",
        (
            (
                "lightning_colossal/strategies/ddp.py",
                "        return wrapped\n\n    def pre_backward",
                "        def _summing_hook(state, bucket):\n"
                "            work = torch.distributed.all_reduce(bucket.buffer(), async_op=True)\n"
                "            return work.get_future().then(lambda future: future.value()[0])\n\n"
                "        wrapped.register_comm_hook(state=None, hook=_summing_hook)\n"
                "        return wrapped\n\n    def pre_backward",
            ),
        ),
        (f"{DIST}/test_ddp_oracle.py", NEW_SCALE),
    ),
    Bug(
        "zero-overlap-stale-rows",
        "ZeRO's step overlapped with the exchange sends the offloaded masters' rows before writing them into the parameters",
        (("lightning_colossal/zero/exchange.py", "            publish_rows(bucket)\n", "            pass\n"),),
        (f"{DIST}/test_zero_oracle.py::-k overlapped or bf16_weights", NEW_SCALE),
    ),
    Bug(
        "zero2-sum-in-place",
        "ZeRO-2 on gloo's point-to-point route sums the received gradient rows instead of averaging them",
        (
            (
                "lightning_colossal/zero/stages.py",
                "torch._foreach_add_(targets, sums, alpha=1.0 / self.world_size)",
                "torch._foreach_add_(targets, sums, alpha=1.0)",
            ),
        ),
        (f"{DIST}/test_zero_oracle.py", NEW_SCALE),
    ),
    Bug(
        "toggle-misses-parameters",
        "With one ZeRO engine per optimizer, toggle_optimizer changes only the masters' flags, not the parameters'",
        (
            (
                "lightning_colossal/strategies/engine_strategy.py",
                "            wrap_toggling(self.lightning_module, self._parameters_stepped_by)\n",
                "            pass\n",
            ),
        ),
        (f"{DIST}/test_manual_optimization.py",),
    ),
    Bug(
        "wrong-engine-after-step",
        "With one ZeRO engine per optimizer, every optimizer step publishes the first engine's rows",
        (
            (
                "lightning_colossal/strategies/engine_strategy.py",
                "self.engine_of(optimizer).after_step(",
                "self.engines[0].after_step(",
            ),
        ),
        (f"{DIST}/test_manual_optimization.py",),
    ),
]


def copy_repository(destination: Path) -> None:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".ruff_cache", ".mypy_cache", "out")
    shutil.copytree(REPOSITORY, destination, ignore=ignore)


def plant(copy: Path, bug: Bug) -> None:
    for relative, old, new in bug.replacements:
        path = copy / relative
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{bug.name}: {relative} holds {count} copies of the text to replace (need exactly one)")
        path.write_text(text.replace(old, new))


def restore(copy: Path, bug: Bug) -> None:
    for relative, _, _ in bug.replacements:
        shutil.copy2(REPOSITORY / relative, copy / relative)


def pytest_runs(selection: tuple[str, ...]) -> list[list[str]]:
    """One pytest argument list per entry (a ``FILE::-k EXPR`` entry becomes ``FILE -k EXPR``)."""
    runs = []
    for entry in selection:
        if "::-k " in entry:
            path, expression = entry.split("::-k ", 1)
            runs.append([path, "-k", expression])
        else:
            runs.append([entry])
    return runs


def run_tests(copy: Path, arguments: list[str]) -> tuple[list[str], int, str]:
    """Run pytest in the copy; return the failed/errored node ids, the number passed, and a status word."""
    environment = {**os.environ, "PYTHONPATH": str(copy) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *arguments]
    try:
        completed = subprocess.run(
            command, cwd=copy, env=environment, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"{arguments[0]} (timed out after {RUN_TIMEOUT_S} s)"], 0, "timeout"
    output = completed.stdout + completed.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)))
    passed = re.search(r"(\d+) passed", output)
    status = "ok" if completed.returncode in (0, 1) else f"exit {completed.returncode}"
    if completed.returncode not in (0, 1):
        failed.append(f"{arguments[0]} (pytest exit code {completed.returncode}: {output.strip()[-300:]!r})")
    return failed, int(passed.group(1)) if passed else 0, status


def check_isolation(copy: Path) -> None:
    environment = {**os.environ, "PYTHONPATH": str(copy)}
    found = subprocess.run(
        [sys.executable, "-c", "import lightning_colossal; print(lightning_colossal.__file__)"],
        cwd=copy,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not found.startswith(str(copy)):
        raise SystemExit(f"the copy does not import its own lightning_colossal (got {found})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bugs", nargs="*", help=f"bug names (default: all): {', '.join(bug.name for bug in BUGS)}")
    parser.add_argument("--baseline", action="store_true", help="first run every selected test on the unmutated copy")
    arguments = parser.parse_args()
    unknown = set(arguments.bugs) - {bug.name for bug in BUGS}
    if unknown:
        parser.error(f"unknown bugs {sorted(unknown)}")
    chosen = [bug for bug in BUGS if not arguments.bugs or bug.name in arguments.bugs]
    with tempfile.TemporaryDirectory(prefix="plant_bugs_") as scratch:
        copy = Path(scratch) / "repository"
        copy_repository(copy)
        check_isolation(copy)
        if arguments.baseline:
            selections = sorted({tuple(run) for bug in chosen for run in pytest_runs(bug.tests)})
            for selection in selections:
                failed, passed, _ = run_tests(copy, list(selection))
                print(f"baseline {' '.join(selection)}: {passed} passed, failing: {failed or 'none'}", flush=True)
                if failed:
                    raise SystemExit("the selected tests must pass unmutated")
        rows = []
        for bug in chosen:
            plant(copy, bug)
            started = time.monotonic()
            caught_by: list[str] = []
            passed_total = 0
            try:
                for run in pytest_runs(bug.tests):
                    failed, passed, _ = run_tests(copy, run)
                    caught_by.extend(failed)
                    passed_total += passed
            finally:
                restore(copy, bug)
            seconds = time.monotonic() - started
            rows.append((bug, caught_by, passed_total, seconds))
            verdict = f"caught by {len(caught_by)}" if caught_by else "NOT CAUGHT"
            print(f"[{bug.name}] {verdict} ({passed_total} passed, {seconds:.0f} s)", flush=True)
            for node in caught_by:
                print(f"    {node}", flush=True)
        print("\n| bug | description | result | caught by |")
        print("|---|---|---|---|")
        for bug, caught_by, passed_total, _ in rows:
            result = f"caught ({len(caught_by)} failing, {passed_total} passing)" if caught_by else "**NOT CAUGHT**"
            tests = "<br>".join(node.replace("tests/distributed/", "") for node in caught_by) or "-"
            print(f"| {bug.name} | {bug.description} | {result} | {tests} |")
        if any(not caught_by for _, caught_by, _, _ in rows):
            sys.exit(1)


if __name__ == "__main__":
    main()
