"""numba CPU kernel of ``neo.paged_decode_attention``: the readable form of the fast algorithm.

It is registered as ``torch.ops.neo_numba.paged_decode_attention`` and serves as the CPU kernel
of ``torch.ops.neo.paged_decode_attention`` when the ISPC build is absent.

Algorithm (flash-decoding on the CPU):

1. **Plan.** The work is the cache blocks of every sequence, laid end to end. It is cut into one
   equal contiguous share per thread, so a long sequence is split over several threads and many
   short ones share a thread. A call too small for every thread to get a long share first splits
   each sequence's KV heads into equal groups, so that the threads' shares are mostly whole
   (sequence, head group) *items*: head groups need no merge. Each piece of one item that falls
   into one share is a *work unit*.
2. **Attend.** Each thread walks its units block by block, and within a block the unit's KV
   heads one by one, so that it reads each block's K and V in sequential runs (the layout is
   ``[num_blocks, num_kv_heads, block_size, head_dim]``) and can prefetch the next block. Every K
   and V element is decoded to float32 where it is loaded and used for up to four query heads of
   its KV group at once; the dot products of a tile of query heads and tokens are summed as
   vectors and reduced together (``numba_vectors``). The softmax is computed online per block
   (running max, running sum, rescaled accumulator), so each unit yields, per query head, an
   unnormalized output with its max and sum of exponentials.
3. **Merge.** A unit that is a whole item writes its normalized result directly. The units of an
   item split between threads are combined afterwards with a log-sum-exp merge.

numba does not take float16 or bfloat16 arrays, so the kernel sees half-precision tensors as bit
patterns (bfloat16 as uint16, float16 as int16) and decodes them where it loads them: bfloat16 is
the upper half of a float32; float16 goes through the CPU's conversion instruction (F16C) or, on
targets without it, is decoded from its IEEE fields (subnormals, infinities and NaN included).
Results are encoded into ``out``'s type where they are stored, rounded to nearest even as torch
rounds.

A call enters compiled code once. The kernel takes the tensors' addresses and shapes as plain
integers, rather than numpy arrays that each cost a conversion, and makes its arrays over their
memory; it checks the block table and lengths, plans, and runs a plan of one thread on the
calling thread, without starting a parallel region.

The machine code is compiled on first use, once per dtype, and kept in numba's on-disk cache
when there is a writable place for it.
"""

import threading

import llvmlite.binding as llvm
import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import checks, numba_vectors as vectors

# Floating-point liberties that let LLVM vectorize the dot products and sums (reassociation,
# contraction into FMA, fast exp), without the "no NaN / no infinity" assumptions of
# ``fastmath=True``: the online softmax starts from -inf and must see it as such.
FAST_MATH = {"reassoc", "contract", "arcp", "nsz", "afn"}

# A thread's share of the work is at least this many (token, KV head) pairs; smaller calls run on
# fewer threads, since splitting them costs more than it gains.
MIN_TOKEN_HEADS_PER_THREAD = 512

# A call whose threads' shares hold at least this many tokens of all KV heads keeps the heads of
# each sequence together (see ``_plan``): from DRAM, a block read as one run of every head's rows
# streams faster than as several shorter runs, and shares this long pay little for merging the
# pieces of a sequence split between threads.
LONG_SHARE_TOKENS = 512

CACHE_LINE_BYTES = 64

# numba's fallback threading layer ("workqueue", used when neither TBB nor OpenMP is installed)
# aborts the process when two threads launch parallel kernels at once. Calls are therefore
# serialized (whether a call launches one is decided in the kernel); a launch uses every thread
# its plan can use anyway.
_launch_lock = threading.Lock()


