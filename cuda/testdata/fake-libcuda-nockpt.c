// fake-libcuda-nockpt: a stand-in for a CUDA driver without the checkpoint API (older than 570):
// just cuInit and cuGetErrorString. Used by cuda/tests/checkpoint.rs for DriverCkptError::Unsupported.
//
//   cc -shared -fPIC -o /tmp/fakecuda-nockpt.so cuda/testdata/fake-libcuda-nockpt.c
int cuGetErrorString(int e, const char** s){ *s = "fake error"; return 0; }
int cuInit(unsigned f){ return 0; }
