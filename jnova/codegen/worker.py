"""MLIR pass pipelines in a child process, so an assertion abort inside MLIR cannot kill the caller.

The upstream bindings are built with assertions: an MLIR bug aborts the process instead of raising.
`run_pipeline` sends the module to a long-lived worker (`python -m jnova.codegen.worker`); if the
worker dies, the caller gets a `CompileError` with the abort message, the input saved to a file and
the command that reproduces the failure, and the next call starts a fresh worker.
`JNOVA_ISOLATE=0` runs pipelines in process instead (faster to debug, no protection).

Usage as a command: `python -m jnova.codegen.worker PIPELINE INPUT.mlir` prints the output module.
"""
from __future__ import annotations

import atexit
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading

from jnova.errors import CompileError


def pipelines() -> dict[str, str]:
    from jnova.codegen.cpu import CPU_PIPELINE
    from jnova.codegen.gpu.ptx import GPU_TO_ISA, GPU_TO_NVVM

    return {"cpu": CPU_PIPELINE, "gpu": GPU_TO_NVVM, "gpu-isa": GPU_TO_ISA}


def run_in_process(pipeline: str, text: str) -> str:
    from mlir import ir, passmanager

    with ir.Context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse(pipelines()[pipeline]).run(module.operation)
        return str(module)


# --------------------------------------------------------------------------- client side
class _Worker:
    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.stderr = None

    def start(self):
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "jnova.codegen.worker", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env)

    def request(self, pipeline: str, text: str) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.start()
        payload = json.dumps({"pipeline": pipeline, "module": text}).encode()
        try:
            self.proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            self.proc.stdin.flush()
            reply = _read_message(self.proc.stdout)
        except (BrokenPipeError, EOFError):
            reply = None
        if reply is None:  # the worker died: report why
            self.proc.wait()
            self.stderr.seek(0)
            tail = self.stderr.read().decode(errors="replace")[-2000:]
            code = self.proc.returncode
            self.close()
            return {"ok": False, "crashed": True, "error": f"MLIR aborted (exit code {code}):\n{tail}"}
        return reply


    def close(self):
        """Stop the worker (it exits when its input closes)."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:  # the pipe is broken when the worker died
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
        if self.stderr is not None:
            self.stderr.close()
        self.proc = self.stderr = None


_WORKER = _Worker()
atexit.register(_WORKER.close)


def run_pipeline(pipeline: str, text: str, stage: str) -> str:
    """Run a named pass pipeline on `text`; raises CompileError naming `stage` on failure."""
    if os.environ.get("JNOVA_ISOLATE", "1") == "0":
        try:
            return run_in_process(pipeline, text)
        except Exception as e:
            raise _failure(stage, pipeline, text, str(e)) from None
    with _WORKER.lock:
        reply = _WORKER.request(pipeline, text)
    if not reply["ok"]:
        raise _failure(stage, pipeline, text, reply["error"])
    return reply["module"]


def _failure(stage: str, pipeline: str, text: str, message: str) -> CompileError:
    from jnova.runtime.dump import failure_path

    path = failure_path(stage, ".mlir")
    with open(path, "w") as f:
        f.write(text)
    return CompileError(stage, message, path, f"{sys.executable} -m jnova.codegen.worker {pipeline} {path}")


# --------------------------------------------------------------------------- worker side
def _read_message(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    body = stream.read(n)
    if len(body) < n:
        raise EOFError
    return json.loads(body)


def _serve():
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            request = _read_message(stdin)
        except EOFError:
            return
        try:
            reply = {"ok": True, "module": run_in_process(request["pipeline"], request["module"])}
        except Exception as e:  # a diagnosed failure (not an abort): send it back
            reply = {"ok": False, "error": str(e)}
        payload = json.dumps(reply).encode()
        stdout.write(struct.pack("<Q", len(payload)) + payload)
        stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    elif len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            print(run_in_process(sys.argv[1], f.read()))
    else:
        sys.exit("usage: python -m jnova.codegen.worker PIPELINE INPUT.mlir")
