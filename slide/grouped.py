"""A layer's label vectors in groups of eight, as int8 (two groups side by side) or 4-bit
copies, and the kernels that estimate a query's scores from them: a group's eight int32 sums in
one register's lanes (AVX2's ``vpmaddubsw`` and ``vpmaddwd``; a loop with the same sums
elsewhere), and a batch's tiles, several rows against a group's bytes in one pass (AVX-512
VNNI's ``vpdpbusd`` where the CPU has it). Every kernel computes the same integers and then the
same float32 estimates, so an answer does not depend on which ran. The engine's index
(:mod:`slide.clusters`) is built on them.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.screen import BIAS, SCALE, quantize_labels, query_range, target_has
from slide.runtime import aligned_empty, aligned_zeros

__all__ = ["GROUP", "PAIR", "LEVELS", "NIBBLE", "OFFSET", "TILE_ROWS", "TILE_GROUPS", "LOOP",
           "AVX2", "VNNI", "AMX", "int8_kind", "dot16_avx2", "dot4_avx2", "dot16_loop", "dot4_loop",
           "tile_vnni", "tile_avx2", "tile4_vnni", "tile4_avx2", "tile_loop", "tile4_loop",
           "tile_estimates", "tile4_estimates", "splat",
           "spread_words", "quantize_queries", "quantize_query_row", "estimates8", "pair_above",
           "above8", "estimates4", "pair_sums", "int8_groups", "int4_groups", "grouped_layout"]


#: labels a step of the scan: one AVX2 register of their int32 sums; the 4-bit copy's rows
#: are stored in groups of this many, each group by pieces of depth
GROUP = 8
#: labels a 4-byte piece of the int8 copy spans: two groups, side by side in one 64-byte run
#: (an AVX-512 register, a row of an AMX tile), so that one load serves sixteen labels
PAIR = 2 * GROUP
#: the query's uint8 levels: AVX2's pairwise sums are int16 and saturate above 2 · 127 · 127,
#: so the query takes 7 bits
LEVELS = 127
#: a centroid's 4-bit levels, -NIBBLE..NIBBLE, stored as w + OFFSET (0..15): they choose the
#: clusters that int8 ones choose, in half the bytes a row reads (docs/ann-kernels.md)
NIBBLE, OFFSET = 7, 8


@lru_cache(maxsize=None)
def int8_kind() -> str | None:
    """The int8 dot product the scan uses on the target CPU (:func:`slide.screen.target_has`):
    ``"avx512vnni"`` (a batch's tiles by ``vpdpbusd``, the rest as on AVX2), ``"avx2"``
    (``vpmaddubsw`` then ``vpmaddwd``), or None (a loop that LLVM vectorises as it can, with
    the same sums)."""
    for kind in ("avx512vnni", "avx2"):
        if target_has(kind):
            return kind
    return None


def _x86(builder, name: str, ret, *operands):
    """The declaration of LLVM's x86 intrinsic ``llvm.x86.NAME`` in the builder's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, operands),
                                          f"llvm.x86.{name}")