def _compiled(**options):
    """``numba.njit(**options)`` with numba's on-disk cache of the machine code when possible.

    numba writes its cache next to the source file or else in the user's cache directory; when
    neither is writable (a read-only install and home) it refuses ``cache=True``, and the kernel
    is then compiled in every process instead.
    """
    def decorate(function):
        try:
            return njit(cache=True, **options)(function)
        except RuntimeError:
            return njit(**options)(function)

    return decorate


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the unsigned integer ``bits``.

    numba widens unsigned arithmetic to 64 bits, so the argument is truncated to 32 first.
    """
    if not isinstance(bits, types.Integer) or bits.signed:
        return None

    def codegen(context, builder, signature, arguments):
        low_bits = builder.trunc(arguments[0], ir.IntType(32)) if bits.bitwidth > 32 \
            else arguments[0]
        return builder.bitcast(low_bits, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _prefetch(typingctx, array, offset):
    """Ask the CPU to bring the cache line of ``array.flat[offset]`` into L2 (no other effect)."""
    if not isinstance(array, types.Array) or not isinstance(offset, types.Integer):
        return None

    def codegen(context, builder, signature, arguments):
        array_value, offset_value = arguments
        data = context.make_array(signature.args[0])(context, builder, array_value).data
        address = builder.bitcast(builder.gep(data, [offset_value]), ir.IntType(8).as_pointer())
        int32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [address.type, int32, int32, int32]),
            "llvm.prefetch.p0")
        # read access, locality 2 (L2), data cache
        builder.call(prefetch, [address, int32(0), int32(2), int32(1)])
        return context.get_dummy_value()

    return types.void(array, offset), codegen


@intrinsic
def _use_512_bit_vectors(typingctx):
    """Let LLVM vectorize the calling function's loops with 512-bit registers (no other effect).

    LLVM's tuning for Intel server cores (Skylake-SP and later) prefers 256-bit vectors where a
    target has 512-bit ones, and numba compiles for the host's tuning: there the kernel's loops,
    bound by their multiply-adds, would run at half the width the cores have. The function
    attribute ``prefer-vector-width`` overrides that tuning for the one function that carries
    it; numba has no option that sets it, and llvmlite's attribute set admits only attributes
    without values, so the attribute is added past its check. It changes nothing where the
    tuning already prefers 512 bits, or where the target has no 512-bit vectors.
    """
    def codegen(context, builder, signature, arguments):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _set_parallel_threads(typingctx, count):
    """``numba.set_num_threads(count)`` from compiled code: the threads that the calling thread's
    next parallel regions run on, ``1 <= count <= NUMBA_NUM_THREADS`` (not checked).

    It calls the threading layer's ``set_num_threads``, which numba links into compiled code by
    that name (as it does ``get_num_threads``, which its parallel regions read). numba's own
    ``set_num_threads`` in compiled code calls it through a ctypes pointer, which would keep the
    kernel out of the on-disk cache.
    """
    if not isinstance(count, types.Integer):
        return None

    def codegen(context, builder, signature, arguments):
        int32 = ir.IntType(32)
        set_num_threads = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [int32]), "set_num_threads")
        builder.call(set_num_threads, [builder.trunc(arguments[0], int32)])
        return context.get_dummy_value()

    return types.void(count), codegen


@njit(inline="always")
def _decode_bfloat16(bits):
    """bfloat16 bit pattern (uint16) -> float32: the bits are the upper half of a float32."""
    return _float_from_bits(np.uint32(bits) << np.uint32(16))


@intrinsic
def _float16_bits_to_float32(typingctx, bits):
    """IEEE float16 bit pattern (int16) -> float32 by the CPU's conversion instruction.

    Compiles to F16C's ``vcvtph2ps`` on x86; only for targets that have it (``HARDWARE_FLOAT16``),
    since elsewhere LLVM would call a runtime helper that numba does not provide.
    """
    if bits != types.int16:
        return None

    def codegen(context, builder, signature, arguments):
        return builder.fpext(builder.bitcast(arguments[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


def _target_has_f16c() -> bool:
    """Whether numba compiles for a CPU with F16C (its target: the host, or NUMBA_CPU_NAME)."""
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


HARDWARE_FLOAT16 = _target_has_f16c()


@njit(inline="always")
def _decode_float16(bits):
    """IEEE float16 bit pattern (int16) -> float32, subnormals, infinities and NaN included.

    The portable decoder, for targets without F16C. Branch-free, so that LLVM vectorizes it: the
    exponent is rebiased from 15 to 127 and the mantissa widened from 10 to 23 bits;
    infinity/NaN get the all-ones exponent; a zero or subnormal ``m * 2**-24`` is built exactly
    as ``2**-14 * (1 + m / 1024)`` minus ``2**-14``.
    """
    # numba widens integer arithmetic to 64 bits; every step is cast back to 32 so that the
    # vectorized code works on 32-bit lanes
    bits32 = np.uint32(np.uint16(bits))
    exponent = np.uint32(np.uint32(bits32 >> np.uint32(10)) & np.uint32(0x1F))
    mantissa = np.uint32(bits32 & np.uint32(0x3FF))
    rebiased = np.uint32(exponent + np.uint32(112))
    rebiased = np.uint32(255) if exponent == np.uint32(0x1F) else rebiased
    rebiased = np.uint32(113) if exponent == np.uint32(0) else rebiased
    magnitude = _float_from_bits(np.uint32(np.uint32(rebiased << np.uint32(23))
                                           | np.uint32(mantissa << np.uint32(13))))
    magnitude -= np.float32(2.0 ** -14) if exponent == np.uint32(0) else np.float32(0.0)
    return -magnitude if bits32 & np.uint32(0x8000) else magnitude


# numba has no float16/bfloat16 arrays: the kernel sees the tensors' memory as arrays of float32,
# or of bit patterns, bfloat16 as uint16 and float16 as int16, so that the element type alone says
# how to decode and encode. A value of that type is what tells the kernel which one to compile.
_ELEMENT_OF = {torch.float32: np.float32(0), torch.bfloat16: np.uint16(0),
               torch.float16: np.int16(0)}


def _to_float32(element):
    """One element -> float32: float32 as is, uint16 as bfloat16 bits, int16 as float16 bits.

    Only callable from numba-compiled code, which picks the decoding by the element's type.
    """
    raise TypeError("_to_float32 runs only inside numba-compiled code")


@overload(_to_float32, inline="always")
def _to_float32_by_type(element):
    if element == types.int16 and HARDWARE_FLOAT16:
        return lambda element: _float16_bits_to_float32(element)
    decoders = {types.float32: lambda element: element,
                types.uint16: lambda element: _decode_bfloat16(element),
                types.int16: lambda element: _decode_float16(element)}
    return decoders.get(element)


@intrinsic
def _bits_of_float(typingctx, value):
    """The bit pattern of the float32 ``value`` as a uint32 (``_float_from_bits`` inverted)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, arguments):
        return builder.bitcast(arguments[0], ir.IntType(32))

    return types.uint32(value), codegen


