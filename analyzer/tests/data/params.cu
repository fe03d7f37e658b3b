// Source of params_sm90.cubin: nvcc -cubin -arch=sm_90 -o params_sm90.cubin params.cu
struct S { float* a; int b; double* c; };
struct Big { int v[2000]; };
__global__ void k1(int n, float* x, S s, char c, float* y) { if (n) y[0] = x[0] + s.b + c + *s.a + *s.c; }
__global__ void k2() {}
__global__ void k3(Big b, int* out) { out[0] = b.v[1999]; }
__global__ void k4(double d, short h, long long* p) { p[0] = d + h; }
