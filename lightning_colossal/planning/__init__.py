"""The memory planner behind ``python -m lightning_colossal.plan`` (see docs/planner.md). No Lightning here.

- ``model_shape`` / ``sources``: a model as parameter shapes plus its transformer shape (demo GPT, Hugging Face
  config, or a parameter count and layer shape);
- ``model_state``: each engine's exact per-rank parameter, gradient and optimizer-state bytes, on the device, in host
  memory and on disk (``chunks``: Gemini's chunks, by the engine's own layout functions);
- ``disk_tier``: the node's disk for the disk tier, the tier's records and a step's disk I/O lower bound;
- ``working`` / ``activations``: estimated working memory and activations;
- ``planner``: evaluate every setting and recommend one; ``report``: the table and the JSON.
"""

from lightning_colossal.planning.activations import ActivationEstimate, Workload, activation_estimate
from lightning_colossal.planning.disk_tier import Disk
from lightning_colossal.planning.model_shape import Architecture, ModelShape, ParameterShape, describe_module
from lightning_colossal.planning.model_state import OPTIMIZERS, ModelState, Placed, Training, model_state
from lightning_colossal.planning.planner import Hardware, Plan, make_plan
from lightning_colossal.planning.settings import Setting, standard_settings

__all__ = [
    "OPTIMIZERS",
    "ActivationEstimate",
    "Architecture",
    "Disk",
    "Hardware",
    "ModelShape",
    "ModelState",
    "ParameterShape",
    "Placed",
    "Plan",
    "Setting",
    "Training",
    "Workload",
    "activation_estimate",
    "describe_module",
    "make_plan",
    "model_state",
    "standard_settings",
]
