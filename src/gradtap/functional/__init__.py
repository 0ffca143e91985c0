"""Explicit functional building blocks: a convolution differentiable to any order.

``gradtap.functional.conv`` is the function; its implementation is ``gradtap.functional._conv``.
"""

from gradtap.functional._conv import conv, conv_input_grad, conv_weight_grad

__all__ = [
    "conv",
    "conv_input_grad",
    "conv_weight_grad",
]
