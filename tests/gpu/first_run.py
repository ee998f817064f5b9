"""The first run on one GPU (``tests/gpu/first_run.sh``; docs/gpu.md, "First run on one GPU"):
every check one H100 / H200 can run, one after the other, within a time budget (8 minutes by
default), each a subprocess with its own timeout, all written to one Markdown report.

Sections (in order; docs/gpu.md lists what each shows and what still needs 2 to 8 GPUs):

1. ``triton``: the Triton codec suite on the device (``tests/gpu/test_gpu_triton.py``: the
   kernels bit for bit against the CPU codecs);
2. ``probe``: ``tests/gpu/first_run_probe.py``: a world-size-1 NCCL group and a subgroup (with
   the communicator's device memory), two-stream overlap on moeflow's communication stream, a
   real CUDA-graph capture of the MoE layer refused with moeflow's error;
3. ``train``: ``moeflow train --device cuda --nproc 1`` with ``--grad-accum 2 --recompute
   moe_act --async-checkpoint``, SIGUSR1 once step 3 is logged (exit 75, ``preempted.json``, the
   checkpoint of the reached step), then ``--resume`` to the last step (exit 0);
4. ``pytest_gpu``: ``pytest -m gpu tests/gpu`` without the Triton file, with the rest of the
   budget (what needs 2 or more GPUs skips, listed by ``-rs``).

``--device cpu`` runs only the ``train`` section, on the CPU (the others are reported
``skipped``): the suite's CPU check of this script (tests/unit/cuda/test_first_run.py).
Exit status: 0 when no section failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 480                       # 8 minutes on one GPU, everything included
PREEMPTED_EXIT = 75                  # moeflow.trainer.PREEMPTED_EXIT
STATUSES = ("pass", "fail", "skipped")


@dataclass
class Section:
    name: str
    status: str = "skipped"
    seconds: float = 0.0
    detail: str = ""
    log: list[str] = field(default_factory=list)


def train_argv(device: str, out: str | Path, steps: int, batch_size: int,
               resume: bool = False) -> list[str]:
    """The ``moeflow train`` arguments of the ``train`` section (spelled as its parser wants:
    tests/unit/cuda/test_first_run.py parses them with it)."""
    argv = ["train", "--device", device, "--nproc", "1", "--preset", "tiny",
            "--steps", str(steps), "--batch-size", str(batch_size), "--grad-accum", "2",
            "--recompute", "moe_act", "--async-checkpoint", "--checkpoint-every", "5",
            "--log-every", "1", "--eval-every", str(steps), "--eval-batches", "2",
            "--no-progress", "--out", str(out)]
    return argv + (["--resume"] if resume else [])


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))


def _run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=max(timeout, 1))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, text = 124, out + f"\n[timed out after {timeout:.0f} s]"
    return rc, text, time.perf_counter() - t0


def _pytest_summary(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if " passed" in ln or " failed" in ln
             or " skipped" in ln or " error" in ln]
    return lines[-1].strip("= ") if lines else "no pytest summary"


def run_pytest(name: str, args: list[str], timeout: float) -> Section:
    rc, text, dt = _run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs",
                         "-p", "no:cacheprovider", *args], timeout)
    # 0: passed (skips allowed, listed by -rs); anything else, 5 (nothing ran) too: failed
    status = "pass" if rc == 0 else "fail"
    return Section(name, status, dt, f"exit {rc}: {_pytest_summary(text)}",
                   text.splitlines()[-60:])


def run_probe(timeout: float) -> Section:
    rc, text, dt = _run([sys.executable, "-m", "tests.gpu.first_run_probe"], timeout)
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith("{")), None)
    got = json.loads(line) if line else {}
    parts = [f"{k}: {'ok' if v.get('ok') else 'FAILED'}" for k, v in got.items()
             if isinstance(v, dict)]
    status = "pass" if rc == 0 and got.get("ok") else "fail"
    return Section("probe", status, dt, f"exit {rc}; " + ", ".join(parts),
                   [json.dumps(got, indent=1)] if got else text.splitlines()[-40:])


def _logged_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(ln).get("step", 0) for ln in path.read_text().splitlines()
             if ln.strip() and "loss" in ln]
    return max(steps, default=0)


def run_train(device: str, work: Path, steps: int, batch_size: int, timeout: float) -> Section:
    """Train, SIGUSR1 after step 3, check the preemption, resume to ``steps``."""
    out = work / "train"
    t0, log = time.perf_counter(), []
    cmd = [sys.executable, "-m", "moeflow.cli", *train_argv(device, out, steps, batch_size)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = t0 + timeout
    try:
        while _logged_step(out) < 3 and proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.05)
        signalled = proc.poll() is None and _logged_step(out) >= 3
        if signalled:
            proc.send_signal(signal.SIGUSR1)
        text, _ = proc.communicate(timeout=max(deadline - time.perf_counter(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        return Section("train", "fail", time.perf_counter() - t0,
                       f"timed out after {timeout:.0f} s", (text or "").splitlines()[-40:])
    log += ["$ moeflow " + " ".join(cmd[3:]), *text.splitlines()[-30:]]
    problems = []
    pre = out / "preempted.json"
    reached = json.loads(pre.read_text())["step"] if pre.exists() else None
    if not signalled:
        problems.append(f"the run ended (exit {proc.returncode}) before step 3 was logged")
    elif proc.returncode != PREEMPTED_EXIT or reached is None:
        problems.append(f"SIGUSR1: exit {proc.returncode} (want {PREEMPTED_EXIT}), "
                        f"preempted.json {'present' if pre.exists() else 'missing'}")
    elif (out / "checkpoint" / "latest").read_text().strip() != f"step-{reached}":
        problems.append(f"the latest checkpoint is not step-{reached}")
    if not problems:
        left = deadline - time.perf_counter()
        resume = [sys.executable, "-m", "moeflow.cli",
                  *train_argv(device, out, steps, batch_size, resume=True)]
        rc, text, _ = _run(resume, left)
        log += ["$ moeflow " + " ".join(resume[3:]), *text.splitlines()[-30:]]
        if rc != 0 or f"resumed from step {reached}" not in text or _logged_step(out) != steps:
            problems.append(f"--resume: exit {rc}, last logged step {_logged_step(out)} "
                            f"(want {steps}, resumed from step {reached})")
    detail = (f"preempted at step {reached} by SIGUSR1 (exit {PREEMPTED_EXIT}), resumed to "
              f"step {steps}" if not problems else "; ".join(problems))
    return Section("train", "fail" if problems else "pass", time.perf_counter() - t0, detail,
                   log)


def write_report(path: Path, sections: list[Section], device: str, budget: float) -> None:
    """One Markdown file: the environment, a table (section | status | seconds | detail), then
    each section's output."""
    import platform

    import torch
    env = [f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", f"- device: {device}",
           f"- torch {torch.__version__}, CUDA {torch.version.cuda}, python "
           f"{platform.python_version()}"]
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.append(f"- GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability "
                   f"{p.major}.{p.minor}")
    try:
        import triton
        env.append(f"- triton {triton.__version__}")
    except ImportError:
        env.append("- triton: not installed")
    total = sum(s.seconds for s in sections)
    lines = ["# moeflow first GPU run", "", *env, f"- budget {budget:.0f} s, used {total:.0f} s",
             "", "| section | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.detail.replace('|', '/')} |"
              for s in sections]
    for s in sections:
        lines += ["", f"## {s.name}", "", "```", *s.log, "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: every section; cpu: the train section only (a CPU check)")
    p.add_argument("--out", default="first-run", help="folder of the report and the run")
    p.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="seconds for all sections together (a section not started in time "
                        "is reported skipped)")
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - start)      # noqa: E731
    gpu = args.device == "cuda"
    # (name, run(seconds left), its share of the budget), the most informative first
    plan = [("triton", lambda t: run_pytest("triton", ["tests/gpu/test_gpu_triton.py"], t),
             0.25),
            ("probe", run_probe, 0.1),
            ("train", lambda t: run_train(args.device, work, args.train_steps,
                                          args.batch_size, t), 0.25),
            ("pytest_gpu", lambda t: run_pytest(
                "pytest_gpu", ["tests/gpu", "--ignore=tests/gpu/test_gpu_triton.py"], t), 1.0)]
    sections = []
    for name, run, share in plan:
        if not gpu and name != "train":
            sections.append(Section(name, "skipped", 0.0, "needs --device cuda"))
            continue
        if left() < 10:
            sections.append(Section(name, "skipped", 0.0, "the time budget is spent"))
            continue
        sections.append(run(min(left(), max(share * args.budget_s, 30))))
    report = work / "report.md"
    write_report(report, sections, args.device, args.budget_s)
    print(f"report: {report}")
    for s in sections:
        print(f"{s.name:12s} {s.status:8s} {s.seconds:7.1f}s  {s.detail}")
    return 1 if any(s.status == "fail" for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
