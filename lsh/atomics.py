"""Atomic integer updates for numba kernels whose threads share out work as they go.

A ``prange`` loop splits its iterations into one fixed chunk per thread. Where the cost of an
iteration varies (a training sample's labels, LSH candidates and cache misses), the thread
with the costlier chunk finishes last and the others wait: at Amazon-670K shape on 2 threads
the training step's per-sample kernels sat idle about 5% of their time that way. With
``fetch_add`` each thread instead claims the next unclaimed item of a shared counter whenever it
finishes one, so the threads finish within one item of each other.
"""
from numba import types
from numba.extending import intrinsic

__all__ = ["fetch_add"]


@intrinsic
def fetch_add(typingctx, counter, value):
    """Atomically add ``value`` to ``counter[0]`` (int64 [>= 1], contiguous) and return the old
    value: among threads that call it at once, each gets a distinct old value."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64
            and counter.ndim == 1 and isinstance(value, types.Integer)):
        return None
    sig = types.int64(counter, value)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        v = context.cast(builder, args[1], signature.args[1], types.int64)
        # monotonic: the claimed index carries no data between threads, only which item is
        # whose (on x86 it is a lock xadd either way)
        return builder.atomic_rmw("add", arr.data, v, "monotonic")

    return sig, codegen
