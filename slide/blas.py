"""Matrix products on strided row-major float32 views, for numba kernels.

numba's ``np.dot`` takes only contiguous operands, so a column block of a row-major matrix
(a thread's block of the shared pool's logits) has to be copied out and back. BLAS itself reads
and writes such a block in place through its leading dimension: :func:`gemm` passes each view's
row stride as that dimension. It calls the same BLAS as ``np.dot`` (scipy's, through numba's
exported helper ``numba_xxgemm``, found by name when the kernel is linked), so kernels that use
it load from numba's cache like any other.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.linalg import ensure_blas

__all__ = ["gemm"]


def _is_matrix(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.dtype == types.float32


@intrinsic
def gemm(typingctx, A, trans_a, B, trans_b, C, beta):
    """``C = op(A) @ op(B) + beta * C`` for float32 [.., ..] views whose rows are strided and
    whose elements within a row are contiguous (rows of a C-contiguous array, or a block of
    its columns); ``op(X)`` is ``X.T`` where ``trans_x`` is true. C is [m, n], op(A) [m, k],
    op(B) [k, n]; shapes are not checked. Runs BLAS's single call on the calling thread."""
    if not (_is_matrix(A) and _is_matrix(B) and _is_matrix(C)):
        return None
    ensure_blas()
    sig = types.void(A, trans_a, B, trans_b, C, beta)

    def codegen(context, builder, signature, args):
        a_ty, _, b_ty, _, c_ty, beta_ty = signature.args
        arrays = [context.make_array(t)(context, builder, v)
                  for t, v in ((a_ty, args[0]), (b_ty, args[2]), (c_ty, args[4]))]
        a, b, c = arrays
        intp = context.get_value_type(types.intp)
        char = ir.IntType(8)
        void_p = ir.IntType(8).as_pointer()
        four = ir.Constant(intp, 4)

        def shape(arr):
            return cgutils.unpack_tuple(builder, arr.shape, 2)

        def ld(arr):  # row stride in elements: the leading dimension of the column-major view
            return builder.sdiv(cgutils.unpack_tuple(builder, arr.strides, 2)[0], four)

        def flag(value, ty):
            return builder.icmp_unsigned("!=", context.cast(builder, value, ty, types.boolean),
                                         ir.Constant(ir.IntType(1), 0))

        t_a, t_b = flag(args[1], signature.args[1]), flag(args[3], signature.args[3])
        m, n = shape(c)
        a0, a1 = shape(a)
        k = builder.select(t_a, a0, a1)
        # row-major C = op(A) op(B) is column-major C' = op(B)' op(A)': the operands swap, and
        # a row-major view's storage is its transpose in column-major order
        trans, notrans = ir.Constant(char, ord("t")), ir.Constant(char, ord("n"))
        alpha = cgutils.alloca_once_value(builder, context.get_constant(types.float32, 1.0))
        beta_v = cgutils.alloca_once_value(
            builder, context.cast(builder, args[5], beta_ty, types.float32))
        fnty = ir.FunctionType(ir.IntType(32), [char, char, char, intp, intp, intp, void_p,
                                                void_p, intp, void_p, intp, void_p, void_p, intp])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "numba_xxgemm")
        builder.call(fn, [ir.Constant(char, ord("s")),
                          builder.select(t_b, trans, notrans), builder.select(t_a, trans, notrans),
                          n, m, k, builder.bitcast(alpha, void_p),
                          builder.bitcast(b.data, void_p), ld(b),
                          builder.bitcast(a.data, void_p), ld(a),
                          builder.bitcast(beta_v, void_p), builder.bitcast(c.data, void_p), ld(c)])
        return context.get_dummy_value()

    return sig, codegen

