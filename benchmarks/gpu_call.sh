#!/usr/bin/env bash
# The one prepared call of a lent GPU (issue 46): DeepSpeed installed from carried wheels, its CPU Adam built,
# then one section of benchmarks/gpu.py: offload (zeroimpl stage 2 + offload against DeepSpeed ZeRO-2 + offload)
# or, in a call of its own (a command may run 10 minutes), the comparison; every table is written row by row into
# $OUT, so a call cut short keeps what ran.
#
#   bash benchmarks/gpu_call.sh --prepare     # here, where pip reaches the registries: the wheels into build/wheels
#   bash benchmarks/gpu_call.sh [SECTION]     # on the GPU machine (device run, carry ["build/wheels"]), $OUT set:
#                                             # offload (the default, at most 7 minutes) or comparison (5)
#
# The GPU machine has torch and transformers but no DeepSpeed and no internet: DeepSpeed 0.19.8 (a source package,
# built here into a wheel) and its dependencies travel as wheels, the compiled ones for Python 3.10 to 3.13; pip
# there takes only what the machine lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/wheels
if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$WHEELS"
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" deepspeed==0.19.8
    python3 -m pip download -q --no-deps -d "$WHEELS" einops hjson py-cpuinfo tqdm packaging annotated-types \
        typing-inspection typing-extensions pydantic==2.14.4
    for version in 3.10 3.11 3.12 3.13; do
        python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
            --python-version "$version" -d "$WHEELS" msgpack psutil ninja pydantic-core==2.50.5
    done
    du -sh "$WHEELS"
    exit 0
fi
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt" || true
# (a failure here leaves DeepSpeed's rows to say so: zeroimpl's rows need no DeepSpeed)
python3 -m pip install -q --no-index --find-links "$WHEELS" deepspeed==0.19.8 2>&1 | tail -3 | tee "$OUT/pip.txt" || true
# DeepSpeed's offload steps with its CPU Adam, compiled on first use: here, before any timed row
DS_ACCELERATOR=cuda timeout 120 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam built')" \
    2>&1 | tail -3 | tee "$OUT/cpu_adam.txt" || echo "cpu_adam did not build: DeepSpeed's rows will say why" | tee -a "$OUT/cpu_adam.txt"
SECTION=${1:-offload}
# one device command runs at most 600 s: pip, the build and the section stay within it
LIMIT=$([[ "$SECTION" == offload ]] && echo 420 || echo 300)
timeout "$LIMIT" python3 benchmarks/gpu.py --sections "$SECTION" --out "$OUT" 2>&1 | tail -20 | tee "$OUT/$SECTION.log" || true
