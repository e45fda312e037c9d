"""Vectors of 16 float32 lanes for numba-compiled code: a type and the few operations the numba
decode-attention kernel's score pass is written with.

numba compiles scalar code and leaves vectorizing to LLVM. A dot product over ``head_dim`` then
becomes a vector of partial sums followed by a horizontal reduction of its lanes, one reduction per
(query head, token): about as many shuffles and adds as the dot product has multiply-adds, on the
ports the multiply-adds need. Given a tile's accumulators as vectors, ``sum_lanes`` reduces many of
them together instead (each shuffle and add of a transposing reduction serves several dot
products), and ``load``/``fma`` let the tile be written over those vectors directly.

``Float32x16`` is an LLVM ``<16 x float>``: LLVM lowers it to one 512-bit register, two 256-bit or
four 128-bit ones, whatever the target has.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), LANES)
_INT32 = ir.IntType(32)
# reassociation lets LLVM contract a multiply and an add into one fused multiply-add
_FLAGS = ("contract", "reassoc")


class Float32x16(types.Type):
    """numba's type of a vector of 16 float32 lanes."""

    def __init__(self):
        super().__init__(name="Float32x16")


float32x16 = Float32x16()


@register_model(Float32x16)
class _Float32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VECTOR)


@intrinsic
def zeros(typingctx):
    """A vector of 16 zeros."""
    def codegen(context, builder, signature, arguments):
        return ir.Constant(_VECTOR, [0.0] * LANES)

    return float32x16(), codegen


@intrinsic
def load(typingctx, array, indices):
    """``array[indices]`` and the 15 elements after it in memory, as float32: a C-contiguous
    array of float32, of bfloat16 bit patterns (uint16) or of float16 bit patterns (int16), the
    element types of the numba kernel's arrays. ``indices`` is a tuple with one integer a
    dimension; the 16 elements must lie in the array (not checked)."""
    if (not isinstance(array, types.Array) or array.layout != "C"
            or array.dtype not in (types.float32, types.uint16, types.int16)
            or not isinstance(indices, types.BaseTuple) or len(indices) != array.ndim
            or not all(isinstance(index, types.Integer) for index in indices)):
        return None

    def codegen(context, builder, signature, arguments):
        array_type, indices_type = signature.args
        array_value, indices_value = arguments
        index_values = [context.cast(builder, value, index_type, types.intp) for value, index_type
                        in zip(cgutils.unpack_tuple(builder, indices_value), indices_type)]
        view = context.make_array(array_type)(context, builder, array_value)
        pointer = cgutils.get_item_pointer2(
            context, builder, data=view.data, shape=cgutils.unpack_tuple(builder, view.shape),
            strides=cgutils.unpack_tuple(builder, view.strides), layout=array_type.layout,
            inds=index_values, wraparound=False, boundscheck=False)
        if array_type.dtype == types.float32:
            return builder.load(builder.bitcast(pointer, _VECTOR.as_pointer()), align=4)
        bits_type = ir.VectorType(ir.IntType(16), LANES)
        bits = builder.load(builder.bitcast(pointer, bits_type.as_pointer()), align=2)
        if array_type.dtype == types.int16:  # float16
            return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)),
                                 _VECTOR)
        # bfloat16: the upper half of a float32
        wide_type = ir.VectorType(_INT32, LANES)
        wide = builder.shl(builder.zext(bits, wide_type), ir.Constant(wide_type, [16] * LANES))
        return builder.bitcast(wide, _VECTOR)

    return float32x16(array, indices), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` lane by lane, fused where the target can."""
    if not (a == b == c == float32x16):
        return None

    def codegen(context, builder, signature, arguments):
        product = builder.fmul(arguments[0], arguments[1], flags=_FLAGS)
        return builder.fadd(product, arguments[2], flags=_FLAGS)

    return float32x16(a, b, c), codegen


def _reduction_plan(count: int) -> tuple[list[list[int]], list[int]]:
    """The transposing reduction of ``count`` vectors (a power of two up to ``LANES``).

    Each level pairs vectors ``2i`` and ``2i + 1`` (a vector with itself once one is left): in
    every chunk of ``width`` lanes, the sum of the chunk's halves of the first, then of the
    second. After ``log2(LANES)`` levels every lane of the one vector left holds one input's
    total. Returns each level's pairs ``[[first, second], ...]`` and, per input, the lane that
    holds its total.
    """
    owners = [[vector] * LANES for vector in range(count)]
    levels = []
    width = LANES
    while width > 1:
        half = width // 2
        pairs = [[i, min(i + 1, len(owners) - 1)] for i in range(0, len(owners), 2)]
        owners = [[owner for chunk in range(0, LANES, width)
                   for owner in (owners[first][chunk:chunk + half]
                                 + owners[second][chunk:chunk + half])]
                  for first, second in pairs]
        levels.append(pairs)
        width = half
    lanes = [owners[0].index(vector) for vector in range(count)]
    return levels, lanes


def _shuffle_mask(width: int, upper: bool) -> ir.Constant:
    """The lanes of ``concat(first, second)`` that a level takes: in each chunk of ``width``
    lanes, the lower (or upper) half of the first vector's chunk, then of the second's."""
    half = width // 2
    offset = half if upper else 0
    lanes = [source + chunk + offset + lane for chunk in range(0, LANES, width)
             for source in (0, LANES) for lane in range(half)]
    return ir.Constant(ir.VectorType(_INT32, LANES), lanes)


@intrinsic
def sum_lanes(typingctx, vectors):
    """The lane sums of a tuple of 4, 8 or 16 vectors, as one vector whose lane ``i`` holds the
    sum of ``vectors[i]`` (lanes past the tuple's length are unspecified).

    A transposing reduction: each shuffle and add serves two of the vectors until one is left,
    ``LANES - 1`` additions for 16 vectors where reducing each alone takes four apiece.
    """
    if not (isinstance(vectors, types.UniTuple) and vectors.dtype == float32x16
            and len(vectors) in (4, 8, 16)):
        return None
    levels, lanes = _reduction_plan(len(vectors))

    def codegen(context, builder, signature, arguments):
        current = cgutils.unpack_tuple(builder, arguments[0])
        width = LANES
        for pairs in levels:
            lower, upper = _shuffle_mask(width, False), _shuffle_mask(width, True)
            current = [builder.fadd(builder.shuffle_vector(current[first], current[second], lower),
                                    builder.shuffle_vector(current[first], current[second], upper),
                                    flags=_FLAGS)
                       for first, second in pairs]
            width //= 2
        # put input i's total in lane i
        order = ir.Constant(ir.VectorType(_INT32, LANES),
                            lanes + list(range(len(lanes), LANES)))
        return builder.shuffle_vector(current[0], current[0], order)

    return float32x16(vectors), codegen


@intrinsic
def lane(typingctx, vector, index):
    """Lane ``index`` of ``vector`` (0 <= index < 16, not checked)."""
    if vector != float32x16 or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, arguments):
        return builder.extract_element(arguments[0],
                                       context.cast(builder, arguments[1], signature.args[1],
                                                    types.int32))

    return types.float32(vector, index), codegen
