"""mxmoe.runtime: load and run compiled mxmoe artifacts. The IREE path imports neither torch nor triton.

    import mxmoe.runtime
    mod = mxmoe.runtime.load("model.mxmoe")
    y = mod(x)
"""

from mxmoe.runtime.artifact import ArtifactError
from mxmoe.runtime.loader import LoadedModule, TargetUnavailableError, WeightsError, load

__all__ = ["ArtifactError", "LoadedModule", "TargetUnavailableError", "WeightsError", "load"]
