"""The engine side a pool plugs into: the Resource protocol, steps, and the runner's admission."""

from .admission import AdmissionQueue, Granted
from .resource import (AdmitOutcome, EngineResourceInfo, LoraStep, Resource, ResourceReqConfig,
                       StepContext, StepRows)

__all__ = ["AdmissionQueue", "Granted", "AdmitOutcome", "EngineResourceInfo", "LoraStep", "Resource",
           "ResourceReqConfig", "StepContext", "StepRows"]
