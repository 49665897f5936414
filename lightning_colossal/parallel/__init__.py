"""Hybrid 3D parallelism (tensor, pipeline, sequence, data/ZeRO): engine, policies, layers. No Lightning."""

from lightning_colossal.parallel.engine import HybridEngine
from lightning_colossal.parallel.groups import HybridGroups, build_groups
from lightning_colossal.parallel.policies import find_policy
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan

__all__ = ["HybridEngine", "HybridGroups", "ModelPolicy", "ParallelPlan", "build_groups", "find_policy"]
