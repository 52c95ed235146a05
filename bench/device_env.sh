#!/usr/bin/env bash
# Sourced on the GPU machine from the repository root, after carrying .gpurun/ there:
#   source bench/device_env.sh
# Unpacks the libraries bench/pack_device_libs.sh packed, keeps only those the machine
# lacks (its own Open MPI, hwloc and the like must match its mpirun), and puts them,
# the CUDA toolkit and the pip packages' NCCL and cuDNN on LD_LIBRARY_PATH. NVLink
# multicast stays off (the device README says why).
mkdir -p /tmp/lib && tar xJf .gpurun/lib.tar.xz -C /tmp
for f in /tmp/lib/*; do
  if ldconfig -p | grep -q " $(basename "$f") "; then rm -f "$f"; fi
done
pylib() { python3 -c "import $1, os; print(os.path.join(list($1.__path__)[0], 'lib'))"; }
export LD_LIBRARY_PATH=/tmp/lib:$(pylib nvidia.cudnn):$(pylib nvidia.nccl):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "device_env: $(ls /tmp/lib | wc -l) carried libraries kept: $(ls /tmp/lib | tr '\n' ' ')"
