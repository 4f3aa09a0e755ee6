"""A script that starts tensor parallelism at its top level, without `if __name__ == "__main__":`,
stops with one line that names the fix and a non-zero exit code, not multiprocessing's double
traceback (every spawned rank imports the script again and would start ranks of its own)."""

import os
import subprocess
import sys

from tests.parallel.checkpoints import save_tiny


def test_an_unguarded_script_gets_one_line_naming_the_guard(tmp_path):
    path = save_tiny("qwen3_5", tmp_path / "qwen3_5")
    script = tmp_path / "unguarded.py"
    script.write_text("from kvstate import LLM\n"
                      f"llm = LLM({str(path)!r}, cache_memory='8MiB', tensor_parallel_size=2)\n"
                      "print('generated')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode != 0 and "generated" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert 'if __name__ == "__main__":' in lines[0]