def splat(builder, value, lanes: int):
    """An LLVM vector of ``lanes`` copies of the scalar ``value`` (insert, then shuffle)."""
    ty = ir.VectorType(value.type, lanes)
    x = builder.insert_element(ir.Constant(ty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(x, ir.Constant(ty, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _grouped_sums(nibbles: bool):
    """The codegen of :func:`dot16_avx2` (``nibbles`` false: a pair of groups of the int8
    copy) or :func:`dot4_avx2` (a group of the 4-bit copy): each group's eight sums in the
    eight int32 lanes of one register, so that no sum is reduced across lanes, over two
    accumulators a group, each every other piece of the rows; a pair's two groups share each
    piece's query word. On a target without AVX2 it compiles the loop instead, which such a
    target's kernels run."""
    def codegen(context, builder, signature, args):
        if not target_has("avx2"):
            loop = dot4_loop if nibbles else dot16_loop
            return context.compile_internal(builder, loop.py_func, signature, args)
        h = context.make_array(signature.args[0])(context, builder, args[0])
        w = context.make_array(signature.args[1])(context, builder, args[1])
        o = context.make_array(signature.args[3])(context, builder, args[3])
        i64, i32, i16, i8 = (ir.IntType(b) for b in (64, 32, 16, 8))
        acc_t, load_t, pairs_t = ir.VectorType(i32, 8), ir.VectorType(i8, 32), ir.VectorType(i16, 16)

        maddubs = _x86(builder, "avx2.pmadd.ub.sw", pairs_t, load_t, load_t)
        maddwd = _x86(builder, "avx2.pmadd.wd", acc_t, pairs_t, pairs_t)
        ones = ir.Constant(pairs_t, [1] * 16)
        low, four = ir.Constant(load_t, [15] * 32), ir.Constant(pairs_t, [4] * 16)
        stride = cgutils.unpack_tuple(builder, w.strides, 2)[0]
        hp = builder.ptrtoint(h.data, i64)
        # a row of w: a group of the 4-bit copy, 32 bytes a piece; a pair of the int8 copy, 64
        # bytes a piece, its first group's 32 first
        halves = 1 if nibbles else 2
        piece_bytes = 32 * halves
        wp = builder.add(builder.ptrtoint(w.data, i64), builder.mul(
            context.cast(builder, args[2], signature.args[2], types.int64), stride))
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(acc_t, None)) for _ in range(2)]
                for _ in range(halves)]

        def spread(depth):
            # the query's four bytes from this depth, in every lane
            at = builder.add(hp, depth)
            word = builder.load(builder.inttoptr(at, i32.as_pointer()), align=1)
            return builder.bitcast(splat(builder, word, 8), load_t)

        def step(piece, k):
            at = builder.add(wp, builder.mul(piece, ir.Constant(i64, piece_bytes)))
            if nibbles:
                depth = builder.mul(piece, ir.Constant(i64, 8))
                xs = (spread(depth), spread(builder.add(depth, ir.Constant(i64, 4))))
            else:
                x = spread(builder.mul(piece, ir.Constant(i64, 4)))
            for half in range(halves):
                wv = builder.load(builder.inttoptr(builder.add(at, ir.Constant(i64, 32 * half)),
                                                   load_t.as_pointer()), align=1)
                if nibbles:  # the low halves hold depths 8 i..8 i + 3, the high ones the next 4
                    lo = builder.and_(wv, low)
                    hi = builder.and_(builder.bitcast(
                        builder.lshr(builder.bitcast(wv, pairs_t), four), load_t), low)
                    pairs = builder.add(  # at most 2 · 2 · 127 · 15 a pair: no int16 overflow
                        builder.call(maddubs, [xs[0], lo]), builder.call(maddubs, [xs[1], hi]))
                else:
                    pairs = builder.call(maddubs, [x, wv])
                acc = accs[half][k]
                builder.store(builder.add(builder.load(acc), builder.call(maddwd, [pairs, ones])),
                              acc)

        # the depth is the rows' (the query may be longer: zeros beyond)
        pieces = builder.sdiv(cgutils.unpack_tuple(builder, w.shape, 2)[1],
                              ir.Constant(i64, piece_bytes))
        with cgutils.for_range(builder, builder.sdiv(pieces, ir.Constant(i64, 2))) as loop:
            first = builder.mul(loop.index, ir.Constant(i64, 2))
            step(first, 0)
            step(builder.add(first, ir.Constant(i64, 1)), 1)
        with cgutils.if_unlikely(builder, builder.icmp_signed(
                "!=", builder.srem(pieces, ir.Constant(i64, 2)), ir.Constant(i64, 0))):
            step(builder.sub(pieces, ir.Constant(i64, 1)), 0)
        out = builder.ptrtoint(o.data, i64)
        for half in range(halves):
            total = builder.add(builder.load(accs[half][0]), builder.load(accs[half][1]))
            builder.store(total, builder.inttoptr(builder.add(out, ir.Constant(i64, 32 * half)),
                                                  acc_t.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def dot16_avx2(typingctx, hq, q, p, out):
    """``out[u] = sum_i hq[i] * w_u[i]`` in int32 for a uint8 row ``hq`` [>= D] (at most 127 a
    byte) and the ``PAIR`` int8 rows ``w_u`` of pair ``p`` of ``q`` [G / 2, PAIR D]
    (:func:`int8_groups`; D a multiple of 4, C-contiguous; bytes 4 i..4 i + 3 of ``w_u`` at
    ``q[p, PAIR 4 i + 4 u:...+ 4]``), on AVX2: one ``vpmaddubsw`` (the query's four bytes
    broadcast) and one ``vpmaddwd`` a group a piece (on a target without AVX2, the loop's
    code: kernels branch to it, never here)."""
    return types.void(hq, q, p, out), _grouped_sums(nibbles=False)


@intrinsic
def dot4_avx2(typingctx, hq, q, g, out):
    """``out[u] = sum_i hq[i] * v_u[i]`` in int32 for a uint8 row ``hq`` [>= D] (at most 127
    a byte) and the ``GROUP`` rows ``v_u`` of 4-bit values (0..15) of group ``g`` of ``q``
    [G, GROUP D / 2] (D a multiple of 8, C-contiguous; 32 bytes a piece of 8 depths, 4 a row:
    byte j of row u's holds depth 8 i + j in its low half, 8 i + 4 + j in its high half), on
    AVX2: each half-byte set widened by a mask, then :func:`dot16_avx2`'s two products, one
    ``vpmaddwd`` for both halves (the loop's code on a target without AVX2)."""
    return types.void(hq, q, g, out), _grouped_sums(nibbles=True)


def _sums_loop(nibbles: bool):
    @njit(cache=True, nogil=True, inline="always")
    def sums(hq, q, g, out):
        # the sums of _grouped_sums's kernels, for CPUs without AVX2: of group g of the 4-bit
        # copy, of pair g of the int8 copy
        width = GROUP if nibbles else PAIR  # labels a piece
        for u in range(width):
            out[u] = 0
        for i in range(q.shape[1] // (4 * width)):
            for u in range(width):
                s = out[u]
                for j in range(4):
                    v = np.int32(q[g, 4 * width * i + 4 * u + j])
                    if nibbles:
                        s += np.int32(hq[8 * i + j]) * (v & 15) + \
                            np.int32(hq[8 * i + 4 + j]) * (v >> 4)
                    else:
                        s += np.int32(hq[4 * i + j]) * v
                out[u] = s
    return sums


dot16_loop, dot4_loop = _sums_loop(nibbles=False), _sums_loop(nibbles=True)


#: a tile of the batch scan: this many of a cluster's rows, each against this many groups,
#: their sums in registers together, so that each load of the int8 rows serves every row
TILE_ROWS, TILE_GROUPS = 4, 2
#: the kernels' int8 kinds (:func:`int8_kind`), as the integers they branch on; AMX's
#: (:mod:`slide.amx`) scans a batch, and otherwise runs as VNNI does
LOOP, AVX2, VNNI, AMX = 0, 1, 2, 3


def _tiles(vnni: bool, nibbles: bool):
    """The codegen of the tile kernels (:func:`tile_vnni`; ``vnni`` false: AVX2's;
    ``nibbles``: of the 4-bit copy's groups, :func:`dot4_avx2`'s layout, else of the int8
    copy's pairs): one body per tile shape (rows 1..TILE_ROWS, groups 1..TILE_GROUPS), chosen
    by a switch, each group's sums in registers over the depth (VNNI's of a pair in one),
    then its estimates. On a target without the instructions: the same sums from generic
    vector code (``vnni``) or the loop."""
    def codegen(context, builder, signature, args):
        if not vnni and not target_has("avx2"):
            loop = tile4_loop if nibbles else tile_loop
            return context.compile_internal(builder, loop.py_func, signature, args)
        Q, R, Wq, T, Z, F, S, B, U, O = (context.make_array(signature.args[i])(
            context, builder, args[i]) for i in (0, 1, 4, 7, 8, 9, 10, 11, 12, 13))
        i64, i32, i16, i8 = (ir.IntType(b) for b in (64, 32, 16, 8))
        j0, nr, g, ng, o = (context.cast(builder, args[i], signature.args[i], types.int64)
                            for i in (2, 3, 5, 6, 14))
        q_stride = cgutils.unpack_tuple(builder, Q.strides, Q.strides.type.count)[0]
        w_stride = cgutils.unpack_tuple(builder, Wq.strides, 2)[0]
        o_stride = cgutils.unpack_tuple(builder, O.strides, 2)[0]
        # the 4-bit copy: a row of Wq a group; the int8 copy: a pair of groups (g even), each
        # 4-byte piece of depth the pair's 64 bytes, group g's half first
        w_base = builder.add(builder.ptrtoint(Wq.data, i64), builder.mul(
            g if nibbles else builder.sdiv(g, ir.Constant(i64, 2)), w_stride))
        o_base = builder.add(builder.ptrtoint(O.data, i64), builder.mul(o, ir.Constant(i64, 4)))
        width = 64 if vnni else 32  # a load's bytes
        # a step's bytes of Wq's row: the 4-bit copy's, a load's; the int8 copy's, a piece
        row_step = 64 if not nibbles else width
        # a step's bytes of a row's query: its spread words (one register, or the low and the
        # high halves' two), or the piece's word (the 4-bit piece's two)
        per_step = (128 if vnni else 8) if nibbles else 4
        steps = builder.sdiv(cgutils.unpack_tuple(builder, Wq.shape, 2)[1],
                             ir.Constant(i64, row_step))
        # VNNI on the int8 copy: one register of sums a row, both groups' (lanes 0-7, 8-15)
        shared = vnni and not nibbles
        acc_t = ir.VectorType(i32, width // 4)
        load_t = ir.VectorType(i8, width)
        halves_t = ir.VectorType(i16, width // 2)
        low, four = ir.Constant(load_t, [15] * width), ir.Constant(halves_t, [4] * (width // 2))

        if vnni and target_has("avx512vnni"):
            dpbusd = _x86(builder, "avx512.vpdpbusd.512", acc_t, acc_t, acc_t, acc_t)

            def product(acc, xs, ws):
                for x, w in zip(xs, ws):
                    acc = builder.call(dpbusd, [acc, builder.bitcast(x, acc_t),
                                                builder.bitcast(w, acc_t)])
                return acc
        elif vnni:  # vpdpbusd's sums in generic vector code: unsigned bytes times signed
            wide = ir.VectorType(i32, 64)

            def product(acc, xs, ws):
                for x, w in zip(xs, ws):
                    p = builder.mul(builder.zext(x, wide), builder.sext(w, wide))
                    for j in range(4):
                        acc = builder.add(acc, builder.shuffle_vector(
                            p, p, ir.Constant(acc_t, [4 * u + j for u in range(16)])))
                return acc
        else:
            maddubs = _x86(builder, "avx2.pmadd.ub.sw", halves_t, load_t, load_t)
            maddwd = _x86(builder, "avx2.pmadd.wd", acc_t, halves_t, halves_t)
            ones = ir.Constant(halves_t, [1] * 16)

            def product(acc, xs, ws):
                # at most 2 · 2 · 127 · 15 a pair of the 4-bit halves: no int16 overflow
                pairs = [builder.call(maddubs, [x, w]) for x, w in zip(xs, ws)]
                pairs = pairs[0] if len(pairs) == 1 else builder.add(*pairs)
                return builder.add(acc, builder.call(maddwd, [pairs, ones]))

        def load(address, ty):
            return builder.load(builder.inttoptr(address, ty.as_pointer()), align=1)

        v8, f8 = ir.VectorType(i32, GROUP), ir.VectorType(ir.FloatType(), GROUP)

        def body(rows, groups):
            row_at, row = [], []
            for a in range(rows):
                at = builder.gep(R.data, [builder.add(j0, ir.Constant(i64, a))])
                r = builder.sext(builder.load(at), i64)
                row.append(r)
                row_at.append(builder.add(builder.ptrtoint(Q.data, i64), builder.mul(r, q_stride)))
            units = 1 if shared else groups
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(acc_t, None))
                     for _ in range(units)] for _ in range(rows)]
            with cgutils.for_range(builder, steps) as loop:
                off = builder.mul(loop.index, ir.Constant(i64, row_step))
                ws = []
                for gg in range(units):
                    # the 4-bit copy's next group is Wq's next row; the int8 copy's, the
                    # piece's next 32 bytes
                    w = load(builder.add(builder.add(w_base, builder.mul(
                        ir.Constant(i64, gg), w_stride if nibbles else ir.Constant(i64, 32))),
                        off), load_t)
                    if nibbles:  # the low halves, then the high ones, as bytes
                        ws.append((builder.and_(w, low), builder.and_(builder.bitcast(
                            builder.lshr(builder.bitcast(w, halves_t), four), load_t), low)))
                    else:
                        ws.append((w,))
                q_off = builder.mul(loop.index, ir.Constant(i64, per_step))
                for a in range(rows):
                    at = builder.add(row_at[a], q_off)
                    if vnni and nibbles:  # spread words: each register as vpdpbusd reads it
                        xs = [load(builder.add(at, ir.Constant(i64, 64 * h)), load_t)
                              for h in range(2)]
                    else:  # the piece's words in every lane
                        xs = [builder.bitcast(splat(builder, load(builder.add(
                            at, ir.Constant(i64, 4 * h)), i32), acc_t.count), load_t)
                              for h in range(2 if nibbles else 1)]
                    for gg in range(units):
                        acc = accs[a][gg]
                        builder.store(product(builder.load(acc), xs, ws[gg]), acc)
            # the estimates from the sums in registers, as estimates8 computes them
            places = [builder.add(builder.mul(g, ir.Constant(i64, GROUP)),
                                  ir.Constant(i64, GROUP * gg)) for gg in range(groups)]
            scale, bias, sums = ([builder.load(builder.bitcast(builder.gep(A.data, [p]),
                                                               ty.as_pointer()), align=4)
                                  for p in places] for A, ty in ((S, f8), (B, f8), (U, v8)))
            for a in range(rows):
                tr = splat(builder, builder.load(builder.gep(T.data, [row[a]])), GROUP)
                zr = splat(builder, builder.load(builder.gep(Z.data, [row[a]])), GROUP)
                sr = splat(builder, builder.load(builder.gep(F.data, [row[a]])) if nibbles else
                           ir.Constant(i32, 0), GROUP)
                for gg in range(groups):
                    if shared:  # the group's half of the pair's register
                        v = builder.load(accs[a][0])
                        v = builder.shuffle_vector(v, v, ir.Constant(
                            v8, list(range(GROUP * gg, GROUP * gg + GROUP))))
                    elif vnni:  # the two pieces' lanes summed
                        v = builder.load(accs[a][gg])
                        v = builder.add(*(builder.shuffle_vector(v, v, ir.Constant(
                            v8, list(range(h, h + GROUP)))) for h in (0, GROUP)))
                    else:
                        v = builder.load(accs[a][gg])
                    x = builder.sitofp(builder.sub(builder.sub(v, sr), builder.mul(zr, sums[gg])),
                                       f8)
                    e = builder.fadd(builder.fmul(builder.fmul(scale[gg], tr), x), bias[gg])
                    at = builder.add(builder.add(o_base, builder.mul(ir.Constant(i64, a), o_stride)),
                                     ir.Constant(i64, 4 * GROUP * gg))
                    builder.store(e, builder.inttoptr(at, f8.as_pointer()), align=4)

        shape = builder.add(builder.mul(builder.sub(nr, ir.Constant(i64, 1)),
                                        ir.Constant(i64, TILE_GROUPS)),
                            builder.sub(ng, ir.Constant(i64, 1)))
        end = builder.append_basic_block("tile.end")
        switch = builder.switch(shape, end)
        for rows in range(1, TILE_ROWS + 1):
            for groups in range(1, TILE_GROUPS + 1):
                block = builder.append_basic_block(f"tile.{rows}x{groups}")
                switch.add_case(ir.Constant(i64, (rows - 1) * TILE_GROUPS + groups - 1), block)
                builder.position_at_end(block)
                body(rows, groups)
                builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()
    return codegen


def _tile_kernel(vnni: bool, nibbles: bool):
    def typer(typingctx, query, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o):
        sig = types.void(query, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o)
        return sig, _tiles(vnni, nibbles)
    typer.__name__ = f"tile{'4' if nibbles else ''}_{'vnni' if vnni else 'avx2'}"
    return intrinsic(typer)


#: ``out[a, o + GROUP gg:...+ GROUP]``: query row ``r = rows[j0 + a]``'s estimates of group
#: ``g + gg`` of ``q`` (:func:`dot16_avx2`'s layout, g even; its
#: places' ``scale``, ``bias``, ``sums``; the row's ``t[r]``, ``z[r]``), as
#: :func:`estimates8` computes them, for a < ``nr`` <= TILE_ROWS and gg < ``ng`` <=
#: TILE_GROUPS, in one pass over the groups' bytes: AVX-512 VNNI's ``vpdpbusd`` on a piece
#: of both groups at once, the row's word of ``query`` (its uint8 copy ``hq`` [n, >= D]) in
#: every lane; ``tile_avx2``: the same by AVX2's products, a group a register; ``tile4_*``:
#: of the 4-bit copy's groups (:func:`dot4_avx2`'s layout, any g), VNNI's on two pieces of a
#: group at once, each row's words from its ``query`` copy spread (:func:`spread_words`), the
#: rows' ``shift`` taken off
tile_vnni, tile_avx2 = _tile_kernel(True, False), _tile_kernel(False, False)
tile4_vnni, tile4_avx2 = _tile_kernel(True, True), _tile_kernel(False, True)


def _tile_loops(nibbles: bool):
    @njit(cache=True, nogil=True, inline="always")
    def tile(hq, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o):
        # the tile kernels' estimates on CPUs without AVX2
        dots = np.empty(PAIR, np.int32)
        est = np.empty(GROUP, np.float32)
        for a in range(nr):
            r = rows[j0 + a]
            if not nibbles:  # the pair's sums (g even)
                dot16_loop(hq[r], q, g // 2, dots)
            for gg in range(ng):
                if nibbles:
                    dot4_loop(hq[r], q, g + gg, dots)
                estimates8(dots, 0 if nibbles else GROUP * gg, scale, bias, sums,
                           (g + gg) * GROUP, t[r], z[r], shift[r] if nibbles else 0, est)
                for u in range(GROUP):
                    out[a, o + GROUP * gg + u] = est[u]
    return tile


tile_loop, tile4_loop = _tile_loops(nibbles=False), _tile_loops(nibbles=True)


@njit(cache=True, nogil=True, inline="always")
def tile_estimates(kind, hq, rows, j0, nr, q, g, ng, t, z, scale, bias, sums, out, o):
    """A tile's estimates of the int8 copy's groups by the ``kind``'s kernel; the arguments
    as :func:`tile_vnni`'s (the int8 copy takes no shift: ``z`` stands in)."""
    if kind >= VNNI:
        tile_vnni(hq, rows, j0, nr, q, g, ng, t, z, z, scale, bias, sums, out, o)
    elif kind == AVX2:
        tile_avx2(hq, rows, j0, nr, q, g, ng, t, z, z, scale, bias, sums, out, o)
    else:
        tile_loop(hq, rows, j0, nr, q, g, ng, t, z, z, scale, bias, sums, out, o)


@njit(cache=True, nogil=True, inline="always")
def tile4_estimates(kind, hq, spread, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums,
                    out, o):
    """:func:`tile_estimates` of the 4-bit copy's groups (the rows' ``shift`` taken off)."""
    if kind >= VNNI:
        tile4_vnni(spread, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o)
    elif kind == AVX2:
        tile4_avx2(hq, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o)
    else:
        tile4_loop(hq, rows, j0, nr, q, g, ng, t, z, shift, scale, bias, sums, out, o)


def spread_words(hq, depth):
    """Each row's 4-byte words of ``hq`` [n, >= depth] as ``vpdpbusd`` reads two pieces of a
    group of the 4-bit copy at once, each word in eight lanes: int32 [n, depth / 16, 32],
    words 4 i and 4 i + 2 (the low halves' depths), then 4 i + 1 and 4 i + 3 (the high
    halves')."""
    words = np.ascontiguousarray(hq[:, :depth]).view(np.int32)
    words = words.reshape(hq.shape[0], depth // 16, 2, 2).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(np.repeat(words.reshape(hq.shape[0], -1, 2, 1), GROUP,
                                          axis=3)).reshape(hq.shape[0], -1, 32)


@njit(cache=True, nogil=True, parallel=True)
def quantize_queries(H, hq, t, z, shift):
    """uint8 rows of ``H`` [n, d] into ``hq`` [n, >= d] (zero beyond d), each over its own
    range [min(0, min h), max(0, max h)] in ``LEVELS`` steps: h ~ t (q - z); ``shift``: what
    a row's sums with 4-bit rows stored as w + 8 count beyond its sums with w, 8 sum(q)."""
    for r in prange(H.shape[0]):
        quantize_query_row(H, r, hq, t, z, shift)


@njit(cache=True, nogil=True, inline="always")
def quantize_query_row(H, r, hq, t, z, shift):
    s, zr = query_range(H, r, LEVELS)  # the exact screen's range rule
    total = 0
    for i in range(H.shape[1]):
        hq[r, i] = zr if s == 0.0 else min(LEVELS, max(0, round(H[r, i] / s) + zr))
        total += hq[r, i]
    t[r], z[r], shift[r] = s, zr, OFFSET * total


def _estimate_lanes(context, builder, signature, args, lanes: int):
    """:func:`estimates8`'s estimates of ``lanes`` labels as one LLVM vector, from its first
    nine arguments (``dots, o, scale, bias, sums, p, tr, zr, sr``)."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, lanes), ir.VectorType(f32, lanes)
    arrays = [context.make_array(signature.args[j])(context, builder, args[j])
              for j in (0, 2, 3, 4)]
    at = context.cast(builder, args[5], signature.args[5], types.intp)
    first = context.cast(builder, args[1], signature.args[1], types.intp)

    def load(array, ty, offset):
        return builder.load(builder.bitcast(builder.gep(array.data, [offset]), ty.as_pointer()),
                            align=4)

    def every(j, to_ty):  # argument j, cast, in every lane
        return splat(builder, context.cast(builder, args[j], signature.args[j], to_ty), lanes)
    d, s, b, u = (load(arrays[0], vi, first), load(arrays[1], vf, at), load(arrays[2], vf, at),
                  load(arrays[3], vi, at))
    n = builder.sub(builder.sub(d, every(8, types.int32)), builder.mul(every(7, types.int32), u))
    x = builder.sitofp(n, vf)
    return builder.fadd(builder.fmul(builder.fmul(s, every(6, types.float32)), x), b)


def _bits_above(context, builder, x, least, least_type):
    """The lanes of the float32 vector ``x`` above the scalar ``least`` as the bits of an
    int64, lane u at 1 << u (an ordered compare: a NaN is never above)."""
    v = splat(builder, context.cast(builder, least, least_type, types.float32), x.type.count)
    bits = builder.bitcast(builder.fcmp_ordered(">", x, v), ir.IntType(x.type.count))
    return builder.zext(bits, ir.IntType(64))


@intrinsic
def estimates8(typingctx, dots, o, scale, bias, sums, p, tr, zr, sr, est):
    """``est[u] = scale[p + u] tr (dots[o + u] - sr - zr sums[p + u]) + bias[p + u]`` for the
    ``GROUP`` lanes u at once, in the order the scalar sum would take (int32 integers, then
    float32; the integers are exact in int32 for depths below 2^31 / 127² ≈ 133,000): LLVM
    would not vectorise the loop, not knowing that ``est`` overlaps none of the arrays it
    reads."""
    sig = types.void(dots, o, scale, bias, sums, p, tr, zr, sr, est)

    def codegen(context, builder, signature, args):
        e = _estimate_lanes(context, builder, signature, args, GROUP)
        out = context.make_array(signature.args[9])(context, builder, args[9])
        builder.store(e, builder.bitcast(out.data, e.type.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def pair_above(typingctx, dots, o, scale, bias, sums, p, tr, zr, sr, least):
    """The bits u (1 << u) of the 2 ``GROUP`` estimates of two groups (:func:`estimates8`'s,
    the same floats) above ``least``, made and compared in registers: most groups hold no
    label that a row's heap takes, and their estimates need not be stored."""
    sig = types.int64(dots, o, scale, bias, sums, p, tr, zr, sr, least)

    def codegen(context, builder, signature, args):
        e = _estimate_lanes(context, builder, signature, args, 2 * GROUP)
        return _bits_above(context, builder, e, args[9], signature.args[9])
    return sig, codegen


@intrinsic
def above8(typingctx, est, o, least):
    """The bits u (1 << u) of the ``GROUP`` estimates ``est[o + u] > least``, in one vector
    compare: a scalar maximum of the eight waited on each of them in turn (a NaN is never
    above)."""
    def codegen(context, builder, signature, args):
        vf = ir.VectorType(ir.FloatType(), GROUP)
        e = context.make_array(signature.args[0])(context, builder, args[0])
        at = builder.gep(e.data, [context.cast(builder, args[1], signature.args[1], types.intp)])
        x = builder.load(builder.bitcast(at, vf.as_pointer()), align=4)
        return _bits_above(context, builder, x, args[2], signature.args[2])
    return types.int64(est, o, least), codegen


@njit(cache=True, nogil=True, inline="always")
def estimates4(r, g, hq, t, z, shift, q, scale, bias, sums, dots, est, avx2):
    """Row ``r``'s estimated scores of the ``GROUP`` rows of group ``g`` of the 4-bit copy
    ``q`` (with each row's ``scale``, ``bias`` and integer ``sums``; stored as w + ``OFFSET``,
    the row's ``shift``) into ``est``; ``dots`` [GROUP] their int32 scratch; ``avx2``: AVX2's
    sums, else the loop's (:func:`int8_kind`). The kind is an argument, not a kernel of its
    own per kind: numba's cache keys a closure by its cells, and a kernel's cell is another
    on every start, so closures over kernels compiled again in every process."""
    if avx2:
        dot4_avx2(hq[r], q, g, dots)
    else:
        dot4_loop(hq[r], q, g, dots)
    estimates8(dots, 0, scale, bias, sums, g * GROUP, t[r], z[r], shift[r], est)


@njit(cache=True, nogil=True, inline="always")
def pair_sums(h, q, p, dots, avx2):
    """The int32 sums of a uint8 row ``h`` with the ``PAIR`` rows of pair ``p`` of the int8
    copy ``q`` into ``dots`` [>= PAIR]: :func:`dot16_avx2`, or its loop (``avx2`` false)."""
    if avx2:
        dot16_avx2(h, q, p, dots)
    else:
        dot16_loop(h, q, p, dots)


def int8_groups(W, b, order, sizes, starts):
    """The int8 copy of the rows ``order`` of the layer ``W`` [n, d] (rows each contiguous)
    with biases ``b`` [n], laid out by :func:`grouped_layout` in pairs of groups (``starts``
    multiples of ``PAIR``), its depth zero-padded to whole 4-byte pieces, with each place's
    scale, bias and int8 sum (padding: 0, -inf, 0), and where each of ``order`` went:
    ``(q, scale, bias, sums, place)``."""
    rows = quantize_labels(W, b)
    d = rows.q.shape[1]
    depth = -(-d // 4) * 4  # a zero weight quantizes to 0 at any scale: pad the int8 rows
    q = rows.q if depth == d else np.pad(rows.q, ((0, 0), (0, depth - d)))
    q, place = grouped_layout(q, order, sizes, starts, width=PAIR)
    return (q, *_placed(place, starts[-1], rows.meta[order, SCALE], rows.meta[order, BIAS],
                        rows.q.sum(axis=1, dtype=np.int32)[order]), place)


def _placed(place, entries, scale, bias, sums):
    """Each copied row's ``scale``, ``bias`` and integer ``sums`` at its ``place`` of
    ``entries``, the padding's 0, -inf and 0: ``(scale, bias, sums)``."""
    out = (np.zeros(entries, np.float32), np.full(entries, -np.inf, np.float32),
           np.zeros(entries, np.int32))
    for a, values in zip(out, (scale, bias, sums)):
        a[place] = values
    return out


def int4_groups(V, order, sizes, starts):
    """The 4-bit copy of the rows ``order`` of ``V`` [n, d + 1] (weights, bias last) laid out
    for :func:`dot4_avx2`, with each place's scale, bias and sum of its levels (padding: 0,
    -inf, 0), and where each of ``order`` went: ``(q, scale, bias, sums, place)``."""
    d = V.shape[1] - 1
    depth = -(-d // 16) * 16  # whole pairs of 8-depth pieces (:func:`tile4_vnni`)
    W = V[:, :d]
    top = np.abs(W).max(axis=1) if d else np.zeros(V.shape[0], np.float32)
    step = (top / NIBBLE).astype(np.float32)
    levels = np.zeros((V.shape[0], depth), np.int8)
    nonzero = step > 0
    levels[nonzero, :d] = np.clip(np.rint(W[nonzero] / step[nonzero, None]), -NIBBLE, NIBBLE)
    flat, place = grouped_layout((levels + OFFSET).astype(np.int8), order, sizes, starts, pieces=8)
    # [group, piece of 8 depths, row, 8] -> the low half-bytes the piece's first four depths
    nibbles = flat.reshape(flat.shape[0], depth // 8, GROUP, 2, 4).astype(np.uint8)
    q = aligned_empty((flat.shape[0], GROUP * depth // 2), np.uint8)
    q.reshape(flat.shape[0], depth // 8, GROUP, 4)[...] = (nibbles[:, :, :, 0] |
                                                          (nibbles[:, :, :, 1] << 4))
    return (q, *_placed(place, starts[-1], step[order], V[order, d],
                        levels[order].sum(axis=1, dtype=np.int32)), place)


def grouped_layout(q, order, sizes, starts, pieces: int = 4, width: int = GROUP):
    """``q`` int8 [n, D]'s rows ``order`` (cluster by cluster, ``sizes`` of them in each) laid
    out for the kernels: each cluster from ``starts`` (its rows padded with zeros to a
    multiple of ``width``), runs of ``width`` rows (a group, or a pair of groups side by side)
    by pieces of ``pieces`` bytes of depth, int8 [P / width, width D]; and the place of each
    of ``order`` in it."""
    D = q.shape[1]
    cluster_of = np.repeat(np.arange(sizes.size), sizes)
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    place = starts[cluster_of] + np.arange(order.size) - first[cluster_of]
    out = aligned_zeros((starts[-1] // width, width * D), np.int8)  # padding rows: zeros
    # each row straight to its place, [run, piece, row, bytes]: no copy of the rows in order
    _scatter_rows(q, order, place, out.reshape(-1, D // pieces, width, pieces))
    return out, place


@njit(cache=True, nogil=True, parallel=True)
def _scatter_rows(q, order, place, out):
    """Row ``order[k]`` of ``q`` [n, D] to row ``place[k] % width`` of run ``place[k] // width``
    of ``out`` [runs, D / pieces, width, pieces], a piece at a time."""
    width, pieces = out.shape[2], out.shape[3]
    for k in prange(order.size):
        run, slot, row = place[k] // width, place[k] % width, order[k]
        for p in range(out.shape[1]):
            for j in range(pieces):
                out[run, p, slot, j] = q[row, p * pieces + j]
