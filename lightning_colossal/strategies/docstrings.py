"""Completing a strategy's ``Args:`` docstring section with the arguments it shares with others.

LightningCLI (through jsonargparse and docstring-parser) shows an argument's description only when the class whose
constructor takes it documents it, one argument per line. The arguments every strategy passes to the base (the
timeout, the launcher, ...) and those a strategy forwards to its config (``HybridConfig``) are described once,
where they are defined; ``complete_argument_docs`` copies those descriptions into each strategy's docstring when
the class is created, so ``--trainer.strategy.help`` lists them all without the text being written five times.
"""

from __future__ import annotations

import inspect


def argument_docs(documented: type) -> dict[str, list[str]]:
    """The ``Args:`` entries of ``documented``'s docstring: name -> its lines (first line, then continuations)."""
    doc = inspect.getdoc(documented) or ""
    if "Args:\n" not in doc:
        return {}
    entries: dict[str, list[str]] = {}
    current: str | None = None
    for line in doc.split("Args:\n", 1)[1].splitlines():
        if line.startswith("        ") and current is not None:
            entries[current].append(line.strip())
        elif line.startswith("    ") and ":" in line:
            current, description = line.strip().split(":", 1)
            entries[current] = [description.strip()]
        else:
            break
    return entries


def complete_argument_docs(cls: type, sources: tuple[type, ...]) -> None:
    """Add to ``cls``'s ``Args:`` section every constructor argument it does not describe, from ``sources``."""
    doc = inspect.getdoc(cls)
    if not doc or "Args:\n" not in doc:
        return
    own = argument_docs(cls)
    borrowed = [argument_docs(source) for source in sources]
    missing: list[str] = []
    for name in inspect.signature(cls.__init__).parameters:
        if name == "self" or name in own:
            continue
        for entries in borrowed:
            if name in entries:
                first, *rest = entries[name]
                missing.append(f"    {name}: {first}")
                missing.extend(f"        {line}" for line in rest)
                break
    if not missing:
        return
    head, section = doc.split("Args:\n", 1)
    lines = section.splitlines()
    end = next((index for index, line in enumerate(lines) if line.strip() and not line.startswith("    ")), len(lines))
    # Keep a blank line that closes the section where it was.
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    cls.__doc__ = head + "Args:\n" + "\n".join([*lines[:end], *missing, *lines[end:]])
