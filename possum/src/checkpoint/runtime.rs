//! How the summary lines name the job's GPU runtime.

use possum_sequence::gpu_runtimes::GpuRuntime;

/// The job's GPU runtime, after its engine in the summary line (nothing for CUDA).
pub(crate) fn on_runtime(runtime: GpuRuntime) -> &'static str {
    match runtime {
        GpuRuntime::Cuda => "",
        GpuRuntime::Hip => " on HIP",
    }
}
