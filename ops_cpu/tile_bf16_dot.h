// The passes of the ISPC decode-attention tile with the CPU's bf16 dot-product
// instruction (tile_bf16_dot.cpp). The ISPC kernel declares and calls its passes
// itself; the driver asks here whether it may.

#pragma once

namespace neo_cpu {

// Whether this CPU executes AVX512-BF16 (VDPBF16PS) with the OS saving its registers.
bool cpu_has_bf16_dot();

// Whether the dot-product passes beat the generic ones here, by CPU maker. On AMD's Zen 4 the
// instruction issues as often as an FMA and does the work of two, and the kernel ran faster (later
// AMD CPUs with the instruction are taken to be alike); on Intel's Sapphire Rapids it issued at a
// quarter of the FMAs' rate (one every two cycles) and the kernel ran slower. Other CPUs keep the
// generic passes.
bool cpu_prefers_bf16_dot();

}  // namespace neo_cpu
