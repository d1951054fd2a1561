"""How the engine process ends: ``engine_proc._exit_process`` skips the interpreter's
finalization (seconds on a loaded model, past the launcher's SIGKILL) but keeps the exit
code, the log and an exception's traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent("""
        import atexit, logging, sys
        from fastsched.engine.engine_proc import _exit_process
        logging.basicConfig(stream=sys.stderr, format="%(message)s", level=logging.INFO)
        atexit.register(lambda: print("finalized", flush=True))
        print("buffered line", end="")
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_clean_exit_keeps_code_and_output_and_skips_finalization() -> None:
    done = _run("""
        logging.getLogger("x").info("engine 0 exiting")
        _exit_process(0)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered line"  # flushed, and no atexit handler ran
    assert "engine 0 exiting" in done.stderr


def test_failure_code_passes_through() -> None:
    assert _run("_exit_process(1)").returncode == 1


def test_exception_on_its_way_out_is_printed_and_fails_the_process() -> None:
    done = _run("""
        try:
            raise RuntimeError("lost in the finally")
        finally:
            _exit_process(0)
    """)
    assert done.returncode == 1
    assert "RuntimeError: lost in the finally" in done.stderr
    assert "finalized" not in done.stdout
