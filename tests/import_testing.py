"""Layering checks: does importing some modules pull in JAX? (A fresh interpreter, from the repo root.)"""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def imports_jax(*modules: str) -> bool:
    code = f"import sys, {', '.join(modules)}; print('jax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return result.stdout.strip() == "True"
