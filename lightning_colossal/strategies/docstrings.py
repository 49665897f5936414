"""Completing a strategy's ``Args:`` docstring section with the arguments it shares with others.

LightningCLI (through jsonargparse and docstring-parser) shows an argument's description only when the class whose
constructor takes it documents it, one argument per line. The arguments every strategy passes to the base (the
timeout, the launcher, ...) and those a strategy forwards to its config (``ZeroConfig``, ``HybridConfig`` and
the flat arguments ``HybridConfig.from_flat_arguments`` turns into one) are described once, where they are defined;
``complete_argument_docs`` copies those descriptions into each strategy's docstring when the class is created, so
``help(ZeroStrategy)`` and the API docs list them all without the text being written twice. A strategy's constructor
still names every argument (LightningCLI reads the signature), but describes only those no source does. A strategy forwards its ``**kwargs`` to ``super().__init__``; ``constructor_arguments`` follows that the way
jsonargparse does for ``--trainer.strategy.help``, so both see the same arguments.
"""

from __future__ import annotations

import inspect


def argument_docs(documented: object) -> dict[str, list[str]]:
    """The ``Args:`` entries of ``documented``'s docstring (a class's or a function's): name -> its lines (first
    line, then continuations)."""
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


def constructor_arguments(cls: type) -> list[str]:
    """The keyword arguments ``cls(...)`` accepts: its ``__init__``'s, then, while an ``__init__`` takes ``**kwargs``
    (forwarded to ``super().__init__``, as every strategy does), those of the next ``__init__`` up the MRO."""
    names: list[str] = []
    for owner in cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
        named = (parameter.name for parameter in parameters if parameter.kind not in _VARIADIC)
        names.extend(name for name in named if name not in names)
        if not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
            break
    return names


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def complete_argument_docs(cls: type, sources: tuple[object, ...]) -> None:
    """Add to ``cls``'s ``Args:`` section (made at the end when it has none) every constructor argument it does not
    describe, from ``sources`` (classes or functions; the first that describes an argument wins)."""
    doc = inspect.getdoc(cls)
    if not doc:
        return
    doc += "\n"  # an ``Args:`` header on the last line opens the section too
    if "Args:\n" not in doc:
        doc += "\nArgs:\n"
    own = argument_docs(cls)
    borrowed = [argument_docs(source) for source in sources]
    missing: list[str] = []
    for name in constructor_arguments(cls):
        if name in own:
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
