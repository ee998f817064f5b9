"""Dispatch plans (who sends which rows where) and the permute / combine that apply them."""

from moeflow.dispatch.capacity import capacity
from moeflow.dispatch.permute import combine, permute
from moeflow.dispatch.plan import DispatchPlan, make_plan

__all__ = ["DispatchPlan", "capacity", "combine", "make_plan", "permute"]
