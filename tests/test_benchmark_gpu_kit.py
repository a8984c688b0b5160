"""The GPU kit's benchmark (benchmarks/gpu.py) runs its own code on CPU with --dry-run, so that a lent GPU's
minutes are not spent on a broken script. (The comparison section's bf16 path is tested in
test_comparison.py.)"""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_gpu_benchmark_dry_run_writes_its_tables(tmp_path):
    """Every section, with the subsets a short GPU lease runs: zeroimpl stage 2's comparison rows beside DDP,
    zeroimpl's ladder alone, and offload against DeepSpeed's (both measured where DeepSpeed is installed)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--dry-run", "--sections",
                           "comparison", "knobs", "largest", "offload", "--only", "zeroimpl stage 2", "--largest",
                           "zeroimpl",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    comparison = (tmp_path / "comparison.md").read_text()
    rows = [line.split(" | ")[0] for line in comparison.splitlines() if line.startswith("| ") and " | " in line]
    assert rows[1:] == ["| DDP", "| zeroimpl stage 2", "| zeroimpl stage 2 + offload"], rows
    assert "within tolerance" in comparison and "--only 'zeroimpl stage 2'" in comparison  # as a shell reads it
    knobs = (tmp_path / "knobs.md").read_text()
    assert knobs.count("| zeroimpl stage 2") == 4 and "| DDP, autocast bf16 | " in knobs
    largest = (tmp_path / "largest.md").read_text()
    rows = [line for line in largest.splitlines() if line.startswith("| zeroimpl stage 2 + offload | ")]
    assert len(rows) == 1 and "| trains (" in rows[0], largest
    assert "| DeepSpeed ZeRO-2 + offload | - | - | not tried in this run (--largest zeroimpl) |" in largest
    offload = (tmp_path / "offload.md").read_text()
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in offload.splitlines()
            if line.startswith("| ") and " | 64 x 2 | " in line}
    assert set(rows) == {"zeroimpl stage 2 + offload", "DeepSpeed ZeRO-2 + offload"}, offload
    measured = [rows["zeroimpl stage 2 + offload"]]
    if importlib.util.find_spec("deepspeed") is not None:
        measured.append(rows["DeepSpeed ZeRO-2 + offload"])
    else:
        assert "skipped: DeepSpeed is not installed" in rows["DeepSpeed ZeRO-2 + offload"][2]
    for cells in measured:  # shape, parameters, tokens/s, TFLOPS, s / step, phases, host bytes / parameter, peak
        assert float(cells[2].replace(",", "")) > 0 and float(cells[4]) > 0, cells
        assert all(float(seconds) > 0 for seconds in cells[5].split(" / ")), cells
        assert float(cells[6]) > 0, cells
