/* The fake driver (cuda/testdata/fake-libcuda.c) with two functions that fail on demand: while
 * a job has called fake_fail_fences(1), cuEventRecord and cuStreamSynchronize answer
 * CUDA_ERROR_LAUNCH_FAILED (719). tests/fake_validate.rs builds it as libcuda.so.1 to make
 * possum's fence of a stream the job destroys fail: a fault of the write path. */
#define cuEventRecord fake_inner_cuEventRecord
#define cuStreamSynchronize fake_inner_cuStreamSynchronize
#include "../../../cuda/testdata/fake-libcuda.c"
#undef cuEventRecord
#undef cuStreamSynchronize

static volatile int failing;
void fake_fail_fences(int on) { failing = on; }
int cuEventRecord(void *e, void *s) { return failing ? 719 : fake_inner_cuEventRecord(e, s); }
int cuStreamSynchronize(void *s) { return failing ? 719 : fake_inner_cuStreamSynchronize(s); }
