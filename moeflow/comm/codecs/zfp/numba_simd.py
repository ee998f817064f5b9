"""The per-block arithmetic of the compiled ZFP coder as LLVM vector code (numba intrinsics):
one block of ``S = 4^d`` values held in one ``<S x i32>`` vector through the block-floating-point
cast (Lindstrom 2014, section 3.1), the lifting transform along x, y, z with constant shuffles
(section 3.2), the sequency reordering and negabinary map (section 3.3), and their inverses;
and the bit-plane gather and scatter of the embedded coder (section 3.4) as vector mask moves.
Sizes (``d`` or ``S``) may be literals or run-time integers (a switch LLVM folds where they are
constant). Equal to the scalar definitions (``tests/unit/zfp/test_zfp_numba_simd.py``); portable LLVM IR.
See ``docs/codecs.md``.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import errors, types
from numba.extending import intrinsic

_I32 = ir.IntType(32)


def _check_array(arr, dtype, what):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
            and arr.dtype == dtype):
        raise errors.TypingError(f"{what} needs C-contiguous 1-D {dtype} arrays, got {arr}")


def _check_integer(ty, what):
    if not isinstance(ty, types.Integer):
        raise errors.TypingError(f"{what} must be an integer, got {ty}")


def _by_value(context, builder, ty, value, allowed, emit, what):
    """``emit(v)`` for the value ``v`` of integer argument ``value`` (numba type ``ty``): emitted
    once for a literal, else once per allowed value behind a ``switch`` (which LLVM folds away
    wherever the value is a known constant, as in the coder's per-dimensionality drivers). Any
    other value raises ``ValueError`` in the calling function. Returns ``emit``'s result
    (merged by a phi), or None."""
    if isinstance(ty, types.IntegerLiteral) and ty.literal_value in allowed:
        return emit(ty.literal_value)
    bad = builder.append_basic_block("bad_size")
    merge = builder.append_basic_block("size_done")
    switch = builder.switch(value, bad)
    results = []
    for v in allowed:
        block = builder.append_basic_block(f"size_{v}")
        switch.add_case(ir.Constant(value.type, v), block)
        builder.position_at_end(block)
        results.append((emit(v), builder.block))
        builder.branch(merge)
    builder.position_at_end(bad)
    context.call_conv.return_user_exc(builder, ValueError, (f"{what} must be one of {allowed}",))
    builder.position_at_end(merge)
    if results[0][0] is None:
        return None
    phi = builder.phi(results[0][0].type)
    for r, block in results:
        phi.add_incoming(r, block)
    return phi


def _load(context, builder, arrty, arr, count):
    """The first ``count`` elements of ``arr`` as one ``<count x i32>`` vector, and its pointer."""
    vty = ir.VectorType(_I32, count)
    data = context.make_array(arrty)(context, builder, arr).data
    ptr = builder.bitcast(data, vty.as_pointer())
    return builder.load(ptr, align=4), ptr, vty


def _splat(builder, value, vty):
    """``value`` (i64) truncated to i32 in every lane of a vector of type ``vty``."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, builder.trunc(value, _I32), ir.Constant(_I32, 0))
    lanes = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(one, undef, lanes)


_SIZES = (4, 16, 64)


@intrinsic
def plane_bits(typingctx, u, k, count):
    """``sum_i ((u[i] >> k) & 1) << i`` over ``i < count`` (4, 16 or 64), as a uint64: bit
    plane ``k`` of the ``count`` uint32 coefficients ``u`` (``0 <= k < 32``)."""
    _check_array(u, types.uint32, "plane gather")
    _check_integer(count, "plane gather count")

    def codegen(context, builder, sig, args):
        def emit(n):
            v, _, vty = _load(context, builder, sig.args[0], args[0], n)
            bit = builder.and_(builder.lshr(v, _splat(builder, args[1], vty)),
                               ir.Constant(vty, [1] * n))
            mask = builder.icmp_unsigned("!=", bit, ir.Constant(vty, [0] * n))
            return builder.zext(builder.bitcast(mask, ir.IntType(n)), ir.IntType(64))

        return _by_value(context, builder, sig.args[2], args[2], _SIZES, emit,
                         "plane gather count")

    return types.uint64(u, k, count), codegen


@intrinsic
def deposit_plane(typingctx, u, x, k, count):
    """``u[i] |= ((x >> i) & 1) << k`` for ``i < count`` (4, 16 or 64): the inverse of
    :func:`plane_bits`, which ors plane ``x`` (uint64) into bit ``k`` of ``u`` (uint32)."""
    _check_array(u, types.uint32, "plane scatter")
    _check_integer(count, "plane scatter count")

    def codegen(context, builder, sig, args):
        def emit(n):
            v, ptr, vty = _load(context, builder, sig.args[0], args[0], n)
            mask = builder.bitcast(builder.trunc(args[1], ir.IntType(n)),
                                   ir.VectorType(ir.IntType(1), n))
            bits = builder.shl(builder.zext(mask, vty), _splat(builder, args[2], vty))
            builder.store(builder.or_(v, bits), ptr, align=4)

        _by_value(context, builder, sig.args[3], args[3], _SIZES, emit, "plane scatter count")
        return context.get_dummy_value()

    return types.void(u, x, k, count), codegen


# ------------------------------------------------------------------ block transform (3.1-3.3)

_NB = -0x55555556                      # 0xAAAAAAAA as an int32: the negabinary mask


def _check_block(src, dst, d, src_dtype, dst_dtype):
    _check_array(src, src_dtype, "block transform")
    _check_array(dst, dst_dtype, "block transform")
    _check_integer(d, "block dimensionality d")


def _const(vty, value):
    return ir.Constant(vty, [value] * vty.count)


def _shuffle(builder, v, lanes):
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))


