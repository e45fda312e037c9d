// The extension module neo.ops._cpu_kernels. Importing it registers the CPU kernels as the CPU
// implementation of torch.ops.neo.<op> and as torch.ops.neo_ispc.<op> (the namespace is
// declared on the Python side, ops/registry.py); the module itself has no attributes.

#include "ops.h"

#include <Python.h>
#include <torch/library.h>

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                 "CPU (ISPC) kernels of torch.ops.neo", -1, nullptr};
    return PyModule_Create(&module);
}

TORCH_LIBRARY_IMPL(neo, CPU, m) {
    m.impl("paged_decode_attention", &neo_cpu::paged_decode_attention);
    m.impl("store_kv_cache", &neo_cpu::store_kv_cache);
}

TORCH_LIBRARY_IMPL(neo_ispc, CPU, m) {
    m.impl("paged_decode_attention", &neo_cpu::paged_decode_attention);
    m.impl("store_kv_cache", &neo_cpu::store_kv_cache);
}
