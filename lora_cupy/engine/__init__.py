"""The engine side a pool plugs into: the Resource protocol, steps, the runner's admission, the
paged KV cache, and the worker that runs a main chain and a side-step lane."""

from .admission import AdmissionQueue, Granted
from .chain import ChainLane
from .kv import KVReqConfig, PagedKVCache
from .manager import EngineConfigError, EngineManager, NodeGroup
from .resource import (AdmitOutcome, EngineResourceInfo, LoraStep, Resource, ResourceReqConfig,
                       StepContext, StepRows)
from .scheduler import CHAIN_LANE, SIDE_LANE, MicroScheduler
from .side_steps import SideStepLane
from .tp import LockstepError, LockstepRank, RankFailureError, StepOrder, StepResult, Teardown, TPGroup
from .worker import Request, RequestResult, Worker

__all__ = ["AdmissionQueue", "Granted", "AdmitOutcome", "EngineResourceInfo", "LoraStep", "Resource",
           "ResourceReqConfig", "StepContext", "StepRows", "KVReqConfig", "PagedKVCache", "EngineConfigError",
           "EngineManager", "NodeGroup", "CHAIN_LANE", "SIDE_LANE", "MicroScheduler", "SideStepLane", "Request",
           "RequestResult", "Worker", "ChainLane"]
__all__ += ["LockstepError", "LockstepRank", "RankFailureError", "StepOrder", "StepResult", "Teardown", "TPGroup"]
