import os

import torch

# Triton's interpreter runs the kernels on CPU tensors. triton.jit reads this variable when a kernel
# is defined (at `import moemesh.ops`), so it is set here, before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
