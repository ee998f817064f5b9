"""Dispatch plans (who sends which rows where) and the permute / un-permute that apply them."""

from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.plan import DispatchPlan, make_plan
from moeflow.dispatch.permute import combine, group_by_expert, permute, ungroup

__all__ = ["DispatchPlan", "capacity", "combine", "group_by_expert", "make_plan", "permute",
           "ungroup"]
