"""Setting learning up on this machine, and saying truthfully whether it will happen.

Learning needs three things besides feedback: a trainer importable in the app's own Python
(PyTorch or MLX), the nightly schedule installed in the OS's service manager, and learning not
paused. A fresh install has none of the first two, so the first run asks. One module per job:
- `trainer`: which trainer is importable here (and, in a subprocess, on which device);
- `install`: which trainer this machine should get, its size, and the `pip install` that gets it;
- `schedule`: installing the nightly schedule (the `macaron daemon install` machinery);
- `choice`: the user's answer (set up or declined), remembered in the settings file;
- `status`: the one function that says whether and when feedback will be learned from;
- `setup`: the three put together, for the session, the app and `macaron setup`.
"""

from macaron_local.learning_setup.setup import LearningSetup
from macaron_local.learning_setup.status import Readiness, readiness

__all__ = ["LearningSetup", "Readiness", "readiness"]