def _axis_lanes(S, axis):
    """For entries 0..3 along ``axis`` (0 = x, stride 1; 1 = y, stride 4; 2 = z, stride 16):
    the block indices holding it, in block order."""
    st = 4 ** axis
    return [[i for i in range(S) if (i // st) % 4 == j] for j in range(4)]


def _lift_axis(builder, v, S, axis, lift):
    """Apply ``lift`` to the four vectors of entries 0..3 along ``axis`` of block vector ``v``."""
    lanes = _axis_lanes(S, axis)
    parts = lift(builder, *[_shuffle(builder, v, ln) for ln in lanes])
    m = S // 4
    lo = builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, 2 * m),
                                                                list(range(2 * m))))
    hi = builder.shuffle_vector(parts[2], parts[3], ir.Constant(ir.VectorType(_I32, 2 * m),
                                                                list(range(2 * m))))
    order = [i for ln in lanes for i in ln]               # block index of each concatenated lane
    where = [order.index(i) for i in range(S)]
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, S), where))


def _fwd_lift(b, x, y, z, w):
    """zfp's ``fwd_lift`` (section 3.2) on four vectors, wrapping 32-bit arithmetic."""
    one = _const(x.type, 1)
    x = b.ashr(b.add(x, w), one); w = b.sub(w, x)
    z = b.ashr(b.add(z, y), one); y = b.sub(y, z)
    x = b.ashr(b.add(x, z), one); z = b.sub(z, x)
    w = b.ashr(b.add(w, y), one); y = b.sub(y, w)
    w = b.add(w, b.ashr(y, one)); y = b.sub(y, b.ashr(w, one))
    return x, y, z, w


def _inv_lift(b, x, y, z, w):
    """zfp's ``inv_lift``: the inverse of :func:`_fwd_lift`."""
    one = _const(x.type, 1)
    y = b.add(y, b.ashr(w, one)); w = b.sub(w, b.ashr(y, one))
    y = b.add(y, w); w = b.sub(b.shl(w, one), y)
    z = b.add(z, x); x = b.sub(b.shl(x, one), z)
    y = b.add(y, z); z = b.sub(b.shl(z, one), y)
    w = b.add(w, x); x = b.sub(b.shl(x, one), w)
    return x, y, z, w


