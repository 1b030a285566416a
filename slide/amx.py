"""Intel AMX's int8 tiles for a batch's scan (:mod:`slide.clusters`): sixteen query rows
against a pair of groups, sixteen labels, of the grouped int8 copy
(:func:`slide.grouped.int8_groups`), 64 bytes of depth, in one ``tdpbusd``, where AVX-512 VNNI
takes 256 ``vpdpbusd``. A batch's
rows share clusters (24 rows a cluster on average at a batch of 128 of the Amazon-670K preset),
so that the tiles are mostly full and a cluster's sums come about as fast as its bytes
(docs/ann-kernels.md).

The layout is the one the other kernels read: a pair's 4-byte pieces of depth, sixteen labels'
each in 64 bytes, are the rows of ``tdpbusd``'s second operand as they lie, a full tile. Linux
lends a process the tile registers only when asked (:func:`amx_ready`); where it does not, or
the CPU has no AMX, the scan runs as before. On a target without AMX the kernels compile the
same sums as loops, so that their results can be tested on any machine.
"""
from __future__ import annotations

import ctypes
import platform
import sys
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from slide.grouped import GROUP, PAIR
from slide.screen import target_has

__all__ = ["AMX_ROWS", "amx_ready", "tile_config", "amx_begin", "amx_end", "amx_sums",
           "amx_group_sums", "gather_rows"]

#: query rows a tile holds: a tile register's rows
AMX_ROWS = 16
#: depth a step: a tile row's 64 bytes
_STEP = 64
# tile registers: the two pairs' sums, the rows' step and last part, each pair's step and
# last part
_C0, _C1, _A, _A_LAST, _B0, _B1, _B0_LAST, _B1_LAST = range(8)


#: Linux's arch_prctl call and its request for the tile data's state
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


def _on_target() -> bool:
    """Whether numba compiles for a CPU with AMX's int8 tiles."""
    return target_has("amx-int8") and target_has("amx-tile")


@lru_cache(maxsize=None)
def amx_ready() -> bool:
    """Whether the scan may use AMX in this process: the target has it, and Linux granted the
    process its tile data (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; without
    the grant the first tile instruction faults)."""
    if not _on_target() or sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def tile_config(depth: int) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) of :func:`amx_sums` at the int8 copy's
    ``depth`` (a multiple of 4): its rows and bytes a row for each register."""
    last = depth % _STEP
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:48].view(np.uint16), cfg[48:64]
    shapes = {_C0: (AMX_ROWS, 4 * PAIR), _C1: (AMX_ROWS, 4 * PAIR), _A: (AMX_ROWS, _STEP),
              _B0: (_STEP // 4, 4 * PAIR), _B1: (_STEP // 4, 4 * PAIR)}
    if last:
        shapes.update({_A_LAST: (AMX_ROWS, last), _B0_LAST: (last // 4, 4 * PAIR),
                       _B1_LAST: (last // 4, 4 * PAIR)})
    for tile, (r, c) in shapes.items():
        rows[tile], colsb[tile] = r, c
    return cfg


def _call(builder, name: str, *operands):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [x.type for x in operands]),
        f"llvm.x86.{name}")
    builder.call(fn, list(operands))


def _tmm(n: int):
    return ir.Constant(ir.IntType(8), n)


@intrinsic
def amx_begin(typingctx, cfg):
    """Load the tile configuration ``cfg`` (:func:`tile_config`) into this thread's tile
    registers (a no-op on a target without AMX)."""
    def codegen(context, builder, signature, args):
        if _on_target():
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            _call(builder, "ldtilecfg", builder.bitcast(data, ir.PointerType(ir.IntType(8))))
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def amx_end(typingctx):
    """Release this thread's tile registers (a no-op on a target without AMX)."""
    def codegen(context, builder, signature, args):
        if _on_target():
            _call(builder, "tilerelease")
        return context.get_dummy_value()
    return types.void(), codegen


