"""Parallel layouts: how a role's ranks split into data, sequence, tensor and expert groups
(layout.py), and each role's layout read off the config (roles.py)."""

from hybridflow.parallel.layout import (
    Layout,
    RoleMesh,
    build_mesh,
    coordinates,
    group_ranks,
    layout_problems,
    ranks_with,
    rollout_layout,
    train_layout,
)
from hybridflow.parallel.roles import RoleLayouts, role_layouts, role_sizes

__all__ = [
    "Layout",
    "RoleLayouts",
    "RoleMesh",
    "build_mesh",
    "coordinates",
    "group_ranks",
    "layout_problems",
    "ranks_with",
    "role_layouts",
    "role_sizes",
    "rollout_layout",
    "train_layout",
]
