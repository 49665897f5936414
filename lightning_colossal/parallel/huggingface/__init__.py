"""The hybrid strategy's built-in policies for Hugging Face ``transformers`` models (tensor and pipeline parallelism).

- ``decoders``: decoders that carry their own ``base_model_tp_plan`` / ``base_model_pp_plan`` (Llama, Qwen2/3,
  Mistral, Gemma, the mixtures): tensor and pipeline parallelism (``PIPELINE_MODEL_TYPES``; ``PIPELINE_REFUSED``
  says why the others have none).
- ``split_gather``: split-gather sequence parallelism for every family whose structure fits, one
  ``SplitGatherLayout`` each (where the residual stream is split and gathered); ``REFUSED`` says why the others
  have none.
- ``families``: one declarative ``FamilyPlan`` per family without a usable plan (OPT, ViT, T5, Switch, BLOOM,
  Falcon, Phi-3), applied through ``parallel/plan_policy.py``.
- ``gpt2``, ``bert``: the policies of models whose split needs more than a plan (GPT-2's fused ``Conv1D``, BERT).
- ``sequence_modes``: the one sequence-parallel step of the policies above (``parallelize_with_sequence``): their
  tensor-parallel split alone, then the mode's attach step, looked up by the mode's type.
- ``sequence``: Ulysses and ring sequence parallelism through ``transformers``' attention interface, for every family
  whose attention goes through it.
- ``base_model``: the base model inside a task model, which every policy here splits.

No module imports ``transformers`` when imported: each policy imports it when asked whether it accepts a module.
"""

from lightning_colossal.parallel.huggingface.bert import BertPolicy
from lightning_colossal.parallel.huggingface.decoders import PIPELINE_MODEL_TYPES, HuggingFacePlanPolicy
from lightning_colossal.parallel.huggingface.families import FAMILY_PLANS, FamilyPlan, FamilyPlanPolicy
from lightning_colossal.parallel.huggingface.gpt2 import GPT2Policy
from lightning_colossal.parallel.policy import ModelPolicy


def huggingface_policies() -> list[ModelPolicy]:
    """The built-in Hugging Face policies, in the order ``find_policy`` asks them."""
    # Model-specific policies first: GPT-2 and BERT carry no tensor-parallel plan of their own, and the family plans
    # cover families without one (OPT, Bloom, ...) or whose own plan's styles are not applied here (Phi-3).
    return [GPT2Policy(), BertPolicy(), FamilyPlanPolicy(), HuggingFacePlanPolicy()]


__all__ = [
    "FAMILY_PLANS",
    "PIPELINE_MODEL_TYPES",
    "BertPolicy",
    "FamilyPlan",
    "FamilyPlanPolicy",
    "GPT2Policy",
    "HuggingFacePlanPolicy",
    "huggingface_policies",
]
