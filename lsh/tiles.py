"""A 16 x 16 tile of a float32 matrix transposed in vector registers, for numba kernels.

The WTA families hash a block of rows at once with the block transposed, so that every
comparison runs across rows in SIMD lanes (:mod:`lsh.families`). Copied element by element
the transpose is a scalar load and a store 256 bytes away per float, and it took as long as
the hashing itself (72 of 172 ms for the 670,091 rows of an Amazon-670K rehash on one thread).
Here each row of the tile is one 64-byte vector load, the tile is transposed by a network of
two-source shuffles (4 rounds of 16, each swapping half of every pair of rows), and each
column goes out as one vector store.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["TILE", "transpose_tile"]

#: the tile's side: 16 float32 lanes, one 64-byte vector
TILE = 16


def _is_rows(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 2 and t.dtype == types.float32


@intrinsic
def transpose_tile(typingctx, src, r, d, dst, i, zeros_to_neg_inf):
    """``dst[d + k, i + m] = src[r + m, d + k]`` for k, m in ``0..15``, with each 0.0 written
    as -inf where ``zeros_to_neg_inf`` is true (DWTA: no bin's argmax may land on a zero).

    ``src`` and ``dst`` are float32 [.., ..] arrays or views whose rows are strided and whose
    elements within a row are contiguous (a C-contiguous array, a block of its columns); the
    tile must lie inside both, which is not checked."""
    if not (_is_rows(src) and _is_rows(dst) and isinstance(r, types.Integer)
            and isinstance(d, types.Integer) and isinstance(i, types.Integer)):
        return None
    sig = types.void(src, r, d, dst, i, zeros_to_neg_inf)

    def codegen(context, builder, signature, args):
        s_ty, r_ty, d_ty, t_ty, i_ty, z_ty = signature.args
        a_src = context.make_array(s_ty)(context, builder, args[0])
        a_dst = context.make_array(t_ty)(context, builder, args[3])
        i64 = ir.IntType(64)
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, TILE)
        i8p = ir.IntType(8).as_pointer()

        def idx(k):
            return context.cast(builder, args[k], signature.args[k], types.int64)

        r0, d0, i0 = idx(1), idx(2), idx(4)
        zeros = builder.icmp_unsigned("!=", context.cast(builder, args[5], z_ty, types.boolean),
                                      ir.Constant(ir.IntType(1), 0))

        def row_ptr(arr, row, col):
            stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
            offset = builder.add(builder.mul(row, stride), builder.mul(col, ir.Constant(i64, 4)))
            base = builder.bitcast(arr.data, i8p)
            return builder.bitcast(builder.gep(base, [offset]), vec.as_pointer())

        zero = ir.Constant(vec, [0.0] * TILE)
        neg = ir.Constant(vec, [float("-inf")] * TILE)
        rows = []
        for m in range(TILE):
            v = builder.load(row_ptr(a_src, builder.add(r0, ir.Constant(i64, m)), d0), align=4)
            v = builder.select(zeros, builder.select(builder.fcmp_ordered("==", v, zero), neg, v), v)
            rows.append(v)
        # round b swaps, for each pair of rows (j, j + b) with bit b of j clear, the elements of
        # row j whose column has bit b set with those of row j + b whose column has it clear;
        # after the rounds for 8, 4, 2 and 1, row k holds column k
        i32 = ir.IntType(32)
        for b in (8, 4, 2, 1):
            low = ir.Constant(ir.VectorType(i32, TILE),
                              [c if not c & b else TILE + c - b for c in range(TILE)])
            high = ir.Constant(ir.VectorType(i32, TILE),
                               [c + b if not c & b else TILE + c for c in range(TILE)])
            for j in range(TILE):
                if not j & b:
                    a, c = rows[j], rows[j + b]
                    rows[j] = builder.shuffle_vector(a, c, low)
                    rows[j + b] = builder.shuffle_vector(a, c, high)
        for k in range(TILE):
            builder.store(rows[k], row_ptr(a_dst, builder.add(d0, ir.Constant(i64, k)), i0), align=4)
        return context.get_dummy_value()

    return sig, codegen
