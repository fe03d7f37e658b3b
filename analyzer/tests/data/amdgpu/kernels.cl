// Kernels whose argument metadata the AMDGPU code object reader is tested against.
// No device libraries are linked: the global index comes from the AMDGPU builtins.
#define IDX ((size_t)__builtin_amdgcn_workgroup_id_x() * 64 + __builtin_amdgcn_workitem_id_x())
typedef struct { float scale; int count; __global float* extra; } params_t;

__kernel void scale_copy(__global const float* restrict in, __global float* restrict out, int n, float factor) {
    size_t i = IDX;
    if (i < (size_t)n) out[i] = in[i] * factor;
}

__kernel void with_struct(__global float* data, params_t p) {
    size_t i = IDX;
    if (i < (size_t)p.count) data[i] = data[i] * p.scale + p.extra[i];
}

__kernel void many_pointers(__global const int* a, __global const int* b, __global int* c, __global int* d, long len) {
    size_t i = IDX;
    if ((long)i < len) { c[i] = a[i] + b[i]; d[i] = a[i] - b[i]; }
}