@njit(inline="always")
def _encode_bfloat16(value):
    """float32 -> bfloat16 bit pattern (uint16), rounded to nearest even as torch rounds.

    The upper half of the float32, plus one where the lower half is more than half a unit, or
    exactly half with an odd upper half (a carry into the exponent rounds up to infinity). A NaN
    keeps its sign and upper payload, made quiet.
    """
    bits = _bits_of_float(value)
    odd = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(1))
    rounded = np.uint32(np.uint32(bits + np.uint32(0x7FFF) + odd) >> np.uint32(16))
    quiet_nan = np.uint32(np.uint32(bits >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16(quiet_nan if value != value else rounded)


@intrinsic
def _float32_to_float16_bits(typingctx, value):
    """float32 -> IEEE float16 bit pattern (int16) by the CPU's conversion instruction, rounded
    to nearest even.

    Compiles to F16C's ``vcvtps2ph`` on x86; only for targets that have it (``HARDWARE_FLOAT16``).
    """
    if value != types.float32:
        return None

    def codegen(context, builder, signature, arguments):
        return builder.bitcast(builder.fptrunc(arguments[0], ir.HalfType()), ir.IntType(16))

    return types.int16(value), codegen


@njit(inline="always")
def _encode_float16(value):
    """float32 -> IEEE float16 bit pattern (int16), rounded to nearest even, subnormals,
    infinities and NaN included.

    The portable encoder, for targets without F16C. Branch-free, so that LLVM vectorizes it.
    Magnitudes from 2**16 become infinity (a NaN a quiet NaN). Below 2**-14, float16's smallest
    normal, adding 0.5 rounds the magnitude to a multiple of 2**-24, the spacing of float16's
    subnormals and of the float32s in [0.5, 1): the low mantissa bits of the sum are then the
    subnormal's. In between, the exponent is rebiased from 127 to 15 and the mantissa rounded from
    23 to 10 bits, a carry into the exponent (up to infinity) included. Exact only without
    fast-math flags, which could rewrite the addition of 0.5.
    """
    # as in _decode_float16, every step is cast back to 32 bits
    bits = _bits_of_float(value)
    magnitude = np.uint32(bits & np.uint32(0x7FFFFFFF))
    odd = np.uint32(np.uint32(magnitude >> np.uint32(13)) & np.uint32(1))
    normal = np.uint32(np.uint32(magnitude - np.uint32(112 << 23) + np.uint32(0xFFF) + odd)
                       >> np.uint32(13))
    subnormal = np.uint32(_bits_of_float(_float_from_bits(magnitude) + np.float32(0.5))
                          - np.uint32(126 << 23))
    overflow = np.uint32(0x7E00) if magnitude > np.uint32(0x7F800000) else np.uint32(0x7C00)
    half = subnormal if magnitude < np.uint32(113 << 23) else normal
    half = overflow if magnitude >= np.uint32(143 << 23) else half
    sign = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(0x8000))
    return np.int16(np.uint16(half | sign))


def _from_float32(value, array):
    """The float32 ``value`` as an element of ``array``: float32 as is, bfloat16 bits for uint16,
    float16 bits for int16, rounded to nearest even.

    Only callable from numba-compiled code, which picks the encoding by the array's type.
    """
    raise TypeError("_from_float32 runs only inside numba-compiled code")


@overload(_from_float32, inline="always")
def _from_float32_by_type(value, array):
    if array.dtype == types.int16 and HARDWARE_FLOAT16:
        return lambda value, array: _float32_to_float16_bits(value)
    encoders = {types.float32: lambda value, array: value,
                types.uint16: lambda value, array: _encode_bfloat16(value),
                types.int16: lambda value, array: _encode_float16(value)}
    return encoders.get(array.dtype)


@intrinsic
def _pointer_to(typingctx, address, element):
    """The integer ``address`` as a pointer to elements of ``element``'s type."""
    if not isinstance(address, types.Integer) or not isinstance(element, types.Number):
        return None

    def codegen(context, builder, signature, arguments):
        return builder.inttoptr(arguments[0], context.get_value_type(signature.return_type))

    return types.CPointer(element)(address, element), codegen


@njit(inline="always")
def _array_at(address, shape, element):
    """The C-contiguous array of ``shape`` at ``address`` (a tensor's ``data_ptr()``), of
    ``element``'s type. It does not own the memory, which its tensor must keep alive, and, having
    no reference count, costs nothing to pass between threads."""
    return numba.carray(_pointer_to(address, element), shape)


# Polynomial for 2**f on [0, 1): least-squares fit with 2**0 = 1 exactly, relative error < 2e-7.
EXP2_COEFFICIENTS = tuple(np.float32(c) for c in (
    1.0, 0.69315135, 0.24016416, 0.055800445, 0.009016688, 0.0018671829))
LOG2_E = np.float32(1.4426950408889634)


@njit(inline="always", fastmath=FAST_MATH)
def _exp_nonpositive(x):
    """``e**x`` for float32 ``x <= 0`` (``-inf`` and anything below about -88 give 0).

    Written out so that LLVM vectorizes it (numba's ``math.exp`` is a scalar libm call), all in
    float32: ``e**x = 2**n * 2**f`` with ``n = floor(x log2 e)`` put into the exponent bits and
    ``2**f`` from a polynomial. Relative error about 1e-6 (from rounding ``x log2 e``).
    """
    y = min(max(x * LOG2_E, np.float32(-127.0)), np.float32(0.0))
    n = np.floor(y)
    f = y - n
    c0, c1, c2, c3, c4, c5 = EXP2_COEFFICIENTS
    power_of_fraction = c0 + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * c5))))
    # 2**n from its exponent bits; n = -127 gives the bits of 0.0
    return power_of_fraction * _float_from_bits(np.uint32(np.int32(n) + np.int32(127))
                                                << np.uint32(23))


@_compiled()
def _values_valid(block_table, seq_lens, num_blocks, block_size):
    """Whether every ``seq_len`` is >= 1, fits ``block_table``'s columns, and every block id it
    uses lies in ``[0, num_blocks)``: the conditions of
    ``checks.check_paged_decode_attention_values`` as one compiled scan, so that valid input
    costs no torch operations."""
    for seq in range(seq_lens.shape[0]):
        length = seq_lens[seq]
        if length < 1:
            return False
        blocks_needed = (length + block_size - 1) // block_size
        if blocks_needed > block_table.shape[1]:
            return False
        for column in range(blocks_needed):
            block = block_table[seq, column]
            if block < 0 or block >= num_blocks:
                return False
    return True


@_compiled()
def _kv_head_groups(num_seqs, num_kv_heads, wanted_items):
    """The fewest groups (a divisor of ``num_kv_heads``) that give the sequences together at
    least ``wanted_items`` (sequence, group) items, or one group a KV head where no count does."""
    for groups in range(1, num_kv_heads):
        if num_kv_heads % groups == 0 and num_seqs * groups >= wanted_items:
            return groups
    return num_kv_heads


