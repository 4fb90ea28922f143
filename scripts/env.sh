# Sourced by every entry point. On a host without a TPU, torch-tpu (loaded by
# every `import torch` through its device-backend entry point) would query the
# cloud metadata server at the first autograd backward and retry for minutes
# with no network (docs/ARCHITECTURE.md, "A CPU host with torch-tpu"). Skip
# that query; users on real TPU VMs do not source this file.
export TPU_SKIP_MDS_QUERY="${TPU_SKIP_MDS_QUERY:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:<TorchTpu/Performance/TcMalloc/}"
# libtpu logs at INFO about missing TPU_* variables on a CPU host; harmless.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
