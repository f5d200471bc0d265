"""The reduce-scatter's fp32 sums follow IEEE on JAX's CPU devices (issue #8 part 4): subnormal
gradients are summed, not flushed to zero (XLA:CPU's threads run with FTZ/DAZ; tide clears it for
its own arithmetic, src/engine/cpu.rs [Note: IEEE arithmetic]), and -0.0 sums stay -0.0, as on CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"
QUARTER_MIN = np.float32(np.finfo(np.float32).tiny / 4)  # subnormal, exact in bfloat16 too


def _reduce_scatter(grads, lay, mesh):
    f = tide_jax.shard_map(
        lambda g: tide_jax.reduce_scatter(g, lay), mesh=mesh, in_specs=(P(),), out_specs=lay.spec, check_vma=False
    )
    return lay.unshard(jax.jit(f)(grads))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("topology", ["1x8", "2x4"])
def test_subnormals_and_signed_zeros(tide_backend, dtype, topology):
    mesh = make_mesh((8,), (AXIS,))
    params = {"sub": np.zeros((16, 3), np.float32), "negzero": np.zeros((9,), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS, topology=topology)
    grads = {
        "sub": jnp.full((16, 3), QUARTER_MIN, dtype),
        "negzero": jnp.full((9,), -0.0, dtype),
    }
    out = _reduce_scatter(grads, lay, mesh)
    # Every device passes the same gradient: 8 x FLT_MIN/4 = 2 x FLT_MIN, exactly.
    np.testing.assert_array_equal(np.asarray(out["sub"]), np.full((16, 3), 8 * QUARTER_MIN, np.float32))
    assert np.all(np.asarray(out["sub"]) > 0), "subnormals flushed to zero"
    neg = np.asarray(out["negzero"])
    assert np.all(neg == 0) and np.all(np.signbit(neg)), f"sum of -0.0 must be -0.0, got {neg}"
