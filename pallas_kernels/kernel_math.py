"""Helpers shared by the GDN, KDA and SSD kernel bodies and wrappers (TPU and GPU): matmuls with f32
accumulation at full precision, the unit-lower-triangular inverse, the SSD D skip."""

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


def add_skip(y, x, d, cu_q_lens, num_seqs):
    """y [T,H,P] f32 (zero on padding) + D x on real tokens only -> x.dtype (padding stays zero)."""
    t = x.shape[0]
    valid = jnp.arange(t) < cu_q_lens[jnp.reshape(num_seqs, (-1,))[0]]
    skip = jnp.where(valid[:, None, None], d.astype(jnp.float32)[:, None] * x.astype(jnp.float32), 0.0)
    return (y + skip).astype(x.dtype)