@_compiled()
def _plan(seq_lens, block_size, num_kv_heads, num_threads):
    """Cut the work into equal contiguous shares per thread.

    The work is made of *items*: item ``i`` is KV head group ``i % groups`` of sequence ``i //
    groups``, all of its blocks. The items, laid end to end, are cut into one equal share of
    blocks per thread. A call whose shares would hold fewer than ``LONG_SHARE_TOKENS`` tokens
    of all KV heads splits each sequence's heads into equal groups first, to have about as many
    items as threads: a head group needs no merge, a token range split between threads does.
    Longer calls keep the heads whole (``groups`` is 1), so that each block is read as one run
    of every head's rows.

    Returns ``(groups, unit_item, unit_first_block, unit_end_block, item_units,
    thread_units)``: unit ``u`` covers blocks ``[unit_first_block[u], unit_end_block[u])`` of
    item ``unit_item[u]``; the units of item ``i`` are ``item_units[i]:item_units[i + 1]`` and
    those of thread ``t`` are ``thread_units[t]:thread_units[t + 1]`` (int64 arrays).
    """
    num_seqs = seq_lens.shape[0]
    total_blocks = 0
    for seq in range(num_seqs):
        total_blocks += (seq_lens[seq] + block_size - 1) // block_size
    min_blocks = max(1, MIN_TOKEN_HEADS_PER_THREAD // (block_size * num_kv_heads))
    num_threads = max(1, min(num_threads, total_blocks // min_blocks))
    groups = 1
    if total_blocks * block_size < num_threads * LONG_SHARE_TOKENS:
        groups = _kv_head_groups(num_seqs, num_kv_heads, num_threads)
    total_work = total_blocks * groups  # blocks of one head group each
    # thread t takes the blocks [share_end[t - 1], share_end[t]) of the work laid end to end
    share_end = np.empty(num_threads, np.int64)
    for thread in range(num_threads):
        share_end[thread] = (thread + 1) * total_work // num_threads

    num_items = num_seqs * groups
    max_units = num_items + num_threads
    unit_item = np.empty(max_units, np.int64)
    unit_first_block = np.empty(max_units, np.int64)
    unit_end_block = np.empty(max_units, np.int64)
    item_units = np.empty(num_items + 1, np.int64)
    thread_units = np.zeros(num_threads + 1, np.int64)
    num_units = 0
    thread = 0
    position = 0  # first block of the current item in the laid-out work
    for item in range(num_items):
        item_units[item] = num_units
        item_blocks = (seq_lens[item // groups] + block_size - 1) // block_size
        start = position
        while start < position + item_blocks:
            while share_end[thread] <= start:
                thread += 1
            end = min(position + item_blocks, share_end[thread])
            unit_item[num_units] = item
            unit_first_block[num_units] = start - position
            unit_end_block[num_units] = end - position
            thread_units[thread + 1] = num_units + 1
            num_units += 1
            start = end
        position += item_blocks
    item_units[num_items] = num_units
    return (groups, unit_item[:num_units], unit_first_block[:num_units],
            unit_end_block[:num_units], item_units, thread_units)


@_compiled()
def _item_heads(item, groups, num_heads):
    """``(seq, first_head, end_head)``: the sequence of ``_plan``'s item ``item`` and the range of
    query heads its KV head group covers."""
    heads_per_item = num_heads // groups
    first_head = (item % groups) * heads_per_item
    return item // groups, first_head, first_head + heads_per_item


# The helpers below get the caches whole, with indices, rather than slices of them: a slice of an
# array shared by the threads updates its reference count, an atomic they would all contend for.
# Slices of a thread's own working arrays are cheap. They read the half-precision caches
# directly, each element decoded once where it is loaded and used for every query head of the
# tile; the token loops take register tiles of four tokens, with whatever remains of a block
# done token by token. The score tiles hold their dot products as vectors of 16 lanes
# (``numba_vectors``; ``head_dim`` is a multiple of 16, as the shared checks require) and reduce
# them together.

@_compiled(nogil=True)
def _prefetch_rows(cache, block, head):
    """Prefetch ``cache[block, head]``, one request per 64-byte cache line."""
    row_elements = cache.shape[2] * cache.shape[3]
    first = (block * cache.shape[1] + head) * row_elements
    for offset in range(first, first + row_elements, CACHE_LINE_BYTES // cache.itemsize):
        _prefetch(cache, offset)


@njit(inline="always")
def _store_tile_scores(totals, heads, tokens, scores, g, t):
    """``scores[g + i, t + j]`` = lane ``i * tokens + j`` of ``totals``, a score tile's dot
    products summed by ``vectors.sum_lanes``."""
    for i in range(heads):
        for j in range(tokens):
            scores[g + i, t + j] = vectors.lane(totals, i * tokens + j)


@_compiled(fastmath=FAST_MATH, nogil=True, inline="always")
def _scores_one_head(queries, h, cache, block, kv_head, count, scores, g):
    """``scores[g, t] = queries[h] . cache[block, kv_head, t]`` for ``count`` tokens."""
    _use_512_bit_vectors()
    head_dim = cache.shape[3]
    t = 0
    while t + 4 <= count:
        dot0 = dot1 = dot2 = dot3 = vectors.zeros()
        for d in range(0, head_dim, vectors.LANES):
            query = vectors.load(queries, (h, d))
            dot0 = vectors.fma(query, vectors.load(cache, (block, kv_head, t, d)), dot0)
            dot1 = vectors.fma(query, vectors.load(cache, (block, kv_head, t + 1, d)), dot1)
            dot2 = vectors.fma(query, vectors.load(cache, (block, kv_head, t + 2, d)), dot2)
            dot3 = vectors.fma(query, vectors.load(cache, (block, kv_head, t + 3, d)), dot3)
        _store_tile_scores(vectors.sum_lanes((dot0, dot1, dot2, dot3)), 1, 4, scores, g, t)
        t += 4
    for t in range(t, count):
        dot = np.float32(0.0)
        for d in range(head_dim):
            dot += queries[h, d] * _to_float32(cache[block, kv_head, t, d])
        scores[g, t] = dot


@_compiled(fastmath=FAST_MATH, nogil=True, inline="always")
def _scores_two_heads(queries, h, cache, block, kv_head, count, scores, g):
    """``_scores_one_head`` for query heads ``h, h + 1`` into score rows ``g, g + 1``: each key
    vector loaded serves both."""
    _use_512_bit_vectors()
    head_dim = cache.shape[3]
    t = 0
    while t + 4 <= count:
        dot00 = dot01 = dot02 = dot03 = vectors.zeros()
        dot10 = dot11 = dot12 = dot13 = vectors.zeros()
        for d in range(0, head_dim, vectors.LANES):
            key0 = vectors.load(cache, (block, kv_head, t, d))
            key1 = vectors.load(cache, (block, kv_head, t + 1, d))
            key2 = vectors.load(cache, (block, kv_head, t + 2, d))
            key3 = vectors.load(cache, (block, kv_head, t + 3, d))
            query0, query1 = vectors.load(queries, (h, d)), vectors.load(queries, (h + 1, d))
            dot00 = vectors.fma(query0, key0, dot00)
            dot01 = vectors.fma(query0, key1, dot01)
            dot02 = vectors.fma(query0, key2, dot02)
            dot03 = vectors.fma(query0, key3, dot03)
            dot10 = vectors.fma(query1, key0, dot10)
            dot11 = vectors.fma(query1, key1, dot11)
            dot12 = vectors.fma(query1, key2, dot12)
            dot13 = vectors.fma(query1, key3, dot13)
        totals = vectors.sum_lanes((dot00, dot01, dot02, dot03, dot10, dot11, dot12, dot13))
        _store_tile_scores(totals, 2, 4, scores, g, t)
        t += 4
    for t in range(t, count):
        dot0 = dot1 = np.float32(0.0)
        for d in range(head_dim):
            key = _to_float32(cache[block, kv_head, t, d])
            dot0 += queries[h, d] * key
            dot1 += queries[h + 1, d] * key
        scores[g, t], scores[g + 1, t] = dot0, dot1


@_compiled(fastmath=FAST_MATH, nogil=True, inline="always")
def _scores_four_heads(queries, h, cache, block, kv_head, count, scores, g):
    """``_scores_one_head`` for query heads ``h .. h + 3`` into score rows ``g .. g + 3``: each
    key vector loaded serves all four."""
    _use_512_bit_vectors()
    head_dim = cache.shape[3]
    t = 0
    while t + 4 <= count:
        dot00 = dot01 = dot02 = dot03 = vectors.zeros()
        dot10 = dot11 = dot12 = dot13 = vectors.zeros()
        dot20 = dot21 = dot22 = dot23 = vectors.zeros()
        dot30 = dot31 = dot32 = dot33 = vectors.zeros()
        for d in range(0, head_dim, vectors.LANES):
            key0 = vectors.load(cache, (block, kv_head, t, d))
            key1 = vectors.load(cache, (block, kv_head, t + 1, d))
            key2 = vectors.load(cache, (block, kv_head, t + 2, d))
            key3 = vectors.load(cache, (block, kv_head, t + 3, d))
            query0, query1 = vectors.load(queries, (h, d)), vectors.load(queries, (h + 1, d))
            query2, query3 = vectors.load(queries, (h + 2, d)), vectors.load(queries, (h + 3, d))
            dot00 = vectors.fma(query0, key0, dot00)
            dot01 = vectors.fma(query0, key1, dot01)
            dot02 = vectors.fma(query0, key2, dot02)
            dot03 = vectors.fma(query0, key3, dot03)
            dot10 = vectors.fma(query1, key0, dot10)
            dot11 = vectors.fma(query1, key1, dot11)
            dot12 = vectors.fma(query1, key2, dot12)
            dot13 = vectors.fma(query1, key3, dot13)
            dot20 = vectors.fma(query2, key0, dot20)
            dot21 = vectors.fma(query2, key1, dot21)
            dot22 = vectors.fma(query2, key2, dot22)
            dot23 = vectors.fma(query2, key3, dot23)
            dot30 = vectors.fma(query3, key0, dot30)
            dot31 = vectors.fma(query3, key1, dot31)
            dot32 = vectors.fma(query3, key2, dot32)
            dot33 = vectors.fma(query3, key3, dot33)
        totals = vectors.sum_lanes((dot00, dot01, dot02, dot03, dot10, dot11, dot12, dot13,
                                    dot20, dot21, dot22, dot23, dot30, dot31, dot32, dot33))
        _store_tile_scores(totals, 4, 4, scores, g, t)
        t += 4
    for t in range(t, count):
        dot0 = dot1 = dot2 = dot3 = np.float32(0.0)
        for d in range(head_dim):
            key = _to_float32(cache[block, kv_head, t, d])
            dot0 += queries[h, d] * key
            dot1 += queries[h + 1, d] * key
            dot2 += queries[h + 2, d] * key
            dot3 += queries[h + 3, d] * key
        scores[g, t], scores[g + 1, t], scores[g + 2, t], scores[g + 3, t] = dot0, dot1, dot2, dot3


@_compiled(fastmath=FAST_MATH, nogil=True)
def _block_scores(queries, first_head, cache, block, kv_head, count, scores):
    """``scores[g, t] = queries[first_head + g] . cache[block, kv_head, t]`` for the group's
    ``scores.shape[0]`` heads and ``count`` tokens, in tiles of four, two and one heads."""
    group = scores.shape[0]
    g = 0
    while g + 4 <= group:
        _scores_four_heads(queries, first_head + g, cache, block, kv_head, count, scores, g)
        g += 4
    if g + 2 <= group:
        _scores_two_heads(queries, first_head + g, cache, block, kv_head, count, scores, g)
        g += 2
    if g < group:
        _scores_one_head(queries, first_head + g, cache, block, kv_head, count, scores, g)


@_compiled(fastmath=FAST_MATH, nogil=True)
def _online_softmax(scores, count, first_head, running_max, running_sum, accumulator):
    """Turn ``scores[:, :count]`` into weights relative to the group's updated running max.

    Query head ``first_head + g``'s running sum and accumulated output are rescaled to its new
    max (skipped when the max did not change), and the block's weights are added to its running
    sum.
    """
    _use_512_bit_vectors()
    for g in range(scores.shape[0]):
        head = first_head + g
        block_max = running_max[head]
        for t in range(count):
            block_max = max(block_max, scores[g, t])
        correction = _exp_nonpositive(running_max[head] - block_max)
        running_max[head] = block_max
        block_sum = np.float32(0.0)
        for t in range(count):
            weight = _exp_nonpositive(scores[g, t] - block_max)
            scores[g, t] = weight
            block_sum += weight
        running_sum[head] = running_sum[head] * correction + block_sum
        if correction != np.float32(1.0):
            for d in range(accumulator.shape[1]):
                accumulator[head, d] *= correction


# In the accumulation tiles the weights are read into local variables before the loop over
# head_dim: the compiler cannot tell that stores to the accumulator leave them unchanged, and
# would otherwise reload them, or guard the loop with run-time overlap checks.

@_compiled(fastmath=FAST_MATH, nogil=True)
def _accumulate_one_head(weights, g, cache, block, kv_head, count, accumulator, h):
    """``accumulator[h] += sum_t weights[g, t] * cache[block, kv_head, t]`` over ``count``
    tokens."""
    _use_512_bit_vectors()
    t = 0
    while t + 4 <= count:
        weight0, weight1, weight2, weight3 = \
            weights[g, t], weights[g, t + 1], weights[g, t + 2], weights[g, t + 3]
        for d in range(cache.shape[3]):
            accumulator[h, d] += (
                (weight0 * _to_float32(cache[block, kv_head, t, d])
                 + weight1 * _to_float32(cache[block, kv_head, t + 1, d]))
                + (weight2 * _to_float32(cache[block, kv_head, t + 2, d])
                   + weight3 * _to_float32(cache[block, kv_head, t + 3, d])))
        t += 4
    for t in range(t, count):
        weight = weights[g, t]
        for d in range(cache.shape[3]):
            accumulator[h, d] += weight * _to_float32(cache[block, kv_head, t, d])


@_compiled(fastmath=FAST_MATH, nogil=True)
def _accumulate_two_heads(weights, g, cache, block, kv_head, count, accumulator, h):
    """``_accumulate_one_head`` for weight rows ``g, g + 1`` into accumulator rows ``h, h + 1``:
    each value loaded serves both."""
    _use_512_bit_vectors()
    t = 0
    while t + 4 <= count:
        weight00, weight01, weight02, weight03 = \
            weights[g, t], weights[g, t + 1], weights[g, t + 2], weights[g, t + 3]
        weight10, weight11, weight12, weight13 = \
            weights[g + 1, t], weights[g + 1, t + 1], weights[g + 1, t + 2], weights[g + 1, t + 3]
        for d in range(cache.shape[3]):
            value0 = _to_float32(cache[block, kv_head, t, d])
            value1 = _to_float32(cache[block, kv_head, t + 1, d])
            value2 = _to_float32(cache[block, kv_head, t + 2, d])
            value3 = _to_float32(cache[block, kv_head, t + 3, d])
            accumulator[h, d] += ((weight00 * value0 + weight01 * value1)
                                  + (weight02 * value2 + weight03 * value3))
            accumulator[h + 1, d] += ((weight10 * value0 + weight11 * value1)
                                      + (weight12 * value2 + weight13 * value3))
        t += 4
    for t in range(t, count):
        weight0, weight1 = weights[g, t], weights[g + 1, t]
        for d in range(cache.shape[3]):
            value = _to_float32(cache[block, kv_head, t, d])
            accumulator[h, d] += weight0 * value
            accumulator[h + 1, d] += weight1 * value


@_compiled(fastmath=FAST_MATH, nogil=True)
def _accumulate_four_heads(weights, g, cache, block, kv_head, count, accumulator, h):
    """``_accumulate_one_head`` for weight rows ``g .. g + 3`` into accumulator rows
    ``h .. h + 3``: each value loaded serves all four."""
    _use_512_bit_vectors()
    t = 0
    while t + 4 <= count:
        weight00, weight01, weight02, weight03 = \
            weights[g, t], weights[g, t + 1], weights[g, t + 2], weights[g, t + 3]
        weight10, weight11, weight12, weight13 = \
            weights[g + 1, t], weights[g + 1, t + 1], weights[g + 1, t + 2], weights[g + 1, t + 3]
        weight20, weight21, weight22, weight23 = \
            weights[g + 2, t], weights[g + 2, t + 1], weights[g + 2, t + 2], weights[g + 2, t + 3]
        weight30, weight31, weight32, weight33 = \
            weights[g + 3, t], weights[g + 3, t + 1], weights[g + 3, t + 2], weights[g + 3, t + 3]
        for d in range(cache.shape[3]):
            value0 = _to_float32(cache[block, kv_head, t, d])
            value1 = _to_float32(cache[block, kv_head, t + 1, d])
            value2 = _to_float32(cache[block, kv_head, t + 2, d])
            value3 = _to_float32(cache[block, kv_head, t + 3, d])
            accumulator[h, d] += ((weight00 * value0 + weight01 * value1)
                                  + (weight02 * value2 + weight03 * value3))
            accumulator[h + 1, d] += ((weight10 * value0 + weight11 * value1)
                                      + (weight12 * value2 + weight13 * value3))
            accumulator[h + 2, d] += ((weight20 * value0 + weight21 * value1)
                                      + (weight22 * value2 + weight23 * value3))
            accumulator[h + 3, d] += ((weight30 * value0 + weight31 * value1)
                                      + (weight32 * value2 + weight33 * value3))
        t += 4
    for t in range(t, count):
        weight0, weight1, weight2, weight3 = \
            weights[g, t], weights[g + 1, t], weights[g + 2, t], weights[g + 3, t]
        for d in range(cache.shape[3]):
            value = _to_float32(cache[block, kv_head, t, d])
            accumulator[h, d] += weight0 * value
            accumulator[h + 1, d] += weight1 * value
            accumulator[h + 2, d] += weight2 * value
            accumulator[h + 3, d] += weight3 * value


@_compiled(fastmath=FAST_MATH, nogil=True)
def _accumulate_values(weights, cache, block, kv_head, count, first_head, accumulator):
    """``accumulator[first_head + g] += sum_t weights[g, t] * cache[block, kv_head, t]`` over
    ``count`` tokens, for the group's ``weights.shape[0]`` heads in tiles of four, two and one.

    Each accumulator element is loaded and stored once per four tokens.
    """
    group = weights.shape[0]
    g = 0
    while g + 4 <= group:
        _accumulate_four_heads(weights, g, cache, block, kv_head, count, accumulator,
                               first_head + g)
        g += 4
    if g + 2 <= group:
        _accumulate_two_heads(weights, g, cache, block, kv_head, count, accumulator,
                              first_head + g)
        g += 2
    if g < group:
        _accumulate_one_head(weights, g, cache, block, kv_head, count, accumulator,
                             first_head + g)


@_compiled(nogil=True)
def _store(values, out, seq, first_head, end_head):
    """``out[seq, first_head:end_head] = values[first_head:end_head]`` (float32 ``[num_heads,
    head_dim]``), encoded in ``out``'s element type.

    Compiled without fast-math flags: the encoders' rounding relies on exact float arithmetic.
    """
    for head in range(first_head, end_head):
        for d in range(values.shape[1]):
            out[seq, head, d] = _from_float32(values[head, d], out)


@_compiled(fastmath=FAST_MATH, nogil=True)
def _attend_units(first_unit, end_unit, q, k_cache, v_cache, block_table, seq_lens, scale, plan,
                  partials, out):
    """Attend the units ``first_unit`` to ``end_unit`` of ``plan`` (see ``_plan``) on this thread.

    A unit that is a whole item writes its query heads' results into ``out``; the others leave,
    per query head of their group, their unnormalized output, running max and running sum in
    ``partials`` (arrays ``[num_units, num_heads, head_dim]``, ``[num_units, num_heads]`` and
    ``[num_units, num_heads]``, rows of other groups' heads unwritten) for
    ``_merge_split_items``.
    """
    groups, unit_item, unit_first_block, unit_end_block, item_units, _ = plan
    partial_out, partial_max, partial_sum = partials
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # the thread's own working arrays (slicing an array shared by the threads would make them
    # contend for its reference count); rows are indexed by query head
    queries = np.empty((num_heads, head_dim), np.float32)
    accumulator = np.empty((num_heads, head_dim), np.float32)
    running_max = np.empty(num_heads, np.float32)
    running_sum = np.empty(num_heads, np.float32)
    scores = np.empty((group, block_size), np.float32)
    for unit in range(first_unit, end_unit):
        item = unit_item[unit]
        seq, first_query_head, end_query_head = _item_heads(item, groups, num_heads)
        kv_head_begin, kv_head_end = first_query_head // group, end_query_head // group
        for head in range(first_query_head, end_query_head):
            for d in range(head_dim):
                queries[head, d] = _to_float32(q[seq, head, d]) * scale
                accumulator[head, d] = 0.0
            running_max[head] = -np.inf
            running_sum[head] = 0.0
        # block by block, the item's KV heads of a block in turn: the reads stay sequential
        for block_index in range(unit_first_block[unit], unit_end_block[unit]):
            block = block_table[seq, block_index]
            # the blocks of a sequence are scattered, out of the hardware prefetcher's reach:
            # each KV head of the next block is fetched while this block's is used
            next_block = block_table[seq, min(block_index + 1, unit_end_block[unit] - 1)]
            count = min(block_size, seq_lens[seq] - block_index * block_size)
            for kv_head in range(kv_head_begin, kv_head_end):
                first_head = kv_head * group
                _prefetch_rows(k_cache, next_block, kv_head)
                _prefetch_rows(v_cache, next_block, kv_head)
                _block_scores(queries, first_head, k_cache, block, kv_head, count, scores)
                _online_softmax(scores, count, first_head, running_max, running_sum,
                                accumulator)
                _accumulate_values(scores, v_cache, block, kv_head, count, first_head,
                                   accumulator)
        if item_units[item + 1] - item_units[item] == 1:  # the whole item: final result
            for head in range(first_query_head, end_query_head):
                # read once: the compiler may then divide by multiplying with its reciprocal
                total = running_sum[head]
                for d in range(head_dim):
                    accumulator[head, d] /= total
            _store(accumulator, out, seq, first_query_head, end_query_head)
        else:
            for head in range(first_query_head, end_query_head):
                for d in range(head_dim):
                    partial_out[unit, head, d] = accumulator[head, d]
                partial_max[unit, head] = running_max[head]
                partial_sum[unit, head] = running_sum[head]


@_compiled(parallel=True, fastmath=FAST_MATH, nogil=True)
def _attend_in_parallel(q, k_cache, v_cache, block_table, seq_lens, scale, plan, partials, out):
    """``_attend_units`` for every thread's share of ``plan``, the shares on parallel threads."""
    _, _, _, _, _, thread_units = plan
    for thread in prange(thread_units.shape[0] - 1):
        _attend_units(thread_units[thread], thread_units[thread + 1], q, k_cache, v_cache,
                      block_table, seq_lens, scale, plan, partials, out)


@_compiled(fastmath=FAST_MATH, nogil=True)
def _merge_split_items(plan, partials, out):
    """Write into ``out`` the items split over threads (at most one per thread boundary): the
    log-sum-exp merge of their units' ``partials`` (see ``_attend_units``)."""
    groups, _, _, _, item_units, _ = plan
    partial_out, partial_max, partial_sum = partials
    num_heads, head_dim = partial_out.shape[1], partial_out.shape[2]
    merged = np.empty((num_heads, head_dim), np.float32)
    for item in range(item_units.shape[0] - 1):
        first, end = item_units[item], item_units[item + 1]
        if end - first == 1:
            continue
        seq, first_head, end_head = _item_heads(item, groups, num_heads)
        for head in range(first_head, end_head):
            overall_max = partial_max[first, head]
            for unit in range(first + 1, end):
                overall_max = max(overall_max, partial_max[unit, head])
            total = np.float32(0.0)
            for d in range(head_dim):
                merged[head, d] = 0.0
            for unit in range(first, end):
                weight = _exp_nonpositive(partial_max[unit, head] - overall_max)
                total += partial_sum[unit, head] * weight
                for d in range(head_dim):
                    merged[head, d] += weight * partial_out[unit, head, d]
            for d in range(head_dim):
                merged[head, d] /= total
        _store(merged, out, seq, first_head, end_head)


@_compiled(fastmath=FAST_MATH, nogil=True)
def _decode_attention(out_address, q_address, k_address, v_address, table_address,
                      lengths_address, q_shape, cache_shape, max_blocks, scale, num_threads,
                      element):
    """Decode attention over the paged cache, written into ``out``; returns False, having written
    nothing, where ``block_table`` or ``seq_lens`` hold values that ``_values_valid`` refuses.

    The arguments are the ``data_ptr()`` of ``out`` and ``q`` (``q_shape`` ``[S, H, D]``), of the
    caches (``cache_shape`` ``[B, KVH, BS, D]``), all C-contiguous of ``element``'s type (see
    ``_to_float32``), and of the C-contiguous int32 ``block_table`` ``[S, max_blocks]`` and
    ``seq_lens`` ``[S]``; then the float scale and the most threads to use. The tensors are
    otherwise valid. A plan of one thread runs on the calling thread, without starting a parallel
    region; a larger one starts its parallel region on as many threads as it has shares.
    """
    out = _array_at(out_address, q_shape, element)
    q = _array_at(q_address, q_shape, element)
    k_cache = _array_at(k_address, cache_shape, element)
    v_cache = _array_at(v_address, cache_shape, element)
    num_seqs, num_heads, head_dim = q_shape
    num_blocks, num_kv_heads, block_size, _ = cache_shape
    block_table = _array_at(table_address, (num_seqs, max_blocks), np.int32(0))
    seq_lens = _array_at(lengths_address, (num_seqs,), np.int32(0))
    if not _values_valid(block_table, seq_lens, num_blocks, block_size):
        return False
    plan = _plan(seq_lens, block_size, num_kv_heads, num_threads)
    _, unit_item, _, _, _, thread_units = plan
    num_units, plan_threads = unit_item.shape[0], thread_units.shape[0] - 1
    partials = (np.empty((num_units, num_heads, head_dim), np.float32),
                np.empty((num_units, num_heads), np.float32),
                np.empty((num_units, num_heads), np.float32))
    if plan_threads == 1:
        _attend_units(0, num_units, q, k_cache, v_cache, block_table, seq_lens,
                      np.float32(scale), plan, partials, out)
    else:
        _set_parallel_threads(plan_threads)
        _attend_in_parallel(q, k_cache, v_cache, block_table, seq_lens, np.float32(scale), plan,
                            partials, out)
        _merge_split_items(plan, partials, out)
    return True


def paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale):
    """``out[s, h] = softmax(scale * q[s, h] . K_s) V_s`` over sequence ``s``'s paged K/V.

    out, q ``[S, H, D]``; k_cache, v_cache ``[B, KVH, BS, D]``, all float32, float16 or bfloat16
    (one dtype, CPU); block_table int32 ``[S, max_blocks]``; seq_lens int32 ``[S]``. Accumulates
    in float32 on ``min(torch.get_num_threads(), numba's thread count)`` threads.
    """
    checks.check_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens,
                                             scale)
    if not q.is_cpu:  # the check saw every tensor on q's device; the kernel reads their addresses
        raise ValueError(f"neo.paged_decode_attention: the numba kernel takes CPU tensors, got "
                         f"{q.device}")
    if q.shape[0] == 0:
        return
    # the kernel reads the tables as C-contiguous: strided ones are copied (they are small)
    table, lengths = block_table.contiguous(), seq_lens.contiguous()
    torch_threads = torch.get_num_threads()
    num_threads = min(torch_threads, numba.config.NUMBA_NUM_THREADS)
    with _launch_lock:
        try:
            valid = _decode_attention(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                                      v_cache.data_ptr(), table.data_ptr(), lengths.data_ptr(),
                                      tuple(q.shape), tuple(k_cache.shape), table.shape[1],
                                      float(scale), num_threads, _ELEMENT_OF[q.dtype])
        finally:
            # numba's OpenMP thread pool can share OpenMP's thread-count setting with torch (and
            # sets it when it starts): leave torch's as it was
            if torch.get_num_threads() != torch_threads:
                torch.set_num_threads(torch_threads)
    if not valid:
        # the shared check names the offending value
        checks.check_paged_decode_attention_values(k_cache, block_table, seq_lens)


IMPLEMENTATIONS = {"paged_decode_attention": paged_decode_attention}
