"""One technique per file: a small class with a frozen ``Config`` and ``apply(model, ...)`` that
returns a ``Change``, what it changed (docs/techniques/README.md)."""

from memfit.techniques._protocol import Change
from memfit.techniques.accumulation import Accumulation
from memfit.techniques.checkpoint import Checkpoint
from memfit.techniques.chunked_loss import ChunkedLoss
from memfit.techniques.low_bit_optimizer import LowBitOptimizer
from memfit.techniques.offload import Offload
from memfit.techniques.optimizer_in_backward import OptimizerInBackward
from memfit.techniques.optimizer_offload import OptimizerOffload
from memfit.techniques.packed_int4 import PackedInt4
from memfit.techniques.param_offload import ParamOffload
from memfit.techniques.precision import Precision
from memfit.techniques.quantized_base import QuantizedBase
from memfit.techniques.remat import Remat
from memfit.techniques.sharding import Sharding

__all__ = ["Change", "Accumulation", "Checkpoint", "ChunkedLoss", "LowBitOptimizer", "Offload",
           "OptimizerInBackward", "OptimizerOffload", "PackedInt4", "ParamOffload", "Precision",
           "QuantizedBase", "Remat", "Sharding"]
