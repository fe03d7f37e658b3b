// Kernels that read the implicit (hidden) kernel arguments the runtime appends after the
// explicit ones; code object v5 places the work-group size there.
#define IDX ((size_t)__builtin_amdgcn_workgroup_id_x() * __builtin_amdgcn_workgroup_size_x() + __builtin_amdgcn_workitem_id_x())

__kernel void sized_fill(__global int* out, int value, int n) {
    size_t i = IDX;
    if (i < (size_t)n) out[i] = value;
}

__kernel void whole_implicit(__global const int* in, __global ulong* out) {
    __constant ulong* implicit = (__constant ulong*)__builtin_amdgcn_implicitarg_ptr();
    size_t i = __builtin_amdgcn_workitem_id_x();
    if (i < 32) out[i] = implicit[i] + (ulong)in[i];
}

__kernel void prints(__global const float* x, int n) {
    if (__builtin_amdgcn_workitem_id_x() == 0) printf("%d %f\n", n, x[0]);
}
