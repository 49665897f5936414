"""Hybrid 3D parallelism (tensor, pipeline, sequence, data/ZeRO): engine, policies, layers. No Lightning."""

from lightning_colossal.parallel.batches import split_sequence
from lightning_colossal.parallel.engine import HybridEngine
from lightning_colossal.parallel.groups import HybridGroups, build_groups
from lightning_colossal.parallel.pipeline import GradientStash, PipelineStep
from lightning_colossal.parallel.policies import find_policy
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan

__all__ = [
    "GradientStash",
    "HybridEngine",
    "HybridGroups",
    "ModelPolicy",
    "ParallelPlan",
    "PipelineStep",
    "build_groups",
    "find_policy",
    "split_sequence",
]
