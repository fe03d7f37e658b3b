// The kernels the simulated HIP runtime (fake-libamdhip64.c) runs on the CPU, as real AMDGPU
// code: sim-kernels-gfx942.hsaco is this file built for gfx942 (see README.md). The simulation
// finds a kernel in a code object by its descriptor symbol (`<name>.kd`) and runs its own C
// version of it; these are what the same launches do on a GPU.
#define IDX ((uint)__builtin_amdgcn_workgroup_id_x() * (uint)__builtin_amdgcn_workgroup_size_x() \
             + (uint)__builtin_amdgcn_workitem_id_x())

__kernel void fill_u32(__global uint* out, uint value, uint n) {
    uint i = IDX;
    if (i < n) out[i] = value;
}

__kernel void axpy_f32(__global float* y, __global const float* x, float a, uint n) {
    uint i = IDX;
    if (i < n) y[i] = a * x[i] + y[i];
}

__kernel void copy_u32(__global uint* dst, __global const uint* src, uint n) {
    uint i = IDX;
    if (i < n) dst[i] = src[i];
}
