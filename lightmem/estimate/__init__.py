"""Memory estimator: a fake-tensor dry run of one training step -> peak, breakdown, advice, plan."""

from lightmem.estimate.estimator import estimate_memory
from lightmem.estimate.frontier import Frontier, frontier
from lightmem.estimate.planner import Plan, plan
from lightmem.estimate.report import Advice, BlockMemory, MemoryEstimate, StepMemory
from lightmem.estimate.search import BatchSearch, SequenceSearch, max_batch_size, max_sequence_length
from lightmem.estimate.step import EstimateError

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
