// The extension module neo.ops._cpu_kernels. Importing it registers the CPU kernels as the CPU
// implementation of torch.ops.neo.<op> and as torch.ops.neo_ispc.<op> (the namespace is
// declared on the Python side, ops/registry.py). The module's one function,
// bf16_decode_attention_variant(), names the variant a bf16 paged_decode_attention call runs
// now ("bf16_dot" or "generic"; ValueError where NEO_CPU_DECODE_ATTENTION_VARIANT is invalid).

#include "ops.h"

#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace {

PyObject* bf16_decode_attention_variant(PyObject*, PyObject*) {
    try {
        return PyUnicode_FromString(neo_cpu::bf16_decode_attention_uses_dot() ? "bf16_dot"
                                                                              : "generic");
    } catch (const c10::ValueError& error) {
        PyErr_SetString(PyExc_ValueError, error.what_without_backtrace());
        return nullptr;
    }
}

PyMethodDef methods[] = {
    {"bf16_decode_attention_variant", bf16_decode_attention_variant, METH_NOARGS,
     "The variant a bf16 paged_decode_attention call runs now: \"bf16_dot\" or \"generic\"."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_kernels(void) {
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                 "CPU (ISPC) kernels of torch.ops.neo", -1, methods};
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