def _vector(context, builder, arrty, arr, elty, count):
    """Pointer to the data of ``arr`` as a ``<count x elty>`` vector."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(data, ir.VectorType(elty, count).as_pointer())


def _splat_float(context, builder, value, fromty, count):
    f = context.cast(builder, value, fromty, types.float32)
    vty = ir.VectorType(ir.FloatType(), count)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), f, ir.Constant(_I32, 0))
    return _shuffle(builder, one, [0] * count)


@intrinsic
def fwd_block(typingctx, fb, scale, u, d):
    """Forward pipeline of one ``d``-D block (d = 1, 2 or 3): float32 ``fb`` (``4^d`` values)
    times ``scale`` (``2^(30 - emax)``), truncated to int32 as x86's ``cvttss2si`` does (out of
    range and NaN give ``-2^31``), lifted along x, y, z, reordered by sequency and mapped to
    negabinary into uint32 ``u``."""
    _check_block(fb, u, d, types.float32, types.uint32)

    def codegen(context, builder, sig, args):
        def emit(n):
            from moeflow.comm.codecs.zfp.transform import PERM
            S = 4 ** n
            fty = ir.VectorType(ir.FloatType(), S)
            vty = ir.VectorType(_I32, S)
            x = builder.load(_vector(context, builder, sig.args[0], args[0], ir.FloatType(), S),
                             align=4)
            y = builder.fmul(x, _splat_float(context, builder, args[1], sig.args[1], S))
            inside = builder.and_(builder.fcmp_ordered("<", y, _const(fty, 2147483648.0)),
                                  builder.fcmp_ordered(">", y, _const(fty, -2147483648.0)))
            v = builder.select(inside, builder.fptosi(y, vty), _const(vty, -2 ** 31))
            for axis in range(n):                          # x, then y, then z
                v = _lift_axis(builder, v, S, axis, _fwd_lift)
            v = _shuffle(builder, v, list(PERM[n]))        # sequency order
            nb = _const(vty, _NB)
            v = builder.xor(builder.add(v, nb), nb)
            builder.store(v, _vector(context, builder, sig.args[2], args[2], _I32, S), align=4)

        _by_value(context, builder, sig.args[3], args[3], (1, 2, 3), emit,
                  "block dimensionality d")
        return context.get_dummy_value()

    return types.void(fb, scale, u, d), codegen


def _inverse_pipeline(context, builder, v, scale, scale_ty, fb, fb_ty, n):
    """Store the block of negabinary coefficients ``v`` (``<4^n x i32>``, sequency order)
    decoded to float32 into ``fb``: section 3.3 inverted, lifting along z, y, x, the cast."""
    from moeflow.comm.codecs.zfp.transform import PERM
    S = 4 ** n
    inverse = [0] * S
    for i, j in enumerate(PERM[n]):
        inverse[j] = i
    nb = _const(v.type, _NB)
    v = _shuffle(builder, builder.sub(builder.xor(v, nb), nb), inverse)
    for axis in reversed(range(n)):                        # z, then y, then x
        v = _lift_axis(builder, v, S, axis, _inv_lift)
    f = builder.fmul(builder.sitofp(v, ir.VectorType(ir.FloatType(), S)),
                     _splat_float(context, builder, scale, scale_ty, S))
    builder.store(f, _vector(context, builder, fb_ty, fb, ir.FloatType(), S), align=4)


@intrinsic
def inv_block(typingctx, u, scale, fb, d):
    """Inverse of :func:`fwd_block`: negabinary uint32 ``u`` (sequency order) back to block
    order, inverse lifting along z, y, x, then ``float32(int) * scale`` (``2^(emax - 30)``)
    into float32 ``fb``."""
    _check_block(u, fb, d, types.uint32, types.float32)

    def codegen(context, builder, sig, args):
        def emit(n):
            v = builder.load(_vector(context, builder, sig.args[0], args[0], _I32, 4 ** n),
                             align=4)
            _inverse_pipeline(context, builder, v, args[1], sig.args[1], args[2], sig.args[2], n)

        _by_value(context, builder, sig.args[3], args[3], (1, 2, 3), emit,
                  "block dimensionality d")
        return context.get_dummy_value()

    return types.void(u, scale, fb, d), codegen


@intrinsic
def inv_block_1d(typingctx, lo, hi, scale, fb):
    """:func:`inv_block` for a 1-D block whose four coefficients come as two uint64 words
    (``lo`` = coefficients 0 and 1, ``hi`` = 2 and 3, low half first): they enter the vector
    code in registers, not through memory."""
    _check_array(fb, types.float32, "inv_block_1d")

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        pair = ir.Constant(ir.VectorType(i64, 2), ir.Undefined)
        for lane, word in enumerate(args[:2]):
            word = context.cast(builder, word, sig.args[lane], types.uint64)
            pair = builder.insert_element(pair, word, ir.Constant(_I32, lane))
        v = builder.bitcast(pair, ir.VectorType(_I32, 4))  # little-endian: c0, c1, c2, c3
        _inverse_pipeline(context, builder, v, args[2], sig.args[2], args[3], sig.args[3], 1)
        return context.get_dummy_value()

    return types.void(lo, hi, scale, fb), codegen


__all__ = ["deposit_plane", "fwd_block", "inv_block", "inv_block_1d", "plane_bits"]
