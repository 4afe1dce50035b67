"""compute-sanitizer memcheck over a short all-managed out-of-core run on the GPU.

``sanitizer`` runs the tool over ``bench_gpu.py --sanitize-child`` (``sanitize_child``: an MLP
whose activations, parameters, grads and Adam state are managed under 80 MiB, 4 steps,
compared bit for bit with the same loop in core) and reports the tool's error summary.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time


def sanitizer(quick: bool, script: str) -> list[str]:
    """compute-sanitizer memcheck over ``script --sanitize-child`` (``sanitize_child``)."""
    tool = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer" if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if tool is None:
        return ["compute-sanitizer not found: not run"]
    # API errors off: cuda-bindings probes driver entry points with cuGetProcAddress, and each
    # probe of one this driver lacks is an "error" that says nothing about memory safety.
    cmd = [tool, "--tool", "memcheck", "--leak-check", "no", "--report-api-errors", "no",
           "--error-exitcode", "3",
           sys.executable, script, "--sanitize-child"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240 if quick else 300)
    except subprocess.TimeoutExpired:
        return ["compute-sanitizer memcheck: did not finish within its time limit (not a verdict)"]
    summary = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR SUMMARY" in ln]
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
    return [f"`{' '.join(cmd[:8])} ... --sanitize-child` (an MLP, activations, params, grads and "
            f"Adam state managed under 80 MiB of its ~100 MiB, 4 steps): exit {proc.returncode} in "
            f"{time.perf_counter() - t0:.0f} s; {summary[-1].strip() if summary else 'no summary line'}",
            "", "```", *tail, "```"]


def sanitize_child() -> int:
    """A short all-managed run for compute-sanitizer: small, so that memcheck finishes."""
    import torch
    import torch.nn as nn

    from ooc.engine import OutOfCore

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10)).cuda()
    ref = copy.deepcopy(model)
    # the engine runs a managed optimizer per parameter: compare with the same implementation
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    ref_opt = torch.optim.Adam(ref.parameters(), foreach=False)
    x = torch.randn(1024, 1024, device="cuda")
    y = torch.randint(0, 10, (1024,), device="cuda")
    engine = OutOfCore(model, opt, budget="80MiB", device="cuda",
                       manage=("activations", "params", "grads", "optimizer_state"))
    for _ in range(4):
        with engine.step():
            nn.functional.cross_entropy(model(x), y).backward()
            engine.optimizer_step()
        nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.close()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    print(f"sanitize child: bitwise {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 4

