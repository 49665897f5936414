"""What the Hugging Face policies read of ``transformers`` beyond its documented API, each read here and only here.

[Note: transformers internals]
Sequence parallelism, the pipeline stages and the tensor-parallel family plans depend on parts of ``transformers``
that a release may move: the attention and mask registries (``AttentionInterface``, ``AttentionMaskInterface``,
``ALL_MASK_ATTENTION_FUNCTIONS``; there is no public way to unregister a name, so ``unregister`` drops it from their
class-wide ``_global_mapping``), the causal LM loss (``LOSS_MAPPING["ForCausalLM"]``, which takes ``shift_labels`` and
``num_items_in_batch``), ``sdpa_attention_forward``, the mask builders ``create_causal_mask`` /
``create_sliding_window_causal_mask``, and each family's attention attributes that the family plans divide
(``families.py``). Each getter here imports what it names and, where the release lacks it, raises
``TransformersInternalsError`` naming the installed version, the tested range and the fix, instead of an
``ImportError`` or ``AttributeError`` deep in a forward.

What a getter cannot check by importing (the meaning of what it returns: the mask functions' index-based signature,
the packed-sequence reading of ``position_ids`` without a mask, the count Falcon's attention caches) is exercised by
``tests/unit/test_transformers_internals.py``, one test per internal on the installed version: a new release that
moves one of them fails that named test. ``TESTED_TRANSFORMERS`` is the range the suite was run on (its oldest and
newest releases; ``docs/huggingface.md`` says which tier on which); the test extra in ``pyproject.toml`` and that page
name the same range. Outside it, ``warn_if_untested`` says so once per
process when a policy first splits a model.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

#: The ``transformers`` releases the test suite was run on (the test extra in ``pyproject.toml`` pins the same).
TESTED_TRANSFORMERS = ">=5.23,<5.26"


class TransformersInternalsError(RuntimeError):
    """A part of ``transformers`` that a Hugging Face policy relies on is missing from the installed release."""


def installed_version() -> str:
    import transformers

    return str(transformers.__version__)


def _missing(what: str, needed_by: str) -> TransformersInternalsError:
    return TransformersInternalsError(
        f"{needed_by} needs {what} from transformers, which transformers {installed_version()} does not have. It is"
        f" tested with transformers{TESTED_TRANSFORMERS}: install a release in that range"
        f" (pip install 'transformers{TESTED_TRANSFORMERS}'), or train this model without it."
    )


def within_tested_range(version: str) -> bool:
    """Whether ``version`` lies in ``TESTED_TRANSFORMERS`` (a pre-release counts as the release it leads to)."""
    from packaging.specifiers import SpecifierSet  # a dependency of transformers
    from packaging.version import Version

    return Version(Version(version).base_version) in SpecifierSet(TESTED_TRANSFORMERS)


@functools.cache
def warn_if_untested() -> None:
    """Once per process: a warning when the installed ``transformers`` is outside ``TESTED_TRANSFORMERS``."""
    version = installed_version()
    if not within_tested_range(version):
        warnings.warn(
            f"lightning_colossal's Hugging Face policies are tested with transformers{TESTED_TRANSFORMERS}, and"
            f" transformers {version} is installed: what they read of its internals may have moved. Run"
            " tests/unit/test_transformers_internals.py to see, or install a tested release.",
            stacklevel=3,
        )


# ------------------------------------------------------------------------------------------------ attention
def attention_registries(needed_by: str) -> tuple[Any, Any]:
    """``AttentionInterface`` and ``AttentionMaskInterface``, where a sequence-parallel attention registers itself."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise _missing("AttentionInterface and masking_utils.AttentionMaskInterface", needed_by) from error
    for interface in (AttentionInterface, AttentionMaskInterface):
        if not hasattr(interface, "register") or not isinstance(getattr(interface, "_global_mapping", None), dict):
            raise _missing(f"{interface.__name__}.register and its _global_mapping", needed_by)
    return AttentionInterface, AttentionMaskInterface


def register_attention(name: str, attention: Any, mask: Any, needed_by: str) -> None:
    """Register ``attention`` and its ``mask`` builder under ``name`` (``config._attn_implementation``)."""
    attention_interface, mask_interface = attention_registries(needed_by)
    attention_interface.register(name, attention)
    mask_interface.register(name, mask)


def unregister_attention(name: str) -> None:
    """Drop ``name`` from both registries: ``register`` writes their class-wide mapping, and ``transformers`` has no
    way to remove an entry but that mapping."""
    attention_interface, mask_interface = attention_registries("Removing sequence parallelism")
    for interface in (attention_interface, mask_interface):
        interface._global_mapping.pop(name, None)


def is_registered(name: str) -> bool:
    attention_interface, mask_interface = attention_registries("Listing registered attentions")
    return name in attention_interface._global_mapping or name in mask_interface._global_mapping


def mask_builder(implementation: str, needed_by: str) -> Any:
    """The mask builder ``transformers`` runs for ``implementation`` (``"sdpa"``, ``"eager"``)."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError as error:
        raise _missing("masking_utils.ALL_MASK_ATTENTION_FUNCTIONS", needed_by) from error
    try:
        return ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    except KeyError as error:
        raise _missing(f"a mask builder for attn_implementation={implementation!r}", needed_by) from error


def sdpa_attention(needed_by: str) -> Any:
    """``transformers``' SDPA attention function (what ``attn_implementation="sdpa"`` runs)."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError as error:
        raise _missing("integrations.sdpa_attention.sdpa_attention_forward", needed_by) from error
    return sdpa_attention_forward


def causal_mask_builders(needed_by: str) -> tuple[Any, Any]:
    """``masking_utils.create_causal_mask`` and ``create_sliding_window_causal_mask`` (a base model's mask makers)."""
    try:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    except ImportError as error:
        raise _missing("masking_utils.create_causal_mask and create_sliding_window_causal_mask", needed_by) from error
    return create_causal_mask, create_sliding_window_causal_mask


# ------------------------------------------------------------------------------------------------ loss
def causal_lm_loss(needed_by: str) -> Any:
    """The loss a causal LM computes from ``labels`` (``LOSS_MAPPING["ForCausalLM"]``), which takes ``shift_labels``
    (labels shifted already) and ``num_items_in_batch`` (what the summed loss is divided by)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError as error:
        raise _missing("loss.loss_utils.LOSS_MAPPING", needed_by) from error
    loss = LOSS_MAPPING.get("ForCausalLM")
    if loss is None:
        raise _missing('LOSS_MAPPING["ForCausalLM"]', needed_by)
    return loss
