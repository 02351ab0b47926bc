"""``from kvpool._torch import torch``: torch, or an ImportError naming the extra to install.

The modules that need torch (``pool``, ``attention``, ``write``, ``formats``) import it from
here, so a missing torch says ``pip install 'kvpool[torch]'`` instead of a bare
``ModuleNotFoundError``; type checkers still see the real module (re-exported below).
"""

from kvpool._deps import require_torch

require_torch()  # raises the ImportError naming the extra when torch is missing

import torch as torch  # noqa: E402  (explicit re-export; already imported above)