def _sums_loop(A, q, p, n_pairs, C):
    # amx_sums' sums where the target has no AMX: byte d of label u of pair p sits at
    # q[p, 64 (d // 4) + 4 u + d % 4]
    depth = q.shape[1] // PAIR
    for a in range(AMX_ROWS):
        for pp in range(n_pairs):
            for u in range(PAIR):
                s = np.int32(0)
                for d in range(depth):
                    at = 4 * PAIR * (d // 4) + 4 * u + d % 4
                    s += np.int32(A[a, d]) * np.int32(q[p + pp, at])
                C[a, PAIR * pp + u] = s


@intrinsic
def amx_sums(typingctx, A, q, p, n_pairs, C):
    """``C[a, PAIR pp + u]``: the int32 sum of query row ``A[a]`` (uint8 [AMX_ROWS, >=
    depth], its rows' stride a multiple of 4) with label u of pair ``p + pp`` of the int8
    copy ``q`` (int8 [pairs, PAIR depth]), for pp < ``n_pairs`` (1 or 2); ``C`` int32
    [AMX_ROWS, >= PAIR n_pairs]. The thread's tiles configured for the depth first
    (:func:`amx_begin`)."""
    sig = types.void(A, q, p, n_pairs, C)

    def codegen(context, builder, signature, args):
        if not _on_target():
            return context.compile_internal(builder, _sums_loop, signature, args)
        i64 = ir.IntType(64)
        p8 = ir.PointerType(ir.IntType(8))
        Aa, Q, Cc = (context.make_array(signature.args[i])(context, builder, args[i])
                     for i in (0, 1, 4))
        p_, n_pairs_ = (context.cast(builder, args[i], signature.args[i], types.int64)
                        for i in (2, 3))
        a_stride = cgutils.unpack_tuple(builder, Aa.strides, 2)[0]
        q_stride = cgutils.unpack_tuple(builder, Q.strides, 2)[0]
        c_stride = cgutils.unpack_tuple(builder, Cc.strides, 2)[0]
        depth = builder.sdiv(cgutils.unpack_tuple(builder, Q.shape, 2)[1],
                             ir.Constant(i64, PAIR))
        steps = builder.sdiv(depth, ir.Constant(i64, _STEP))
        last = builder.srem(depth, ir.Constant(i64, _STEP))
        a_base = builder.ptrtoint(Aa.data, i64)
        b_base = [builder.add(builder.ptrtoint(Q.data, i64),
                              builder.mul(builder.add(p_, ir.Constant(i64, pp)), q_stride))
                  for pp in range(2)]
        piece = ir.Constant(i64, 4 * PAIR)  # a pair's bytes a 4-byte piece of depth
        two = builder.icmp_signed("==", n_pairs_, ir.Constant(i64, 2))

        def ptr(address):
            return builder.inttoptr(address, p8)

        def step(a_tile, b_tiles, a_at, b_at):
            _call(builder, "tileloadd64", _tmm(a_tile), ptr(builder.add(a_base, a_at)), a_stride)
            for pp, (c_tile, b_tile) in enumerate(zip((_C0, _C1), b_tiles)):
                def product():
                    _call(builder, "tileloadd64", _tmm(b_tile),
                          ptr(builder.add(b_base[pp], b_at)), piece)
                    _call(builder, "tdpbusd", _tmm(c_tile), _tmm(a_tile), _tmm(b_tile))
                if pp:
                    with builder.if_then(two):
                        product()
                else:
                    product()

        _call(builder, "tilezero", _tmm(_C0))
        _call(builder, "tilezero", _tmm(_C1))
        step_bytes = ir.Constant(i64, _STEP)
        with cgutils.for_range(builder, steps) as loop:
            at = builder.mul(loop.index, step_bytes)
            step(_A, (_B0, _B1), at, builder.mul(at, ir.Constant(i64, PAIR)))
        with builder.if_then(builder.icmp_signed(">", last, ir.Constant(i64, 0))):
            at = builder.mul(steps, step_bytes)
            step(_A_LAST, (_B0_LAST, _B1_LAST), at, builder.mul(at, ir.Constant(i64, PAIR)))
        c_base = builder.ptrtoint(Cc.data, i64)
        _call(builder, "tilestored64", _tmm(_C0), ptr(c_base), c_stride)
        with builder.if_then(two):
            _call(builder, "tilestored64", _tmm(_C1), ptr(builder.add(c_base, piece)), c_stride)
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def amx_group_sums(A, q, lo, hi, C):
    """``C[a, GROUP (g - lo) + u]``: :func:`amx_sums` of every group g of ``lo..hi`` (even:
    whole pairs; ``C`` int32 [AMX_ROWS, >= GROUP (hi - lo)]). All are stored before the
    caller reads any: a load that waits on a tile's store stalls the core."""
    for p in range(lo // 2, hi // 2, 2):
        amx_sums(A, q, p, min(2, hi // 2 - p), C[:, PAIR * (p - lo // 2):])


@njit(cache=True, nogil=True, inline="always")
def gather_rows(hq, rows, j0, nr, A):
    """``A[a] = hq[rows[j0 + a], :width of A]`` for a < ``nr``: a tile's query rows in one
    piece."""
    for a in range(nr):
        r = rows[j0 + a]
        for d in range(A.shape[1]):
            A[a, d] = hq[r, d]
