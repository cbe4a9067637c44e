"""Thermal-aware placement: slot profiles, stage heat, assignment, launcher hooks.

    from advisor.placement import load_profile, plan, env_for_node
    p = plan("llama3-70b", "h200x16", cfg, ["node0.json", "node1.json"])
    if p.applied:
        os.environ.update(env_for_node(p))      # before the ranks of this node start

Nothing here imports torch; ``advisor thermal-profile`` runs its GEMM burn in subprocesses.
See docs/placement.md.
"""
from advisor.placement.assign import Assigner, Placement, SlotEffect, ThrottleCurve, slot_effect
from advisor.placement.launch import PlacementSkipped, env_for_node, exec_placed, placement_env
from advisor.placement.planner import DEFAULT_MARGIN_PCT, Plan, Planner, node_profiles, plan
from advisor.placement.profile import (NodeProfile, ProfileError, SlotProfile, fit_thermal, leakage_per_c,
                                       load_profile, profile_from_burn_json, profile_from_dict,
                                       profile_from_trace)
from advisor.placement.stage_heat import LayerCosts, StageHeat, stage_heat

__all__ = [
    "Assigner", "Placement", "SlotEffect", "ThrottleCurve", "slot_effect", "PlacementSkipped", "env_for_node",
    "exec_placed", "placement_env", "DEFAULT_MARGIN_PCT", "Plan", "Planner", "node_profiles", "plan",
    "NodeProfile", "ProfileError", "SlotProfile", "fit_thermal", "leakage_per_c", "load_profile",
    "profile_from_burn_json", "profile_from_dict", "profile_from_trace", "LayerCosts", "StageHeat", "stage_heat",
]
