"""ooc on a second PyTorch: torch 2.14.1 with torchvision 0.29.1, in an environment of its own.

Why: the suite's own environment has the CPU build of torch 2.13, beside which PyPI's
torchvision does not import ("operator torchvision::nms does not exist"), so the torchvision
and timm models of ``tests/ooc/test_outside_models.py`` skip there; and a single PyTorch
version hides version-specific breakage (``torch.Tag.out``, used since 2.13, does not exist in
the 2.11 of the lent GPU machines: every ooc run failed there). This test builds (once, then
reuses) a virtual environment with torch 2.14.1 and torchvision 0.29.1 (on this project's
machines pip takes both from local disk: a CUDA build that runs on the CPU, ~5.5 GB), the
suite's pinned dependencies (``constraints.txt``) and timm, and runs in it the outside-model
cases of torchvision and timm (none skipped), timm's optimizers under the engine
(``test_timm_optimizers.py``) and a smoke of the engine's own tests.

The environment lives under ``~/.cache/ooc/`` (``OOC_SECOND_TORCH_VENV`` to put it elsewhere),
named by the versions and the constraints it was built from. ``OOC_SECOND_TORCH=0`` skips this
test (a machine that would have to download the CUDA build); CI runs it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH, TORCHVISION = "2.14.1", "0.29.1"
# The torchvision and timm cases (the transformers ones run in the suite's own environment),
# and a smoke of the engine: the CUDA path over the fake driver, end to end.
CASES, SMOKE = "tests/ooc/test_outside_models.py", "tests/ooc/test_cuda_fake_e2e.py"
OPTIMIZERS = "tests/ooc/test_timm_optimizers.py"   # timm's optimizers, every kind managed
# Each model and way of managing it, but the least budget for the whole step with every kind
# managed on resnet18d, mobilenet and convnext_atto (convnext's alone: 48 s of the run's 345 on
# a 2-core AMD EPYC): resnet18 and vit keep that case here, and the transformers models in the
# suite's own environment.
SELECT = ["-k", "(torchvision or timm or test_cuda_fake_e2e)"
                " and not (whole_step and (resnet18d-all or mobilenet_v3_small-all or convnext_atto-all))"]


def _venv() -> Path:
    key = hashlib.sha256(f"{TORCH} {TORCHVISION} ".encode() + (ROOT / "constraints.txt").read_bytes())
    default = Path.home() / ".cache" / "ooc" / f"venv-torch{TORCH}-{key.hexdigest()[:10]}"
    return Path(os.environ.get("OOC_SECOND_TORCH_VENV", default))


def _build(venv: Path) -> Path:
    """The environment's python, built unless a finished build is there."""
    python = venv / "bin" / "python"
    done = venv / ".ooc-complete"
    if done.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [[*pip, f"torch=={TORCH}", f"torchvision=={TORCHVISION}"],
             [*pip, "-c", str(ROOT / "constraints.txt"), "timm", "pytest", "pytest-timeout", "hypothesis",
              "transformers", "scipy", "numpy", "tqdm", "matplotlib"]]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"{' '.join(cmd[3:])}: exit {p.returncode}\n{p.stderr[-3000:]}"
    done.write_text(f"torch {TORCH}, torchvision {TORCHVISION}\n")
    return python


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("OOC_SECOND_TORCH") == "0", reason="OOC_SECOND_TORCH=0")
def test_outside_models_and_a_smoke_pass_on_a_second_pytorch_with_torchvision() -> None:
    python = _build(_venv())
    # The versions installed (whether they import, the run below says: a case whose library
    # does not import skips, and nothing may skip).
    versions = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                               "print(version('torch'), version('torchvision'), version('timm'))"],
                              capture_output=True, text=True, timeout=300)
    assert versions.returncode == 0, versions.stderr[-2000:]
    assert versions.stdout.split()[0].startswith(TORCH) and versions.stdout.split()[1].startswith(TORCHVISION)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OOC_SECOND_TORCH": "0"}
    # One run for both (this torch's import, ~12 s here, paid once); -rA names each test that passed.
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", SMOKE, CASES, OPTIMIZERS,
                          *SELECT],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=3000)
    tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-30:])
    assert run.returncode == 0, tail
    passed = [ln.split()[1] for ln in run.stdout.splitlines() if ln.startswith("PASSED ")]
    for path, at_least in ((CASES, 10), (SMOKE, 3), (OPTIMIZERS, 17)):   # 5 models x 2 ways of managing them
        assert sum(t.startswith(path + "::") for t in passed) >= at_least, (path, tail)
    skipped = [ln for ln in run.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert not skipped, "\n".join(skipped)   # torchvision and timm import here: nothing skips
