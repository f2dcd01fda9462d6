"""The thread that makes IREE's local-task calls (runtime/invoker.py): priority, results, errors, the switch."""

import os
import sys
import threading

import pytest

from mxmoe.runtime import invoker as inv_mod
from mxmoe.runtime.invoker import Invoker, call_nice, invoker_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's


def test_calls_run_on_a_thread_of_lower_priority():
    inv = Invoker(5)
    caller = _nice()
    ran_on, nice = inv(lambda: (threading.get_ident(), _nice()))
    assert ran_on != threading.get_ident()
    assert nice == min(19, caller + 5)
    assert _nice() == caller  # the caller's own priority is left alone


def test_results_arguments_and_errors_come_back_to_the_caller():
    inv = Invoker(3)
    assert inv(lambda a, b: a * 10 + b, 4, 2) == 42

    def boom():
        raise KeyError("bad input 7")

    with pytest.raises(KeyError, match="bad input 7"):
        inv(boom)
    assert inv(sum, [1, 2, 3]) == 6  # still serving after an error


def test_a_call_made_inside_a_call_runs_there():
    inv = Invoker(2)
    assert inv(lambda: inv(lambda: threading.get_ident()) == threading.get_ident())


def test_in_a_forked_child_calls_run_on_the_calling_thread(monkeypatch):
    inv = Invoker(2)
    assert inv(threading.get_ident) != threading.get_ident()
    monkeypatch.setattr(inv, "_pid", os.getpid() + 1)  # as seen from a child forked after the thread started
    assert inv(threading.get_ident) == threading.get_ident()


def test_concurrent_callers_each_get_their_own_result():
    inv = Invoker(1)
    out = {}

    def work(i):
        out[i] = [inv(lambda k=k: (i, k)) for k in range(50)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == {i: [(i, k) for k in range(50)] for i in range(4)}


def test_switch(monkeypatch):
    monkeypatch.setattr(inv_mod, "_SHARED", {})
    monkeypatch.delenv("MXMOE_CALL_NICE", raising=False)
    assert call_nice() == 10
    shared = invoker_for("local-task")
    assert shared is not None and shared.nice == 10 and invoker_for("local-task") is shared
    assert invoker_for("local-sync") is None  # computes on the calling thread: no priority change there
    assert invoker_for("hip") is None
    monkeypatch.setenv("MXMOE_CALL_NICE", "0")
    assert invoker_for("local-task") is None
    monkeypatch.setenv("MXMOE_CALL_NICE", "4")
    assert invoker_for("local-task").nice == 4
    for bad in ("high", "-1", "20"):
        monkeypatch.setenv("MXMOE_CALL_NICE", bad)
        with pytest.raises(ValueError, match=f"MXMOE_CALL_NICE='{bad}': expected an integer 0-19"):
            invoker_for("local-task")


def test_an_executor_on_the_cpu_calls_through_it(monkeypatch):
    """IreeExecutor on local-task: calls run on the invoker's thread, results and IREE's errors come back."""
    np = pytest.importorskip("numpy")
    ic = pytest.importorskip("iree.compiler")
    from mxmoe.runtime.iree_executor import IreeExecutor

    monkeypatch.delenv("MXMOE_CALL_NICE", raising=False)
    vmfb = ic.compile_str("func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n"
                          "  %r = arith.addf %a, %a : tensor<4xf32>\n  return %r : tensor<4xf32>\n}",
                          target_backends=["llvm-cpu"])
    ex = IreeExecutor(vmfb, {})
    assert ex._invoke is invoker_for("local-task") and ex._invoke is not None
    (out,) = ex(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(out, [0, 2, 4, 6])
    with pytest.raises(Exception, match="4"):  # IREE's shape check, raised in the caller
        ex(np.arange(3, dtype=np.float32))
    (out,) = ex(np.ones(4, np.float32))
    np.testing.assert_array_equal(out, [2, 2, 2, 2])
