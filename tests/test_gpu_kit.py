"""The GPU kit's benchmark (benchmarks/gpu.py) runs its own code on CPU with --dry-run, so that a lent GPU's
minutes are not spent on a broken script. (The comparison section's bf16 path is tested in
test_comparison.py.)"""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_gpu_benchmark_dry_run_writes_its_tables(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--dry-run", "--sections",
                           "knobs", "largest", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    knobs = (tmp_path / "knobs.md").read_text()
    assert knobs.count("| zeroimpl stage 2") == 4 and "| DDP, autocast bf16 | " in knobs
    largest = (tmp_path / "largest.md").read_text()
    rows = [line for line in largest.splitlines() if line.startswith("| zeroimpl stage 2 + offload | ")]
    assert len(rows) == 1 and "| trains (" in rows[0], largest
