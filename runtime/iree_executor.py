"""Runs an IREE-compiled mxmoe module (a .vmfb plus its weights as IREE parameters). No torch.

Weights come from a parameter archive (.irpa, memory-mapped, never read whole into memory) or from
in-memory numpy arrays; both are bound under the scope the compiler used.
"""

from __future__ import annotations

import os
import threading
from typing import Mapping, Sequence

import numpy as np

from mxmoe.runtime.invoker import invoker_for

PARAMETER_SCOPE = "model"

_CONFIGS: dict[str, object] = {}
_CONFIGS_LOCK = threading.Lock()


def shared_config(driver: str):
    """One ``iree.runtime.Config`` (VM instance, device, thread pool) per driver for the whole process.

    Every executor on a driver shares it, so a model with many compiled layers gets one pool of
    worker threads, not one per layer.
    """
    import iree.runtime as rt

    with _CONFIGS_LOCK:
        if driver not in _CONFIGS:
            _CONFIGS[driver] = rt.Config(driver)
        return _CONFIGS[driver]


class IreeExecutor:
    """One loaded module on one IREE device; calls are serialised, so sharing it across threads is safe.

    A module may export several functions (the entries of a layer) over one set of weights: ``function(name)``
    gives a callable for another one, sharing the loaded module and its bound weights."""

    def __init__(self, vmfb: bytes, parameters,  # .irpa path, name -> array mapping, or iree ParameterIndex
                 driver: str = "local-task", function: str = "main"):
        import iree.runtime as rt

        self._rt = rt
        self._config = shared_config(driver)
        index = rt.ParameterIndex()
        if isinstance(parameters, rt.ParameterIndex):
            index = parameters  # e.g. an archive section of an mxmoe artifact, memory-mapped by the caller
        elif isinstance(parameters, Mapping):
            self._keepalive = {k: np.ascontiguousarray(v) for k, v in parameters.items()}
            for name, arr in self._keepalive.items():
                index.add_buffer(name, arr.reshape(-1).view(np.uint8) if arr.size else arr.tobytes())
        else:
            index.load(os.fspath(parameters), mmap=True)
        self._index = index
        inst = self._config.vm_instance
        modules = [rt.create_io_parameters_module(inst, index.create_provider(scope=PARAMETER_SCOPE)),
                   rt.create_hal_module(inst, self._config.device),
                   rt.VmModule.copy_buffer(inst, vmfb)]
        self._context = rt.SystemContext(vm_modules=modules, config=self._config)
        self._lock = threading.Lock()
        # local-task calls are made from a thread that yields to IREE's workers (runtime/invoker.py)
        self._invoke = invoker_for(driver)
        self._fn = self._lookup(function)

    def _lookup(self, name: str):
        try:
            return getattr(self._context.modules.module, name)
        except AttributeError:
            raise ValueError(f"the compiled module has no function {name!r}") from None

    def function(self, name: str):
        """``(*arrays) -> [arrays]`` running another exported function of the same loaded module."""
        fn = self._lookup(name)
        return lambda *inputs: self._run(fn, inputs)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        return self._run(self._fn, inputs)

    def _run(self, fn, inputs) -> list[np.ndarray]:
        with self._lock:
            out = self._invoke(fn, *inputs) if self._invoke is not None else fn(*inputs)
            outs = out if isinstance(out, (list, tuple)) else [out]
            return [np.asarray(o.to_host()).copy() for o in outs]


def available_drivers() -> Sequence[str]:
    import iree.runtime as rt

    return rt.query_available_drivers()
