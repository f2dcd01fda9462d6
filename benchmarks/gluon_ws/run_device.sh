#!/bin/bash
# run from the repo root on the device machine
set -x
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
( source benchmarks/_devpath.sh; timeout 200 python -P benchmarks/gpu_moe.py --plans build/gpu_plans --models gpt-oss-20b --tokens 512 --timeline ) > $OUT/mxmoe_timeline.txt 2>&1
tail -30 $OUT/mxmoe_timeline.txt
timeout 240 python benchmarks/gluon_ws/device.py "$@" > $OUT/device.txt 2>&1
echo "device.py rc=$?"
tail -40 $OUT/device.txt
