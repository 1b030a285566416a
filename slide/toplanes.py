"""A row's best entries (float32 score, int32 id) held sorted, best first, in vector lanes.

An offer compares the score with every lane at once, counts the lanes ahead of it and moves
those behind it one lane on: a few vector instructions and no branch on the data, where a
binary heap's sift branches on every level it passes. The clusters' scan offers its estimates
this way (docs/ann-kernels.md). Entries are ordered by score, best first, then by id, the lower
first; a held id is not taken again (a label in two clusters is offered twice, with the same
score). Empty lanes hold -inf and id -1, so the k-th lane's score is the least a new entry
must beat once k are held, and -inf before.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["LANES", "lanes_for", "new_tops", "top_offer", "top_held", "trailing_zeros"]

#: entries a vector step compares: an AVX-512 register of float32 (two on AVX2)
LANES = 16
#: an id no entry has: it ranks after every other at -inf, so an empty lane is never passed
_EMPTY = -1
#: what :func:`_rank` returns for an id the lanes hold: past the end, so nothing moves
_HELD = 1 << 30


@njit(cache=True, nogil=True)
def lanes_for(keep):
    """The lanes that hold ``keep`` entries: whole vector steps."""
    return LANES * -(-keep // LANES)


@njit(cache=True, nogil=True)
def new_tops(rows, keep):
    """Empty lanes for ``rows`` rows of ``keep`` entries: ``(scores float32, ids int32)``,
    each [rows, :func:`lanes_for` keep]."""
    w = lanes_for(keep)
    return np.full((rows, w), -np.inf, np.float32), np.full((rows, w), _EMPTY, np.int32)


def _vectors(context, builder, signature, args):
    """The arguments ``scores, ids, at, v, j`` of :func:`_rank` and :func:`_shift` as LLVM
    values: the pointers to step ``at``'s lanes, those lanes loaded, ``v`` and ``j`` in every
    lane."""
    vf = ir.VectorType(ir.FloatType(), LANES)
    vi = ir.VectorType(ir.IntType(32), LANES)
    arrays = [context.make_array(signature.args[a])(context, builder, args[a]) for a in (0, 1)]
    at = context.cast(builder, args[2], signature.args[2], types.intp)
    pf, pi = (builder.bitcast(builder.gep(x.data, [at]), t.as_pointer())
              for x, t in zip(arrays, (vf, vi)))
    v = context.cast(builder, args[3], signature.args[3], types.float32)
    j = context.cast(builder, args[4], signature.args[4], types.int32)
    return (pf, pi, builder.load(pf, align=4), builder.load(pi, align=4), _splat(builder, v),
            _splat(builder, j))


def _splat(builder, value):
    ty = ir.VectorType(value.type, LANES)
    x = builder.insert_element(ir.Constant(ty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(x, ir.Constant(ty, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _lanes_typer(scores, ids):
    return (isinstance(scores, types.Array) and scores.dtype == types.float32 and
            isinstance(ids, types.Array) and ids.dtype == types.int32)


@intrinsic
def _rank(typingctx, scores, ids, at, v, j):
    """How many of the LANES lanes from ``at`` rank ahead of score ``v``, id ``j`` (a higher
    score, or the same and a lower id), or ``_HELD`` where one holds ``j``."""
    if not _lanes_typer(scores, ids):
        return None

    def codegen(context, builder, signature, args):
        _, _, S, D, V, J = _vectors(context, builder, signature, args)
        mask = ir.IntType(LANES)
        held = builder.icmp_unsigned("!=", builder.bitcast(builder.icmp_signed("==", D, J), mask),
                                     ir.Constant(mask, 0))
        ahead = builder.or_(builder.fcmp_ordered(">", S, V),
                            builder.and_(builder.fcmp_ordered("==", S, V),
                                         builder.icmp_signed("<", D, J)))
        count = builder.call(builder.module.declare_intrinsic("llvm.ctpop", [mask]),
                             [builder.bitcast(ahead, mask)])
        i64 = ir.IntType(64)
        return builder.select(held, ir.Constant(i64, _HELD), builder.zext(count, i64))
    return types.int64(scores, ids, at, v, j), codegen


@intrinsic
def _shift(typingctx, scores, ids, at, v, j, lane):
    """The LANES lanes from ``at`` with ``v``, ``j`` put in lane ``lane`` (lane 0 where
    ``lane`` < 0): those before it kept, those after it one lane on, the last let go."""
    if not _lanes_typer(scores, ids):
        return None

    def codegen(context, builder, signature, args):
        pf, pi, S, D, V, J = _vectors(context, builder, signature, args)
        i32 = ir.IntType(32)
        p = _splat(builder, builder.trunc(
            context.cast(builder, args[5], signature.args[5], types.int64), i32))
        # each lane from the one before it, lane 0 the new entry
        on = ir.Constant(ir.VectorType(i32, LANES), [LANES] + list(range(LANES - 1)))
        index = ir.Constant(ir.VectorType(i32, LANES), list(range(LANES)))
        before = builder.icmp_signed("<", index, p)
        here = builder.icmp_signed("==", index, p)
        for ptr, x, new in ((pf, S, V), (pi, D, J)):
            moved = builder.shuffle_vector(x, new, on)
            builder.store(builder.select(before, x, builder.select(here, new, moved)), ptr,
                          align=4)
        return context.get_dummy_value()
    return types.void(scores, ids, at, v, j, lane), codegen


@njit(cache=True, nogil=True, inline="always")
def top_offer(scores, ids, v, j):
    """Offer score ``v`` (not NaN) of id ``j`` to one row's lanes ``scores``, ``ids``
    (:func:`new_tops`): put in order unless they hold ``j`` or it ranks after every lane."""
    w = scores.size
    at = 0
    for c in range(0, w, LANES):
        at += _rank(scores, ids, c, v, j)
    for c in range(at - at % LANES, w, LANES):  # none where ``at`` is past the end
        last_v, last_j = scores[c + LANES - 1], ids[c + LANES - 1]
        _shift(scores, ids, c, v, j, at - c)
        v, j = last_v, last_j


@njit(cache=True, nogil=True, inline="always")
def top_held(ids, keep):
    """How many of the first ``keep`` lanes hold an entry."""
    n = 0
    for a in range(keep):
        n += ids[a] != _EMPTY
    return n


@intrinsic
def trailing_zeros(typingctx, bits):
    """The index of the lowest set bit of the int64 ``bits`` (not 0)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        x = context.cast(builder, args[0], signature.args[0], types.int64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.cttz.i64")
        return builder.call(fn, [x, ir.Constant(ir.IntType(1), 1)])
    return types.int64(bits), codegen
