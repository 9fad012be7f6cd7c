"""Memory estimator: a fake-tensor dry run of one training step -> peak, breakdown, advice, plan."""

from lightmem.estimate.estimator import estimate_memory
from lightmem.estimate.frontier import Frontier, frontier
from lightmem.estimate.planner import plan
from lightmem.estimate.planning.result import Plan
from lightmem.estimate.report import Advice, MemoryEstimate, StepMemory
from lightmem.estimate.search import BatchSearch, max_batch_size
from lightmem.estimate.sequence import SequenceSearch, max_sequence_length
from lightmem.estimate.trace.blocks import BlockMemory
from lightmem.estimate.trace.errors import EstimateError

__all__ = [
    "Advice",
    "BatchSearch",
    "BlockMemory",
    "EstimateError",
    "Frontier",
    "MemoryEstimate",
    "Plan",
    "SequenceSearch",
    "StepMemory",
    "estimate_memory",
    "frontier",
    "max_batch_size",
    "max_sequence_length",
    "plan",
]
