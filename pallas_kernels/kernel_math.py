"""Matmul helpers shared by the GDN and KDA kernel bodies (TPU and GPU): f32 accumulation, full precision."""

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
F32 = jnp.float32


def dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=F32)


def dot_nt(a, b):
    """a [M,D], b [N,D] -> a b^T [M,N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def dot_tn(a, b):
    """a [D,M], b [D,N] -> a^T b [M,N]."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def unit_lower_inverse(a):
    """(I + A)^-1 for strictly lower-triangular A [C,C] by repeated squaring (as `gdn.py`'s
    reference): (I - A)(I + A^2)(I + A^4)..., 2 log2(C) MXU matmuls instead of C row steps."""
    c = a.shape[0]
    eye = lax.broadcasted_iota(jnp.int32, (c, c), 0) == lax.broadcasted_iota(jnp.int32, (c, c), 1)
    inverse = eye.astype(F32) - a
    power = a
    span = 2
    while span < c:
        power = dot(power, power)
        inverse = inverse + dot(inverse, power)
        span *= 2
    return inverse
