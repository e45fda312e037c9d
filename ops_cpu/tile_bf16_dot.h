// The passes of the ISPC decode-attention tile with the CPU's bf16 dot-product
// instruction (tile_bf16_dot.cpp). The ISPC kernel declares and calls its passes
// itself; the driver asks here whether it may.

#pragma once

namespace neo_cpu {

// Whether this CPU executes AVX512-BF16 (VDPBF16PS) with the OS saving its registers.
bool cpu_has_bf16_dot();

}  // namespace neo_cpu
