"""Per-layer rules, one module per layer family, registered here and nowhere else.

Each family module defines its :class:`~gradtap._samples.rule.PerSampleRule` entries;
this module registers every built-in entry in ``PER_SAMPLE`` for the module types it serves
(and, through the class hierarchy, their subclasses).
"""

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from gradtap._samples.rule import PER_SAMPLE
from gradtap._samples.rules import attention, conv, embedding, linear, norm

__all__ = ["attention", "conv", "embedding", "linear", "norm"]

PER_SAMPLE.register(nn.Linear)(linear.LINEAR)
PER_SAMPLE.register(*conv.CONV_TYPES)(conv.CONV)
PER_SAMPLE.register(nn.Embedding)(embedding.EMBEDDING)
PER_SAMPLE.register(nn.LayerNorm)(norm.LAYER_NORM)
PER_SAMPLE.register(nn.RMSNorm)(norm.RMS_NORM)
PER_SAMPLE.register(nn.GroupNorm)(norm.GROUP_NORM)
PER_SAMPLE.register(_InstanceNorm)(norm.INSTANCE_NORM)
PER_SAMPLE.register(_BatchNorm)(norm.BATCH_NORM)
PER_SAMPLE.register(nn.MultiheadAttention)(attention.ATTENTION)
