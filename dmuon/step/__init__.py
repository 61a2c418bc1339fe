"""The step of :class:`dmuon.Muon`, owned by one object (:class:`Stepper`)."""

from dmuon.step.stepper import StepCompanion, Stepper

__all__ = ["StepCompanion", "Stepper"]
