"""Kept path: ``weight_checker.ray.EngineActorMixin`` lives in
:mod:`weight_checker.integrations.ray`."""

from weight_checker.integrations.ray import EngineActorMixin

__all__ = ["EngineActorMixin"]
